"""The planted-payload tests' world (test_planted_payloads.py), one launch per family, on every rank:

    payload_worker.py OUT FAMILY

trains 2 steps and saves OUT/<FORMAT>/checkpoint-2 for each format of FAMILY (planting.FAMILIES);
rank 0 then plants every case (planting.prepare) and writes case -> action -> marker to
OUT/markers.json; every rank resumes OUT/cases/<CASE>/checkpoint-2 for each case and writes what each
resume raised to OUT/resumed_<rank>.json.

Resuming from a planted checkpoint must raise CheckpointError on every rank alike (all ranks read the
same shared files), so the next case starts with the process group in step."""

import json
import os
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from tests.checkpoint.planting import FAMILIES, prepare  # noqa: E402
from tests.strategies.contract.scenarios import ContractNet, config, token_data  # noqa: E402


def _ds(stage: int) -> tuple[str, dict]:
    return "deepspeed", {"deepspeed": {"zero_optimization": {"stage": stage}}}


#: format label -> (strategy, config entries)
FORMATS = {
    "single": ("single", {}),
    "ddp": ("ddp", {}),
    "fsdp-sharded": (None, {"strategy": {"name": "fsdp", "device": "cpu", "state_dict_type": "sharded"}}),
    "fsdp-full": (None, {"strategy": {"name": "fsdp", "device": "cpu", "state_dict_type": "full"}}),
    **{f"zero{s}": _ds(s) for s in range(4)},
}


def build(fmt: str, root: str, name: str, world: int, **extra):
    from kiln import Trainer

    strategy, more = FORMATS[fmt]
    cfg = config(root, name, world, **{"max_steps": 2, "save": {"strategy": "steps", "steps": 2}, **more, **extra})
    torch.manual_seed(0)
    return Trainer(ContractNet(), cfg, train_dataset=token_data(40, seed=1), strategy=strategy)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    out, family = sys.argv[1], sys.argv[2]
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    for fmt in FAMILIES[family][0]:
        build(fmt, out, fmt, world).fit()
    _barrier()  # every rank's files are written before rank 0 copies the checkpoints
    if rank == 0:
        markers = prepare(Path(out), family)
        with open(os.path.join(out, "markers.json"), "w", encoding="utf-8") as fh:
            json.dump(markers, fh)
    _barrier()
    with open(os.path.join(out, "markers.json"), encoding="utf-8") as fh:
        cases = list(json.load(fh))
    results: dict = {}
    for name in cases:
        fmt = name.split("--")[0]
        ckpt = os.path.join(out, "cases", name, "checkpoint-2")
        try:
            build(fmt, os.path.join(out, "resumed"), name, world, max_steps=3, resume_from_checkpoint=ckpt).fit()
            results[name] = None
        except Exception as err:  # noqa: BLE001 - the test reads the type and the sentence
            results[name] = f"{type(err).__name__}: {err}"
    with open(os.path.join(out, f"resumed_{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
