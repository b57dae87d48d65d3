"""Ways of building a model under ZeRO-3 against the same model trained without ZeRO (issue 34, 7b
and 11). Runs as a plain `python` process (one process, no launcher: DeepSpeed must just work) or
under torchrun. Writes results.json and tensors.safetensors (rank 0).

Checks, in this order (the first must run before anything imports Transformers):
- late_import: a factory that imports Transformers itself and calls the class under zero.Init is refused;
- gpt2: `GPT2LMHeadModel(config)` and `AutoModelForCausalLM.from_config(config)`, ZeRO-3 with and
  without zero.Init, against `single` (one process) or `ddp` (several);
- plain: a TrainingModule initialising its children in its constructor (nanoGPT: `self.apply(init)`,
  then `nn.init.normal_` on some parameters);
- pretrained: `from_pretrained` under ZeRO-3 with and without zero.Init starts from the saved weights;
- mismatch: a model partitioned by the user's own zero.Init handed to a ZeRO-2 strategy is refused.
Usage: python worker_model_building.py OUT [CHECK ...] (or under torchrun --nproc_per_node=2)"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

from kiln import Trainer, TrainingModule  # noqa: E402
from kiln.utils.errors import ConfigError, KilnError  # noqa: E402
from tests.strategies.contract.scenarios import full_weights  # noqa: E402

out = sys.argv[1]
checks = sys.argv[2:] or ["late_import", "gpt2", "plain", "pretrained", "mismatch"]
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
reference = "single" if world == 1 else "ddp"
root = os.path.join(out, "runs")
results: dict = {"world": world}
tensors: dict = {}


def config(name: str, stage: int = 0, zero_init: bool = True, **extra) -> dict:
    cfg = {
        "output_dir": os.path.join(root, name),
        "seed": 3,
        "learning_rate": 0.01,
        "max_steps": 6,
        "per_device_train_batch_size": 4 // world,
        "per_device_eval_batch_size": 4 // world,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
        "strategy": {"device": "cpu"},
    }
    if stage:
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
        cfg["deepspeed"] = {"zero_optimization": zero}
        cfg["strategy"]["zero3_init_flag"] = zero_init
    cfg.update(extra)
    return cfg


def lm_rows(n: int, seed: int) -> list:
    ids = torch.randint(0, 64, (n, 12), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


def fit(key: str, model_init, strategy: str, **cfg) -> Trainer:
    trainer = Trainer(
        model_init=model_init,
        config=config(key, **cfg),
        train_dataset=lm_rows(32, 1),
        eval_dataset=lm_rows(8, 2),
        strategy=strategy,
    )
    partitioned = all(hasattr(p, "ds_id") for p in trainer.model.parameters())
    tensors.update({f"{key}/initial/{k}": v for k, v in full_weights(trainer).items()})
    trainer.fit()
    results[key] = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": trainer.evaluate()["eval_loss"],
        "partitioned_at_build": partitioned,
    }
    tensors.update({f"{key}/final/{k}": v for k, v in full_weights(trainer).items()})
    return trainer


def refused(key: str, call) -> None:
    try:
        call()
        results[key] = {"refused": None}
    except (ConfigError, KilnError) as err:
        results[key] = {"refused": str(err)}


def gpt2_config():
    import transformers

    return transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )


if "late_import" in checks:
    results["transformers_before"] = "transformers" in sys.modules

    def late():
        import transformers  # first imported here, inside zero.Init

        return transformers.GPT2LMHeadModel(gpt2_config())

    started = time.monotonic()
    refused("late_import", lambda: fit("late_import", late, "deepspeed", stage=3))
    results["late_import"]["seconds"] = time.monotonic() - started


class InitInConstructor(TrainingModule):
    """Children initialised by the parent's constructor after zero.Init partitioned them (nanoGPT)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64)
        self.apply(self._init)  # DeepSpeed gathers around Module.apply itself
        for name, p in self.named_parameters():  # nanoGPT's scaled init of its projections: kiln gathers it
            if name == "mix.weight":
                nn.init.normal_(p, std=0.05)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.3)
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.bias, 0.1)

    def training_step(self, batch: dict) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.emb(batch["input_ids"]))))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def validation_step(self, batch: dict) -> dict:
        return {"loss": self.training_step(batch)}


builders: dict = {}
if "gpt2" in checks:
    import transformers

    builders["class"] = lambda: transformers.GPT2LMHeadModel(gpt2_config())
    builders["from_config"] = lambda: transformers.AutoModelForCausalLM.from_config(gpt2_config())
if "plain" in checks:
    builders["plain"] = InitInConstructor
if "pretrained" in checks:
    import transformers

    path = os.path.join(
        out, f"pretrained{rank}"
    )  # each rank saves the same weights: no collective before a group exists
    torch.manual_seed(11)
    transformers.GPT2LMHeadModel(gpt2_config()).save_pretrained(path)
    tensors.update(
        {
            f"pretrained/saved/{k}": v.clone()
            for k, v in transformers.GPT2LMHeadModel.from_pretrained(path).state_dict().items()
        }
    )
    builders["pretrained"] = lambda: transformers.AutoModelForCausalLM.from_pretrained(path)
# every reference first: a DeepSpeed strategy's ZeRO-3 config stays registered with Transformers
# for the life of the process (as HF's Trainer leaves it), so a later from_config would partition
for way, build in builders.items():
    fit(f"{way}/reference", build, reference)
for way, build in builders.items():
    for zero_init in (True, False) if way != "plain" else (True,):
        fit(f"{way}/zero3_init{int(zero_init)}", build, "deepspeed", stage=3, zero_init=zero_init)
if builders:
    from deepspeed import comm

    results["shm_comm_op_built"] = getattr(comm.comm.cdb, "shm_comm_op", None) is not None

if "mismatch" in checks:
    import deepspeed

    def partitioned():
        with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 4}):
            return InitInConstructor()

    refused("mismatch", lambda: fit("mismatch", partitioned, "deepspeed", stage=2))

if rank == 0:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "tensors.safetensors"))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)
