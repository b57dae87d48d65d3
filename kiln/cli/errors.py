"""How a command that failed ends: one line on stderr naming the problem (the full traceback only with
`--traceback`) and the exit code: 2 for an error, 130 for Ctrl-C (the shell's code for SIGINT)."""

from __future__ import annotations

import sys

from kiln.task_import import TaskError


def interrupted(err: BaseException | None = None) -> int:
    """Ctrl-C, here or on a peer rank: one line from one process."""
    from kiln.launch.environment import detect

    if detect().rank == 0:
        print(f"kiln: {err or 'interrupted'}", file=sys.stderr, flush=True)
    return 130


def by_peer_interrupt(err: BaseException) -> bool:
    """A peer's Ctrl-C broke this rank's collective (the error is then the interrupt, not a failure)."""
    from kiln.launch.worker import peer_interrupted

    return isinstance(err, RuntimeError) and peer_interrupted()


def failed(err: BaseException) -> int:
    """Print the error's one line (kiln's own sentence, or `error_line`) and, for a collective that lost its
    peer, the rank that died; under `kiln fit --nproc` a config error every rank meets alike is said once."""
    from kiln.config import ConfigError
    from kiln.launch.worker import report_failure
    from kiln.registry import UnknownNameError
    from kiln.utils.errors import KilnError

    known = isinstance(err, (ConfigError, KilnError, UnknownNameError, TaskError))
    line = f"kiln: error: {err if known else error_line(err)}"
    if not (known and report_failure(line.removeprefix("kiln: "))):
        print(line, file=sys.stderr)
    if isinstance(err, RuntimeError) and "torch.distributed" in sys.modules:
        from kiln.strategies.process_group import lost_peer_note

        note = lost_peer_note()  # a collective that lost its peer: name the rank that died
        if note:
            print(note, file=sys.stderr)
    return 2


def error_line(err: BaseException) -> str:
    """One line for an error kiln did not phrase itself: kiln's own TypeError/ValueError sentences as
    they are; anything else (raised in the user's task code, or in a library kiln called) as its type
    and first line, where in the user's code it came from, and how to see the traceback."""
    import os
    import sysconfig
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    kiln_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # kiln/, from kiln/cli/
    if (
        isinstance(err, (TypeError, ValueError))
        and frames
        and first
        and os.path.abspath(frames[-1].filename).startswith(kiln_dir)
    ):
        return first  # raised by kiln with its own sentence
    libraries = tuple(
        os.path.abspath(p) + os.sep for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    )
    user = [
        f
        for f in frames
        if not f.filename.startswith("<") and not os.path.abspath(f.filename).startswith((kiln_dir, *libraries))
    ]
    where = f" (in {user[-1].name}, {user[-1].filename}:{user[-1].lineno})" if user else ""
    what = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return f"{what}{where}; rerun with --traceback for the full traceback."
