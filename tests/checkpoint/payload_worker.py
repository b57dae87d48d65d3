"""Checkpoints for the planted-payload tests (test_planted_payloads.py), on every rank.

    payload_worker.py OUT save FORMAT...   train 2 steps, save OUT/<FORMAT>/checkpoint-2
    payload_worker.py OUT resume CASE...   resume OUT/cases/<CASE>/checkpoint-2 (CASE is "<FORMAT>--<label>"),
                                           write what each resume raised to OUT/resumed_<rank>.json

Resuming from a planted checkpoint must raise CheckpointError on every rank alike (all ranks read the
same shared files), so the next case starts with the process group in step."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

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


def main() -> None:
    out, mode, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    results: dict = {}
    for name in names:
        fmt = name.split("--")[0]
        if mode == "save":
            build(fmt, out, fmt, world).fit()
            continue
        ckpt = os.path.join(out, "cases", name, "checkpoint-2")
        try:
            build(fmt, os.path.join(out, "resumed"), name, world, max_steps=3, resume_from_checkpoint=ckpt).fit()
            results[name] = None
        except Exception as err:  # noqa: BLE001 - the test reads the type and the sentence
            results[name] = f"{type(err).__name__}: {err}"
    if mode == "resume":
        with open(os.path.join(out, f"resumed_{rank}.json"), "w", encoding="utf-8") as fh:
            json.dump(results, fh)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
