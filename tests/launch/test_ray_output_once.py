"""Under `kiln fit --ray`, each line kiln prints in a worker reaches the output once (issue 52 item 17).

Ray Train replaces `print` in its workers with one that logs the line and prints it too (its tee fires because
Ray's own worker stdout is not `sys.__stdout__`), so every `kiln:` line and metrics block arrived twice, once
on stdout and once on stderr. The worker's two log files are what Ray forwards to the driver: read there, on
the package's local Ray instance (tests/launch/conftest.py), they hold each line once. The run read is the
package's `kiln fit --ray 2` DDP run with a restart (tests/launch/conftest.py), whose weights and
checkpoints test_ray_train.py checks: each attempt prints its start once, and the attempt that finishes
its end once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.installed import requires

pytestmark = [pytest.mark.distributed, requires("ray", "pip install 'kiln[ray]'")]


def _worker_output(ray, marker: str) -> str:
    """stdout + stderr of the Ray worker processes whose output holds `marker`."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())  # noqa: SLF001 - the session's log folder
    stems = {p.with_suffix("") for p in logs.glob("worker-*.out")} | {
        p.with_suffix("") for p in logs.glob("worker-*.err")
    }
    texts = []
    for stem in stems:
        text = "".join(
            p.read_text(errors="replace") for p in (stem.with_suffix(".out"), stem.with_suffix(".err")) if p.exists()
        )
        if marker in text:
            texts.append(text)
    return "".join(texts)


def test_every_kiln_line_and_metrics_block_of_a_ray_worker_is_printed_once(local_ray, ray_restarted_run):
    # `kiln fit --ray 2` (tests/launch/conftest.py): rank 0 prints, rank 1 does not; rank 1 died in the
    # first attempt, and Ray started a second one, which ran to the end
    out, folder, _ = ray_restarted_run
    attempts = len((folder / "starts").read_text().split())
    assert attempts == 2
    text = _worker_output(local_ray, f"kiln: output_dir {out}")
    lines = [line for line in text.splitlines() if line.strip()]
    for wanted, times in (
        (f"kiln: output_dir {out}", attempts),
        (f"kiln: done; the run's files are in {out}", 1),
        ("***** train metrics *****", 1),
        ("***** eval metrics *****", 1),
    ):
        assert sum(line.endswith(wanted) for line in lines) == times, (wanted, text[-3000:])
    model = [line for line in lines if "kiln: model Regressor" in line]
    assert len(model) == attempts, model
