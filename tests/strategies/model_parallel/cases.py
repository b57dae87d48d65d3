"""A tiny Llama (from LlamaConfig), data and named runs shared by the model_parallel workers (every
rank) and the tests (the parent). `run_case(name, root)` trains with the same global batch for any
mesh: the per-device batch is 4 / (the case's data shards)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from kiln import TrainingModule  # noqa: E402
from tests.helpers import padded_token_data  # noqa: E402

VOCAB = 64


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def llama(seed: int = 0) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


class HookedLlama(TrainingModule):
    """Parallelises itself in `configure_model(mesh)`: TP on the MLPs only, by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.llm = llama()
        self.meshes: list[tuple[str, ...]] = []

    def configure_model(self, mesh: Any) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.meshes.append(tuple(mesh.mesh_dim_names))
        for layer in self.llm.model.layers:
            parallelize_module(
                layer.mlp,
                mesh["tp"],
                {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()},
            )

    def training_step(self, batch: dict) -> torch.Tensor:
        return self.llm(**batch).loss

    def validation_step(self, batch: dict) -> dict:
        return {"loss": self.llm(**batch).loss}

    def configure_optimizers(self) -> Any:
        """One group over tp-split and plain parameters, the kernel left to torch (run under
        `cuda_kernel_default`, which picks foreach as torch does on CUDA)."""
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.0)


@contextlib.contextmanager
def cuda_kernel_default() -> Iterator[None]:
    """torch's optimizers choosing their kernel as on CUDA (foreach), on this CPU machine."""
    import torch.optim.adam as adam

    chooser = adam._default_to_fused_or_foreach
    adam._default_to_fused_or_foreach = lambda *args, **kwargs: (False, True)
    try:
        yield
    finally:
        adam._default_to_fused_or_foreach = chooser


class TupleLlama(TrainingModule):
    """Asks the Llama for tuples (`return_dict=False`) and takes the loss from them: under loss
    parallel that loss must still reach the module as a plain tensor. No configure_model, so the
    strategy's tp_plan parallelises the Llama inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.llm = llama()
        self.seen: list[list[int]] = []  # the shapes of the tensors in the first training tuple

    def training_step(self, batch: dict) -> torch.Tensor:
        out = self.llm(**batch, return_dict=False)
        if not self.seen:
            self.seen = [list(x.shape) for x in out if isinstance(x, torch.Tensor)]  # not the KV cache
        return out[0]

    def validation_step(self, batch: dict) -> dict:
        return {"loss": self.llm(**batch, return_dict=False)[0]}


MP = {"name": "model_parallel", "device": "cpu"}
SINGLE = {"strategy": {"name": "single", "device": "cpu"}}
EVERY_2 = {"save": {"strategy": "steps", "steps": 2}}
SGD = {"optim": "sgd", "learning_rate": 0.5}
BF16 = {"bf16": True, **SGD}

#: name -> (config entries beside the common ones, data shards)
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "single": (SINGLE, 1),
    "tp2": ({"strategy": {**MP, "mesh": {"tp": 2}, "tp_plan": "auto"}, **EVERY_2}, 1),
    "dp2": ({"strategy": {**MP, "mesh": {"dp_shard": 2}}, **EVERY_2}, 2),
    "one": ({"strategy": {**MP, "mesh": {"dp_shard": 1}}, **EVERY_2}, 1),  # model_parallel on one process
    "hook": ({"strategy": {**MP, "mesh": {"tp": -1}}}, 1),
    "hook_single": (SINGLE, 1),  # the same module on one process
    "dp2tp2": ({"strategy": {**MP, "mesh": {"dp_shard": 2, "tp": 2}}}, 2),
    "dp2tp2_ck": ({"strategy": {**MP, "mesh": {"dp_shard": 2, "tp": 2}}, **EVERY_2}, 2),  # the reshard chain's source
    "dp4": ({"strategy": {**MP, "mesh": {"dp_shard": 4}}}, 4),
    "hsdp": ({"strategy": {**MP, "mesh": {"dp_replicate": 2, "dp_shard": 2}}}, 4),
    "hf_dp2tp2": ({"parallelism_config": {"dp_shard_size": 2, "tp_size": 2}, "strategy": {"device": "cpu"}}, 2),
    "resume": ({"strategy": {**MP}}, 1),  # the default mesh: dp_shard over every process
    # the Llama split by transformers at load (from_pretrained(tp_plan="auto")); strategy auto picks model_parallel
    "loaded_tp2": ({"strategy": {"device": "cpu"}, **EVERY_2}, 1),
    # bf16 with SGD: AdamW would turn bf16's rounding of a near-zero gradient into a full-size step
    "single_bf16": ({**SINGLE, **BF16}, 1),
    "tp2_bf16": ({"strategy": {**MP, "mesh": {"tp": 2}}, **BF16}, 1),
    "dp2_bf16": ({"strategy": {**MP, "mesh": {"dp_shard": 2}}, **BF16}, 2),
    # sequence parallel (sp) and loss parallel (lp) over tp 2, and both with FSDP (4 processes)
    "tp2_sp": ({"strategy": {**MP, "mesh": {"tp": 2}, "sequence_parallel": True}}, 1),
    "tp2_lp": ({"strategy": {**MP, "mesh": {"tp": 2}, "loss_parallel": True}, **EVERY_2}, 1),
    "tp2_sp_lp": (
        {"strategy": {**MP, "mesh": {"tp": 2}, "sequence_parallel": True, "loss_parallel": True}, **EVERY_2},
        1,
    ),
    # TupleLlama, and the same module on one process (its loss is a mean per micro-batch); SGD, so a
    # weight's distance is its gradient's (AdamW's first steps divide by sqrt(v): near-zero gradient
    # elements would magnify float-order differences to 1e-4)
    "tp2_lp_tuple": ({"strategy": {**MP, "mesh": {"tp": 2}, "loss_parallel": True}, **SGD}, 1),
    "tuple_single": ({**SINGLE, **SGD}, 1),
    "tp2_sp_lp_bf16": (
        {"strategy": {**MP, "mesh": {"tp": 2}, "sequence_parallel": True, "loss_parallel": True}, **BF16},
        1,
    ),
    "dp2tp2_sp_lp": (
        {"strategy": {**MP, "mesh": {"dp_shard": 2, "tp": 2}, "sequence_parallel": True, "loss_parallel": True}},
        2,
    ),
}

#: the cases whose activations and parameters probes.py records (result["probe"], result["params"])
PROBED = ("tp2_sp", "tp2_lp", "tp2_sp_lp", "dp2tp2_sp_lp", "tp2_lp_tuple")
WRAPPED = {
    "hook": HookedLlama,
    "hook_single": HookedLlama,
    "tp2_lp_tuple": TupleLlama,
    "tuple_single": TupleLlama,
}  # a TrainingModule holding the Llama as .llm


def resumed(name: str) -> tuple[str, bool]:
    """`<case>_from_<source>` resumes a source's checkpoint and trains on as <case>; `<case>_at_<source>`
    loads it and stops there (max_steps is the checkpoint's step: the weights are what was loaded);
    `<case>_hop_<source>` trains on like `_from_` and saves every step, for the next mesh of a chain.
    Returns (case, stops at the checkpoint); a plain case name is itself."""
    for word, stops in (("_from_", False), ("_at_", True), ("_hop_", False)):
        if word in name:
            return name.split(word)[0], stops
    return name, False


def config(
    name: str, root: str, table: dict[str, tuple[dict[str, Any], int]] | None = None, **extra: Any
) -> dict[str, Any]:
    """The config of the named run of `table` (CASES by default; cp_cases keeps its own), with `extra` on top."""
    case, stops = resumed(name)
    entries, shards = (CASES if table is None else table)[case]
    cfg: dict[str, Any] = {
        "output_dir": os.path.join(root, name),
        "seed": 3,
        "learning_rate": 0.01,
        "max_steps": 4,
        "per_device_train_batch_size": 4 // shards,
        "per_device_eval_batch_size": 1,  # eval loss is a mean of batch means: one sample each
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 1.0,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
    }
    cfg.update(entries)
    if case != name:  # a resumed run: no checkpoints of its own
        saves = {"strategy": "steps", "steps": 1} if "_hop_" in name else {"strategy": "no"}
        cfg.update({"save": saves, "max_steps": 2 if stops else 4})
    cfg.update(extra)
    return cfg


def data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    return padded_token_data(n, length=8, vocab=VOCAB, seed=seed)


def trainer_for(name: str, root: str, model: Any = None, **extra: Any) -> Any:
    from kiln import Trainer

    if model is None and name in (
        "dp2",
        "dp2tp2",
        "dp2tp2_ck",
        "hsdp",
        "dp2tp2_sp_lp",
    ):  # each rank builds other weights: rank 0's must win (sync before sharding)
        model = llama(seed=int(os.environ.get("RANK", "0")))
    if model is None and name == "loaded_tp2":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(saved_llama(root), tp_plan="auto")
    model = model if model is not None else (WRAPPED[name]() if name in WRAPPED else llama())
    return Trainer(model, config(name, root, **extra), train_dataset=data(32, seed=1), eval_dataset=data(8, seed=2))


def saved_llama(root: str) -> str:
    """Where the test saved `llama()` for the loaded cases: beside the runs folder."""
    return os.path.join(os.path.dirname(root), "llama")


def full_weights(trainer: Any) -> dict[str, torch.Tensor]:
    """The trained weights, gathered (rank 0 gets them; the other ranks an empty dict)."""
    state = trainer.strategy.model_state_for_export(trainer.model)
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def run_case(name: str, root: str, export: Any = None, **extra: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from tests.strategies.model_parallel import probes

    trainer = trainer_for(name, root, **extra)
    seen = probes.watch(getattr(trainer.model, "llm", trainer.model)) if name in PROBED else None
    if seen is not None:
        probes.watch_loss(trainer, seen)
    with cuda_kernel_default() if name.startswith("hook") else contextlib.nullcontext():
        trainer.fit()
    metrics = trainer.evaluate()
    if export is not None:
        trainer.save_model(export)
    hist = trainer.state.log_history
    result = {
        "losses": [h["loss"] for h in hist if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in hist if "grad_norm" in h],
        "eval_loss": metrics["eval_loss"],
        "strategy": type(trainer.strategy).__name__,
        "data_shards": trainer.strategy.data_shards,
        "tp_split": tp_split(trainer.model),
        "steps": trainer.state.global_step,
        "fsdp_units": fsdp_units(trainer.model),
        "releases_groups": releases_groups(trainer.model),
    }
    if name.startswith("hook"):
        result["meshes"] = trainer.model.meshes
        result["foreach"] = [group["foreach"] for group in trainer.optimizer.param_groups]
    if isinstance(trainer.model, TupleLlama):
        result["tuple"] = trainer.model.seen
    if seen is not None:
        result["probe"], result["params"] = seen, probes.parameters(trainer.model)
    weights = full_weights(trainer)
    if name in WRAPPED:  # the same key names as the plain Llama's
        weights = {k.removeprefix("llm."): v for k, v in weights.items()}
    return result, weights


def fsdp_units(model: Any) -> list[str]:
    """The classes of the modules FSDP2 made units of, innermost first as fully_shard met them."""
    from torch.distributed.fsdp import FSDPModule

    return [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]


def releases_groups(model: Any) -> bool:
    """Whether the exit teardown will drop this FSDP module's references to its process groups
    (register_group_user), so gloo's workers can be joined before the interpreter finalizes (issue 16)."""
    from kiln.strategies import process_group
    from kiln.strategies.mesh.fsdp import release_fsdp_groups

    return any(ref() is model and release is release_fsdp_groups for ref, release in process_group._GROUP_USERS)


def tp_split(model: Any) -> int:
    """How many parameters tensor parallelism split (DTensors with a `tp` mesh axis)."""
    from torch.distributed.tensor import DTensor

    return sum(1 for p in model.parameters() if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()))


def logits(model: Any) -> torch.Tensor:
    batch = torch.stack([d["input_ids"] for d in data(4, seed=9)])
    with torch.no_grad():
        return model(input_ids=batch).logits
