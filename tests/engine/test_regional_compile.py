"""Regional compilation (issue 54 item 4): `torch_compile: {regions: blocks}` compiles each repeated block's
forward in place, once for all of them, before the strategy wraps the model, on every strategy.

The rule is the recompile tests' (tests/engine/test_compile_recompiles.py): kiln compiles exactly the graphs
of a hand-written loop that compiles the blocks the same way, and here that loop runs a ONE-block model while
kiln runs four blocks, so equal counts mean 0 recompiles across layers; nothing recompiles in epoch 2; and
the weights are those of the uncompiled run. Shapes are the recompile tests' (18 samples in micro-batches of
4, windows of 2, 6 evaluation samples, 2 epochs), with the counting aot_eager backend."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from kiln import Trainer
from kiln.utils.errors import ConfigError
from tests.distributed import compile_toy as toy

LAYERS = 4
REGIONS = {"torch_compile": {"regions": "blocks"}}


def _hand_one_block(train, evaluation) -> dict:
    toy.reset()
    model = toy.block_lm(layers=1)
    for block in model.h:
        block.forward = torch.compile(block.forward, backend=toy.BACKEND)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    toy.hand_loop(
        model,
        optimizer,
        toy.windows(toy.batches(train, 4), 2),
        toy.batches(evaluation, 4),
        epochs=2,
        counts_items=False,
    )
    return toy.counts()


def _fit(tmp, strategy: str, train, evaluation, **overrides):
    toy.reset()
    seen = toy.CountsPerStep()
    model = toy.block_lm(layers=LAYERS)
    config = toy.kiln_config(str(tmp), batch=4, eval_batch=4, strategy={"name": strategy, "device": "cpu"}, **overrides)
    trainer = Trainer(model, config, train_dataset=train, eval_dataset=evaluation, callbacks=[seen])
    trainer.fit()
    assert trainer.state.global_step == 6
    return model, trainer, seen, toy.counts()


@pytest.fixture(scope="module")
def data():
    return toy.token_data(18), toy.token_data(6, seed=1)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The hand-written one-block loop's counts and the uncompiled 4-block run's weights."""
    eager, _, _, _ = _fit(tmp_path_factory.mktemp("eager"), "single", *data, torch_compile_backend=None)
    return _hand_one_block(*data), toy.flat(eager.parameters())


def _full(params) -> list[torch.Tensor]:
    """The whole weights: fsdp and model_parallel leave the model's parameters as DTensors after the fit (on a
    1-process mesh too), and a DTensor does not compare with a plain tensor."""
    return [p.full_tensor() if isinstance(p, DTensor) else p for p in params]


def _assert_regional(reference, model, trainer, seen, got) -> None:
    hand, eager = reference
    assert got == hand and got["graphs"] > 0 and got["breaks"] == 0  # 4 blocks compile what 1 block compiles
    assert seen.steps[0] == seen.steps[1] and seen.steps[3:] == [seen.evals[0]] * 3  # epoch 2 compiles nothing
    assert seen.evals == [got["graphs"]] * 2
    assert not hasattr(trainer.model_wrapped, "_orig_mod")  # the whole model is not compiled on top
    assert all(hasattr(block.forward, "_torchdynamo_orig_callable") for block in model.h)
    assert not any("_orig_mod" in name for name, _ in model.named_parameters())  # the model's own names
    torch.testing.assert_close(toy.flat(_full(model.parameters())), eager, rtol=1e-5, atol=1e-6)


def test_single_compiles_one_block_for_all_and_trains_the_uncompiled_weights(reference, data, tmp_path):
    _assert_regional(reference, *_fit(tmp_path, "single", *data, **REGIONS))


# one process each: the wrappers (DDP, FSDP2's fully_shard, DeepSpeed's engine) around compiled blocks; the
# 2-process runs of DDP and FSDP with per-block compile are tests/distributed/test_compile_distributed.py
@pytest.mark.heavy
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "model_parallel", "deepspeed"])
def test_every_strategy_compiles_one_block_for_all(reference, data, tmp_path, strategy):
    _assert_regional(reference, *_fit(tmp_path, strategy, *data, **REGIONS))


@pytest.mark.heavy  # the set-up order is asserted below without a fit
def test_with_activation_checkpointing_the_compiled_forward_wraps_the_checkpointed_one(reference, data, tmp_path):
    """torchtitan's order (checkpoint, then compile): the same graphs and weights as without checkpointing."""
    run = _fit(tmp_path, "single", *data, activation_checkpointing={"mode": "full"}, **REGIONS)
    hand, eager = reference
    torch.testing.assert_close(toy.flat(run[0].parameters()), eager, rtol=1e-5, atol=1e-6)
    assert all(getattr(block, "_kiln_checkpointed", False) for block in run[0].h)
    assert run[3]["graphs"] > 0 and run[3]["breaks"] == 0 and run[2].steps[3:] == [run[2].evals[0]] * 3


# DeepSpeed's engine takes ~20 s to build here: its fit above (heavy) covers it
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "model_parallel"])
def test_every_strategy_compiles_the_blocks_before_it_wraps_them(strategy, tmp_path):
    """Each strategy's set-up as the engine drives it (checkpointing, regional compile, setup), without a
    step: the blocks' forwards are compiled around the checkpointed forwards (torchtitan's order), and the
    wrapper the strategy returns is not compiled on top."""
    from kiln.engine.compile import compile_module
    from kiln.engine.run import module_to_set_up

    model = toy.block_lm(layers=LAYERS)
    own = [block.forward for block in model.h]
    config = toy.kiln_config(
        str(tmp_path),
        batch=4,
        eval_batch=4,
        strategy={"name": strategy, "device": "cpu"},
        activation_checkpointing={"mode": "full"},
        **REGIONS,
    )
    trainer = Trainer(model, config, train_dataset=toy.token_data(4))
    try:
        wrapped = trainer.strategy.setup(module_to_set_up(trainer.run, trainer.config, trainer.strategy)).model
        for block, forward in zip(model.h, own):
            assert block.forward._torchdynamo_orig_callable.__wrapped__ == forward  # compiled(checkpointed(forward))
        assert compile_module(wrapped, trainer.strategy, trainer.config) is wrapped
    finally:
        trainer.teardown()  # the process group this set-up started (no fit, so nothing else ends it)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_model_without_blocks_is_refused_in_one_sentence(strategy, tmp_path):
    config = toy.kiln_config(
        str(tmp_path),
        batch=4,
        eval_batch=4,
        strategy={"name": strategy, "device": "cpu"},
        eval_strategy="no",
        **REGIONS,
    )
    trainer = Trainer(toy.mlp(), config, train_dataset=toy.regression_data(8))
    try:
        with pytest.raises(
            ConfigError, match=r"torch_compile.regions: blocks found no repeated blocks in MLP: .*_no_split_modules"
        ):
            trainer.fit()
    finally:
        trainer.teardown()  # the refusal comes at set-up, after FSDP's process group started


@pytest.mark.parametrize("value", ["layers2", "model"])
def test_a_bad_value_names_the_allowed_ones(value, tmp_path):
    from kiln.config import load_config

    with pytest.raises(
        ConfigError, match=rf"^Config key 'torch_compile.regions' is '{value}'; use blocks .* or leave it unset"
    ):
        load_config({"output_dir": str(tmp_path), "torch_compile": {"regions": value}})


def test_hf_flat_switch_and_the_section_together(tmp_path):
    """`torch_compile: true` stays HF's flat switch (train.torch_compile); the mapping is the section."""
    from kiln.config import load_config
    from kiln.config.compile import compiles_blocks, compiles_model

    flat = load_config({"output_dir": str(tmp_path), "torch_compile": True})
    assert flat.train.torch_compile and not compiles_blocks(flat)
    section = load_config({"output_dir": str(tmp_path), "torch_compile": {"regions": "blocks"}})
    assert compiles_model(section) and compiles_blocks(section) and not section.train.torch_compile
    both = load_config({"output_dir": str(tmp_path), "torch_compile": {"regions": "blocks"}}, ["torch_compile=true"])
    assert both.train.torch_compile and compiles_blocks(both)


def test_compile_blocks_compiles_each_block_once_and_only_when_asked():
    """Direct: the count the strategies log, nothing without the section, no second compile of a block."""
    from types import SimpleNamespace

    from kiln.strategies.regional_compile import compile_blocks

    def config(regions):
        train = SimpleNamespace(torch_compile=False, torch_compile_backend=toy.BACKEND, torch_compile_mode=None)
        return SimpleNamespace(train=train, torch_compile=SimpleNamespace(regions=regions))

    model = toy.block_lm(layers=3)
    assert compile_blocks(model, config(None), list(model.h)) == 0
    assert not hasattr(model.h[0].forward, "_torchdynamo_orig_callable")
    assert compile_blocks(model, config("blocks"), list(model.h)) == 3
    assert compile_blocks(model, config("blocks"), list(model.h)) == 0
    assert compile_blocks(model, config(None), []) == 0  # not asked: no refusal either
