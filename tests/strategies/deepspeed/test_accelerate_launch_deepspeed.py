"""Real `accelerate launch` runs with the Hugging Face guide's two DeepSpeed accelerate configs (adapted
to 2 CPU processes): each ends with the same weights as `kiln fit --nproc 2` with the same settings
written as kiln keys (the DeepSpeed config beside the kiln config)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.distributed.conftest import kiln_cli, run
from tests.distributed.test_accelerate_launch import _free_port
from tests.distributed.toy import write_cli_config
from tests.installed import requires
from tests.strategies.test_launch import DS_FILE, DS_INLINE

pytestmark = [pytest.mark.distributed, requires("accelerate"), requires("deepspeed")]

# the HF guide's accelerate config with a DeepSpeed file (test_launch's DS_FILE): 2 CPU processes, a free port
ACCELERATE_DS_FILE = (
    DS_FILE.replace("/home/user/configs/ds_zero3_config.json", "{path}")
    .replace("num_processes: 4", "num_processes: 2")
    .replace("use_cpu: false", "use_cpu: true\nmain_process_port: {port}")
)
# HF's ds_config_zero3.json, less what this model cannot fill (no hidden_size: bucket sizes) and kiln's optimizer
DS_ZERO3 = {
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "stage3_param_persistence_threshold": 0,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
}
# the same guide's accelerate config with DeepSpeed plugin settings (test_launch's DS_INLINE) in the form
# the issue names: ZeRO-2, accumulation 2, clipping 0.7, CPU offload, bf16; 2 CPU processes, a free port
ACCELERATE_DS_PLUGIN = (
    DS_INLINE.replace("gradient_accumulation_steps: 1", "gradient_accumulation_steps: 2")
    .replace("zero_stage: 3", "zero_stage: 2")
    .replace("num_processes: 4", "num_processes: 2")
    .replace("use_cpu: false", "use_cpu: true\nmain_process_port: {port}")
)


def _launch(tmp_path, name: str, accelerate_yaml: str) -> dict:
    conf = tmp_path / f"{name}-accelerate.yaml"
    conf.write_text(accelerate_yaml)
    cfg = write_cli_config(str(tmp_path / f"{name}.yaml"), str(tmp_path / name))
    run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.accelerate_cli",
            "launch",
            "--config_file",
            str(conf),
            "-m",
            "kiln.cli",
            "fit",
            cfg,
        ],
        timeout=600,
    )
    return load_file(str(tmp_path / name / "model.safetensors"))


def _native(tmp_path, name: str, **keys) -> dict:
    path = write_cli_config(str(tmp_path / f"{name}.yaml"), str(tmp_path / name))
    cfg = OmegaConf.load(path)
    cfg.merge_with(keys)
    OmegaConf.save(cfg, path)
    kiln_cli("fit", path, "--nproc", "2", timeout=600)
    return load_file(str(tmp_path / name / "model.safetensors"))


def _same(got: dict, expected: dict) -> None:
    assert expected and expected.keys() == got.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0, msg=k)


@pytest.mark.heavy  # two 2-process ZeRO-3 runs (~40 s); the file-to-kiln mapping itself is test_launch's
def test_accelerate_deepspeed_config_file_runs_like_kiln_with_the_file(tmp_path):
    ds_file = tmp_path / "ds_zero3.json"
    ds_file.write_text(json.dumps(DS_ZERO3))
    got = _launch(tmp_path, "acc", ACCELERATE_DS_FILE.format(path=ds_file, port=_free_port()))
    assert OmegaConf.load(tmp_path / "acc" / "kiln_config.yaml").strategy.name == "deepspeed"
    _same(got, _native(tmp_path, "own", deepspeed=str(ds_file)))


@pytest.mark.heavy  # two CPU-offload runs and the CPU-Adam JIT build: ~2 min; the mapping itself is test_launch's
def test_accelerate_deepspeed_plugin_settings_run_like_the_kiln_config(tmp_path):
    got = _launch(tmp_path, "acc", ACCELERATE_DS_PLUGIN.format(port=_free_port()))
    saved = OmegaConf.load(tmp_path / "acc" / "kiln_config.yaml")
    assert saved.strategy.name == "deepspeed" and saved.precision.name == "bf16" and saved.train.max_grad_norm == 0.7
    _same(
        got,
        _native(
            tmp_path,
            "own",
            bf16=True,
            max_grad_norm=0.7,
            deepspeed={
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "cpu"},
                }
            },
        ),
    )
