"""`save`: when and how checkpoints are written, and where they are uploaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from kiln.config.schema.fields import opt


@dataclass
class SaveConfig:
    """Checkpoints."""

    strategy: str = opt("steps", "When to save: no, steps, epoch or best.")
    steps: float = opt(500, "Steps between saves (int, or a ratio < 1 of total steps).")
    total_limit: Optional[int] = opt(None, "Keep at most this many checkpoints (the best one is always kept).")
    only_model: bool = opt(False, "Save only the weights (such checkpoints cannot be resumed).")
    safetensors: bool = opt(True, "Save weights as safetensors.")
    on_each_node: bool = opt(False, "Save on every node's local rank 0, not only on global rank 0.")
    restore_callback_states_from_checkpoint: bool = opt(
        False,
        "On resume, also rebuild ExportableState callbacks from their saved args (their counters are always restored).",
    )
    on_preemption: bool = opt(
        False,
        "On SIGTERM, save a checkpoint at the next step boundary on every rank and stop: fit() returns, kiln fit "
        "exits 0 (enable_jit_checkpoint).",
    )
    signing_key_env: Optional[str] = opt(
        None,
        "Name of an environment variable holding a secret key: each checkpoint's COMPLETE marker is signed "
        "(HMAC-SHA256 over its checksums), and resume, kiln convert, evaluate and predict accept only checkpoints whose "
        "signature verifies with it. For checkpoints stored where others can write.",
    )
    async_save: bool = opt(
        False,
        "Write checkpoints in the background (also spelled save.async): the state is staged in host memory at the "
        "step boundary and training goes on while a writer thread writes it; COMPLETE is still written last, one save "
        "is in flight at a time, and the next save, the end of fit and a preemption wait for it. The full-state format "
        "(single device, DDP) and FSDP / model_parallel's formats (sharded: DCP's async_save; state_dict_type full: "
        "gathered at the step boundary) write in the background; the others (DeepSpeed, XLA, PEFT adapters) save "
        "synchronously, with one log line.",
    )
    remote_dir: Optional[str] = opt(
        None,
        "An fsspec URL (s3://bucket/run, gs://..., memory://...) each checkpoint is uploaded to once it is complete in "
        "output_dir, its COMPLETE marker last; rotation and resume then work on the store. Set by kiln from an "
        "output_dir URL, whose local folder becomes output_dir; set it yourself to keep the local copy in a folder "
        "of your choice.",
    )
    staging_dir: Optional[str] = opt(
        None,
        "The local folder a run whose output_dir is a URL writes into before uploading (default: a folder for that "
        "URL under the system's temporary folder, the same on every run, so a restarted job reuses what it "
        "downloaded). It needs room for save.total_limit checkpoints.",
    )
    storage_options: Dict[str, Any] = opt(
        {},
        "Options for the store's fsspec file system (s3fs: endpoint_url in client_kwargs, key/secret, profile; gcsfs: "
        "project, token). Unset, the store's own configuration is used (AWS_* variables, ~/.aws, gcloud). Keys naming "
        "secrets (key, secret, token, password, ...) are never written to saved configs or trackers.",
    )
