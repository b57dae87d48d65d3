"""`accelerate launch` with the Hugging Face guide's FSDP config file (adapted to 2 CPU processes and
to this model's block class) runs kiln's FSDP exactly like `kiln fit --nproc 2` with the same
settings written as kiln keys."""

from __future__ import annotations

import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.distributed.conftest import kiln_cli, run
from tests.distributed.test_accelerate_launch import _free_port
from tests.distributed.toy import write_cli_config

pytestmark = pytest.mark.distributed
pytest.importorskip("accelerate")

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

NATIVE = ["strategy.name=fsdp", "strategy.sharding=full_shard", "strategy.wrap=[Linear]", "strategy.offload=true",
          "strategy.sync_module_states=true"]


def test_accelerate_fsdp_config_runs_like_the_native_config(tmp_path):
    conf = tmp_path / "accelerate.yaml"
    conf.write_text(ACCELERATE_FSDP.format(port=_free_port()))
    acc = run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(conf),
               "-m", "kiln.cli", "fit", write_cli_config(str(tmp_path / "acc.yaml"), str(tmp_path / "acc"))], timeout=300)
    assert "has no effect" in acc.stderr  # use_orig_params, said once per rank, not dropped silently
    kiln_cli("fit", write_cli_config(str(tmp_path / "own.yaml"), str(tmp_path / "own")), "--nproc", "2", *NATIVE, timeout=300)
    for name in ("acc", "own"):
        assert OmegaConf.load(tmp_path / name / "kiln_config.yaml").strategy.name == "fsdp"
    expected, got = load_file(str(tmp_path / "own" / "model.safetensors")), load_file(str(tmp_path / "acc" / "model.safetensors"))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
