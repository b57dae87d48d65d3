"""`kiln fit --nproc 2`: a DDP run killed right after a checkpoint and resumed ends bit-identical to
the run that never stopped, and only rank 0 writes checkpoints, logs and the exported model (the
other rank writes only its own RNG and loop state)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import kiln_cli, torchrun
from tests.distributed.toy import write_cli_config

pytestmark = pytest.mark.distributed


def _losses(output_dir):
    with open(os.path.join(output_dir, "trainer_state.json")) as fh:
        return [h["loss"] for h in json.load(fh)["log_history"] if "loss" in h]


def test_kill_and_resume_under_ddp_is_bit_identical_and_only_rank0_writes(tmp_path):
    full, run, audit = tmp_path / "full", tmp_path / "run", tmp_path / "audit"
    # one torchrun job runs the uninterrupted run, then the run that dies right after checkpoint-3
    torchrun(
        "worker_cli_runs.py",
        write_cli_config(str(tmp_path / "full.yaml"), str(full)),
        write_cli_config(str(tmp_path / "kill.yaml"), str(run), kill_at=3),
    )
    assert sorted(p for p in os.listdir(run) if p.startswith("checkpoint-")) == ["checkpoint-3"]
    assert not (run / "model.safetensors").exists()  # the process really ended at step 3

    # resumed through the CLI's own launcher
    resume_cfg = write_cli_config(str(tmp_path / "resume.yaml"), str(run), audit=str(audit), root=str(run))
    # history files are written only when asked for (report_to none): ask, to see that rank 0 alone writes them
    kiln_cli("fit", resume_cfg, "--nproc", "2", "resume_from_checkpoint=true", "log.history=[csv,jsonl]")

    expected, got = load_file(str(full / "model.safetensors")), load_file(str(run / "model.safetensors"))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert _losses(run) == _losses(full)  # logged losses too, including the steps before the kill

    ranks = {r: json.loads((audit / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert ranks[0]["is_world_process_zero"] and not ranks[1]["is_world_process_zero"]
    own_state = re.compile(r"\.checkpoint-\d+\.tmp/(rng_state_1\.pth|loop_state_1\.pt)")
    extra = [e for e in ranks[1]["events"] if not own_state.fullmatch(e[1])]
    assert ranks[1]["events"] and not extra, f"rank 1 wrote more than its own state: {extra}"
    written = {os.path.basename(path) for _, path in ranks[0]["events"]}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "COMPLETE", "rng_state_0.pth"} <= written
    assert {"metrics.csv", "metrics.jsonl", "train_results.json"} <= written  # logs and metrics: rank 0 only
