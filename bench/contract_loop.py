"""The least a Trainer with HF's per-step contract can do, written by hand: bench/interleaved.py's loop plus only
what every step of HF's `Trainer` (and kiln's) promises a user, each piece as cheap as Python allows.

Per step, on top of the bare loop: the `on_step_begin` / `on_pre_optimizer_step` / `on_optimizer_step` /
`on_step_end` events (dispatched only to callbacks that override them, with HF's flag resets), the
`training_step` -> `compute_loss` override points, the step's loss kept for the logs, the samples and FLOPs
counted, the learning rate this step used read before the scheduler moves it, `global_step` and the fractional
`epoch`, and the log / evaluate / save check after `on_step_end` (a flow callback sets `should_log` every
`log_every` steps; a log event reads the losses, the grad norm and the rate and calls `on_log`).

It exists to answer one question with a measurement: how far below this floor is a ratio to the bare loop
reachable at all on a step as short as the tiny MLP's (issue 33). It is not kiln and shares none of its code."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


class Control:
    __slots__ = ("should_log", "should_evaluate", "should_save", "should_training_stop")

    def __init__(self) -> None:
        self.should_log = self.should_evaluate = self.should_save = self.should_training_stop = False


class Callback:
    """HF's callback events, every one a no-op."""

    def on_step_begin(self, state: State, control: Control) -> None: ...

    def on_pre_optimizer_step(self, state: State, control: Control) -> None: ...

    def on_optimizer_step(self, state: State, control: Control) -> None: ...

    def on_step_end(self, state: State, control: Control) -> None: ...

    def on_log(self, state: State, control: Control, logs: dict[str, float]) -> None: ...


class Flow(Callback):
    """HF's DefaultFlowCallback, its logging rule only (no evaluation or saving in this recipe)."""

    def __init__(self, log_every: int) -> None:
        self.log_every = log_every

    def on_step_end(self, state: State, control: Control) -> None:
        if state.global_step % self.log_every == 0:
            control.should_log = True


class History(Callback):
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, state: State, control: Control, logs: dict[str, float]) -> None:
        self.logs.append({**logs, "step": state.global_step})


class Events:
    """Calls an event on the callbacks that override it (a list per event, built once)."""

    def __init__(self, callbacks: list[Callback]) -> None:
        names = ("on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log")
        self.by_event = {
            name: [getattr(cb, name) for cb in callbacks if getattr(type(cb), name) is not getattr(Callback, name)]
            for name in names
        }

    def call(self, event: str, state: State, control: Control, **kw: Any) -> None:
        for handler in self.by_event[event]:
            handler(state, control, **kw)


class State:
    def __init__(self) -> None:
        self.global_step, self.epoch, self.samples, self.flos = 0, 0.0, 0, 0.0


def contract_loop(
    net: torch.nn.Module,
    data: Any,
    batch: int,
    compile_model: bool,
    lr: float,
    schedule: Callable[[int], float],
    log_every: int,
) -> Callable[[int], float]:
    """`run(n)` takes n steps of the contract loop and returns their seconds (as bench/interleaved.py's loop)."""
    model = torch.compile(net) if compile_model else net
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)
    params = list(net.parameters())
    per_token = 6.0 * sum(p.numel() for p in params)
    batches_per_epoch = len(loader)
    history = History()
    events, state, control = Events([Flow(log_every), history]), State(), Control()
    pending: list[torch.Tensor] = []
    grad_norm = torch.zeros(())
    step_lr = 0.0

    def compute_loss(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**inputs)["loss"]

    def training_step(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = compute_loss(model, inputs)
        loss.backward()
        return loss.detach()

    def batches() -> Iterator[Any]:
        while True:
            yield from loader

    stream = batches()

    def log() -> None:
        losses = [loss.item() for loss in pending]
        logs = {
            "loss": sum(losses) / len(losses),
            "grad_norm": grad_norm.item(),
            "learning_rate": step_lr,
            "epoch": state.epoch,
        }
        pending.clear()
        events.call("on_log", state, control, logs=logs)

    def run(n: int) -> float:
        nonlocal grad_norm, step_lr
        start = time.perf_counter()
        for _ in range(n):
            inputs = next(stream)
            for flag in ("should_log", "should_evaluate", "should_save"):
                setattr(control, flag, False)
            events.call("on_step_begin", state, control)
            pending.append(training_step(model, inputs))
            state.samples += next(iter(inputs.values())).shape[0]
            ids = inputs.get("input_ids")
            state.flos += per_token * ids.numel() if ids is not None else 0.0
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            events.call("on_pre_optimizer_step", state, control)
            opt.step()
            events.call("on_optimizer_step", state, control)
            step_lr = sched.get_last_lr()[0]
            sched.step()
            opt.zero_grad(set_to_none=True)
            state.global_step += 1
            state.epoch = state.global_step / batches_per_epoch
            events.call("on_step_end", state, control)
            if control.should_log:
                log()
            if control.should_evaluate or control.should_save:
                raise RuntimeError("this recipe neither evaluates nor saves")
        return time.perf_counter() - start

    return run
