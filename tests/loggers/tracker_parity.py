"""A real (tiny) Trainer run that reports to TensorBoard and one more tracker, and the check that the
tracker holds what TensorBoard holds: every metric with the same steps and values, the same
hyperparameters, and the same run name, with the `${oc.env:...}` value masked in all of them.

Each tracker's test reads its files back with the tracker's own reader and hands `assert_same` a
`Read`: metrics by HF's grouped name (`train/loss`), parameters by dotted key, and the run's name."""

from __future__ import annotations

import glob
import json
import math
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import pytest

from kiln import Trainer
from kiln.loggers.base import grouped_name
from tests.helpers import TinyRegressor, regression_data

SECRET = "s3cret-run-name-7f3a"  # what ${oc.env:KILN_TRACKER_RUN} resolves to: no tracker may hold it
MASKED = "${oc.env:KILN_TRACKER_RUN}"


@dataclass
class Read:
    name: str
    metrics: dict[str, list[tuple[int, float]]]
    params: dict[str, Any] = field(default_factory=dict)


# Metrics no tracker has code for (issue 55 item 2's names): they must reach every tracker as they are.
NEW_FIGURES = {"train_tokens_per_second": 1024.0, "train_tflops": 1.5, "mfu": 0.25}


class _MoreFigures(Trainer):
    """Hands figures to the loggers with each training log, the way the fit loop hands them throughput."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            self.log_to_loggers_only = {**(self.log_to_loggers_only or {}), **NEW_FIGURES}
        super().log(logs, start_time)


def train(tmp_path, monkeypatch, tracker: str, **extra: Any) -> str:
    """Fit TinyRegressor for 8 steps (a log every 2, with NEW_FIGURES; an evaluation every 4); the output_dir."""
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("KILN_TRACKER_RUN", SECRET)
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "run_name": MASKED,
        "max_steps": 8,
        "learning_rate": 1e-2,
        "per_device_train_batch_size": 4,
        "report_to": ["tensorboard", tracker],
        "log": {"steps": 2, "history": [], "disable_tqdm": True},
        "optim": {"weight_decay": 0.01},
        "eval": {"strategy": "steps", "steps": 4},
        "save": {"strategy": "no"},
        "strategy": {"device": "cpu"},
        **extra,
    }
    trainer = _MoreFigures(
        TinyRegressor(), cfg, train_dataset=regression_data(32), eval_dataset=regression_data(8, seed=1)
    )
    trainer.fit()
    return str(trainer.config.output_dir)


def tensorboard(output_dir: str) -> Read:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    [run] = [d for d in glob.glob(os.path.join(output_dir, "runs", "*")) if os.path.isdir(d)]
    acc = EventAccumulator(run, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    metrics = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    params = {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
    return Read(params["run_name"], metrics, params)


def canonical(value: Any) -> Any:
    """One form for a parameter however a tracker stores it: TensorBoard keeps numbers and booleans as
    floats and None as "None", others keep ints, bools, strings or JSON."""
    if value is None or value == "None":
        return "None"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return float(value.lower() == "true")
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return "nan" if math.isnan(number) else number  # nan != nan; log.nonfinite_window may be "nan"


def assert_same(got: Read, output_dir: str, one_per_step: bool = False) -> Read:
    """`got` holds TensorBoard's metrics, parameters and run name; the masked value is nowhere. With
    `one_per_step` (a tracker that keys a series by step), a value logged twice at one step (`epoch`,
    in the training and the evaluation logs) is held once. Returns TensorBoard's Read."""
    tb = tensorboard(output_dir)
    if one_per_step:
        tb.metrics = {tag: sorted(dict(points).items()) for tag, points in tb.metrics.items()}
    assert tb.name == MASKED and got.name == MASKED
    assert {"train/loss", "eval/loss", "train/train_runtime", "train/samples_per_second"} <= set(tb.metrics)
    assert {f"train/{k}" for k in NEW_FIGURES} <= set(tb.metrics)
    assert set(got.metrics) == set(tb.metrics)
    for tag, points in tb.metrics.items():
        mine = sorted(got.metrics[tag])
        assert [s for s, _ in mine] == [s for s, _ in points], tag
        assert [v for _, v in mine] == pytest.approx([v for _, v in points], rel=1e-6), tag  # float32 events
    mine, want = ({k: canonical(v) for k, v in p.items()} for p in (got.params, tb.params))
    differ = {
        k: (mine.get(k, "<missing>"), want.get(k, "<missing>")) for k in {*mine, *want} if mine.get(k) != want.get(k)
    }
    assert not differ, f"parameters (tracker, TensorBoard) that differ: {differ}"
    assert SECRET not in json.dumps(got.params, default=str) + got.name
    return tb


def trials(callback: Any, config: Any) -> None:
    """Two hyperparameter-search trials through `callback`: trial-i logs loss i at step 1, with lr i."""
    from kiln.engine.callbacks.state import TrainerState
    from tests.loggers.conftest import drive

    for i in range(2):
        state = TrainerState(max_steps=6, is_hyper_param_search=True, trial_name=f"trial-{i}", trial_params={"lr": i})
        drive(callback, config, [(1, {"loss": float(i)})], state=state)


@pytest.fixture
def no_network(monkeypatch):
    """Any connection or name lookup beyond loopback made in this process fails the test."""
    attempts: list[Any] = []
    connect, lookup = socket.socket.connect, socket.getaddrinfo

    def loopback(host: str | None) -> bool:
        return host in (None, "localhost", "") or str(host).startswith("127.") or host == "::1"

    def guarded_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not loopback(address[0]):
            attempts.append(address)
            raise OSError(f"test: no network ({address})")
        return connect(sock, address)

    def guarded_lookup(host, *args, **kwargs):
        if not loopback(host):
            attempts.append(host)
            raise socket.gaierror(f"test: no network ({host})")
        return lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_lookup)
    yield attempts
    assert attempts == [], f"the tracker reached for the network: {attempts}"


__all__ = [
    "MASKED",
    "Read",
    "SECRET",
    "assert_same",
    "canonical",
    "grouped_name",
    "no_network",
    "tensorboard",
    "train",
    "trials",
]
