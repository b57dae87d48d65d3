"""TensorBoard: read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import glob
import os
import re

import pytest

pytest.importorskip("tensorboard", reason="pip install kiln[tensorboard]")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import plugin_data_pb2  # noqa: E402

from kiln.engine.callbacks.loggers import LoggerCallback  # noqa: E402
from kiln.loggers.base import grouped_name  # noqa: E402
from kiln.loggers.build import build_loggers  # noqa: E402
from kiln.loggers.tensorboard import TensorBoardLogger  # noqa: E402
from tests.loggers.conftest import SEQUENCE, drive, expected_points, make_config  # noqa: E402


def read(log_dir: str) -> EventAccumulator:
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def hparams(acc: EventAccumulator) -> dict:
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def all_names(sequence=SEQUENCE):
    return {k for _, logs in sequence for k in logs}


def test_scalars_and_hparams_through_the_callback(tmp_path):
    cfg = make_config(tmp_path, report_to=["tensorboard"], optim={"lr": 3e-4})
    callback = LoggerCallback(cfg, build_loggers(cfg))
    drive(callback, cfg)
    runs = glob.glob(os.path.join(cfg.output_dir, "runs", "*"))
    assert len(runs) == 1 and re.fullmatch(
        r"[A-Z][a-z]{2}\d\d_\d\d-\d\d-\d\d_.+", os.path.basename(runs[0])
    )  # HF's name
    acc = read(runs[0])
    assert set(acc.Tags()["scalars"]) == {grouped_name(k) for k in all_names()}
    for name in all_names():
        got = scalars(acc, grouped_name(name))
        want = expected_points(name)
        assert [s for s, _ in got] == [s for s, _ in want], name
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), name  # float32 on disk
    hp = hparams(acc)
    assert hp["optim.lr"] == pytest.approx(3e-4) and hp["run_name"] == "unit-run"
    assert hp["log.report_to"] == "['tensorboard']" and hp["eval.steps"] == "None"


def test_logging_dir_and_direct_use(tmp_path):
    cfg = make_config(tmp_path, log={"logging_dir": str(tmp_path / "tb")})
    logger = TensorBoardLogger(cfg)
    assert not os.path.exists(tmp_path / "tb")  # building opens nothing
    logger.log_metrics({"loss": 0.5, "eval_loss": 0.25, "test_acc": 1.0}, 7)
    logger.finalize("success")
    logger.log_metrics({"eval_loss": 0.125}, 8)  # evaluate() after fit(): same run folder
    logger.finalize("success")
    acc = read(str(tmp_path / "tb"))
    assert scalars(acc, "train/loss") == [(7, 0.5)]
    assert scalars(acc, "eval/loss") == [(7, 0.25), (8, 0.125)]
    assert scalars(acc, "test/acc") == [(7, 1.0)]


def test_resume_purges_what_the_killed_job_wrote_after_the_checkpoint(tmp_path):
    cfg = make_config(tmp_path, report_to=["tensorboard"])
    killed = SEQUENCE[:5] + [(5, {"loss": 9.0}), (6, {"loss": 9.5})]
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg, killed, end=False)
    drive(LoggerCallback(cfg, build_loggers(cfg)), cfg, SEQUENCE[5:], start_step=4)
    runs = glob.glob(os.path.join(cfg.output_dir, "runs", "*"))
    assert len(runs) == 1  # the resumed job continued the same run folder
    acc = read(runs[0])
    assert scalars(acc, "train/loss") == expected_points("loss")
    assert scalars(acc, "eval/loss") == expected_points("eval_loss")


def test_trials_get_their_own_folders(tmp_path):
    from kiln.engine.callbacks.state import TrainerState

    cfg = make_config(tmp_path, log={"logging_dir": str(tmp_path / "tb")}, report_to=["tensorboard"])
    callback = LoggerCallback(cfg, build_loggers(cfg))
    for i in range(2):
        state = TrainerState(max_steps=6, is_hyper_param_search=True, trial_name=f"trial-{i}", trial_params={"lr": i})
        drive(callback, cfg, [(1, {"loss": float(i)})], state=state)
    for i in range(2):
        acc = read(str(tmp_path / "tb" / f"trial-{i}"))
        assert scalars(acc, "train/loss") == [(1, float(i))]
        assert hparams(acc)["lr"] == i
