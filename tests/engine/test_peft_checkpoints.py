"""Checkpoints of a PeftModel hold the adapter only, as HF's Trainer writes them (adapter_model.safetensors,
adapter_config.json; no base model), load with `PeftModel.from_pretrained(base, checkpoint)`, resume
bit for bit (LoRA dropout on, so the RNG streams matter), give `load_best_model_at_end` the best
adapter, and a checkpoint that does not fit the adapter is refused with one sentence."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kiln import Trainer
from kiln.engine.model.peft import AdapterCheckpointIO, base_model_of, checkpoint_io_for, is_peft_model
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import Crash, CrashAfterSave, Scripted, numeric_history
from tests.distributed.worker_peft import base_model, data, lora_model
from tests.installed import requires

pytestmark = requires("peft")


def _config(out: str, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "output_dir": out,
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "learning_rate": 0.05,
        "logging_steps": 1,
        "save_steps": 3,
        "seed": 7,
        "report_to": "none",
        "disable_tqdm": True,
        "log": {"history": []},
    }
    cfg.update(overrides)
    return cfg


def _train(
    out: str, model: Any = None, resume: Any = None, metrics: Any = None, crash_at: Any = None, **overrides: Any
) -> Trainer:
    trainer = Trainer(
        model if model is not None else lora_model(lora_dropout=0.3),
        _config(out, **overrides),
        train_dataset=data(),
        eval_dataset=data()[:6],
        compute_metrics=metrics,
        callbacks=[CrashAfterSave(crash_at)] if crash_at else None,
    )
    trainer.fit(resume_from_checkpoint=resume)
    return trainer


def _adapter(model: Any) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


class _Strategy:
    """Stands in for a strategy: only its CheckpointIO's format matters here."""

    def __init__(self, fmt: str) -> None:
        self.io = type("IO", (), {"format": fmt})()

    def checkpoint_io(self) -> Any:
        return self.io


def test_only_a_peft_model_under_a_format_the_adapter_can_replace_gets_the_adapter_io():
    plain, lora = torch.nn.Linear(2, 2), lora_model()
    for fmt in ("full", "fsdp-full", "fsdp-sharded"):
        strategy = _Strategy(fmt)
        assert checkpoint_io_for(strategy, plain) is strategy.io
        io = checkpoint_io_for(strategy, lora)
        assert isinstance(io, AdapterCheckpointIO) and io.inner is strategy.io and io.format == "peft-adapter"
    deepspeed = _Strategy("deepspeed")
    assert checkpoint_io_for(deepspeed, lora) is deepspeed.io  # DeepSpeed keeps its own files
    assert is_peft_model(lora) and not is_peft_model(plain) and not is_peft_model(lora.get_base_model())
    assert base_model_of(lora) is lora.get_base_model() and base_model_of(plain) is plain


def test_a_checkpoint_is_the_adapter_and_loads_with_peft_from_pretrained(tmp_path):
    out = str(tmp_path / "run")
    trainer = _train(out, max_steps=3)
    ckpt = os.path.join(out, "checkpoint-3")
    files = set(os.listdir(ckpt))
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt"} <= files
    assert not files & {"model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"}
    assert json.loads(open(os.path.join(ckpt, "COMPLETE")).read())["format"] == "peft-adapter"
    saved = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    live = _adapter(trainer.model)
    assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in live)
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(base_model(), ckpt).eval()
    trainer.model.eval()
    ids = data()[0]["input_ids"][None]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)


def test_save_only_model_writes_the_adapter_without_optimizer_state(tmp_path):
    out = str(tmp_path / "run")
    trainer = _train(out, max_steps=3, save_only_model=True)
    files = set(os.listdir(os.path.join(out, "checkpoint-3")))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    assert not files & {"optimizer.pt", "scheduler.pt", "model.safetensors"}
    saved = load_file(os.path.join(out, "checkpoint-3", "adapter_model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in _adapter(trainer.model).items())


def test_resume_from_an_adapter_checkpoint_is_bitwise_identical(tmp_path):
    straight = _train(str(tmp_path / "straight"))
    out = str(tmp_path / "run")
    with pytest.raises(Crash):
        _train(out, crash_at=3)
    resumed = _train(out, model=lora_model(lora_seed=5, lora_dropout=0.3), resume=True)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
    assert numeric_history(resumed) == numeric_history(straight)


def test_load_best_model_at_end_restores_the_best_adapter(tmp_path):
    out = str(tmp_path / "run")
    trainer = _train(
        out,
        max_steps=6,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="score",
        load_best_model_at_end=True,
        metrics=Scripted([0.2, 0.9, 0.5]),
    )
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-4")
    best = load_file(os.path.join(out, "checkpoint-4", "adapter_model.safetensors"))
    last = load_file(os.path.join(out, "checkpoint-6", "adapter_model.safetensors"))
    now = _adapter(trainer.model)
    assert all(torch.equal(now[k], best[k]) for k in best)
    assert not all(torch.equal(now[k], last[k]) for k in last)


def test_an_adapter_that_does_not_fit_is_refused(tmp_path):
    out = str(tmp_path / "run")
    _train(out, max_steps=3)
    other = Trainer(lora_model(r=8), _config(str(tmp_path / "other")), train_dataset=data())
    with pytest.raises(
        CheckpointError,
        match=r"does not fit this model: .*lora_A\.weight is \(4, 16\) there and "
        r"\(8, 16\) here; use the peft config",
    ):
        other._load_from_checkpoint(os.path.join(out, "checkpoint-3"))
    with pytest.raises(
        CheckpointError, match=r"^No adapter weights \(adapter_model.safetensors or adapter_model.bin\) in "
    ):
        os.remove(os.path.join(out, "checkpoint-3", "adapter_model.safetensors"))
        other._load_from_checkpoint(os.path.join(out, "checkpoint-3"))


def test_the_run_weights_of_kiln_evaluate_include_an_exported_adapter(tmp_path):
    from kiln.engine.checkpoint.weights import find_run_weights

    out = str(tmp_path / "run")
    trainer = _train(out, max_steps=3, save_strategy="no")
    trainer.save_model()
    found = find_run_weights(out)
    assert found is not None and found.origin == "exported model"
