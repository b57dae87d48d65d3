"""The name of an output_dir's run lock, the error of a refused run and the files a finished run
leaves: shared by the local output_dir (output_dir.py) and its object-store form (remote.py)."""

from __future__ import annotations

from kiln.utils.errors import KilnError

LOCK = ".kiln-run.lock"
#: files a finished run leaves at the top of output_dir (kiln's export and HF's save_model)
FINISHED_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "trainer_state.json",
)


class OutputDirInUse(KilnError):
    """Another live process holds the output_dir's run lock."""
