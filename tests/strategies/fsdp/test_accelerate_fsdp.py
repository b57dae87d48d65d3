"""The accelerate forms of FSDP run kiln's FSDP exactly like `kiln fit --nproc 2` with the same
settings written as kiln keys: `accelerate launch` with the Hugging Face guide's FSDP config file
(adapted to 2 CPU processes and to this model's block class), `kiln fit --accelerate-config` with
that file, and `accelerate launch --use_fsdp --fsdp_sharding_strategy=1 ...` (the command-line
form, whose defaults also turn on cpu_ram_efficient_loading: ranks > 0 build on the meta device)."""

from __future__ import annotations

import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.distributed.conftest import kiln_cli, run, torchrun
from tests.distributed.test_accelerate_launch import _free_port
from tests.distributed.toy import write_cli_config
from tests.installed import requires

pytestmark = [pytest.mark.distributed, requires("accelerate")]

# docs: https://huggingface.co/docs/transformers/fsdp (accelerate config); BertLayer -> Linear,
# mixed_precision bf16 -> no (the comparison is exact), 2 processes on one machine
ACCELERATE_FSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_forward_prefetch: false
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: true
  fsdp_sharding_strategy: 1
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: Linear
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
main_process_port: {port}
"""

NATIVE = [
    "strategy.name=fsdp",
    "strategy.sharding=full_shard",
    "strategy.wrap=[Linear]",
    "strategy.offload=true",
    "strategy.sync_module_states=true",
]


CLI_FLAGS = [
    "--use_fsdp",
    "--num_processes",
    "2",
    "--fsdp_sharding_strategy=1",
    "--fsdp_auto_wrap_policy",
    "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap",
    "Linear",
    "--fsdp_offload_params",
    "true",
    "--fsdp_state_dict_type",
    "SHARDED_STATE_DICT",
    "--mixed_precision",
    "no",
]


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    own = write_cli_config(str(root / "own.yaml"), str(root / "own"))
    OmegaConf.save(OmegaConf.merge(OmegaConf.load(own), OmegaConf.from_dotlist(NATIVE)), own)
    torchrun("worker_cli_runs.py", own, timeout=300)  # `kiln fit` in each rank of a 2-process world
    return load_file(str(root / "own" / "model.safetensors"))


def _same_run(folder, expected) -> None:
    assert OmegaConf.load(folder / "kiln_config.yaml").strategy.name == "fsdp"
    got = load_file(str(folder / "model.safetensors"))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def _accelerate_launch(*args: str, timeout: float = 300):
    return run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *args], timeout=timeout)


def test_accelerate_fsdp_config_runs_like_the_native_config(tmp_path, native):
    conf = tmp_path / "accelerate.yaml"
    conf.write_text(ACCELERATE_FSDP.format(port=_free_port()))
    acc = _accelerate_launch(
        "--config_file",
        str(conf),
        "-m",
        "kiln.cli",
        "fit",
        write_cli_config(str(tmp_path / "acc.yaml"), str(tmp_path / "acc")),
    )
    assert "has no effect" in acc.stderr  # use_orig_params, said once per rank, not dropped silently
    _same_run(tmp_path / "acc", native)


# CI time: the file means to `kiln fit --accelerate-config` what it means to `accelerate launch`
# (tests/strategies/test_launch.py::test_accelerate_config_files_mean_what_accelerate_launch_makes_of_them),
# and `accelerate launch` with it runs like the native config (test_accelerate_fsdp_config_runs_like_the_native_config)
@pytest.mark.heavy
def test_kiln_fit_with_the_accelerate_config_file_runs_like_the_native_config(tmp_path, native):
    conf = tmp_path / "accelerate.yaml"
    conf.write_text(ACCELERATE_FSDP.format(port=_free_port()))
    kiln_cli(
        "fit",
        write_cli_config(str(tmp_path / "kiln.yaml"), str(tmp_path / "kiln")),
        "--accelerate-config",
        conf,
        timeout=300,
    )
    _same_run(tmp_path / "kiln", native)


# CI time: accelerate turns its command-line flags into the same environment its config file does, and what kiln
# makes of that environment for each flag is tested in process with accelerate's own export
# (tests/strategies/fsdp/test_options.py, `accelerate launch --use_fsdp --fsdp_sharding_strategy=N ...`), while
# `accelerate launch` end to end runs like the native config (test_accelerate_fsdp_config_runs_like_the_native_config)
@pytest.mark.heavy
def test_accelerate_command_line_flags_run_like_the_native_config(tmp_path, native):
    flags = _accelerate_launch(
        *CLI_FLAGS,
        "--main_process_port",
        str(_free_port()),
        "-m",
        "kiln.cli",
        "fit",
        write_cli_config(str(tmp_path / "flags.yaml"), str(tmp_path / "flags")),
    )
    assert "'cpu_ram_efficient_loading'" not in flags.stderr  # it has an effect now: not logged as ignored
    _same_run(tmp_path / "flags", native)
