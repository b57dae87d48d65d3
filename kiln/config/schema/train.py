"""`train`: how long to train and how one optimizer step is computed, with the two sections that change how a
step's forward and backward run (`activation_checkpointing`, `torch_compile`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kiln.config.schema.fields import opt


@dataclass
class LossConfig:
    """How the training loss of a Transformers causal LM is computed."""

    chunked: bool = opt(
        False,
        "Compute the causal-LM loss from the last hidden state and the LM head chunk_size tokens at a time, inside "
        "the model's forward, never building the whole [tokens x vocabulary] logits (kiln's alternative to Liger's "
        "fused loss, on any device); the loss and gradients are the plain loss's. Training steps only: evaluation "
        "keeps the logits ([fine-tuning](fine-tuning.md#a-loss-without-the-full-logits)).",
    )
    chunk_size: int = opt(1024, "Tokens per chunk of the chunked loss (its peak memory is one chunk's logits).")


@dataclass
class TrainConfig:
    """How long to train and how one optimizer step is formed."""

    num_train_epochs: float = opt(
        3.0,
        "Epochs to train; a fraction runs part of the last epoch. 0 loads (a config for "
        "evaluate/predict) but fit() refuses it unless max_steps is set (HF trains nothing).",
    )
    max_steps: int = opt(-1, "If > 0, the number of optimizer steps; overrides num_train_epochs.")
    gradient_accumulation_steps: int = opt(1, "Micro-batches accumulated into one optimizer step.")
    max_grad_norm: float = opt(1.0, "Clip the global gradient norm to this value (0 disables).")
    gradient_checkpointing: bool = opt(
        False, "HF's switch (also activation_checkpointing: true): activation_checkpointing with mode full."
    )
    gradient_checkpointing_kwargs: Optional[Dict[str, Any]] = opt(
        None,
        "HF's checkpointing arguments: use_reentrant false (kiln's checkpointing is non-reentrant) and every_n_layers "
        "(activation_checkpointing.every); others are refused.",
    )
    torch_compile: bool = opt(False, "Compile the model with torch.compile.")
    torch_compile_backend: Optional[str] = opt(None, "torch.compile backend; setting it implies torch_compile.")
    torch_compile_mode: Optional[str] = opt(None, "torch.compile mode; setting it implies torch_compile.")
    torch_compile_optimizer_step: bool = opt(
        False,
        "Compile the optimizer step with torch.compile (train.torch_compile_backend, default inductor), as "
        "torchtitan can; independent of torch_compile. Not with optimizers that step inside backward (LOMO) or "
        "strategies whose engine steps (DeepSpeed). HF has no such key.",
    )
    ignore_data_skip: bool = opt(False, "On resume, start the epoch's data from the beginning instead of skipping.")
    label_smoothing_factor: float = opt(0.0, "Label smoothing for HF-contract classification/LM models.")
    include_num_input_tokens_seen: bool = opt(False, "Track num_input_tokens_seen in the state.")
    neftune_noise_alpha: Optional[float] = opt(
        None,
        "NEFTune: add uniform noise of size alpha / sqrt(seq_len * hidden) to the input embeddings while training.",
    )
    average_tokens_across_devices: bool = opt(
        True,
        "Normalise the loss by the items (tokens with a label) summed over all data-parallel ranks, so the "
        "gradient is that of the global mean (one scalar all-reduce per step); false: each rank's own mean, averaged.",
    )
    debug: List[str] = opt(
        [],
        "HF debug features: underflow_overflow (stop at the first inf/nan activation or weight and print the "
        "frames before it), tpu_metrics_debug (XLA strategies only).",
    )
    use_cache: Optional[bool] = opt(
        None,
        "Set the model's config.use_cache (HF's TrainingArguments default is false); unset leaves the model's own.",
    )
    torch_empty_cache_steps: Optional[int] = opt(None, "Empty the accelerator's memory cache every N optimizer steps.")
    loss: LossConfig = field(default_factory=LossConfig)
    max_nonfinite_steps: Optional[int] = opt(
        None,
        "Stop with an error once the training loss has been nan/inf for this many consecutive optimizer steps "
        "(0: never stop), before saving them; the first non-finite loss is warned about, and a checkpoint or export made "
        "after non-finite steps says so. The losses are read at log and save steps and at most every this many steps "
        "between them (one host read), so the run stops right after the last step the limit allows. Unset: 10, or 0 "
        "when the config comes in HF's dialect (a TrainingArguments, or HF's flat names only), as HF has no such limit.",
    )


@dataclass
class ActivationCheckpointingConfig:
    """Recompute activations in backward instead of keeping them (torchtitan's per-layer and per-op policies),
    on the model's repeated blocks: its `_no_split_modules` (the FSDP wrap classes under fsdp and
    model_parallel). Gradients are unchanged ([fine-tuning](fine-tuning.md#activation-checkpointing))."""

    mode: Optional[str] = opt(
        None,
        "full: a block keeps only its inputs and backward reruns its forward; selective: a block keeps the outputs "
        "of `ops` and recomputes the rest; null: off (unless train.gradient_checkpointing, which means full).",
    )
    every: int = opt(1, "Checkpoint blocks N, 2N, ... and leave the others alone (1: every block).")
    ops: Optional[List[str]] = opt(
        None,
        "selective: the operators whose outputs are kept (aten.<op>[.<overload>]); unset: torchtitan's list "
        "(matmuls, attention, max; every second matmul is recomputed).",
    )


@dataclass
class TorchCompileConfig:
    """Regional compilation: what torch.compile compiles as one region (see also train.torch_compile*).

    HF's flat `torch_compile: true` still sets train.torch_compile; a mapping under that name is this section."""

    regions: Optional[str] = opt(
        None,
        "blocks: compile each repeated block (the model's _no_split_modules, FSDP's wrap classes under fsdp and "
        "model_parallel) on its own, once for all of them, on every strategy; setting it implies compiling. Unset: "
        "the whole model (per block under fsdp and model_parallel) "
        "([fine-tuning](fine-tuning.md#regional-compilation)).",
    )
