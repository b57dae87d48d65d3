"""Launcher detection (torchrun, accelerate launch, SLURM) from environment dicts, and the
precedence between accelerate's settings and the kiln config."""

from __future__ import annotations

import logging

import pytest

from kiln.config import load_config
from kiln.config.schema import TrainingConfig
from kiln.config.schema.precision import PrecisionConfig
from kiln.launch import settings as envmod
from kiln.launch.environment import ClusterEnvironment, detect
from kiln.launch.environment.slurm import first_host, slurm_port
from kiln.launch.settings import launcher_overrides

TORCHRUN_NODE1 = {
    "WORLD_SIZE": "8",
    "RANK": "5",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def test_plain_python_is_one_process():
    env = detect({})
    assert env == ClusterEnvironment() and not env.distributed and not env.launched and env.init_method == "env://"


def test_torchrun_single_node():
    env = detect(
        {
            "WORLD_SIZE": "2",
            "RANK": "1",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.world_size, env.rank, env.local_rank, env.node_rank, env.num_nodes) == (2, 1, 1, 0, 1)
    assert env.source == "torchrun" and env.distributed and env.rendezvous and env.init_method == "env://"


def test_torchrun_multi_node():
    env = detect(TORCHRUN_NODE1)
    assert (env.world_size, env.rank, env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (
        8,
        5,
        1,
        4,
        1,
        2,
    )


def test_node_rank_falls_back_to_rank_over_local_world():
    env = detect({k: v for k, v in TORCHRUN_NODE1.items() if k != "GROUP_RANK"})
    assert env.node_rank == 1


def test_accelerate_multi_process_is_torchrun_plus_its_variables():
    env = detect({**TORCHRUN_NODE1, "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "False"})
    assert env.source == "accelerate" and env.world_size == 8 and env.rank == 5


def test_accelerate_single_process():
    env = detect({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False"})
    assert env.source == "accelerate" and env.world_size == 1 and not env.rendezvous


SLURM = {
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[007-008]",
    "SLURM_JOB_ID": "123456",
}


def test_slurm():
    env = detect(SLURM)
    assert (env.world_size, env.rank, env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (
        8,
        6,
        2,
        4,
        1,
        2,
    )
    assert env.source == "slurm" and env.init_method == "tcp://gpu007:18456"


def test_slurm_respects_master_addr_and_port():
    env = detect({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert env.init_method == "tcp://head:4000"


def test_torchrun_inside_a_slurm_allocation_wins():
    env = detect({**SLURM, **TORCHRUN_NODE1})
    assert env.source == "torchrun" and env.rank == 5


def test_slurm_single_task_or_salloc_shell_is_not_distributed():
    assert not detect({**SLURM, "SLURM_NTASKS": "1"}).distributed
    assert not detect({k: v for k, v in SLURM.items() if k != "SLURM_PROCID"}).distributed


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node01", "node01"),
        ("gpu[003-005,009],cpu01", "gpu003"),
        ("a[1,3],b[2-4]", "a1"),
        ("rack[2-3]-ib", "rack2-ib"),
        ("x1,x2", "x1"),
        ("", None),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_slurm_port_is_the_same_for_every_task_of_a_job():
    assert slurm_port("123456") == slurm_port("123456") == 18456 and 15000 <= slurm_port("7") < 25000


def test_auto_picks_ddp_only_when_launched_with_several_processes(monkeypatch):
    from kiln.strategies import STRATEGIES
    from kiln.strategies.auto import AutoStrategy

    cfg = load_config({})
    for key in ("WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    assert AutoStrategy.resolve(cfg) is STRATEGIES.get("single")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert AutoStrategy.resolve(cfg) is STRATEGIES.get("ddp")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert AutoStrategy.resolve(cfg) is STRATEGIES.get("single")


# -- accelerate settings and precedence ----------------------------------------------------------
ACC = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "False", "ACCELERATE_DYNAMO_BACKEND": "NO"}


def overrides_for(source, overrides=(), env=ACC):
    return launcher_overrides(source, overrides, load_config(source, overrides), env)


def test_accelerate_precision_applies_when_the_config_is_silent(caplog):
    with caplog.at_level(logging.WARNING, "kiln"):
        assert overrides_for({"learning_rate": 1e-3}) == {"precision.name": "bf16"}
    assert "Using precision.name=bf16 from accelerate launch (ACCELERATE_MIXED_PRECISION=bf16)" in caplog.text


@pytest.mark.parametrize(
    "source, overrides",
    [
        ({"precision": "fp32"}, ()),
        ({"fp16": True}, ()),  # HF flat name
        ({"precision": {"name": "fp16"}}, ()),
        ({}, ["precision=fp32"]),  # a command-line override
        (TrainingConfig(precision=PrecisionConfig(name="fp16")), ()),
    ],
)
def test_an_explicit_kiln_precision_wins_and_says_so(caplog, source, overrides):
    with caplog.at_level(logging.WARNING, "kiln"):
        assert "precision.name" not in overrides_for(source, overrides)
    assert "but the kiln config sets precision.name=" in caplog.text and "which wins" in caplog.text


def test_explicit_precision_in_a_yaml_file_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("precision: fp32\n")
    assert overrides_for(str(path)) == {}
    path.write_text("learning_rate: 0.1\n")
    assert overrides_for(str(path)) == {"precision.name": "bf16"}


def test_hf_false_flag_is_not_a_choice():
    assert overrides_for({"bf16": False}) == {"precision.name": "bf16"}  # HF: fp16/bf16=False means "not set"


def test_a_typed_config_at_its_default_lets_accelerate_choose():
    assert overrides_for(TrainingConfig()) == {"precision.name": "bf16"}


def test_a_loaded_dictconfig_is_not_resolved_twice():
    cfg = load_config({"precision": "fp32"})
    assert launcher_overrides(cfg, (), cfg, ACC) == {}


def test_accelerate_no_mixed_precision_changes_nothing(caplog):
    with caplog.at_level(logging.WARNING, "kiln"):
        assert overrides_for({}, env={"ACCELERATE_MIXED_PRECISION": "no"}) == {"precision.name": "fp32"}
    assert caplog.text == ""


def test_fp8_is_not_offered(caplog):
    with caplog.at_level(logging.WARNING, "kiln"):
        assert overrides_for({}, env={"ACCELERATE_MIXED_PRECISION": "fp8"}) == {}
    assert "does not provide" in caplog.text


def test_no_launcher_no_overrides():
    assert launcher_overrides({}, (), None, {}) == {}


def test_only_rank_zero_talks(caplog):
    with caplog.at_level(logging.WARNING, "kiln"):
        overrides_for({}, env={**ACC, "WORLD_SIZE": "2", "RANK": "1"})
    assert caplog.text == ""


def test_cpu_and_dynamo():
    env = {
        **ACC,
        "ACCELERATE_USE_CPU": "True",
        "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR",
        "ACCELERATE_DYNAMO_MODE": "max-autotune",
    }
    assert overrides_for({"precision": "fp32"}, env=env) == {
        "strategy.device": "cpu",
        "train.torch_compile_backend": "inductor",
        "train.torch_compile_mode": "max-autotune",
    }


FSDP_ENV = {
    "ACCELERATE_MIXED_PRECISION": "bf16",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "1",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "BertLayer",
    "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
    "FSDP_USE_ORIG_PARAMS": "true",
    "FSDP_SYNC_MODULE_STATES": "true",
}


def test_fsdp_is_handed_over_in_hf_format():
    settings = {s.key: s.values for s in envmod.accelerate_settings(FSDP_ENV)}
    assert settings["strategy.name"] == {
        "strategy.name": "fsdp",
        "strategy.options.fsdp": ["full_shard", "auto_wrap"],
        "strategy.options.fsdp_config": {
            "transformer_layer_cls_to_wrap": ["BertLayer"],
            "backward_prefetch": "backward_pre",
            "state_dict_type": "FULL_STATE_DICT",
            "use_orig_params": True,
            "sync_module_states": True,
        },
    }


def test_strategy_auto_lets_the_launcher_pick_but_an_explicit_strategy_wins(caplog):
    settings = dict(envmod.accelerate_settings(FSDP_ENV)[1].values)
    for source in ({}, {"strategy": "auto"}):
        chosen = launcher_overrides(source, (), load_config(source), {"ACCELERATE_USE_FSDP": "true"})
        assert (
            chosen["strategy.name"] == "fsdp"
            and chosen["strategy.options.fsdp"] == settings["strategy.options.fsdp"][:1]
        )
    with caplog.at_level(logging.WARNING, "kiln"):
        assert launcher_overrides({"strategy": "ddp"}, (), load_config({"strategy": "ddp"}), FSDP_ENV) == {
            "precision.name": "bf16"
        }
    assert "kiln config sets strategy.name=ddp, which wins" in caplog.text


def test_deepspeed_from_accelerate():
    file_env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "/cfg/ds.json"}
    assert envmod.accelerate_settings(file_env)[0].values == {
        "strategy.name": "deepspeed",
        "strategy.options.config": "/cfg/ds.json",
    }
    inline = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
        "ACCELERATE_GRADIENT_CLIPPING": "1.0",
    }
    assert envmod.accelerate_settings(inline)[0].values["strategy.options.config"] == {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
    }


def test_trainer_honours_accelerate_precision(monkeypatch, tmp_path):
    from kiln import Trainer
    from tests.distributed.toy import Regressor

    for key, value in {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "True"}.items():
        monkeypatch.setenv(key, value)
    base = {"output_dir": str(tmp_path), "strategy": {"device": "cpu"}}
    assert Trainer(Regressor(), base).config.precision.name == "bf16"
    assert Trainer(Regressor(), {**base, "precision": "fp32"}).config.precision.name == "fp32"
