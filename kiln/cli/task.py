"""What the config's `task` names, built for a command: `task.data` imported and called (its dict checked
against DATA_KEYS), `task.model` imported and handed to the Trainer as its `model_init`, every keyword argument
checked against the callables before anything is built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from kiln.task_import import TaskError

#: what a `task.data` function may return (docs/training-module.md); the Trainer keywords go to the Trainer
DATA_KEYS = (
    "train_dataset",
    "eval_dataset",
    "test_dataset",
    "data_collator",
    "compute_metrics",
    "preprocess_logits_for_metrics",
    "callbacks",
    "processing_class",
    "model_args",
)


def check_data(data: Any, path: str) -> None:
    """The dict task.data returned: a dataset to work on, and no key kiln would drop unread (a typo such as
    `collate_fn` would otherwise train with the default collator)."""
    import difflib

    if not isinstance(data, dict) or "train_dataset" not in data and "eval_dataset" not in data:
        raise TaskError("task.data must return a dict with train_dataset (and optionally eval_dataset, ...).")
    unknown = [key for key in data if key not in DATA_KEYS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), DATA_KEYS, n=1, cutoff=0.5)  # collate_fn: data_collator
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TaskError(
            f"task.data ({path}) returned {unknown[0]!r}, which kiln does not read; it reads "
            f"{', '.join(DATA_KEYS)} (docs/training-module.md).{hint}"
        )


def build_task(cfg: Any) -> tuple[Callable[[], Any], dict[str, Any]]:
    """Import task.data (called now) and task.model (called by the Trainer after seeding); every
    keyword argument is checked against the callables before anything is built."""
    from omegaconf import OmegaConf

    from kiln.task_import import check_kwargs, import_callable

    if not cfg.task.data or not cfg.task.model:
        raise TaskError("the config must name task.model and task.data ('package.module:callable').")
    model_fn = import_callable(cfg.task.model, "task.model")
    data_fn = import_callable(cfg.task.data, "task.data")
    # the schema types both Dict[str, Any]: to_container gives a dict with str keys
    model_args = cast(dict[str, Any], OmegaConf.to_container(cfg.task.model_args))
    data_args = cast(dict[str, Any], OmegaConf.to_container(cfg.task.data_args))
    check_kwargs(model_fn, model_args, "task.model_args", cfg.task.model)
    check_kwargs(data_fn, data_args, "task.data_args", cfg.task.data)
    data = data_fn(**data_args)
    check_data(data, cfg.task.data)
    kwargs = {**model_args, **data.get("model_args", {})}
    check_kwargs(model_fn, kwargs, f"task.model_args (with the model_args {cfg.task.data} returned)", cfg.task.model)

    def build_model() -> Any:
        import torch

        model = model_fn(**kwargs)
        if not isinstance(model, torch.nn.Module):
            raise TaskError(
                f"task.model ({cfg.task.model}) returned a {type(model).__name__}, not a torch.nn.Module: "
                "return the model (a kiln TrainingModule, or a Transformers-style model that returns its loss)."
            )
        return model

    return build_model, data


def build_trainer(cfg: Any) -> tuple[Any, dict[str, Any]]:
    from kiln import Trainer

    model_init, data = build_task(cfg)
    trainer = Trainer(
        None,
        cfg,
        model_init=model_init,
        train_dataset=data.get("train_dataset"),
        eval_dataset=data.get("eval_dataset"),
        data_collator=data.get("data_collator"),
        compute_metrics=data.get("compute_metrics"),
        callbacks=data.get("callbacks"),
        preprocess_logits_for_metrics=data.get("preprocess_logits_for_metrics"),
        processing_class=data.get("processing_class"),
    )
    return trainer, data
