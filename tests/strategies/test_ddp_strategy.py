"""DDPStrategy in one process (a world of 1 over an in-memory store): options, wrapping, no_sync,
collectives, process-group ownership, and bit-identity with the single-device strategy."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from kiln import Trainer
from kiln.config import load_config
from kiln.launch.environment import ClusterEnvironment
from kiln.precision import build_precision
from kiln.strategies import STRATEGIES
from kiln.strategies.ddp.strategy import DDPStrategy
from kiln.strategies.process_group import default_backend, pick_device
from tests.distributed import toy

LAUNCH_VARS = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_DEEPSPEED",
)


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def make(overrides=None, **cfg):
    config = load_config({"strategy": {"name": "ddp", "device": "cpu", **(overrides or {})}, **cfg})
    return DDPStrategy(config, build_precision(config))


def test_registered_names():
    assert STRATEGIES.get("ddp") is DDPStrategy is STRATEGIES.get("ddp_find_unused_parameters_true")


def buffers(kwargs):
    """DDP's buffer-sync flag, under its torch >= 2.13 name or the older one."""
    return kwargs.get("forward_sync_buffers", kwargs.get("broadcast_buffers"))


def test_hf_defaults_for_ddp_options():
    kw = make().ddp_kwargs()  # find_unused_parameters unset: off, decided on the first step (test_ddp_unused.py)
    assert kw["find_unused_parameters"] is False and buffers(kw) is True and kw["static_graph"] is False
    assert (
        make().choose_unused_on_first_step()
        and not make({"find_unused_parameters": True}).choose_unused_on_first_step()
    )
    assert "bucket_cap_mb" not in kw
    checkpointing = make(gradient_checkpointing=True).ddp_kwargs()
    assert checkpointing["find_unused_parameters"] is False and buffers(checkpointing) is False
    assert not make(gradient_checkpointing=True).choose_unused_on_first_step()
    section = make(activation_checkpointing={"mode": "selective"})  # the section, as HF's switch
    assert buffers(section.ddp_kwargs()) is False and not section.choose_unused_on_first_step()


def test_explicit_ddp_options_and_the_find_unused_alias():
    kw = make(
        {"find_unused_parameters": False, "bucket_cap_mb": 50, "static_graph": True, "broadcast_buffers": False}
    ).ddp_kwargs()
    assert kw["find_unused_parameters"] is False and kw["bucket_cap_mb"] == 50 and kw["static_graph"] is True
    assert buffers(kw) is False
    alias = make({"name": "ddp_find_unused_parameters_true"}, gradient_checkpointing=True).ddp_kwargs()
    assert alias["find_unused_parameters"] is True


def test_hf_flat_names_reach_the_strategy():
    cfg = load_config(
        {
            "strategy": "ddp",
            "ddp_backend": "gloo",
            "ddp_timeout": 30,
            "ddp_find_unused_parameters": False,
            "ddp_bucket_cap_mb": 10,
            "ddp_broadcast_buffers": False,
        }
    )
    s = DDPStrategy(cfg, build_precision(cfg))
    assert s.backend == "gloo" and cfg.strategy.timeout == 30
    assert s.ddp_kwargs()["find_unused_parameters"] is False and s.ddp_kwargs()["bucket_cap_mb"] == 10


def test_backend_and_device_defaults(monkeypatch):
    assert make().backend == "gloo" and make().root_device == torch.device("cpu")
    assert default_backend(torch.device("cuda", 0)) == "nccl" and default_backend(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        pick_device(ClusterEnvironment(), "cuda")
    with pytest.raises(RuntimeError, match="use strategy: mps"):
        pick_device(ClusterEnvironment(), "mps")


def test_cuda_device_follows_local_rank_and_names_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert pick_device(ClusterEnvironment(world_size=2, rank=1, local_rank=1), None) == torch.device("cuda", 1)
    assert pick_device(ClusterEnvironment(world_size=2, rank=1, local_rank=1), "cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"Local rank 2 has no CUDA device: 2 visible \(CUDA_VISIBLE_DEVICES=0,2\)"):
        pick_device(ClusterEnvironment(world_size=4, rank=2, local_rank=2), None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # srun --gpus-per-task=1
    assert pick_device(ClusterEnvironment(world_size=4, rank=3, local_rank=3, source="slurm"), None) == torch.device(
        "cuda", 0
    )


def test_process_group_is_created_once_and_destroyed_by_its_owner():
    owner, guest = make(), make()
    owner.setup_environment()
    guest.setup_environment()
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    guest.teardown()
    assert dist.is_initialized()  # not the guest's to destroy
    owner.teardown()
    owner.teardown()  # idempotent
    assert not dist.is_initialized()


def test_collectives_on_one_rank():
    s = make()
    s.setup_environment()
    assert s.reduce(torch.tensor(3), "sum").item() == 3
    assert s.reduce(torch.tensor(3), "mean").item() == 3.0 and s.reduce(torch.tensor(3), "mean").is_floating_point()
    assert s.reduce(torch.tensor([1.0, 5.0]), "max").tolist() == [1.0, 5.0]
    x = torch.tensor([1.5, 2.5])
    s.reduce(x, "sum")
    assert x.tolist() == [1.5, 2.5]  # the input is never modified
    with pytest.raises(ValueError, match="reduce op"):
        s.reduce(x, "avg")
    assert s.all_gather(torch.arange(6).view(2, 3)).shape == (1, 2, 3)
    assert s.all_gather(torch.tensor(7)).tolist() == [7]
    assert s.all_gather(torch.tensor([True, False])).dtype == torch.bool
    assert s.all_gather_object({"a": 1}) == [{"a": 1}]
    assert s.broadcast_object("x") == "x"
    s.barrier("test")


def test_wrap_unwrap_and_no_sync():
    s = make({"find_unused_parameters": False})
    s.setup_environment()
    inner = nn.Linear(3, 1)
    wrapped = s.setup_module(inner)
    assert isinstance(wrapped, nn.parallel.DistributedDataParallel) and s.unwrap(wrapped) is inner
    with s.micro_batch_context(wrapped, boundary=False):
        assert not wrapped.require_backward_grad_sync
    with s.micro_batch_context(wrapped, boundary=True):
        assert wrapped.require_backward_grad_sync
    with s.micro_batch_context(inner, boundary=False):  # nothing to skip on an unwrapped module
        pass


def test_one_process_ddp_fit_is_bit_identical_to_single(tmp_path):
    results = {}
    for name in ("ddp", "single"):
        cfg = toy.scenario_config("accum", str(tmp_path / name), world=2)
        cfg["strategy"] = {"name": name, "device": "cpu"}
        torch.manual_seed(0)
        model = toy.Regressor()
        trainer = Trainer(model, cfg, train_dataset=toy.regression_data(32))
        trainer.fit()
        results[name] = (toy.flat_params(model), trainer.evaluate(toy.regression_data(7))["eval_loss"])
        if name == "ddp":
            assert isinstance(trainer.model_wrapped, nn.parallel.DistributedDataParallel)
            export = trainer.save_model(str(tmp_path / "export"))
            from safetensors.torch import load_file

            assert set(load_file(f"{export}/model.safetensors")) == set(model.state_dict())
    assert torch.equal(results["ddp"][0], results["single"][0])
    assert results["ddp"][1] == results["single"][1]


def test_a_misspelt_strategy_option_is_refused_with_a_suggestion():
    from kiln.utils.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"Unknown option strategy\.find_unsed_parameters for strategy 'ddp'\. "
        r"Did you mean 'find_unused_parameters'\?",
    ):
        make({"find_unsed_parameters": True})


def test_an_option_of_another_strategy_is_refused():
    from kiln.strategies.single import SingleDeviceStrategy
    from kiln.utils.errors import ConfigError

    config = load_config({"strategy": {"name": "single", "sharding": "full_shard"}})
    with pytest.raises(ConfigError, match=r"Unknown option strategy\.sharding for strategy 'single'"):
        SingleDeviceStrategy(config, build_precision(config))
