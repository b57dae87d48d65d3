"""Bad values that used to train silently or end in a traceback from deep inside torch or the
alias table: one sentence at config validation, naming the key and the fix (issue 34, item 11)."""

from __future__ import annotations

import pytest

from kiln.config import load_config
from kiln.utils.errors import ConfigError


@pytest.mark.parametrize(
    "overrides, sentence",
    [
        (["report_to=5"], r"report_to is 5; give a tracker name or a list of them"),
        (["report_to=[tensorboard, 5]"], r"report_to is \['tensorboard', 5\]; give a tracker name"),
        (["log.report_to=5"], r"'log.report_to' expects List\[str\], got 5"),
        (
            ["ddp_timeout=-5"],
            r"'strategy.timeout' \(ddp_timeout\) is the seconds a collective may wait and must be > 0, got -5",
        ),
        (["strategy.timeout=0"], r"must be > 0, got 0"),
        (
            ["torch_compile_backend=nonexistent"],
            r"'train.torch_compile_backend' is 'nonexistent', which torch.compile does "
            r"not know; choose one of .*inductor",
        ),
        (["train.max_nonfinite_steps=-1"], r"'train.max_nonfinite_steps' must be >= 0"),
    ],
)
def test_one_sentence(overrides: list[str], sentence: str) -> None:
    with pytest.raises(ConfigError, match=sentence) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_zero_epochs_loads_for_evaluate_but_fit_refuses(tmp_path) -> None:
    """HF trains 0 steps and reports success; kiln accepts the config (evaluate/predict need no epochs)
    and refuses to fit it, before the model is set up."""
    from kiln import Trainer
    from tests.helpers import TinyRegressor, base_config, regression_data

    assert load_config(None, ["num_train_epochs=0", "max_steps=3"]).train.max_steps == 3
    trainer = Trainer(TinyRegressor(), base_config(tmp_path, num_train_epochs=0), train_dataset=regression_data(8))
    with pytest.raises(
        ValueError,
        match=r"^train.num_train_epochs is 0 and train.max_steps is unset, so fit\(\) would "
        r"train nothing: set num_train_epochs > 0 or max_steps > 0",
    ):
        trainer.fit()
    assert trainer.state.global_step == 0 and trainer.optimizer is None


@pytest.mark.parametrize("overrides", [["report_to=[tensorboard, csv]"], ["report_to=csv"], ["log.report_to=[csv]"]])
def test_tracker_lists_from_the_command_line_pass(overrides: list[str]) -> None:
    assert "csv" in load_config(None, overrides).log.report_to


def test_known_compile_backend_passes() -> None:
    assert load_config(None, ["torch_compile_backend=eager"]).train.torch_compile_backend == "eager"


def test_a_one_second_timeout_is_accepted() -> None:
    assert load_config(None, ["strategy.timeout=1"]).strategy.timeout == 1
