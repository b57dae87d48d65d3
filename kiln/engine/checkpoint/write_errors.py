"""A checkpoint write that fails on the file system (a full disk, a file-size limit, a quota, an I/O
error, ...) ends the same way whatever the errno: the temporary folder is removed, the previous
checkpoints are untouched, and one sentence names the errno and what to do.

The writers report the errno differently: Python's OSError carries it, safetensors says "(os error
27)", and `torch.save` to a path only says "unexpected pos" (to an open file, the OSError is its
context). Where none says, the file system is asked: nearly no space left means ENOSPC, a file-size
limit (`ulimit -f`) that a written file reached means EFBIG."""

from __future__ import annotations

import errno
import os
import re
import shutil

_OS_ERROR = re.compile(r"\(os error (\d+)\)")
#: what the writers say without an errno: the OS's own words, or torch's "the stream fell short"
_TEXTS = {os.strerror(code): code for code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO)}
_TORCH_SHORT_WRITE = ("unexpected pos", "iostream error")
_FIXES = {
    errno.ENOSPC: "Free some space (or lower save.total_limit)",
    errno.EDQUOT: "Free some of your disk quota (or lower save.total_limit)",
    errno.EFBIG: "Raise the file-size limit (ulimit -f) or save to a file system that allows larger files",
    errno.EIO: "Check the disk or network file system (an I/O error is a device or storage fault)",
}


def write_errno(err: BaseException, directory: str) -> int | None:
    """The errno of a failed checkpoint write (0: a writer's short write whose cause the file system does
    not show), or None when `err` is no file-system failure (a bug, a refusal of kiln's own: those are
    raised as they are)."""
    seen: BaseException | None = err
    short_write = False
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        text = str(seen)
        if match := _OS_ERROR.search(text):
            return int(match.group(1))
        for words, code in _TEXTS.items():
            if words in text:
                return code
        short_write = short_write or any(words in text for words in _TORCH_SHORT_WRITE)
        seen = seen.__cause__ or seen.__context__
    return (_ask_file_system(directory) or 0) if short_write else None


def _ask_file_system(directory: str) -> int | None:
    """ENOSPC or EFBIG when the file system shows it; None when it does not say."""
    import resource

    try:
        if shutil.disk_usage(directory).free < (16 << 20):
            return errno.ENOSPC
    except OSError:
        pass
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        sizes = (os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(directory) for n in names)
        if any(size >= limit for size in sizes):
            return errno.EFBIG
    return None


def disk_full(err: BaseException, directory: str) -> bool:
    """Whether a failed write ran out of disk space."""
    return write_errno(err, directory) == errno.ENOSPC


def write_failure(code: int, checkpoint: str, out: str, previous: str | None) -> str:
    """The one sentence for a checkpoint write that failed with `code` (0: the writer gave no reason)."""
    what = (
        f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
        if code
        else "A write failed (the writer gave no reason)"
    )
    kept = (
        f"the previous checkpoint {os.path.basename(previous)} is intact"
        if previous
        else "no earlier checkpoint exists"
    )
    fix = _FIXES.get(code, "Fix the cause") if code else "Fix the cause"
    return f"{what} while writing {checkpoint} in {out}; {kept}. {fix} and resume with resume_from_checkpoint=true."
