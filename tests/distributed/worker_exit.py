"""Worker: a run that ends in one of the ways that used to leave gloo's worker threads alive into
interpreter finalization (issue 35 item 15: "terminate called without an active exception"). The
first atexit hook registered runs last: it writes how many gloo worker threads are still alive
then to OUT/threads<rank>.json.
Usage: torchrun --nproc_per_node=2 worker_exit.py OUT hf_args|own_destroy"""

import atexit
import json
import os
import sys

out, how = sys.argv[1], sys.argv[2]


def gloo_threads() -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                count += fh.read().strip() == "pt_gloo_runloop"
        except FileNotFoundError:  # a thread that ended while listing
            pass
    return count


def report() -> None:
    with open(os.path.join(out, f"threads{os.environ['RANK']}.json"), "w") as fh:
        json.dump(gloo_threads(), fh)


atexit.register(report)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import toy  # noqa: E402

from kiln import Trainer  # noqa: E402

torch.manual_seed(0)
if (
    how == "hf_args"
):  # TrainingArguments makes the process group itself (accelerate's PartialState): kiln does not own it
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=os.path.join(out, "run"),
        max_steps=3,
        per_device_train_batch_size=2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    assert dist.is_initialized()
    trainer = Trainer(toy.Regressor(), args=args, train_dataset=toy.regression_data(16))
    trainer.fit()
    trainer.evaluate(toy.regression_data(8))
else:  # FSDP, then the script destroys the group itself, as scripts (and kiln's own test workers) did
    cfg = toy.scenario_config(
        "plain", os.path.join(out, "run"), world=2, max_steps=3, strategy={"name": "fsdp", "device": "cpu"}
    )
    model = toy.Regressor()
    trainer = Trainer(model, cfg, train_dataset=toy.regression_data(16))
    trainer.fit()
    dist.barrier()
    dist.destroy_process_group()
