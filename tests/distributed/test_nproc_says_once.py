"""`kiln fit --nproc 2`: what every rank would say alike is said once (issue 30 item 12d): the line
naming the accelerate setting the kiln config overrides, and a config error every rank raises
(hybrid_shard with a shard size that does not divide the world), which the launcher reports."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.distributed.conftest import kiln_cli
from tests.distributed.toy import write_cli_config

pytestmark = pytest.mark.distributed

ACCELERATE_BF16 = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
mixed_precision: bf16
num_machines: 1
num_processes: 2
use_cpu: true
"""


def test_a_conflict_line_and_an_every_rank_error_are_printed_once(tmp_path):
    cfg = write_cli_config(str(tmp_path / "cfg.yaml"), str(tmp_path / "run"))
    conf = OmegaConf.load(cfg)
    conf.strategy = {"name": "fsdp", "device": "cpu", "sharding": "hybrid_shard", "shard_size": 3, "timeout": 60}
    conf.precision = "fp32"  # accelerate asks for bf16: the kiln config wins, and says so
    OmegaConf.save(conf, cfg)
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_BF16)
    proc = kiln_cli("fit", cfg, "--accelerate-config", tmp_path / "accelerate.yaml", check=False, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.count("but the kiln config sets precision.name=fp32, which wins") == 1, out
    assert out.count("hybrid_shard needs the world size (2) to be a multiple of the shard group size (3)") == 1, out
    # every rank hits the error; one whose report the agent's SIGTERM cut short (a loaded machine) leaves the
    # other rank's report alone, which kiln then names: either way the error is printed once, as kiln's line
    assert "kiln: error: hybrid_shard needs" in out or "failed first (exit code 2): error: hybrid_shard needs" in out, (
        out
    )
