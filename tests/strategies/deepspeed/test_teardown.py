"""DeepSpeed's teardown unregisters its config from Transformers: before it, a model built later in the
same process (another Trainer, a plain from_config) would still be built partitioned for ZeRO-3."""

from __future__ import annotations

import pytest

from tests.installed import requires

pytest.importorskip("transformers")
pytestmark = requires("deepspeed")


def _stage3(stage: str = "deepspeed_stage_3"):
    from kiln.config import load_config
    from kiln.precision import build_precision
    from kiln.strategies import build_strategy

    cfg = load_config({"max_steps": 2, "strategy": {"name": stage, "device": "cpu"}})
    return build_strategy(cfg, build_precision(cfg))


def test_teardown_unregisters_the_deepspeed_config_from_transformers_and_is_idempotent():
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    strategy = _stage3()
    strategy._share_with_transformers()  # what setup_environment / module_init_context do
    held = strategy._hf_config  # Transformers holds it weakly; something else may hold it strongly
    assert is_deepspeed_zero3_enabled()
    strategy.teardown()
    assert not is_deepspeed_zero3_enabled()
    strategy.teardown()  # twice (the Trainer, then atexit): nothing left to do
    assert not is_deepspeed_zero3_enabled() and held is not None


def test_teardown_leaves_a_config_another_strategy_registered_since():
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    first, second = _stage3(), _stage3()
    first._share_with_transformers()
    second._share_with_transformers()  # the later Trainer's config is the one Transformers holds now
    first.teardown()
    assert is_deepspeed_zero3_enabled()
    second.teardown()
    assert not is_deepspeed_zero3_enabled()
    unset_hf_deepspeed_config()


def test_teardown_releases_deepspeeds_cached_groups_of_the_destroyed_world():
    """DeepSpeed caches groups of the world (its clone, the data-parallel group); a later DeepSpeed run
    in this process reusing the destroyed ones fails ("Group ... is not registered")."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    strategy = _stage3("deepspeed_stage_2")
    strategy.setup_environment()
    assert groups._clone_world_group() is not None  # what ZeRO's optimizer caches
    strategy.teardown()
    assert not dist.is_initialized() and groups._WORLD_GROUP is None


def test_teardown_takes_back_the_local_rank_it_exported_and_leaves_a_users(monkeypatch):
    """DeepSpeed's engine asserts LOCAL_RANK, so a one-process run exports it; left behind, it tells a later
    Hugging Face Trainer in the same process that it is one rank of a distributed job (which then fails
    for want of MASTER_ADDR)."""
    import os

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    strategy = _stage3("deepspeed_stage_2")
    strategy.setup_environment()
    assert os.environ["LOCAL_RANK"] == "0"
    strategy.teardown()
    assert "LOCAL_RANK" not in os.environ
    monkeypatch.setenv("LOCAL_RANK", "0")  # the launcher's, not kiln's to take back
    strategy = _stage3("deepspeed_stage_2")
    strategy.setup_environment()
    strategy.teardown()
    assert os.environ["LOCAL_RANK"] == "0"


def test_teardown_puts_back_the_torch_linear_that_zero3s_init_swapped_out():
    """ZeRO-3's Init replaces torch.nn.functional.linear for the whole process; left behind, a later
    plain layer fails on a list input with DeepSpeed's AttributeError instead of torch's TypeError (it
    broke other tests run after an in-process ZeRO-3 fit), and runs DeepSpeed's autograd function."""
    import torch
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    torch_linear = torch.nn.functional.linear
    strategy = _stage3()
    strategy.setup_environment()
    InsertPostInitMethodToModuleSubClasses._enable_mem_efficient_linear(None)  # what zero.Init does
    assert torch.nn.functional.linear is zero3_linear_wrap
    strategy.teardown()
    assert torch.nn.functional.linear is torch_linear
    with pytest.raises(TypeError):
        torch.nn.Linear(2, 2)([[1.0, 2.0]])
    strategy.teardown()  # idempotent, and a linear someone else set is left alone
    mine = lambda *a, **k: torch_linear(*a, **k)  # noqa: E731
    torch.nn.functional.linear = mine
    try:
        _stage3().teardown()
        assert torch.nn.functional.linear is mine
    finally:
        torch.nn.functional.linear = torch_linear
