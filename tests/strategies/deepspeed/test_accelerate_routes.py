"""The HF guide's two accelerate DeepSpeed configs (adapted to 2 CPU processes) give the same
DeepSpeed config, and the same kiln settings, as the equivalent kiln config. accelerate's own code
turns each file into launcher variables; no process is started."""

from __future__ import annotations

import json

from kiln.config.hf.deepspeed import process
from kiln.launch.settings import load_with_launcher_settings
from tests.installed import requires
from tests.strategies.test_launch import _accelerate_env

pytestmark = requires("accelerate")

BASE = {"learning_rate": 0.01, "per_device_train_batch_size": 2, "max_steps": 4}
FILE = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: {path}
  zero3_init_flag: true
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 2
use_cpu: true
"""
PLUGIN = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 0.7
  offload_optimizer_device: cpu
  offload_param_device: cpu
  zero3_init_flag: true
  zero_stage: 2
distributed_type: DEEPSPEED
mixed_precision: bf16
num_machines: 1
num_processes: 2
use_cpu: true
"""


def _ds(config):
    return process(
        config,
        dict(config.strategy.options.get("config") or {})
        if not isinstance(config.strategy.options.get("config"), str)
        else json.load(open(config.strategy.options.config)),
        world_size=2,
        precision=config.precision.name,
        name=config.strategy.name,
    )


def _via_accelerate(tmp_path, text, monkeypatch):
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    for key, value in _accelerate_env(str(path)).items():
        monkeypatch.setenv(key, value)
    return load_with_launcher_settings(dict(BASE))


def test_accelerate_deepspeed_config_file_route_equals_kiln_config(tmp_path, monkeypatch):
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3},
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "train_micro_batch_size_per_gpu": "auto",
            }
        )
    )
    launched = _via_accelerate(tmp_path, FILE.format(path=ds_file), monkeypatch)
    assert launched.strategy.name == "deepspeed"
    from kiln.config import load_config

    direct = load_config({**BASE, "deepspeed": str(ds_file)})
    assert _ds(launched) == _ds(direct)


def test_accelerate_plugin_route_equals_kiln_config(tmp_path, monkeypatch):
    launched = _via_accelerate(tmp_path, PLUGIN, monkeypatch)
    ds = _ds(launched)
    from kiln.config import load_config

    direct = load_config(
        {
            **BASE,
            "bf16": True,
            "gradient_accumulation_steps": 2,
            "max_grad_norm": 0.7,
            "deepspeed": {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "cpu"},
                }
            },
        }
    )
    assert ds == _ds(direct)
    # kiln's config holds accelerate's values, so the loop accumulates and clips as DeepSpeed does
    assert launched.train.gradient_accumulation_steps == 2 and launched.train.max_grad_norm == 0.7
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 0.7 and ds["train_batch_size"] == 8
