"""HF's words where an HF user looks for them (issue 52 items 11-13): the errors for a resume path that
does not exist and for `save_strategy="best"` without `metric_for_best_model` start with HF's own text;
`EarlyStoppingCallback.check_metric_value` takes HF's `TrainingArguments`; and HF's warnings (a duplicate
callback, a checkpoint's callback state this run has no callback for, settings changed since the
checkpoint) are logged on HF's logger names once transformers is imported, where `patch(...logger.warning)`
in HF's own tests and users' log filters find them."""

from __future__ import annotations

import logging
import os
import sys
from unittest.mock import patch

import pytest

from kiln import EarlyStoppingCallback, Trainer
from kiln.engine.callbacks.base import Callback
from kiln.engine.callbacks.state import TrainerControl, TrainerState
from kiln.engine.checkpoint.resume import ResumeError
from kiln.utils.errors import ConfigError
from kiln.utils.hf_logging import hf_logger
from tests.checkpoint.checkpoint_helpers import regression_data as small_data
from tests.checkpoint.checkpoint_helpers import train
from tests.hf_logs import hf_propagation  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")
from tests.checkpoint.test_resume_errors_vs_hf import HFRegressor, data  # noqa: E402 - after the skip


def args(tmp_path, **kw):
    return transformers.TrainingArguments(
        **{
            "output_dir": str(tmp_path),
            "max_steps": 1,
            "per_device_train_batch_size": 4,
            "report_to": "none",
            "use_cpu": True,
            "save_strategy": "no",
            "disable_tqdm": True,
            **kw,
        }
    )


# -- item 11: HF's error texts -------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda root: os.path.join(root, "nope"),
        lambda root: open(os.path.join(root, "a_file"), "w").close() or os.path.join(root, "a_file"),
    ],
    ids=["missing", "a file"],
)
def test_a_resume_path_that_is_no_folder_gets_hfs_text(tmp_path, make):
    os.makedirs(tmp_path / "hf")
    os.makedirs(tmp_path / "kiln")
    hf_path, kiln_path = make(str(tmp_path / "hf")), make(str(tmp_path / "kiln"))
    with pytest.raises(ValueError) as theirs:
        transformers.Trainer(model=HFRegressor(), args=args(tmp_path / "hf" / "out"), train_dataset=data()).train(
            resume_from_checkpoint=hf_path
        )
    with pytest.raises(ResumeError) as ours:
        Trainer(HFRegressor(), args=args(tmp_path / "kiln" / "out"), train_dataset=data()).fit(
            resume_from_checkpoint=kiln_path
        )
    hf_text = str(theirs.value).replace(hf_path, kiln_path)
    assert hf_text == f"Can't find a valid checkpoint at {kiln_path}"
    assert str(ours.value).startswith(hf_text + " (")  # then what is wrong and how to resume instead
    assert "resume_from_checkpoint=true" in str(ours.value) and "\n" not in str(ours.value)


def test_save_strategy_best_without_a_metric_gets_hfs_text(tmp_path):
    settings = dict(save_strategy="best", eval_strategy="steps", eval_steps=1)
    with pytest.raises(ValueError) as theirs:
        transformers.Trainer(
            model=HFRegressor(), args=args(tmp_path / "hf", **settings), train_dataset=data(), eval_dataset=data()
        )
    with pytest.raises(ConfigError) as ours:
        Trainer(HFRegressor(), args=args(tmp_path / "kiln", **settings), train_dataset=data(), eval_dataset=data())
    assert str(ours.value).startswith(str(theirs.value).rstrip(".") + ": set eval.metric_for_best_model")
    assert isinstance(ours.value, ValueError)


# -- item 12: EarlyStoppingCallback with HF's arguments --------------------------------------------
@pytest.mark.parametrize(
    "metric, values", [("accuracy", [0.5, 0.6, 0.6, 0.55, 0.7, 0.69]), ("loss", [1.0, 0.9, 0.95, 0.5])]
)
def test_check_metric_value_takes_hfs_training_arguments(tmp_path, metric, values):
    hf_args = args(
        tmp_path,
        metric_for_best_model=metric,
        eval_strategy="steps",
        save_strategy="steps",
        load_best_model_at_end=True,
    )
    ours, theirs = EarlyStoppingCallback(3, 0.01), transformers.EarlyStoppingCallback(3, 0.01)
    our_state, their_state = TrainerState(), transformers.TrainerState()
    counters = []
    for value in values:
        ours.check_metric_value(hf_args, our_state, TrainerControl(), value)
        theirs.check_metric_value(hf_args, their_state, transformers.TrainerControl(), value)
        counters.append((ours.early_stopping_patience_counter, theirs.early_stopping_patience_counter))
        better = our_state.best_metric is None or (
            value > our_state.best_metric if metric == "accuracy" else value < our_state.best_metric
        )
        if better:  # the Trainer records the new best after on_evaluate
            our_state.best_metric = their_state.best_metric = value
    assert [o for o, _ in counters] == [t for _, t in counters] and max(o for o, _ in counters) > 0


def test_the_other_events_read_hfs_arguments_too(tmp_path):
    cb = EarlyStoppingCallback(1)
    hf_args = args(
        tmp_path,
        metric_for_best_model="accuracy",
        eval_strategy="steps",
        save_strategy="steps",
        load_best_model_at_end=True,
    )
    state, control = TrainerState(), TrainerControl()
    cb.on_train_begin(hf_args, state, control)
    state.best_metric = 0.9
    cb.on_evaluate(hf_args, state, control, metrics={"eval_accuracy": 0.8})
    assert control.should_training_stop
    with pytest.raises(Exception, match="needs evaluation during training"):
        cb.on_train_begin(args(tmp_path, metric_for_best_model="accuracy"), state, control)


# -- item 13: HF's warnings on HF's loggers --------------------------------------------------------
class Counted(Callback):
    pass


def test_a_duplicate_callback_is_warned_where_hfs_test_patches(tmp_path):
    with patch("transformers.trainer_callback.logger.warning") as warn_mock:  # HF's own test_duplicate_callback_warning
        Trainer(HFRegressor(), args=args(tmp_path), train_dataset=data(), callbacks=[Counted, Counted])
    assert warn_mock.called
    assert "Counted" in warn_mock.call_args[0][0] and "but there is already one" in warn_mock.call_args[0][0]


def _stateful_run(out: str, **cfg) -> None:
    train(
        out,
        {
            "max_steps": 2,
            "save_steps": 2,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "metric_for_best_model": "loss",
            **cfg,
        },
        eval_data=lambda: small_data(8, seed=5),
        callbacks=[EarlyStoppingCallback()],
    )


def test_state_of_a_missing_callback_is_warned_where_hfs_test_patches(tmp_path):
    out = str(tmp_path / "run")
    _stateful_run(out)
    with patch("transformers.trainer.logger.warning") as warn_mock:  # HF's own test_missing_stateful_callback_warning
        train(out, {"max_steps": 3, "save_steps": 2}, resume=os.path.join(out, "checkpoint-2"))
    assert warn_mock.called
    said = warn_mock.call_args[0][0]
    assert said.startswith(
        "Checkpoint included callbacks not included in current configuration. Ignoring. (EarlyStoppingCallback"
    )


def test_changed_settings_are_warned_on_hfs_logger_with_eval_steps_that_follow_logging_steps(
    tmp_path, caplog, hf_propagation
):
    """Evaluating by steps without eval_steps follows logging_steps; HF's arguments then hold logging_steps as
    eval_steps, so HF names both when logging_steps changes."""
    out = str(tmp_path / "run")
    train(
        out,
        {"max_steps": 4, "save_steps": 4, "logging_steps": 2, "eval_strategy": "steps"},
        eval_data=lambda: small_data(8, seed=5),
    )
    with caplog.at_level(logging.WARNING):
        train(
            out,
            {"max_steps": 6, "save_steps": 4, "logging_steps": 3, "eval_strategy": "steps"},
            eval_data=lambda: small_data(8, seed=5),
            resume=True,
        )
    [record] = [r for r in caplog.records if "do not match the ones in the `trainer_state.json`" in r.getMessage()]
    assert record.name == "transformers.trainer_utils"  # HF's compare_trainer_and_checkpoint_args logs there
    assert "\tlogging_steps: 3 (from args) != 2 (from trainer_state.json)" in record.getMessage()
    assert "\teval_steps: 3 (from args) != 2 (from trainer_state.json)" in record.getMessage()


def test_the_missing_callback_warning_on_caplog(tmp_path, caplog, hf_propagation):
    out = str(tmp_path / "run")
    _stateful_run(out)
    with caplog.at_level(logging.WARNING):
        train(out, {"max_steps": 3, "save_steps": 2}, resume=os.path.join(out, "checkpoint-2"))
    assert [r.name for r in caplog.records if "Checkpoint included callbacks" in r.getMessage()] == [
        "transformers.trainer"
    ]


def test_without_transformers_the_warnings_stay_on_kilns_loggers(monkeypatch):
    own = logging.getLogger("kiln.engine.callbacks.base")
    assert hf_logger("transformers.trainer_callback", own).name == "transformers.trainer_callback"
    monkeypatch.delitem(sys.modules, "transformers")  # nothing here imports it again: hf_logger only looks
    assert hf_logger("transformers.trainer_callback", own) is own
