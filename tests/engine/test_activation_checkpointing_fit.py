"""The `activation_checkpointing` config section through a whole fit of a tiny Llama on one process:
every mode (and HF's `gradient_checkpointing: true`) ends with the un-checkpointed fit's weights within 1e-6,
and backward really recomputes what the mode says (matmuls counted over the fit by a dispatch mode). The
blocks are found inside a TrainingModule too; a model without blocks is one sentence. DDP and FSDP run the
same section in tests/strategies/fsdp/test_parity.py, model_parallel the strategy's alias in
tests/strategies/mesh."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln import Trainer
from kiln.config import load_config
from kiln.strategies.activation_checkpointing import Policy, find_blocks, policy
from kiln.utils.errors import ConfigError
from tests.helpers import base_config, flat_params
from tests.strategies.test_activation_checkpointing import Ops

transformers = pytest.importorskip("transformers")

LAYERS = 4
MM = "aten.mm.default"


def llama():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=LAYERS,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=64,
            attn_implementation="sdpa",
        )
    )


def data():  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 8), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


STEPS = 2


def fit(tmp_path, **extra):  # type: ignore[no-untyped-def]
    """(final weights, logged losses, matmuls run over the fit, the trainer)."""
    cfg = base_config(
        tmp_path,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        log={"history": [], "steps": 1},
        **extra,
    )
    trainer = Trainer(llama(), cfg, train_dataset=data())
    with Ops() as ops:
        trainer.fit()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return flat_params(trainer.model), losses, ops.counts[MM], trainer


@pytest.fixture(scope="module")
def plain(tmp_path_factory):  # type: ignore[no-untyped-def]
    return fit(tmp_path_factory.mktemp("plain"))


# extra matmuls per step: a block's 7 (q, k, v, o, gate, up, down); full recomputes all but the last (its
# output is not needed in backward), selective the 2nd, 4th and 6th (tests/strategies/test_activation_checkpointing.py)
@pytest.mark.parametrize(
    "extra, recomputed",
    [
        ({"activation_checkpointing": {"mode": "full"}}, LAYERS * 6),
        ({"activation_checkpointing": {"mode": "selective"}}, LAYERS * 3),
        ({"activation_checkpointing": {"mode": "full", "every": 2}}, LAYERS // 2 * 6),
        ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"every_n_layers": 2}}, LAYERS // 2 * 6),
    ],
    ids=["full", "selective", "full-every-2", "hf-every-2"],
)
def test_a_checkpointed_fit_ends_where_the_plain_fit_does(tmp_path, plain, extra, recomputed):
    weights, losses, mm, trainer = fit(tmp_path, **extra)
    torch.testing.assert_close(weights, plain[0], rtol=1e-6, atol=1e-6)
    assert losses == pytest.approx(plain[1], rel=1e-6) and len(losses) == STEPS
    assert mm - plain[2] == STEPS * recomputed
    layers = trainer.model.model.layers
    assert not any(layer.gradient_checkpointing for layer in layers)  # kiln's checkpointing, not Transformers'


class Wrapper(nn.Module):
    """A module holding a Transformers model, without _no_split_modules of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = llama()


def test_blocks_are_found_inside_a_wrapper_and_a_model_without_blocks_is_one_sentence(tmp_path):
    wrapper = Wrapper()
    assert find_blocks(wrapper) == list(wrapper.lm.model.layers)
    model = nn.Sequential(nn.Linear(4, 4))
    cfg = base_config(tmp_path, activation_checkpointing={"mode": "full"}, max_steps=1)
    trainer = Trainer(model, cfg, train_dataset=[{"x": torch.zeros(4)}] * 2)
    with pytest.raises(ConfigError, match="activation_checkpointing has no blocks to checkpoint in Sequential: give"):
        trainer.fit()


def test_the_policy_of_a_config():
    assert policy(load_config({})) is None
    assert policy(load_config({}), strategy_flag=True) == Policy("full")  # the mesh strategy's alias
    assert policy(load_config({"gradient_checkpointing": True})) == Policy("full")
    section = {"activation_checkpointing": {"mode": "selective", "every": 2, "ops": ["aten.mm"]}}
    assert policy(load_config(section)) == Policy("selective", 2, ("aten.mm",))
    with pytest.raises(
        ConfigError, match="activation_checkpointing.every / ops are set but activation_checkpointing.mode"
    ):
        policy(load_config({"activation_checkpointing": {"every": 2}}))
