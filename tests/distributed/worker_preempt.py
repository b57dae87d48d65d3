"""2-process worker for preemption and start-up checks. Usage:
worker_preempt.py preempt OUT MAX_STEPS SIGNAL_RANKS [resume [STRAIGHT]]
    on_step_end of step 3, each rank in SIGNAL_RANKS (e.g. "1" or "01") writes its pid to OUT/pid<rank>
    and waits until it has received SIGTERM (the test sends it); then training goes on as kiln decides.
    With STRAIGHT, the same process then trains the uninterrupted run into STRAIGHT (one launch fewer).
worker_preempt.py dirs OUT
    each rank gets its own output_dir (OUT/rank<r>): refused at start-up."""

import json
import os
import signal
import sys
import time

import torch
import toy

from kiln import Callback, Trainer

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])


class WaitForSigterm(Callback):
    """Chains onto kiln's SIGTERM handler to know when the signal has arrived (no timing guesses)."""

    def on_step_end(self, config, state, control, **kw):
        if state.global_step != 3 or str(rank) not in sys.argv[4]:
            return
        got = []
        kiln_handler = signal.getsignal(signal.SIGTERM)

        def chained(signum, frame):
            got.append(signum)
            kiln_handler(signum, frame)

        signal.signal(signal.SIGTERM, chained)
        with open(os.path.join(out, f"pid{rank}.tmp"), "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)


if mode == "dirs":
    torch.manual_seed(0)
    model = toy.Regressor(dropout=0.2)
    cfg = toy.scenario_config(
        "plain", os.path.join(out, f"rank{rank}"), world=2, strategy={"name": "ddp", "device": "cpu", "timeout": 60}
    )
    Trainer(model, cfg, train_dataset=toy.regression_data(64)).fit()
    sys.exit(0)


def train(output_dir: str, resume: bool) -> None:
    torch.manual_seed(0)
    cfg = toy.scenario_config(
        "plain",
        output_dir,
        world=2,
        max_steps=int(sys.argv[3]),
        enable_jit_checkpoint=True,
        save={"strategy": "steps", "steps": 100},
        resume_from_checkpoint="true" if resume else None,
        strategy={"name": "ddp", "device": "cpu", "timeout": 60},
    )
    trainer = Trainer(
        toy.Regressor(dropout=0.2), cfg, train_dataset=toy.regression_data(64), callbacks=[WaitForSigterm()]
    )
    trainer.fit()
    if rank == 0:
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        torch.save(state, os.path.join(output_dir, "final.pt"))
        with open(os.path.join(output_dir, "history.json"), "w") as fh:
            json.dump(trainer.state.log_history[:-1], fh)
    print(f"training finished at step {trainer.state.global_step}", flush=True)


train(out, resume=len(sys.argv) > 5 and sys.argv[5] == "resume")
if len(sys.argv) > 6:
    os.makedirs(sys.argv[6], exist_ok=True)
    train(sys.argv[6], resume=False)
