"""Every write error ends like a full disk (issue 52, item 6): EFBIG, EDQUOT, EIO and ENOSPC, whether the
writer says so with an OSError, safetensors' "(os error N)" or torch's bare "unexpected pos", give one
sentence naming the errno and what to do, remove `.checkpoint-N.tmp`, and leave the previous checkpoint
the newest intact one. EFBIG also for real: a file-size limit (`ulimit -f`) set in a child process."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import torch

from kiln.engine.callbacks.base import Callback
from kiln.engine.checkpoint.files import is_complete, latest_checkpoint, why_damaged
from kiln.engine.checkpoint.write_errors import write_errno, write_failure
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import folders, train
from tests.world import python_path

CFG = {"max_steps": 4, "save_steps": 2}
FIXES = {
    errno.ENOSPC: "Free some space (or lower save.total_limit)",
    errno.EDQUOT: "Free some of your disk quota (or lower save.total_limit)",
    errno.EFBIG: "Raise the file-size limit (ulimit -f) or save to a file system that allows larger files",
    errno.EIO: "Check the disk or network file system (an I/O error is a device or storage fault)",
}


class Arm(Callback):
    """Turns the fault on once checkpoint-2 is written: checkpoint-4 is the write that fails."""

    armed = False

    def on_save(self, config, state, control, **kw):  # type: ignore[no-untyped-def]
        Arm.armed = state.global_step >= 2


def _torch_fails(code: int):  # type: ignore[no-untyped-def]
    real = torch.save

    def save(obj, f, *args, **kw):  # type: ignore[no-untyped-def]
        if not Arm.armed:
            return real(obj, f, *args, **kw)
        try:  # what torch.save into an open file raises: its own words, the OSError as the context
            raise OSError(code, os.strerror(code))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

    return "torch.save", save


def _safetensors_fails(code: int):  # type: ignore[no-untyped-def]
    from safetensors import torch as st

    real = st.save_file

    def save_file(tensors, filename, metadata=None):  # type: ignore[no-untyped-def]
        if Arm.armed:
            open(filename, "wb").write(b"partial")
            raise Exception(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
        return real(tensors, filename, metadata=metadata)

    return "safetensors.torch.save_file", save_file


@pytest.mark.parametrize(
    "writer, code",
    [
        *((_torch_fails, code) for code in (errno.EFBIG, errno.EDQUOT, errno.EIO, errno.ENOSPC)),
        (_safetensors_fails, errno.EDQUOT),
    ],
    ids=["torch-EFBIG", "torch-EDQUOT", "torch-EIO", "torch-ENOSPC", "safetensors-EDQUOT"],
)
def test_every_write_error_ends_like_a_full_disk(tmp_path, monkeypatch, code, writer):
    target, fake = writer(code)
    monkeypatch.setattr(target, fake)
    monkeypatch.setattr(Arm, "armed", False)
    out = str(tmp_path / "run")
    with pytest.raises(CheckpointError) as err:
        train(out, CFG, callbacks=[Arm()])
    assert str(err.value) == (
        f"{os.strerror(code)} ({errno.errorcode[code]}) while writing checkpoint-4 in {out}; the "
        f"previous checkpoint checkpoint-2 is intact. {FIXES[code]} and resume with "
        "resume_from_checkpoint=true."
    )
    assert err.value.__cause__ is None and err.value.__suppress_context__  # one sentence, not a torch traceback
    assert folders(out) == {"checkpoint-2"}  # no .checkpoint-4.tmp left behind
    ckpt = os.path.join(out, "checkpoint-2")
    assert is_complete(ckpt) and why_damaged(ckpt) is None and latest_checkpoint(out, verify=True) == ckpt


def test_other_errors_are_raised_as_they_are_and_leave_no_debris(tmp_path, monkeypatch):
    class Boom(Exception):
        pass

    real = torch.save

    def save(obj, f, *args, **kw):  # type: ignore[no-untyped-def]
        if Arm.armed:
            raise Boom("not a file-system error")
        return real(obj, f, *args, **kw)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(Arm, "armed", False)
    out = str(tmp_path / "run")
    with pytest.raises(Boom):
        train(out, CFG, callbacks=[Arm()])
    assert folders(out) == {"checkpoint-2"}


def test_the_errno_is_found_however_the_writer_reports_it(tmp_path):
    assert write_errno(OSError(errno.EDQUOT, "quota"), str(tmp_path)) == errno.EDQUOT
    assert write_errno(Exception("I/O error: File too large (os error 27)"), str(tmp_path)) == errno.EFBIG
    assert write_errno(Exception("[Errno 5] Input/output error"), str(tmp_path)) == errno.EIO
    assert write_errno(ValueError("a bug"), str(tmp_path)) is None
    assert write_errno(RuntimeError("unexpected pos 1 vs 2"), str(tmp_path)) == 0  # the file system does not say
    assert write_failure(0, "checkpoint-4", "out", None) == (
        "A write failed (the writer gave no reason) while writing checkpoint-4 in out; no earlier checkpoint exists. "
        "Fix the cause and resume with resume_from_checkpoint=true."
    )


CHILD = """
import json, os, resource, sys
from kiln.engine.callbacks.base import Callback
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import train

class Limit(Callback):  # ulimit -f, once checkpoint-2 is written: model.safetensors fits, optimizer.pt does not
    def on_save(self, config, state, control, **kw):
        if state.global_step == 2:
            size = os.path.getsize(os.path.join(config.output_dir, "checkpoint-2", "model.safetensors"))
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + 256, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

try:
    train(sys.argv[1], {"max_steps": 4, "save_steps": 2}, callbacks=[Limit()])
except CheckpointError as err:
    print("RESULT " + json.dumps(str(err)))
"""


def test_a_real_file_size_limit(tmp_path):
    """torch.save to a path says only "unexpected pos": the file system's limit names EFBIG."""
    out = str(tmp_path / "run")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": python_path(first=root)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, out], capture_output=True, text=True, cwd=root, env=env, timeout=300
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    message = json.loads(lines[0][len("RESULT ") :])
    assert message.startswith(
        f"File too large (EFBIG) while writing checkpoint-4 in {out}; the previous checkpoint "
        "checkpoint-2 is intact. Raise the file-size limit (ulimit -f)"
    ), message
    assert folders(out) == {"checkpoint-2"} and why_damaged(os.path.join(out, "checkpoint-2")) is None
