"""A training run for the background-writer tests, in its own process so it can be signalled.

    python -m tests.loggers.writer_worker OUT sigterm|sigkill

Trains with csv+jsonl history files whose writes are slowed down (so records queue up behind the
writer) and prints every log dict as `LOG {json}` the moment it is logged. Then it signals itself:
SIGTERM after logging step STOP (the default action: the writer's handler must flush, then the
process dies of SIGTERM), or SIGKILL right after the checkpoint of step SAVED is written (nothing
runs; the records up to that step must already be on disk for a resume)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from kiln import Callback  # noqa: E402
from kiln.loggers.build import scalar_metrics  # noqa: E402
from kiln.loggers.csv import CSVLogger  # noqa: E402
from kiln.loggers.jsonl import JSONLLogger  # noqa: E402

STOP = 6
SAVED = 4
WRITE_DELAY = 0.05


def run_config(out: str) -> dict[str, Any]:
    return {
        "output_dir": out,
        "max_steps": 12,
        "learning_rate": 1e-2,
        "per_device_train_batch_size": 4,
        "seed": 3,
        "log": {"steps": 2, "history": ["csv", "jsonl"], "disable_tqdm": True},
        "save": {"strategy": "steps", "steps": 4},
        "strategy": {"device": "cpu"},
    }


def slow_writes(patch: Any = None, delay: float = WRITE_DELAY) -> None:
    """Make every history write take `delay` seconds (`patch`: pytest's monkeypatch, else global)."""
    for cls in (CSVLogger, JSONLLogger):
        original = cls.log_metrics

        def slow(self, metrics, step, __original=original):  # type: ignore[no-untyped-def]
            time.sleep(delay)
            __original(self, metrics, step)

        if patch is not None:
            patch.setattr(cls, "log_metrics", slow)
        else:
            cls.log_metrics = slow  # type: ignore[method-assign]


class Recorder(Callback):
    """What the loggers were handed, as (step, metrics), in order; `echo` also prints each one."""

    def __init__(self, echo: bool = False, stop_with: Any = None) -> None:
        self.records: list[dict[str, float]] = []
        self.echo, self.stop_with = echo, stop_with

    def on_log(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
        record = {"step": state.global_step, **scalar_metrics(kw.get("logs") or {})}
        self.records.append(record)
        if self.echo:
            print("LOG " + json.dumps(record), flush=True)
        if self.stop_with == signal.SIGTERM and state.global_step == STOP:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler runs at the next bytecode; this is never reached in full

    def on_save(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
        if self.stop_with == signal.SIGKILL and state.global_step == SAVED:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    import torch

    from kiln import Trainer
    from tests.helpers import TinyRegressor, regression_data

    out, how = sys.argv[1], sys.argv[2]
    # SIGKILL follows the checkpoint at once: slower than a checkpoint write, the record of that step
    # would still be queued if nothing waited for the writer before saving
    slow_writes(delay=0.5 if how == "sigkill" else WRITE_DELAY)
    stop = {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[how]
    torch.manual_seed(0)  # the initial weights the test's uninterrupted run has
    Trainer(
        TinyRegressor(),
        run_config(out),
        train_dataset=regression_data(64),
        callbacks=[Recorder(echo=True, stop_with=stop)],
    ).fit()


if __name__ == "__main__":
    main()
