"""The running loss sums behind the logged `loss` and the final `train_loss`.

Nothing reads a device value back to the host between logging steps: each step's micro-batch losses
stay tensors in `pending` until a log or save step folds them in, all in one transfer; from there the
sums are host floats (float64), as HF's `_total_loss_scalar` is. They go into checkpoints per rank,
so a resumed run logs the same numbers as an uninterrupted one."""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.engine.loop.loss_reads import NonFiniteGuard, loss_values


class RunningLoss:
    def __init__(self, guard: NonFiniteGuard, nan_inf_filter: bool, last_logged: int) -> None:
        self.guard, self.nan_inf_filter = guard, nan_inf_filter
        self.tr_loss = 0.0  # the loss sum of the steps since the last log (HF's tr_loss)
        self.total_loss = 0.0  # the loss sum of every step, for train_loss (HF's _total_loss_scalar)
        self.last_logged = last_logged
        self.steps_before_resume = 0
        self.pending: list[list[torch.Tensor]] = []  # per step, its micro-batch losses not yet folded in
        guard.schedule(last_logged, 0)

    def state_dict(self, steps_this_run: int) -> dict[str, Any]:
        # float64 tensors (checkpoints before host sums held a float32 tr_loss; both load)
        return {
            "tr_loss": torch.tensor(self.tr_loss, dtype=torch.float64),
            "total_loss": torch.tensor(self.total_loss, dtype=torch.float64),
            "last_logged": self.last_logged,
            "steps": self.steps_before_resume + steps_this_run,
            "nonfinite_streak": self.guard.consecutive,
        }  # so a resumed run reads the losses at the same steps

    def load_state_dict(self, state: dict[str, Any], global_step: int) -> None:
        self.tr_loss, self.total_loss = float(state["tr_loss"]), float(state["total_loss"])
        self.last_logged, self.steps_before_resume = int(state["last_logged"]), int(state["steps"])
        self.guard.resumed()
        self.guard.consecutive = self.guard.longest = int(state.get("nonfinite_streak", 0))
        self.guard.schedule(global_step, self.guard.consecutive)

    def fold(self, global_step: int, strategy: Any) -> None:
        """Add the queued micro-batch losses to tr_loss and total_loss (before logs, saves and the end).

        The losses are read here, all at once (see loss_values): a log step reads the loss anyway, and
        summing a few floats on the host costs less than the tensor ops that would keep the sums on
        the device. With `nan_inf_filter`, a nan/inf micro-batch loss counts as the logging window's
        mean so far, per micro-batch as in HF (the finite micro-batches of the same window still
        count); train_loss uses the same filtered values."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        values = loss_values([loss for micro_losses in pending for loss in micro_losses])
        total = sum(values)  # finite exactly when every loss is (float32 losses cannot overflow a float64 sum)
        first_step = global_step - len(pending) + 1
        if math.isfinite(total):
            self.guard.all_finite()
        else:
            i = 0
            for j, micro_losses in enumerate(pending):
                self.guard.step(first_step + j, values[i : i + len(micro_losses)])
                i += len(micro_losses)
        self.guard.check(strategy, global_step)  # too many nan/inf steps: stop here, before a log or save uses them
        if not self.nan_inf_filter or math.isfinite(total):
            self.tr_loss += total
            self.total_loss += total
            return
        values.reverse()
        for j, micro_losses in enumerate(pending):
            steps_before = first_step + j - 1 - self.last_logged  # completed steps in this logging window
            for _ in micro_losses:
                value = values.pop()
                if not math.isfinite(value):
                    value = self.tr_loss / (1 + steps_before)
                self.tr_loss += value
                self.total_loss += value


def mean_over_ranks(value: float, strategy: Any) -> float:
    """`value` averaged over the processes (one collective; none on a single process)."""
    if strategy.world_size == 1:
        return value
    return float(strategy.reduce(torch.tensor(value, dtype=torch.float64), "mean").item())


def sum_over_ranks(values: list[float], strategy: Any) -> list[float]:
    """`values` summed over the processes, in one collective (none on a single process)."""
    if strategy.world_size == 1:
        return list(values)
    return [float(v) for v in strategy.reduce(torch.tensor(values, dtype=torch.float64), "sum").tolist()]
