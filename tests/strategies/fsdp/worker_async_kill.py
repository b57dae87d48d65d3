"""Asynchronous saves (`save.async`) under a real SIGKILL, one 2-process world per run.
Usage: torchrun --nproc_per_node=2 worker_async_kill.py OUT CASE MAX_STEPS MODE [VICTIM K]

Every run trains CASE to MAX_STEPS with checkpoints every 2 steps, save.async and save_total_limit 2,
into OUT/<run>/CASE. CASE (CASES) is `full_shard` (fsdp, sharded: DCP's async_save), `model_parallel_tp`
(model_parallel on a tp-2 mesh, sharded: the blocks split by tests/strategies/mesh/cases.PLAN) or
`fsdp_full` (fsdp, `state_dict_type: full`: the gathers at the step boundary, rank 0's writer thread
writes model.safetensors and optimizer.pt).

- `kill VICTIM K`: trains into OUT/run with resume_from_checkpoint="if_exists". Rank VICTIM kills itself
  with SIGKILL right before the K-th file-system step of its background writes, counted from the start of
  the run: DCP's shard write and its .metadata, the weights and optimizer files of a full checkpoint, each
  fsync, rename and replace, and each removal (rotation), on DCP's thread, kiln's checkpoint thread or its
  fsync pool. Every kill lands at a known step of a background write, from the same trigger as the real
  write, with no environment variable and no delay. The other rank is left alone: what it does until its
  peer's death stops it is part of what the test checks.
- `trace`: the same run into OUT/trace, not killed; each rank writes OUT/trace-<rank>.txt, its counted
  steps in order (`thread op path`): what K counts.
- `final [sigterm]`: resumes OUT/run to the end, then trains an uninterrupted run in OUT/straight; with
  `sigterm`, also a run into OUT/preempted whose rank 1 alone gets SIGTERM in step 3 while checkpoint-2's
  write is held in flight on rank 0 until its step 3 has ended (a sharded case's in DCP's coordinator,
  before `.metadata`; `fsdp_full`'s on kiln's writer thread, before model.safetensors), then that run
  resumed to the end. Rank 0 writes OUT/final.pt: the final
  weights, and for `sigterm` whether checkpoint-2 was complete at the end of step 3 and whether
  checkpoint-2 and -3 were complete when the run said it was preempted (as each rank saw them), and the
  checkpoint its resumed run loaded.

Rank 0 of each run into OUT/run appends `<MODE and arguments> <checkpoint it loaded, or fresh>` to
OUT/resumes.log when training begins; the victim appends the step it dies at (`kill-VICTIM-K thread op
path`) to OUT/kills.log."""

import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint import filesystem  # noqa: E402

from kiln import Callback  # noqa: E402
from kiln.engine.checkpoint import manager as checkpoint  # noqa: E402
from kiln.engine.checkpoint.files import is_complete  # noqa: E402
from kiln.engine.loop.preemption import Preemption  # noqa: E402
from kiln.strategies.mesh import checkpoint_io  # noqa: E402
from tests.strategies.fsdp import cases  # noqa: E402
from tests.strategies.mesh.cases import PLAN  # noqa: E402

#: case -> its strategy
CASES = {
    "full_shard": {**cases.FSDP, "state_dict_type": "sharded"},
    "model_parallel_tp": {**cases.FSDP, "name": "model_parallel", "mesh": {"tp": 2}, "tp_plan": PLAN},
    "fsdp_full": {**cases.FSDP, "state_dict_type": "full"},
}
out, case, max_steps, mode, rest = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
rank = int(os.environ["RANK"])
SAVE = {"strategy": "steps", "steps": 2, "async": True, "total_limit": 2}
EXTRA = {"max_steps": max_steps, "strategy": CASES[case]}
BACKGROUND = ("kiln-checkpoint-", "kiln-fsync", "AsyncCheckpointExecutor")


def _count_background_steps(at_step: Callable[[str, str], None]) -> None:
    """Call `at_step(op, what)` right before each file-system step a background thread takes."""
    lock = threading.Lock()

    def counted(op: str, fn: Callable[..., Any], arg: int = 0) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            what = getattr(args[arg], "path", args[arg])  # DCP's writer: its folder; an fsync: the descriptor
            if threading.current_thread().name.startswith(BACKGROUND) and isinstance(what, (int, str, os.PathLike)):
                with lock:
                    at_step(op, str(what) if isinstance(what, int) else os.path.relpath(str(what), out))
            return fn(*args, **kwargs)

        return step

    os.fsync, os.rename, os.replace = (
        counted("fsync", os.fsync),
        counted("rename", os.rename),
        counted("replace", os.replace),
    )
    shutil.rmtree = counted("rmtree", shutil.rmtree)
    writer = filesystem._FileSystemWriter
    writer.write_data = counted("write_data", writer.write_data)  # this rank's shards
    writer.finish = counted("finish", writer.finish)  # the coordinator's .metadata
    # a full checkpoint's files (fsdp_full), by rank 0's writer thread: the weights' folder, optimizer.pt
    checkpoint_io.save_weights = counted("save_weights", checkpoint_io.save_weights, arg=1)
    torch.save = counted("torch.save", torch.save, arg=1)  # to a file (DCP's to its streams are not counted)


class Resumed(Callback):
    """Logs which checkpoint the run loaded (seen by CheckpointManager.load) when training begins."""

    def __init__(self, log: bool) -> None:
        self.loaded, self.log = "fresh", log

    def on_train_begin(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
        if rank == 0 and self.log:
            with open(os.path.join(out, "resumes.log"), "a") as fh:
                fh.write(f"{'-'.join(sys.argv[4:])} {self.loaded}\n")


def case_trainer(root: str, save: dict[str, Any]) -> Any:
    """CASE trained into `root`/CASE."""
    return cases.trainer_for("full_shard", root, 2, save=save, output_dir=os.path.join(root, case), **EXTRA)


def trainer(root: str, **save: Any) -> Any:
    """A run into `root`; one into OUT/run logs the checkpoint it loads to OUT/resumes.log."""
    resumed = Resumed(log=os.path.basename(root) == "run")
    load = checkpoint.CheckpointManager.load

    def recording_load(self: Any, path: str) -> Any:
        resumed.loaded = os.path.basename(path)
        return load(self, path)

    checkpoint.CheckpointManager.load = recording_load  # type: ignore[method-assign]
    t = case_trainer(root, {**SAVE, **save})
    t.add_callback(resumed)
    t.resumed = resumed
    return t


def hold_checkpoint_2(release: threading.Event) -> Callable[[], None]:
    """Hold checkpoint-2's background write on rank 0 until `release` is set; returns what undoes it. A
    sharded case's (DCP's async_save) is held in its coordinator's `finish`, before `.metadata`, on DCP's
    thread; `fsdp_full`'s before model.safetensors, on kiln's writer thread (rank 1 writes nothing there)."""
    held = ".checkpoint-2.tmp"
    if case == "fsdp_full":
        save_weights = checkpoint_io.save_weights

        def held_weights(weights: Any, directory: str, *args: Any, **kwargs: Any) -> Any:
            if os.path.basename(directory) == held:
                assert release.wait(120), "step 3 never ended"
            return save_weights(weights, directory, *args, **kwargs)

        checkpoint_io.save_weights = held_weights

        def undo() -> None:
            checkpoint_io.save_weights = save_weights

        return undo
    finish = filesystem._FileSystemWriter.finish

    def held_finish(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.path.parent.name == held:
            assert release.wait(120), "step 3 never ended"
        return finish(self, *args, **kwargs)

    filesystem._FileSystemWriter.finish = held_finish

    def undo_finish() -> None:
        filesystem._FileSystemWriter.finish = finish

    return undo_finish


def preempted_run(result: dict) -> None:
    """SIGTERM to rank 1 alone in step 3 while checkpoint-2's write is in flight (held on rank 0)."""
    run = os.path.join(out, "preempted")
    folder = os.path.join(run, case)
    release = threading.Event()

    class SigtermInStep3(Callback):
        def on_step_begin(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step + 1 == 3 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_step_end(self, config: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 3 and rank == 0:
                result["in_flight_at_step_3"] = not is_complete(os.path.join(folder, "checkpoint-2"))
                release.set()

    stop = Preemption.stop

    def recorded_stop(self: Any, step: int) -> None:
        complete = [is_complete(os.path.join(folder, f"checkpoint-{s}")) for s in (2, 3)]
        seen: list[Any] = [None] * dist.get_world_size()  # as each rank saw them (every rank stops here)
        dist.all_gather_object(seen, complete)
        result["complete_when_preempted"] = seen
        result["preempted_at"] = step
        stop(self, step)

    undo = hold_checkpoint_2(release)
    Preemption.stop = recorded_stop  # type: ignore[method-assign]
    if rank == 1:
        release.set()  # only rank 0's write is held
    preempted = trainer(run, on_preemption=True)
    preempted.add_callback(SigtermInStep3())
    preempted.fit()
    undo()
    Preemption.stop = stop  # type: ignore[method-assign]
    resumed = trainer(run)
    resumed.fit(resume_from_checkpoint="if_exists")
    result["preempted"], result["preempted_resumed_from"] = cases.full_weights(resumed), resumed.resumed.loaded


if mode == "kill":
    victim, kill_at, seen = int(rest[0]), int(rest[1]), [0]

    def kill(op: str, what: str) -> None:
        seen[0] += 1
        if seen[0] == kill_at:
            with open(os.path.join(out, "kills.log"), "a") as fh:  # what the kill point hit, for the record
                fh.write(f"kill-{victim}-{kill_at} {threading.current_thread().name} {op} {what}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    if rank == victim:
        _count_background_steps(kill)
    trainer(os.path.join(out, "run")).fit(resume_from_checkpoint="if_exists")
    raise SystemExit(f"rank {victim} was not killed: its background writes took fewer than {kill_at} steps")

if mode == "trace":
    trace: list[str] = []
    _count_background_steps(lambda op, what: trace.append(f"{threading.current_thread().name} {op} {what}"))
    trainer(os.path.join(out, "trace")).fit()
    with open(os.path.join(out, f"trace-{rank}.txt"), "w") as fh:
        fh.write("\n".join(trace) + "\n")
else:
    result: dict = {}
    resumed = trainer(os.path.join(out, "run"))
    resumed.fit(resume_from_checkpoint="if_exists")
    result["resumed"] = cases.full_weights(resumed)
    straight = case_trainer(os.path.join(out, "straight"), SAVE)
    straight.fit()
    result["straight"] = cases.full_weights(straight)
    if rest == ["sigterm"]:
        preempted_run(result)
    if rank == 0:
        torch.save(result, os.path.join(out, "final.pt"))
dist.barrier()
dist.destroy_process_group()
