"""A LoRA GPT-2 (peft, tiny, built from a config) trained by kiln and by transformers.Trainer itself
on the same data in the same order: the same adapter weights after 4 steps for plain training,
gradient checkpointing (HF's default kwargs and reentrant checkpointing, which only trains the
adapters because the base model's `enable_input_require_grads` hook makes the frozen embeddings'
output require grad) and a run resumed from its step-2 adapter checkpoint, kiln's or HF's own."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from kiln import Trainer
from tests.distributed.worker_peft import data, lora_model
from tests.helpers import base_config
from tests.installed import requires

transformers = pytest.importorskip("transformers")
pytestmark = requires("peft")

STEPS, BATCH, ACCUMULATION, LR = 4, 2, 2, 0.05


class _InOrder(transformers.Trainer):
    """HF's Trainer reading the data in order, so both runs see the same micro-batches."""

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


def _hf(tmp_path, model, **kw: Any) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=LR,
        logging_steps=1,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **{"save_strategy": "no", **kw},
    )
    trainer = _InOrder(model=model, args=args, train_dataset=data())
    trainer.train()
    return trainer


def _kiln(tmp_path, model, resume: str | None = None, **kw: Any) -> Trainer:
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=False)
    cfg = base_config(
        tmp_path, max_steps=STEPS, learning_rate=LR, gradient_accumulation_steps=ACCUMULATION, logging_steps=1, **kw
    )
    trainer = Trainer(model, cfg, train_dataset=loader)
    trainer.fit(resume_from_checkpoint=resume)
    return trainer


def _adapter(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def _assert_same_adapter(got: dict, want: dict, tol: float = 1e-6) -> None:
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def _assert_trained(model) -> None:
    start = _adapter(lora_model())
    moved = [k for k, v in _adapter(model).items() if not torch.equal(v, start[k])]
    assert sorted(moved) == sorted(start), f"adapter tensors that did not train: {sorted(set(start) - set(moved))}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[dict, str, Trainer, str]:
    """The plain runs three tests compare (suite time): HF's adapter after STEPS steps and its step-2
    checkpoint, and kiln's trainer of the same run with its own step-2 checkpoint (saving changes no
    weight)."""
    tmp = tmp_path_factory.mktemp("peft_plain")
    hf = _hf(tmp, lora_model(), save_strategy="steps", save_steps=2)
    ours = _kiln(tmp / "kiln", lora_model(), save={"strategy": "steps", "steps": 2})
    return _adapter(hf.model), str(tmp / "hf" / "checkpoint-2"), ours, str(tmp / "kiln" / "out" / "checkpoint-2")


def test_plain_lora_matches_hf_and_save_model_writes_the_adapter_only(tmp_path, plain):
    hf_adapter, _, ours, _ = plain
    _assert_trained(ours.model)
    _assert_same_adapter(_adapter(ours.model), hf_adapter)
    base = {k: v for k, v in lora_model().state_dict().items() if "lora_" not in k}
    assert all(torch.equal(v, base[k]) for k, v in ours.model.state_dict().items() if "lora_" not in k)
    ours.save_model(str(tmp_path / "export"))
    files = set(os.listdir(tmp_path / "export"))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    from safetensors.torch import load_file

    _assert_same_adapter(load_file(str(tmp_path / "export" / "adapter_model.safetensors")), _adapter(ours.model), 0)


def test_label_smoothing_treats_a_peft_causal_lm_as_hf_does(tmp_path):
    """HF decides on shifting the labels by the class of the model inside the PeftModel (GPT2LMHeadModel)."""
    assert type(lora_model()).__name__ == "PeftModel"  # no task type: the wrapper's name says nothing
    hf = _hf(tmp_path, lora_model(), label_smoothing_factor=0.1)
    ours = _kiln(tmp_path, lora_model(), label_smoothing_factor=0.1)
    _assert_same_adapter(_adapter(ours.model), _adapter(hf.model))


def test_gradient_checkpointing_is_kiln_s_and_trains_the_adapters_as_hf_does(tmp_path):
    """HF's switch is kiln's activation checkpointing (mode full) on the base model's blocks, found through the
    PeftModel: non-reentrant, so gradients reach the adapters inside checkpointed blocks without HF's
    input-grad hook, and the adapters end where HF's own checkpointing leaves them."""
    hf = _hf(tmp_path, lora_model(), gradient_checkpointing=True)
    ours = _kiln(tmp_path, lora_model(), gradient_checkpointing=True)
    blocks = [m for m in ours.model.modules() if getattr(m, "_kiln_checkpointed", False)]
    assert blocks and all(type(m).__name__ == "GPT2Block" for m in blocks)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in ours.model.modules())
    assert not getattr(ours.model.get_base_model(), "_require_grads_hooks", None)
    _assert_trained(ours.model)
    _assert_same_adapter(_adapter(ours.model), _adapter(hf.model))


def test_resume_from_an_adapter_checkpoint_matches_hf_and_the_uninterrupted_run(tmp_path, plain):
    hf_adapter, _, straight, checkpoint = plain
    resumed = _kiln(tmp_path / "resumed", lora_model(lora_seed=7), resume=checkpoint)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _assert_same_adapter(_adapter(resumed.model), hf_adapter)


def test_resume_from_hf_adapter_checkpoint_matches_hf(tmp_path, plain):
    hf_adapter, checkpoint, _, _ = plain
    assert os.path.exists(os.path.join(checkpoint, "adapter_model.safetensors"))
    with pytest.warns(UserWarning, match="Resumed from Hugging Face checkpoint"):
        resumed = _kiln(tmp_path, lora_model(lora_seed=7), resume=checkpoint)
    assert resumed.state.global_step == STEPS
    _assert_same_adapter(_adapter(resumed.model), hf_adapter)
