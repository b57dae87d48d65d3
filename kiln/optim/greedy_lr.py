"""GreedyLR, Transformers' metric-driven learning-rate schedule (`lr_scheduler_type: greedy`), rewritten
so that kiln does not need transformers; checked against it in tests/engine/test_schedulers.py."""

from __future__ import annotations

import logging
import math
from typing import Any

from torch.optim import Optimizer

logger = logging.getLogger(__name__)


class GreedyLR:
    """HF's metric-driven schedule (arXiv 2512.14527): more than `patience` improving metrics divide the lr
    by `factor`, more than `patience` non-improving ones multiply it, within [min_lr, max_lr]; `reset_start`
    reductions spent at min_lr restart from the initial lr. Same arguments, arithmetic and state_dict keys as
    transformers.optimization.GreedyLR, so an HF user's run behaves the same and its checkpoints load here."""

    _STATE = (
        "factor",
        "min_lrs",
        "max_lrs",
        "patience",
        "verbose",
        "cooldown",
        "warmup",
        "cooldown_counter",
        "mode",
        "warmup_counter",
        "threshold",
        "threshold_mode",
        "best",
        "num_bad_epochs",
        "num_good_epochs",
        "eps",
        "last_epoch",
        "smooth",
        "window_size",
        "reset_start",
        "reset_start_original",
        "_last_lr",
        "_init_lrs",
    )

    def __init__(
        self,
        optimizer: Optimizer,
        mode: str = "min",
        factor: float = 0.95,
        patience: int = 10,
        threshold: float = 1e-6,
        threshold_mode: str = "abs",
        cooldown: int = 0,
        warmup: int = 0,
        min_lr: float | list[float] = 1e-3,
        max_lr: float | list[float] = 1.0,
        eps: float = 1e-8,
        verbose: bool = False,
        smooth: bool = False,
        window_size: int = 50,
        reset_start: int = 500,
    ) -> None:
        if factor >= 1.0 or mode not in ("min", "max") or threshold_mode not in ("rel", "abs"):
            raise ValueError(
                "lr scheduler 'greedy' needs `scheduler.kwargs` factor < 1, mode min|max, threshold_mode rel|abs."
            )
        self.optimizer, self.mode, self.factor, self.patience, self.threshold = (
            optimizer,
            mode,
            factor,
            patience,
            threshold,
        )
        self.threshold_mode, self.cooldown, self.warmup, self.eps, self.verbose = (
            threshold_mode,
            cooldown,
            warmup,
            eps,
            verbose,
        )
        self.smooth, self.window_size, self.reset_start, self.reset_start_original = (
            smooth,
            window_size,
            reset_start,
            reset_start,
        )
        n = len(optimizer.param_groups)
        self.min_lrs = list(min_lr) if isinstance(min_lr, (list, tuple)) else [min_lr] * n
        self.max_lrs = list(max_lr) if isinstance(max_lr, (list, tuple)) else [max_lr] * n
        if len(self.min_lrs) != n or len(self.max_lrs) != n:
            raise ValueError(f"`scheduler.kwargs` min_lr / max_lr lists need one value per param group ({n}).")
        self._init_lrs = [group["lr"] for group in optimizer.param_groups]
        self._last_lr, self.last_epoch = list(self._init_lrs), 0
        self._start()

    def _start(self) -> None:
        self.best = math.inf if self.mode == "min" else -math.inf
        self.num_bad_epochs = self.num_good_epochs = self.cooldown_counter = self.warmup_counter = 0
        self._values: list[float] = []  # the smoothing window (HF's StreamingAverage) and its sum
        self._sum = 0.0

    def is_better(self, current: float, best: float) -> bool:
        if self.mode == "min":
            return current < (best * (1.0 - self.threshold) if self.threshold_mode == "rel" else best - self.threshold)
        return current > (best * (1.0 + self.threshold) if self.threshold_mode == "rel" else best + self.threshold)

    def step(self, metrics: float, epoch: int | None = None) -> None:
        current = float(metrics)
        if self.smooth:
            self._values.append(current)
            self._sum += current
            if len(self._values) > self.window_size:
                self._sum -= self._values.pop(0)
            current = self._sum / len(self._values)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = self.num_good_epochs = 0
        elif self.warmup_counter > 0:
            self.warmup_counter -= 1
            self.num_bad_epochs = self.num_good_epochs = 0
        else:
            if self.is_better(current, self.best):
                self.best, self.num_bad_epochs, self.num_good_epochs = current, 0, self.num_good_epochs + 1
            else:
                self.num_bad_epochs, self.num_good_epochs = self.num_bad_epochs + 1, 0
            if self.num_good_epochs > self.patience:
                self._scale(increase=True)
                self.warmup_counter, self.num_good_epochs = self.warmup, 0
            elif self.num_bad_epochs > self.patience:
                self._scale(increase=False)
                self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _scale(self, increase: bool) -> None:
        all_at_min = True
        for i, group in enumerate(self.optimizer.param_groups):
            old = float(group["lr"])
            new = min(old / self.factor, self.max_lrs[i]) if increase else max(old * self.factor, self.min_lrs[i])
            if abs(new - old) > self.eps and (new > old) == increase:
                group["lr"] = new
                if self.verbose:
                    logger.info("GreedyLR: lr of group %d -> %.4e", i, new)
            all_at_min = all_at_min and group["lr"] <= self.min_lrs[i]
        if increase:
            self.reset_start = self.reset_start_original
        elif all_at_min:
            self.reset_start -= 1
            if self.reset_start <= 0:
                for group, lr in zip(self.optimizer.param_groups, self._init_lrs):
                    group["lr"] = lr
                self._start()
                self.reset_start = self.reset_start_original

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        state = {key: getattr(self, key) for key in self._STATE}
        if self.smooth:
            state["_streaming_avg"] = {"window_size": self.window_size, "values": list(self._values), "sum": self._sum}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in self._STATE:
            setattr(self, key, state_dict.get(key, getattr(self, key)))
        avg = state_dict.get("_streaming_avg", {})
        self._values, self._sum = list(avg.get("values", self._values)), avg.get("sum", self._sum)
        if "_last_lr" in state_dict:
            for group, lr in zip(self.optimizer.param_groups, self._last_lr):
                group["lr"] = lr
