"""The 2-process leg of tests/checkpoint/test_lease_lost.py's lost-lease world: both ranks of a gloo world
train into URL-<variant> (a store, save.remote_dir; global rank 0 uploads) with checkpoints every 5 steps,
synchronous and then with save.async_save; at step 7 another run takes the run lock over from rank 0's
process, the lock's holder. Variant "outputs" runs as `kiln fit` does (kiln.cli.fit: fit, then save_model
and save_state under the run lock) and the lock is taken over at the end of fit, so that rank 0 meets the
lost lease uploading the exported model. Each rank writes what it raised, [type name, sentence], in
ROOT/<variant>_<RANK>.json. URL's scheme names the store (s3 or gs), ENDPOINT its test server
(store_world.py). Usage: remote_lease_worker.py ROOT URL ENDPOINT"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
RANK = int(os.environ["RANK"])

import torch.distributed as dist  # noqa: E402

from kiln.engine.callbacks.base import Callback  # noqa: E402
from kiln.engine.checkpoint.in_use import LOCK  # noqa: E402
from kiln.engine.checkpoint.lease import Lease  # noqa: E402
from kiln.engine.checkpoint.remote import RemoteCheckpoints  # noqa: E402
from tests.checkpoint.checkpoint_helpers import config, make_model, regression_data, train  # noqa: E402
from tests.checkpoint.store_world import store_options  # noqa: E402

root, url, endpoint = sys.argv[1:4]
options = store_options(endpoint, url.split("://", 1)[0])  # s3:// on moto's server, gs:// on gcs_server.py's


class TakenOver(Callback):
    """Another run, whose clock is 1000 s ahead (it sees this run's lease run out), takes the lock at step 7
    (or, `at_end`, when fit ends)."""

    def __init__(self, url: str, at_end: bool = False) -> None:
        self.url, self.at_end, self.successor = url, at_end, []

    def take(self) -> None:
        if RANK == 0:
            store = RemoteCheckpoints(self.url, options)
            lease = Lease(store.fs, f"{store.root}/{LOCK}", self.url, clock=lambda: time.time() + 1000)
            lease.take()
            self.successor.append(lease)

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == 7 and not self.at_end:
            self.take()

    def on_train_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if self.at_end:
            self.take()


def kiln_fit(out: str, cfg: dict, taker: TakenOver) -> None:
    """What `kiln fit` runs (kiln.cli.fit): fit, then the export and the state, under the run lock."""
    from kiln import Trainer
    from kiln.cli.fit import fit

    trainer = Trainer(make_model(0), config(out, **cfg), train_dataset=regression_data(), callbacks=[taker])
    fit(trainer, {})


for variant, background in (("sync", False), ("async", True), ("outputs", False)):
    taker = TakenOver(f"{url}-{variant}", at_end=variant == "outputs")
    save = {"storage_options": options, "staging_dir": os.path.join(root, variant), "async_save": background}
    try:
        if variant == "outputs":
            kiln_fit(f"{url}-{variant}", {"save": save, "max_steps": 5}, taker)
        else:
            train(f"{url}-{variant}", {"save": save}, callbacks=[taker])
        outcome = ["finished", ""]
    except Exception as err:
        outcome = [type(err).__name__, str(err)]
    finally:
        for lease in taker.successor:
            lease.release()
    with open(os.path.join(root, f"{variant}_{RANK}.json"), "w") as fh:
        json.dump(outcome, fh)
dist.destroy_process_group()
