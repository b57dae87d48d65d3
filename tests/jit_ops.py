"""Where the suite's JIT-compiled C++ ops (DeepSpeed's CPU-Adam, for the optimizer-offload tests) are built:
one folder per Python environment.

torch builds them under ~/.cache/torch_extensions/py311_cpu by default, one folder for every virtual
environment of the machine, and the build command names the environment's include paths: after a run in
another environment (CI's venv beside a developer's) ninja sees a new command and rebuilds the op, 2-4
minutes of a core, inside the first test that needs it. `python -m tests.jit_ops` builds it ahead (.ci/run
starts it beside the first tests)."""

from __future__ import annotations

import hashlib
import os
import sys


def extensions_dir() -> str:
    """This environment's own build folder (torch's cache folder, one level down)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    env = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    return os.path.join(cache, "torch_extensions", f"kiln-py{sys.version_info.major}{sys.version_info.minor}-{env}")


def use_own_extensions_dir() -> None:
    """Point torch (here and in every process started from here) at this environment's folder, unless
    the caller chose one."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())


if __name__ == "__main__":
    use_own_extensions_dir()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the workers set it: the CPU accelerator's op builder
    from deepspeed.accelerator import get_accelerator

    get_accelerator().create_op_builder("CPUAdamBuilder").load()
