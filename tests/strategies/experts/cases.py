"""Tiny mixture-of-experts models from their configs (hidden 32, 2 layers, 4 experts of which each
token takes 2, vocab 128; no download), their data, and the run the expert-parallel tests compare:
`train(out, strategy, ...)` trains one with one global batch on any strategy and returns the per-step
logged losses, the final full weights and the Trainer."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests.helpers import padded_token_data  # noqa: E402

VOCAB = 128
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}


def moe(kind: str = "mixtral", seed: int = 0, **extra: Any) -> Any:
    """A tiny MoE causal LM of transformers: mixtral, qwen3_moe, olmoe or deepseek_v3."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "mixtral":
        config = tf.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, **extra)
        return tf.MixtralForCausalLM(config)
    if kind == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=4, decoder_sparse_step=1, **extra
        )
        return tf.Qwen3MoeForCausalLM(config)
    if kind == "olmoe":
        config = tf.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=4, **extra)
        return tf.OlmoeForCausalLM(config)
    config = tf.DeepseekV3Config(  # one dense layer first, then an MoE layer with a shared expert
        **{**COMMON, "num_key_value_heads": 4},
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        intermediate_size=48,
        moe_intermediate_size=24,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        **extra,
    )
    return tf.DeepseekV3ForCausalLM(config)


def data(n: int = 20) -> list[dict[str, torch.Tensor]]:
    """Sequences with 1..10 real tokens (the rest -100): micro-batches differ in items."""
    return padded_token_data(n, length=10, vocab=VOCAB, seed=3)


def config(out: str, strategy: Any, **extra: Any) -> dict[str, Any]:
    """SGD with momentum (optimizer state to resume; the comparison sees the gradients, not AdamW's
    magnified float noise) and global clipping; per-device micro-batches of `per_device_train_batch_size`."""
    cfg: dict[str, Any] = {
        "output_dir": out,
        "seed": 7,
        "learning_rate": 0.5,
        "optim": {"name": "sgd", "optim_args": "momentum=0.9"},
        "num_train_epochs": 1,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.3,
        "save": {"strategy": "no"},
        "log": {"history": [], "disable_tqdm": True, "steps": 1},
        "strategy": strategy,
    }
    cfg.update(extra)
    return cfg


def train(
    out: str,
    strategy: Any,
    *,
    kind: str = "mixtral",
    model: Any = None,
    teardown: bool = True,
    resume: str | None = None,
    eval_dataset: Any = None,
    **extra: Any,
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    from kiln import Trainer

    model = model if model is not None else moe(kind)
    trainer = Trainer(model, config(out, strategy, **extra), train_dataset=data(), eval_dataset=eval_dataset)
    trainer.fit(resume_from_checkpoint=resume)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    state = trainer.strategy.model_state_for_export(trainer.model)
    if teardown:
        trainer.teardown()
    return losses, state, trainer


# -- the 4-process ep worlds' comparison with single (test_expert_tp.py, test_expert_replicate.py) -------------
#: one sample an evaluation batch, so each batch's loss is one sample's on any number of ranks
EVAL_BATCH = {"per_device_eval_batch_size": 1}


def local_state(model: Any) -> dict[str, torch.Tensor]:
    """Each entry of `model`'s state dict as this rank holds it (a DTensor's local piece)."""
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in model.state_dict().items()}


def grad_norms(trainer: Any) -> list[float]:
    return [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]


def single_reference(out: str) -> tuple[list[float], dict[str, torch.Tensor], list[float], float]:
    """The same global batch on one process: its losses, weights, grad norms (every step clips) and eval loss."""
    losses, weights, single = train(
        out, {"name": "single", "device": "cpu"}, per_device_train_batch_size=4, teardown=False, **EVAL_BATCH
    )
    norms, evaluated = grad_norms(single), single.evaluate(data(5))["eval_loss"]
    single.teardown()
    assert len(losses) == 3 and min(norms) > 0.3  # every step clips
    return losses, weights, norms, evaluated


def assert_ranks_follow_single(ranks: list[dict[str, Any]], reference: tuple) -> None:
    """Rank 0's gathered weights, and every rank's losses, grad norms and eval loss, equal single's within 1e-5."""
    losses, weights, norms, evaluated = reference
    got = ranks[0]["export"]  # gathered on rank 0
    assert sorted(got) == sorted(weights) and all(rank["export"] == {} for rank in ranks[1:])
    for name, value in weights.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"{name} differs")
    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["losses"], losses, rtol=1e-5, atol=1e-5, msg=f"rank {r} losses")
        torch.testing.assert_close(rank["norms"], norms, rtol=1e-5, atol=1e-5, msg=f"rank {r} grad norms")
        assert rank["evaluate"] == pytest.approx(evaluated, rel=1e-5, abs=1e-6)


def assert_resumes(ranks: list[dict[str, Any]], run: str, out: str, weights: dict[str, torch.Tensor]) -> None:
    """The world's step-1 resume under its own mesh is bitwise on every rank, and its step-2 checkpoint resumed
    on one process (model_parallel without ep) ends on single's `weights`."""
    for r, rank in enumerate(ranks):
        resumed = rank["resumed"]
        assert resumed["losses"] == rank["losses"], f"rank {r}"
        assert sorted(resumed["local"]) == sorted(rank["local"])
        for name, value in resumed["local"].items():
            assert torch.equal(value, rank["local"][name]), f"rank {r}: {name} is not bitwise equal"
    one = {"name": "model_parallel", "device": "cpu"}
    resume = os.path.join(run, "checkpoint-2")
    _, got, _ = train(out, one, model=moe(seed=1), per_device_train_batch_size=4, resume=resume)
    for name, value in weights.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"resumed: {name} differs")
