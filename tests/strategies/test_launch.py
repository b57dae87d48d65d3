"""kiln's local launcher without starting processes: accelerate config files (checked against what
`accelerate launch` itself exports), the first-failure report, and the worker shim's tail."""

from __future__ import annotations

import io
import json
import signal
from types import SimpleNamespace

import pytest

from kiln.launch import local as launch
from kiln.launch import worker
from kiln.launch.accelerate_config import AccelerateConfig
from kiln.launch.settings import accelerate_config_settings, accelerate_settings, settings_of

# The accelerate config files of the Hugging Face docs (multi-GPU DDP, FSDP, DeepSpeed file / inline).
MULTI_GPU = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 0
main_process_ip: 192.168.20.1
main_process_port: 9898
main_training_function: main
mixed_precision: fp16
num_machines: 2
num_processes: 8
rdzv_backend: static
same_network: true
use_cpu: false
"""
FSDP = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_forward_prefetch: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: 1
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""
DS_FILE = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: /home/user/configs/ds_zero3_config.json
  zero3_init_flag: true
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: false
"""
DS_INLINE = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 1
  gradient_clipping: 0.7
  offload_optimizer_device: cpu
  offload_param_device: cpu
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: false
"""


def _kiln_view(settings: list) -> dict:
    """What kiln takes from an accelerate configuration."""
    out = {}
    for setting in settings:
        out.update(setting.values)
    cfg = out.pop("strategy.options.fsdp_config", {})
    out.update(
        {
            f"fsdp_config.{k}": cfg[k]
            for k in ("transformer_layer_cls_to_wrap", "state_dict_type", "use_orig_params")
            if k in cfg
        }
    )
    return out


def _accelerate_env(path: str) -> dict:
    """The variables `accelerate launch --config_file path` exports (accelerate's own code)."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "train.py"]))
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = []
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize(
    "text, nproc, expected",
    [
        (
            FSDP,
            2,
            {
                "precision.name": "bf16",
                "strategy.name": "fsdp",
                "strategy.options.fsdp": ["full_shard", "auto_wrap"],
                "fsdp_config.transformer_layer_cls_to_wrap": ["BertLayer"],
                "fsdp_config.state_dict_type": "FULL_STATE_DICT",
                "fsdp_config.use_orig_params": True,
            },
        ),
        (
            DS_FILE,
            4,
            {
                "precision.name": "fp32",
                "strategy.name": "deepspeed",
                "strategy.options.config": "/home/user/configs/ds_zero3_config.json",
            },
        ),
        (
            DS_INLINE,
            4,
            {
                "precision.name": "bf16",
                "strategy.name": "deepspeed",
                "strategy.options.config": {
                    "zero_optimization": {
                        "stage": 3,
                        "offload_optimizer": {"device": "cpu"},
                        "offload_param": {"device": "cpu"},
                    },
                    "gradient_accumulation_steps": 1,
                    "gradient_clipping": 0.7,
                },
            },
        ),
    ],
)
def test_accelerate_config_files_mean_what_accelerate_launch_makes_of_them(tmp_path, text, nproc, expected):
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    num, settings, devices = accelerate_config_settings(str(path))
    assert num == nproc and devices == {}
    assert _kiln_view(settings) == expected
    assert (
        _kiln_view(accelerate_settings(_accelerate_env(str(path)))) == expected
    )  # same result as through accelerate itself


@pytest.mark.parametrize("text", [FSDP, DS_FILE, DS_INLINE])
def test_the_file_and_accelerates_variables_read_into_one_structure(tmp_path, text):
    """Both ways an accelerate config reaches kiln give the same AccelerateConfig in what kiln reads."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    from_file, from_env = AccelerateConfig.from_file(str(path)), AccelerateConfig.from_env(_accelerate_env(str(path)))
    for name in ("mixed_precision", "use_cpu", "distributed_type", "dynamo_backend"):
        assert getattr(from_file, name) == getattr(from_env, name), name
    assert {k: v for k, v in from_env.fsdp.items() if k in from_file.fsdp} == from_file.fsdp
    assert (
        from_env.deepspeed.items() >= {k: v for k, v in from_file.deepspeed.items() if k != "zero3_init_flag"}.items()
    )
    # accelerate adds its defaults for what the file leaves out (cpu_ram_efficient_loading, ...): kiln's view above
    assert _kiln_view(settings_of(from_file)) == _kiln_view(settings_of(from_env))


def test_a_multi_machine_accelerate_config_is_refused(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text(MULTI_GPU)
    with pytest.raises(ValueError, match="2 machines"):
        accelerate_config_settings(str(path))


def test_single_machine_multi_gpu_config_sets_gpus(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text(MULTI_GPU.replace("num_machines: 2", "num_machines: 1").replace("gpu_ids: all", "gpu_ids: 0,2"))
    num, settings, devices = accelerate_config_settings(str(path))
    assert (
        num == 8 and devices == {"CUDA_VISIBLE_DEVICES": "0,2"} and _kiln_view(settings) == {"precision.name": "fp16"}
    )


def test_launch_refuses_to_nest(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="already launched"):
        launch.launch_local(2, ["x.py"])


def _failure(code):
    return SimpleNamespace(exitcode=code)


def _write(tmp_path, rank, t, error, code=1):
    (tmp_path / f"rank_{rank}.json").write_text(
        json.dumps({"rank": rank, "time": t, "error": error, "detail": "", "exitcode": code})
    )


def test_report_picks_the_earliest_failure_not_the_consequences(tmp_path, capsys):
    _write(tmp_path, 0, 2.0, "RuntimeError: Connection closed by peer")
    _write(tmp_path, 1, 1.0, "ValueError: boom", code=3)
    err = SimpleNamespace(failures={0: _failure(1), 1: _failure(3)})
    assert launch._report(err, str(tmp_path)) == 3
    assert "kiln: rank 1 failed first (exit code 3): ValueError: boom" in capsys.readouterr().err


def test_report_blames_a_killed_rank_but_not_the_ones_the_agent_stopped(tmp_path, capsys):
    _write(tmp_path, 0, 2.0, "RuntimeError: Connection closed by peer")
    err = SimpleNamespace(failures={0: _failure(1), 1: _failure(-signal.SIGKILL), 2: _failure(-signal.SIGTERM)})
    assert launch._report(err, str(tmp_path)) == 1
    assert "rank 1 died first (killed by signal 9" in capsys.readouterr().err


def test_tail_keeps_the_last_output():
    sink = io.StringIO()
    tail = worker._Tail(sink, limit=20)
    for word in ("hello ", "world ", "kiln: error: x"):
        tail.write(word)
    assert sink.getvalue() == "hello world kiln: error: x"
    assert tail.text() == "world kiln: error: x"
    assert tail.getvalue() == sink.getvalue()  # other attributes pass through
