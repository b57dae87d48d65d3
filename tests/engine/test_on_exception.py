"""`on_exception`: a fit that ends with an error calls it with the error before re-raising it; a note a
callback adds there reaches the caller, and a callback failing there never hides the run's own error."""

from __future__ import annotations

import pytest
import torch

from kiln import Trainer
from kiln.engine.callbacks.base import Callback
from tests.helpers import TinyRegressor, base_config, regression_data


class Explodes(TinyRegressor):
    def training_step(self, batch):  # type: ignore[no-untyped-def]
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().training_step(batch)


class Notes(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, BaseException]] = []

    def on_exception(self, config, state, control, exception=None, **kw):  # type: ignore[no-untyped-def]
        self.seen.append((state.global_step, exception))
        exception.add_note("kiln: the memory snapshot is in /somewhere")


class Broken(Callback):
    def on_exception(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
        raise ValueError("the callback itself is broken")


def fit(tmp_path, *callbacks):  # type: ignore[no-untyped-def]
    cfg = base_config(tmp_path, max_steps=5, per_device_train_batch_size=4)
    Trainer(Explodes(), cfg, train_dataset=regression_data(32), callbacks=list(callbacks)).fit()


def test_the_error_that_ends_a_fit_goes_through_on_exception_and_keeps_its_notes(tmp_path):
    notes = Notes()
    with pytest.raises(torch.OutOfMemoryError) as err:
        fit(tmp_path, notes)
    [(step, seen)] = notes.seen
    assert step == 2 and seen is err.value  # raised in the third step, after two finished
    assert err.value.__notes__ == ["kiln: the memory snapshot is in /somewhere"]


def test_a_callback_failing_in_on_exception_never_hides_the_runs_error(tmp_path, caplog):
    notes = Notes()
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 2.00 GiB"):
        fit(tmp_path, Broken(), notes)
    assert len(notes.seen) == 0  # the broken callback came first: the event stopped there, logged
    assert "A callback's on_exception failed while the fit was ending with OutOfMemoryError" in caplog.text
