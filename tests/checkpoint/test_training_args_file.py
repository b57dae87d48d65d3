"""`training_args.bin` (issue 30 item 6): HF's Trainer writes its TrainingArguments into every
checkpoint and into save_model's folder; kiln does too — the object the user passed, else one built
from kiln's config — and never reads it back: a planted pickle there runs nothing on resume."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.engine.checkpoint.convert import convert_checkpoint  # noqa: E402
from kiln.engine.checkpoint.files import latest_checkpoint  # noqa: E402
from kiln.engine.checkpoint.integrity import ALGORITHM  # noqa: E402
from kiln.engine.trainer import Trainer  # noqa: E402
from tests.checkpoint.checkpoint_helpers import folders, make_model, regression_data, train  # noqa: E402
from tests.checkpoint.planting import Payload, remark  # noqa: E402

ARGS = {
    "max_steps": 4,
    "save_steps": 2,
    "per_device_train_batch_size": 4,
    "learning_rate": 3e-3,
    "logging_steps": 1,
    "weight_decay": 0.1,
    "lr_scheduler_type": "cosine",
    "seed": 11,
    "report_to": "none",
    "disable_tqdm": True,
}


def tiny_gpt2(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    )


def lm_data(n: int = 16):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, 32, (8,), generator=g)), "labels": ids.clone()} for _ in range(n)]


def read_args(folder) -> transformers.TrainingArguments:
    return torch.load(os.path.join(folder, "training_args.bin"), weights_only=False)  # the test's own file


def test_given_training_arguments_are_written_as_hf_writes_them(tmp_path):
    """The same TrainingArguments (but output_dir) to HF's Trainer and to kiln's: both checkpoints and both
    save_model folders hold training_args.bin, and it reads back as the arguments that were passed."""
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **ARGS)
    kiln_args = transformers.TrainingArguments(output_dir=str(tmp_path / "kiln"), use_cpu=True, **ARGS)
    hf = transformers.Trainer(model=tiny_gpt2(), args=hf_args, train_dataset=lm_data())
    hf.train()
    hf.save_model(str(tmp_path / "hf_export"))
    ours = Trainer(tiny_gpt2(), args=kiln_args, train_dataset=lm_data())
    ours.fit()
    ours.save_model(str(tmp_path / "kiln_export"))
    assert folders(str(tmp_path / "kiln")) == folders(str(tmp_path / "hf")) == {"checkpoint-2", "checkpoint-4"}

    def same(loaded, given) -> None:
        assert type(loaded) is type(given)
        assert {**loaded.to_dict(), "output_dir": None} == {**given.to_dict(), "output_dir": None}

    for name in ("checkpoint-2", "checkpoint-4"):
        same(read_args(tmp_path / "hf" / name), hf_args)  # what HF does
        same(read_args(tmp_path / "kiln" / name), kiln_args)
        assert read_args(tmp_path / "kiln" / name).output_dir == str(tmp_path / "kiln")
    same(read_args(tmp_path / "hf_export"), hf_args)
    same(read_args(tmp_path / "kiln_export"), kiln_args)


def test_built_from_kilns_config_with_the_users_values(tmp_path):
    """A kiln config (nested keys, HF names) gives a TrainingArguments whose fields hold what HF's own
    TrainingArguments of the same settings holds (HF's enum types included)."""
    from transformers.trainer_utils import SchedulerType

    cfg = {
        "output_dir": str(tmp_path / "run"),
        "optim": {"lr": 0.03, "weight_decay": 0.1},
        "max_steps": 2,
        "save_steps": 2,
        "logging_steps": 1,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "lr_scheduler_type": "cosine",
        "seed": 7,
        "save_total_limit": 3,
        "warmup_steps": 1,
        "report_to": "none",
        "disable_tqdm": True,
        "log": {"history": []},
    }
    trainer = Trainer(make_model(), cfg, train_dataset=regression_data())
    trainer.fit()
    trainer.save_model(str(tmp_path / "export"))
    flat = {
        "output_dir": str(tmp_path / "run"),
        "learning_rate": 0.03,
        "weight_decay": 0.1,
        "max_steps": 2,
        "save_steps": 2,
        "logging_steps": 1,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "lr_scheduler_type": "cosine",
        "seed": 7,
        "save_total_limit": 3,
        "warmup_steps": 1,
    }
    reference = transformers.TrainingArguments(use_cpu=True, **flat)
    for folder in (tmp_path / "run" / "checkpoint-2", tmp_path / "export"):
        loaded = read_args(folder)
        assert isinstance(loaded, transformers.TrainingArguments)
        for key in flat:
            assert getattr(loaded, key) == getattr(reference, key), key
            assert type(getattr(loaded, key)) is type(getattr(reference, key)), key
        assert loaded.lr_scheduler_type is SchedulerType.COSINE
        assert loaded.adam_beta1 == reference.adam_beta1  # HF's default where kiln's config says nothing else


def test_without_transformers_nothing_is_written_and_nothing_is_said(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "transformers.training_args", None)  # import fails as if not installed
    out = str(tmp_path / "run")
    trainer = train(out, {"max_steps": 2, "save_steps": 2})
    trainer.save_model(str(tmp_path / "export"))
    assert os.path.exists(os.path.join(out, "checkpoint-2", "COMPLETE"))
    assert not os.path.exists(os.path.join(out, "checkpoint-2", "training_args.bin"))
    assert not os.path.exists(tmp_path / "export" / "training_args.bin")
    assert "training_args" not in caplog.text


def test_sealed_with_the_checkpoint_and_never_read_on_resume(tmp_path):
    out, cfg = str(tmp_path / "run"), {"max_steps": 2, "save_steps": 2}
    train(out, cfg)
    ckpt = tmp_path / "run" / "checkpoint-2"
    marker = json.loads((ckpt / "COMPLETE").read_text())
    assert "training_args.bin" in marker["files"] and "training_args.bin" in marker[ALGORITHM]
    # changed behind kiln's back (same size): the checksum catches it like any other file
    original = (ckpt / "training_args.bin").read_bytes()
    (ckpt / "training_args.bin").write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.warns(UserWarning, match="training_args.bin does not match the checksum"):
        assert latest_checkpoint(out, verify=True) is None
    # planted by someone who also rewrote the marker: resume, weights loading and convert never unpickle it
    pwned = str(tmp_path / "PWNED")
    torch.save(Payload(pwned), ckpt / "training_args.bin")
    remark(ckpt)
    resumed = train(out, {**cfg, "max_steps": 3}, resume=str(ckpt))
    assert resumed.state.global_step == 3
    resumed._load_from_checkpoint(str(ckpt))
    convert_checkpoint(str(ckpt), str(tmp_path / "converted"))
    assert not os.path.exists(pwned)


def test_the_built_arguments_read_as_hfs_post_init_leaves_them(tmp_path):
    """No training: kiln's config straight to TrainingArguments, field by field against HF's own."""
    from kiln.config.hf.training_args import training_arguments
    from kiln.config.load import load_config

    cfg = load_config(
        {
            "output_dir": str(tmp_path),
            "logging_steps": 3,
            "save_steps": 0.25,
            "eval_strategy": "steps",
            "report_to": "none",
            "gradient_checkpointing": True,
            "warmup_ratio": 0.1,
            "fp16": True,
            "label_names": ["labels"],
            "adam_beta2": 0.95,
        }
    )
    ours = training_arguments(cfg)
    with pytest.warns(FutureWarning):  # HF 5's name for gradient_checkpointing is activation_checkpointing
        hf = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            logging_steps=3,
            save_steps=0.25,
            eval_strategy="steps",
            report_to="none",
            gradient_checkpointing=True,
            warmup_steps=0.1,
            fp16=True,
            label_names=["labels"],
            adam_beta2=0.95,
            use_cpu=True,
        )
    for key in (
        "logging_steps",
        "save_steps",
        "eval_steps",
        "eval_strategy",
        "report_to",
        "gradient_checkpointing",
        "activation_checkpointing",
        "warmup_steps",
        "fp16",
        "bf16",
        "label_names",
        "adam_beta2",
        "save_strategy",
        "hub_strategy",
        "debug",
        "output_dir",
        "include_for_metrics",
    ):
        assert getattr(ours, key) == getattr(hf, key), key
        assert type(getattr(ours, key)) is type(getattr(hf, key)), key


def test_values_from_the_environment_stay_masked(tmp_path, monkeypatch):
    """A token passed as `${oc.env:VAR}` reads as the interpolation in the pickle too, as in config.yaml
    (the masks must not be resolved again on the way to TrainingArguments)."""
    from kiln.config.hf.training_args import training_arguments
    from kiln.config.load import load_config

    monkeypatch.setenv("KILN_TEST_RUN", "run-3c9e11ab")
    monkeypatch.setenv("KILN_TEST_TOKEN", "tok-5d20f7aa")
    cfg = load_config(
        {"output_dir": str(tmp_path), "run_name": "${oc.env:KILN_TEST_RUN}"}, ["hub_token=${oc.env:KILN_TEST_TOKEN}"]
    )
    assert cfg.run_name == "run-3c9e11ab"  # training reads the value
    ours = training_arguments(cfg)
    assert ours.run_name == "${oc.env:KILN_TEST_RUN}"
    assert "run-3c9e11ab" not in repr(vars(ours)) and "tok-5d20f7aa" not in repr(vars(ours))


def test_a_file_that_cannot_be_written_costs_nothing_but_a_log_line(tmp_path, caplog):
    from kiln.config.load import load_config
    from kiln.engine.checkpoint.hf_files import write_training_args

    assert write_training_args(str(tmp_path), load_config({}), given=lambda: None) is None  # a lambda does not pickle
    assert not os.listdir(tmp_path)
    assert "training_args.bin was not written" in caplog.text
    assert write_training_args(str(tmp_path), load_config({"learning_rate": 0.5})) == str(
        tmp_path / "training_args.bin"
    )
    assert read_args(tmp_path).learning_rate == 0.5


def test_a_plain_pytorch_run_neither_imports_transformers_nor_writes_the_file(tmp_path):
    """The file serves HF's tools; a run that never touched transformers does not import it (seconds, on
    every rank's first checkpoint) to write one."""
    import subprocess
    import textwrap

    script = textwrap.dedent(f"""
        import os, sys, torch
        from kiln import Trainer
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        data = [(torch.randn(4), torch.randn(1)) for _ in range(16)]
        def loss(m, batch):
            x, y = batch
            return torch.nn.functional.mse_loss(m(x), y)
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__(); self.lin = model
            def forward(self, x, y):
                return torch.nn.functional.mse_loss(self.lin(x), y)
        out = {str(tmp_path / "run")!r}
        Trainer(M(), {{"output_dir": out, "max_steps": 2, "save_steps": 2, "report_to": "none",
                      "disable_tqdm": True}}, train_dataset=[{{"x": x, "y": y}} for x, y in data]).train()
        assert os.path.exists(os.path.join(out, "checkpoint-2", "COMPLETE"))
        print("files", sorted(os.listdir(os.path.join(out, "checkpoint-2"))))
        print("transformers imported:", "transformers" in sys.modules)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "transformers imported: False" in proc.stdout, proc.stdout
    assert "training_args.bin" not in proc.stdout.split("files", 1)[1], proc.stdout
