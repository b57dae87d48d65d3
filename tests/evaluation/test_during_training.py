"""Evaluation inside fit(): eval_strategy steps/epoch, eval_steps (default logging_steps), eval_delay,
eval_on_start, log_history and on_evaluate, best-metric tracking with a dict of eval datasets."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln import Callback, KilnError, Trainer
from tests.evaluation.common import Recorder, accuracy, config, digits, eval_logs, make_model


def fit(tmp_path: Any, eval_dataset: Any = None, **overrides: Any) -> tuple[Trainer, Recorder]:
    """64 training rows in batches of 16: 4 optimizer steps per epoch."""
    train, evals = digits(n_train=64, n_eval=32)
    recorder = Recorder()
    cfg = config(tmp_path, per_device_train_batch_size=16, learning_rate=1e-3, **overrides)
    trainer = Trainer(
        make_model("module"),
        cfg,
        train_dataset=train,
        eval_dataset=evals if eval_dataset is None else eval_dataset,
        compute_metrics=accuracy,
        callbacks=[recorder],
    )
    trainer.fit()
    return trainer, recorder


@pytest.mark.parametrize(
    "overrides, steps",
    [
        ({"eval_strategy": "steps", "eval_steps": 3, "max_steps": 7}, [3, 6, 7]),  # and the final step (HF)
        (
            {"eval_strategy": "steps", "logging_steps": 2, "max_steps": 5},
            [2, 4, 5],
        ),  # eval_steps defaults to logging_steps
        ({"eval_strategy": "steps", "eval_steps": 0.25, "max_steps": 8}, [2, 4, 6, 8]),  # a ratio of max_steps
        ({"eval_strategy": "steps", "eval_steps": 2, "eval_delay": 4, "max_steps": 8}, [4, 6, 8]),
        ({"eval_strategy": "epoch", "num_train_epochs": 3}, [4, 8, 12]),
        ({"eval_strategy": "epoch", "num_train_epochs": 3, "eval_delay": 2}, [8, 12]),
        ({"eval_strategy": "no", "max_steps": 4}, []),
        ({"eval_strategy": "steps", "eval_steps": 3, "max_steps": 4, "eval_on_start": True}, [0, 3, 4]),
    ],
)
def test_when_evaluation_runs(tmp_path: Any, overrides: dict[str, Any], steps: list[int]) -> None:
    trainer, recorder = fit(tmp_path, **overrides)
    logged = eval_logs(trainer)
    assert [entry["step"] for entry in logged] == steps
    assert [step for step, _ in recorder.evaluations] == steps
    for entry, (step, metrics) in zip(logged, recorder.evaluations):
        assert entry == {**metrics, "step": step}  # on_evaluate sees exactly what was logged
        assert {"eval_loss", "eval_accuracy", "eval_runtime", "epoch"} <= set(metrics)
        assert metrics["epoch"] == pytest.approx(step / 4)  # 4 steps per epoch


def test_model_is_back_in_train_mode_and_eval_does_not_touch_training(tmp_path: Any) -> None:
    """Evaluating during training leaves train mode on and takes from the training randomness only the
    one number HF's evaluation loader takes from the global RNG (kiln.engine.data.global_draw): the weights
    equal those of a run that does not evaluate but draws that number at the same steps."""
    from kiln import Callback
    from kiln.engine.data.global_draw import global_draw

    class DrawLikeAnEvaluation(Callback):
        def on_step_end(self, config, state, control, **kwargs):
            if state.global_step % 2 == 0:
                global_draw()

    modes: list[bool] = []
    train, evals = digits(n_train=64, n_eval=32)
    weights = []
    for strategy in ("no", "steps"):
        model = make_model("module")
        original = model.training_step
        model.training_step = lambda batch, m=model, step=original: modes.append(m.training) or step(batch)  # type: ignore
        model.net.insert(1, torch.nn.Dropout(0.2))  # randomness that evaluation must not shift
        cfg = config(
            tmp_path / strategy, per_device_train_batch_size=16, max_steps=6, eval_strategy=strategy, eval_steps=2
        )
        draws = [DrawLikeAnEvaluation()] if strategy == "no" else []
        Trainer(model, cfg, train_dataset=train, eval_dataset=evals, callbacks=draws).fit()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert all(modes)
    assert torch.equal(weights[0], weights[1])


def test_eval_on_start_does_not_count_as_a_best_model(tmp_path: Any) -> None:
    trainer, recorder = fit(
        tmp_path, eval_strategy="steps", eval_steps=2, max_steps=2, eval_on_start=True, metric_for_best_model="accuracy"
    )
    assert [step for step, _ in recorder.evaluations] == [0, 2]
    assert trainer.state.best_global_step == 2
    assert trainer.state.best_metric == recorder.evaluations[1][1]["eval_accuracy"]


def test_evaluation_strategy_without_eval_dataset_fails_before_training(tmp_path: Any) -> None:
    train, _ = digits(n_train=64)
    model = make_model("module")
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model, config(tmp_path, eval_strategy="steps", max_steps=4), train_dataset=train)
    with pytest.raises(KilnError, match="no eval_dataset"):
        trainer.fit()
    assert trainer.state.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_dict_of_eval_datasets_during_training_and_metric_for_best_model(tmp_path: Any) -> None:
    _, evals = digits(n_eval=64)
    datasets = {
        "easy": torch.utils.data.Subset(evals, range(32)),
        "hard": torch.utils.data.Subset(evals, range(32, 64)),
    }
    trainer, recorder = fit(
        tmp_path,
        eval_dataset=datasets,
        eval_strategy="steps",
        eval_steps=2,
        max_steps=6,
        metric_for_best_model="hard_loss",
    )
    hard = [(step, m["eval_hard_loss"]) for step, m in recorder.evaluations if "eval_hard_loss" in m]
    easy = [step for step, m in recorder.evaluations if "eval_easy_loss" in m]
    assert [s for s, _ in hard] == easy == [2, 4, 6]
    best_step, best = min(hard, key=lambda item: item[1])  # greater_is_better defaults to False for a loss
    assert trainer.state.best_metric == best and trainer.state.best_global_step == best_step

    with pytest.raises(KilnError, match="eval_loss"):  # "loss" alone names no metric of a dict evaluation
        fit(
            tmp_path / "again",
            eval_dataset=datasets,
            eval_strategy="steps",
            eval_steps=2,
            max_steps=2,
            metric_for_best_model="loss",
        )


def test_greater_is_better_follows_the_metric_name(tmp_path: Any) -> None:
    scores = iter([0.5, 0.9, 0.7])
    train, evals = digits(n_train=64, n_eval=32)
    cfg = config(
        tmp_path,
        per_device_train_batch_size=16,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="eval_score",
    )
    trainer = Trainer(
        make_model("module"),
        cfg,
        train_dataset=train,
        eval_dataset=evals,
        compute_metrics=lambda p: {"score": next(scores)},
    )
    trainer.fit()
    assert (trainer.state.best_metric, trainer.state.best_global_step) == (0.9, 4)


def test_load_best_model_at_end(tmp_path: Any) -> None:
    """The best evaluation (step 2 of 6) is restored at the end, by the metric's direction."""
    scores = iter([0.9, 0.5, 0.7])
    train, evals = digits(n_train=64, n_eval=32)
    snapshots: dict[int, torch.Tensor] = {}

    class Snapshot(Callback):
        def on_evaluate(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
            snapshots[state.global_step] = torch.cat([p.detach().flatten().clone() for p in kw["model"].parameters()])

    model = make_model("module")
    cfg = config(
        tmp_path,
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    trainer = Trainer(
        model,
        cfg,
        train_dataset=train,
        eval_dataset=evals,
        callbacks=[Snapshot()],
        compute_metrics=lambda p: {"score": next(scores)},
    )
    trainer.fit()
    assert trainer.state.best_global_step == 2 and trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    final = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(final, snapshots[2]) and not torch.equal(final, snapshots[6])
