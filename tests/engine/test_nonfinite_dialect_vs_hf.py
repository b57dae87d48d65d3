"""nan/inf losses in HF's dialect (issue 52 item 10). A config that comes as HF's `TrainingArguments`, or
as HF's flat names only, trains as HF's Trainer does: on through nan/inf losses (no
`max_nonfinite_steps` stop unless asked for), logging HF's filtered values, 0.0 for a window without a
finite loss. Any other config keeps kiln's guard, and logs nan for such a window. Checked against HF's
own Trainer on the same scripted losses, and with HF's own `test_logging_inf_nan_filter`."""

from __future__ import annotations

import math

import pytest
import torch

from kiln import Trainer
from kiln.config import load_config
from kiln.engine.loop.loss_reads import NonFiniteLossError
from tests.engine.test_nan_inf_filter import Scripted, data
from tests.helpers import base_config

transformers = pytest.importorskip("transformers")

NAN, INF = float("nan"), float("inf")
# logged every 4 steps: a window with a nan, one with nothing finite (HF logs 0.0 there), one with an inf
VALUES = [1.0, 2.0, NAN, NAN] + [NAN] * 4 + [3.0, 4.0, INF, 6.0]


def hf_args(tmp_path, **kw):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=len(VALUES),
        per_device_train_batch_size=1,
        learning_rate=0.0,
        max_grad_norm=0.0,
        logging_steps=4,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        **kw,
    )


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        x == pytest.approx(y, rel=1e-6) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("flt", [True, False], ids=["filter", "no filter"])
def test_training_arguments_log_what_hfs_trainer_logs(tmp_path, flt):
    theirs = transformers.Trainer(
        model=Scripted(VALUES),
        args=hf_args(tmp_path / "hf", logging_nan_inf_filter=flt),
        train_dataset=data(len(VALUES)),
    )
    their_out = theirs.train()
    ours = Trainer(
        Scripted(VALUES), args=hf_args(tmp_path / "kiln", logging_nan_inf_filter=flt), train_dataset=data(len(VALUES))
    )
    our_out = ours.fit()
    assert our_out.global_step == their_out.global_step == len(VALUES)  # no stop after 10 nan steps: HF has none
    if flt:
        assert same(losses(ours), losses(theirs)), (losses(ours), losses(theirs))
        assert losses(ours)[1] == 0.0  # the window without a finite loss: HF's stand-in, not kiln's nan
        assert our_out.training_loss == pytest.approx(their_out.training_loss, rel=1e-6)
    else:  # HF's running sum stays nan once a window was (it is reset by subtracting itself); kiln's restarts at 0
        assert same(losses(ours)[:2], losses(theirs)[:2]) and math.isnan(losses(ours)[1])
        assert losses(ours)[2] == INF and math.isnan(losses(theirs)[2])
        assert math.isnan(our_out.training_loss) and math.isnan(their_out.training_loss)


def test_hfs_flat_names_are_hfs_dialect_too(tmp_path):
    args = {
        k: v
        for k, v in hf_args(tmp_path).to_dict().items()
        if k
        in (
            "output_dir",
            "max_steps",
            "per_device_train_batch_size",
            "learning_rate",
            "max_grad_norm",
            "logging_steps",
            "report_to",
            "save_strategy",
            "use_cpu",
            "disable_tqdm",
            "dataloader_pin_memory",
        )
    }
    trainer = Trainer(Scripted(VALUES), args, train_dataset=data(len(VALUES)))
    trainer.fit()
    assert losses(trainer)[1] == 0.0 and trainer.state.global_step == len(VALUES)


def test_kilns_dialect_keeps_its_guard_and_its_nan(tmp_path):
    cfg = base_config(
        tmp_path,
        max_steps=len(VALUES),
        per_device_train_batch_size=1,
        learning_rate=0.0,
        max_grad_norm=0.0,
        logging_steps=4,
    )
    trainer = Trainer(Scripted(VALUES), cfg, train_dataset=data(len(VALUES)))
    trainer.fit()  # 6 nan steps in a row: under kiln's limit of 10
    assert math.isnan(losses(trainer)[1])  # not a made-up 0.0
    long_nan = [1.0] + [NAN] * 11
    stopped = Trainer(Scripted(long_nan), {**cfg, "max_steps": 12}, train_dataset=data(12))
    with pytest.raises(NonFiniteLossError, match="for 10 consecutive steps"):
        stopped.fit()
    assert stopped.state.global_step == 11


def test_a_setting_given_explicitly_wins_over_the_dialect(tmp_path):
    guarded = Trainer(
        Scripted(VALUES),
        args=hf_args(tmp_path),
        train_dataset=data(len(VALUES)),
        overrides=["train.max_nonfinite_steps=3", "log.nonfinite_window=nan"],
    )
    with pytest.raises(NonFiniteLossError, match="for 3 consecutive steps"):
        guarded.fit()
    assert guarded.state.global_step == 5  # nan at steps 3, 4, 5
    cfg = load_config(
        {**base_config(tmp_path), "train": {"max_nonfinite_steps": 0}, "log": {"nonfinite_window": "filtered"}}
    )
    assert (cfg.train.max_nonfinite_steps, cfg.log.nonfinite_window) == (0, "filtered")


@pytest.mark.parametrize(
    "source, hf",
    [
        ({"learning_rate": 1e-3, "output_dir": "x", "seed": 1, "optim": "adamw_torch", "fp16": False}, True),
        ({"learning_rate": 1e-3, "train": {"max_steps": 3}}, False),
        ({"learning_rate": 1e-3, "strategy": "ddp"}, False),
        ({"learning_rate": 1e-3, "optim": {"name": "sgd"}}, False),
        ({"learning_rate": 1e-3, "optim.lr": 1e-3}, False),
        ({}, False),
    ],
)
def test_which_configs_are_hfs_dialect(source, hf):
    cfg = load_config(source)
    assert (cfg.train.max_nonfinite_steps, cfg.log.nonfinite_window) == ((0, "filtered") if hf else (10, "nan"))


def test_a_loaded_config_keeps_its_dialect(tmp_path):
    """A config loaded again (a checkpoint's, the launcher's second pass) keeps the values the first load chose."""
    first = load_config(hf_args(tmp_path))
    assert (first.train.max_nonfinite_steps, first.log.nonfinite_window) == (0, "filtered")
    again = load_config(first, ["learning_rate=0.1"])
    assert (again.train.max_nonfinite_steps, again.log.nonfinite_window) == (0, "filtered")


def test_a_bad_window_value_is_refused():
    from kiln.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="Config key 'log.nonfinite_window' is 'zero'; choose one of nan, filtered."):
        load_config({"log": {"nonfinite_window": "zero"}})


class RepeatDataset(torch.utils.data.Dataset):
    """HF's test dataset: the same token row every time."""

    def __init__(self, x: torch.Tensor, length: int = 64) -> None:
        self.x, self.length = x, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x, "labels": self.x}


def test_hfs_own_logging_inf_nan_filter_test(tmp_path):
    """HF's `test_logging_inf_nan_filter`, with kiln's Trainer (and a smaller GPT-2): 24 steps at learning rate
    1e9 (the loss goes nan/inf within a few), which kiln stopped after 10 before."""
    torch.manual_seed(0)  # HF's sizes are n_positions=128, n_embd=32, n_layer=3: smaller is as nan, and faster
    config = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    tiny_gpt2 = transformers.GPT2LMHeadModel(config)
    train_dataset = RepeatDataset(torch.randint(0, 100, (16,)))
    histories = {}
    for flt in (False, True):
        args = transformers.TrainingArguments(
            str(tmp_path / str(flt)),
            learning_rate=1e9,
            logging_steps=5,
            logging_nan_inf_filter=flt,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(tiny_gpt2, args, train_dataset=train_dataset)
        assert trainer.fit().global_step == 24
        histories[flt] = trainer.state.log_history

    def any_nan_or_inf(log_history) -> bool:
        return any(not math.isfinite(entry["loss"]) for entry in log_history[:-1])

    assert any_nan_or_inf(histories[False])
    assert not any_nan_or_inf(histories[True])
