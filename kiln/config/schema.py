"""The typed config tree. Every group is a dataclass whose fields carry a `help` text; the CLI's
`--help` and docs/config.md are generated from these. Defaults follow Hugging Face
`TrainingArguments` so that an HF user's numbers mean the same thing here."""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


def opt(default: Any, help: str) -> Any:
    """A dataclass field with a help text (mutable defaults are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(type(default), default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


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
class PackingConfig:
    """Packing: several examples per row, each with its own positions and attention (TRL's packing)."""

    strategy: Optional[str] = opt(
        None,
        "How training examples become rows of max_length tokens: bfd (best-fit decreasing: whole examples, one "
        "longer than max_length cut to it), bfd_split (the same, an overlong example split into max_length pieces), "
        "wrapped (concatenated in order and cut every max_length tokens; a piece continuing in the next row starts "
        "there at position 0, as a new example); null: examples are not packed. Attention and positions restart at "
        "every example, and no token is trained to predict the next example's first token "
        "([fine-tuning](fine-tuning.md#packing)).",
    )
    max_length: int = opt(1024, "Tokens per packed row (TRL's max_length).")
    padding_free: Optional[bool] = opt(
        None,
        "Concatenate each micro-batch (its packed rows, or its examples when strategy is null) into one row "
        "without padding; false: rows are padded to the longest row of the micro-batch. Unset: true with "
        "flash-attention implementations (varlen kernels), false with sdpa, eager and flex_attention (whose masks "
        "grow with the square of a row's tokens).",
    )


@dataclass
class DataConfig:
    """Dataloaders."""

    per_device_train_batch_size: int = opt(8, "Training batch size per process.")
    per_device_eval_batch_size: int = opt(8, "Evaluation batch size per process.")
    dataloader_num_workers: int = opt(0, "Worker processes per dataloader (0 loads in the main process).")
    dataloader_pin_memory: bool = opt(True, "Pin host memory (only has an effect with an accelerator).")
    dataloader_drop_last: bool = opt(False, "Drop the last incomplete batch.")
    dataloader_persistent_workers: bool = opt(False, "Keep workers alive between epochs.")
    dataloader_prefetch_factor: Optional[int] = opt(None, "Batches each worker loads ahead.")
    auto_find_batch_size: bool = opt(
        False,
        "Before training, lower per_device_train_batch_size by 10% steps until the first step fits in memory; a later "
        "out-of-memory error (one process) in a step's forward/backward redoes the step with smaller micro-batches and more "
        "accumulation; elsewhere (optimizer step, callbacks) it restarts training 10% smaller, as HF does.",
    )
    group_by_length: bool = opt(False, "Group samples of similar length into batches (less padding).")
    length_column_name: str = opt("length", "Key holding precomputed lengths for group_by_length.")
    remove_unused_columns: bool = opt(True, "Drop batch keys the model's forward() does not accept (HF models).")
    label_names: Optional[List[str]] = opt(None, "Batch keys that hold labels (default: 'labels'-like keys).")
    split_batches: bool = opt(
        False,
        "The configured batch sizes are global: each of the N data-parallel ranks gets batch_size / N "
        "(which must divide evenly).",
    )
    dispatch_batches: bool = opt(
        False,
        "Rank 0 alone iterates the training data and sends every rank its slice of each global batch "
        "(for streaming datasets that cannot shard themselves).",
    )
    even_batches: bool = opt(
        True,
        "Pad every rank's shard with samples from the start so that all ranks get equal batches; false: no "
        "sample is repeated and the last global batch is smaller instead.",
    )
    use_seedable_sampler: bool = opt(
        True,
        "Shuffle with an order that depends only on (data_seed, epoch), the same on every rank "
        "(kiln's sampler always is; false is refused because resume could not reproduce the order).",
    )
    dataloader_multiprocessing_context: Optional[str] = opt(
        None, "Start method of the worker processes: fork, spawn or forkserver."
    )
    dataloader_in_order: bool = opt(True, "Yield batches in order; false yields each as soon as a worker has it.")
    packing: PackingConfig = field(default_factory=PackingConfig)


def hf_default_optimizer() -> str:
    """HF's default `optim` (transformers 5, `TrainingArguments.optim`): the fused AdamW kernel on torch >= 2.8,
    `adamw_torch` before. The version comes from torch when it is imported, else from the installed metadata
    (the config does not import torch)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        installed = str(torch.__version__)
    else:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("torch")
        except PackageNotFoundError:
            return "adamw_torch"
    try:
        major, minor = (int(part) for part in re.findall(r"\d+", installed)[:2])
    except ValueError:  # not two numbers
        return "adamw_torch"
    return "adamw_torch_fused" if (major, minor) >= (2, 8) else "adamw_torch"


@dataclass
class OptimConfig:
    """The optimizer (names as HF's `optim`)."""

    name: str = opt(
        hf_default_optimizer(),
        "Optimizer name, e.g. adamw_torch, adamw_torch_fused, sgd, adafactor. "
        "Default as HF's: adamw_torch_fused on torch >= 2.8 (adamw_torch before; on a device without "
        "fused kernels, such as XLA, it steps with adamw_torch's).",
    )
    lr: float = opt(5e-5, "Peak learning rate.")
    weight_decay: float = opt(
        0.0,
        "Decoupled weight decay; never applied to biases and norm weights. The optimizer has "
        "HF's two param groups whatever the decay (decayed weights, then biases and norm weights), "
        "so either Trainer resumes the other's checkpoints; while their settings are equal a step "
        "runs them as one group ([checkpoints](checkpoints.md#optimizer-param-groups)).",
    )
    adam_beta1: float = opt(0.9, "Adam beta1.")
    adam_beta2: float = opt(0.999, "Adam beta2.")
    adam_epsilon: float = opt(1e-8, "Adam epsilon.")
    optim_args: Optional[str] = opt(None, "Extra optimizer arguments, 'key=value,key=value'.")
    target_modules: Any = opt(
        None,
        "GaLore/APOLLO: module names (a list, or one regex) whose 2-D weights get the low-rank optimizer "
        "(optim_target_modules).",
    )


@dataclass
class SchedulerConfig:
    """The learning-rate schedule (names as HF's `lr_scheduler_type`)."""

    name: str = opt("linear", "Schedule name, e.g. linear, cosine, constant_with_warmup, warmup_stable_decay.")
    warmup_steps: int = opt(0, "Linear warmup steps; overrides warmup_ratio when > 0.")
    warmup_ratio: float = opt(0.0, "Fraction of total steps used for linear warmup.")
    kwargs: Dict[str, Any] = opt({}, "Extra schedule arguments (lr_scheduler_kwargs).")


@dataclass
class EvalConfig:
    """Evaluation during and after training."""

    strategy: str = opt("no", "When to evaluate during training: no, steps or epoch.")
    steps: Optional[float] = opt(
        None, "Steps between evaluations (int, or a ratio < 1 of total steps); default logging steps."
    )
    delay: float = opt(0, "Epochs or steps to wait before the first evaluation.")
    on_start: bool = opt(False, "Evaluate once before training starts (sanity check).")
    accumulation_steps: Optional[int] = opt(None, "Move accumulated predictions to CPU every N eval steps.")
    prediction_loss_only: bool = opt(False, "Only compute the loss in evaluate/predict.")
    include_inputs_for_metrics: bool = opt(False, "Pass the inputs to compute_metrics (EvalPrediction.inputs).")
    do_concat_batches: bool = opt(True, "Concatenate per-batch predictions (False keeps a list per batch).")
    batch_eval_metrics: bool = opt(False, "Call compute_metrics per batch with compute_result.")
    padding_index: int = opt(-100, "Value used to pad predictions of different lengths.")
    compile: bool = opt(
        False,
        "Run the evaluation/prediction forward through torch.compile, with train.torch_compile_backend and "
        "torch_compile_mode (jit_mode_eval: HF's TorchScript tracing, which PyTorch deprecated).",
    )
    use_gather_object: bool = opt(
        False,
        "Gather outputs across ranks as Python objects (all_gather_object), for predictions that are not "
        "tensors (e.g. decoded strings); slower, opt-in (eval_use_gather_object).",
    )
    metric_for_best_model: Optional[str] = opt(None, "Metric that picks the best checkpoint (with or without 'eval_').")
    greater_is_better: Optional[bool] = opt(None, "Whether a larger metric is better (HF default by metric name).")
    load_best_model_at_end: bool = opt(False, "Restore the best checkpoint's weights when training ends.")
    predict_with_generate: bool = opt(False, "Use model.generate() for predictions (seq2seq).")
    generation_max_length: Optional[int] = opt(None, "max_length for generate().")
    generation_num_beams: Optional[int] = opt(None, "num_beams for generate().")
    generation_kwargs: Dict[str, Any] = opt({}, "Other generate() keyword arguments.")


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
        "(single device, DDP) and FSDP / model_parallel's sharded format (DCP's async_save) write in the background; "
        "the others (state_dict_type full, DeepSpeed, XLA, PEFT adapters) save synchronously, with one log line.",
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


@dataclass
class LogConfig:
    """Logging, progress and trackers."""

    strategy: str = opt("steps", "When to log: no, steps or epoch.")
    steps: float = opt(500, "Steps between logs (int, or a ratio < 1 of total steps).")
    first_step: bool = opt(False, "Also log the first optimizer step.")
    nan_inf_filter: bool = opt(
        True,
        "Replace a nan/inf step loss by the window's mean in the logs, and leave nan/inf "
        "batches out of eval_loss (HF's logging_nan_inf_filter); see nonfinite_window for a "
        "window without a finite loss.",
    )
    nonfinite_window: Optional[str] = opt(
        None,
        "The logged loss of a window whose every step had a nan/inf loss, and train_loss of a run without a finite "
        "one, under nan_inf_filter: 'nan' (kiln: there is no finite loss to stand in with) or 'filtered' (HF: the "
        "filter's stand-in, 0.0). Unset: 'filtered' when the config comes in HF's dialect (see "
        "train.max_nonfinite_steps), else 'nan'.",
    )
    report_to: List[str] = opt(
        ["none"],
        "Trackers: tensorboard, mlflow, wandb, comet_ml, clearml, dvclive, aim, trackio, "
        "swanlab, codecarbon, neptune, csv, jsonl, all or none.",
    )
    logging_dir: Optional[str] = opt(
        None,
        "Run files (metrics.csv/jsonl; default output_dir/runs) and TensorBoard events (default output_dir/runs/<date>_<host>).",
    )
    level: str = opt("passive", "Log level on the main process: debug, info, warning, error, critical, passive.")
    level_replica: str = opt("warning", "Log level on the other processes.")
    on_each_node: bool = opt(True, "Apply `level` on each node's main process, not only node 0.")
    disable_tqdm: Optional[bool] = opt(None, "Disable the progress bar.")
    model_summary: str = opt(
        "auto",
        "What fit prints about the model when it starts, on the main process: table (a line, "
        "then Lightning's ModelSummary table: name, type, parameters, trainable, size per module), "
        "line, off, or auto: the table on one process, the line with several.",
    )
    model_summary_depth: int = opt(
        1,
        "Module depth of the summary table's rows (Lightning's max_depth): 1 the model's "
        "top-level modules, 2 their children too, -1 every module.",
    )
    skip_memory_metrics: bool = opt(True, "Skip memory metrics (they slow training).")
    include_tokens_per_second: bool = opt(False, "Report tokens per second.")
    mfu_peak_tflops: Optional[float] = opt(
        None,
        "Peak TFLOP/s of one device, for the logged mfu; unset: the table's figure for the GPU and precision "
        "(H100, H200, A100, L4, MI300), none on the CPU.",
    )
    history: Optional[List[str]] = opt(
        None,
        "Local history files (csv, jsonl) written to logging_dir, default output_dir/runs. "
        "Unset: csv and jsonl, except with report_to none (HF's default), which writes "
        "nothing there, as HF does; [] for none.",
    )
    project: Optional[str] = opt(
        None,
        "Tracker project: W&B, Comet, ClearML, Trackio, SwanLab project, MLflow or Aim "
        "experiment (default WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME / COMET_PROJECT_NAME / "
        "CLEARML_PROJECT, then 'kiln').",
    )
    log_artifacts: Optional[str] = opt(
        None,
        "Upload the model to trackers: false, end or checkpoint (default HF_MLFLOW_LOG_ARTIFACTS / WANDB_LOG_MODEL).",
    )
    nested_run: Optional[bool] = opt(
        None, "MLflow: open the run as a child of the caller's active run (default MLFLOW_NESTED_RUN)."
    )


@dataclass
class StrategyConfig:
    """How the model is placed and replicated. `name` picks the class; the other fields are its options."""

    name: str = opt("auto", "single, ddp, fsdp, model_parallel, deepspeed, xla, xla_fsdp, mps or auto.")
    device: Optional[str] = opt(None, "Device for the single strategy (cpu, cuda, cuda:1); default the best available.")
    backend: Optional[str] = opt(None, "torch.distributed backend (nccl, gloo, ...); default by device.")
    timeout: int = opt(1800, "Seconds before a collective times out (ddp_timeout).")
    find_unused_parameters: Optional[bool] = opt(
        None, "DDP find_unused_parameters; unset: on only if the first step leaves a parameter without a gradient."
    )
    bucket_cap_mb: Optional[int] = opt(None, "DDP bucket size in MB.")
    broadcast_buffers: Optional[bool] = opt(None, "DDP broadcast_buffers.")
    static_graph: bool = opt(False, "DDP static_graph.")
    options: Dict[str, Any] = opt({}, "Further strategy-specific options (FSDP, model_parallel, DeepSpeed, XLA).")


@dataclass
class Float8Config:
    """float8 training through torchao (`precision: fp8`, needs `pip install 'kiln[float8]'`)."""

    recipe: str = opt(
        "tensorwise",
        "torchao's scaling recipe: tensorwise (fastest), rowwise (more accurate) or rowwise_with_gw_hp "
        "(rowwise, the weight gradient in high precision).",
    )
    exclude: List[str] = opt(
        ["lm_head"],
        "Linear layers left in high precision: a run of name parts (lm_head, layers.0) or a glob over the "
        "qualified name (*.mlp.*). Layers whose dimensions are not multiples of 16 are always left.",
    )
    emulate: bool = opt(
        False,
        "Emulate float8 matmuls in high precision (same numbers, no speed-up); required where the hardware "
        "has none (the CPU, GPUs below compute capability 8.9).",
    )
    fsdp_float8_all_gather: Optional[bool] = opt(
        None,
        "Under FSDP, cast each weight shard to float8 before the all-gather (half of bf16's traffic, and the "
        "weight rounded once, from fp32). tensorwise only; unset: on for tensorwise.",
    )


@dataclass
class MXFP8Config:
    """MXFP8 training through torchao (`precision: mxfp8`, needs `pip install 'kiln[float8]'`): float8 values in
    blocks of 32 that share a power-of-two scale."""

    recipe: str = opt(
        "rceil", "torchao's recipe: rceil, or rceil_wgrad_with_hp (the weight gradient in high precision)."
    )
    exclude: List[str] = opt(
        ["lm_head"],
        "Linear layers left in high precision, named as for precision.fp8.exclude. Layers whose dimensions "
        "are not multiples of 32 are always left.",
    )
    emulate: bool = opt(
        False,
        "Emulate MXFP8 matmuls in high precision (same numbers, no speed-up); required where the hardware has "
        "none (the CPU, GPUs below compute capability 10.0).",
    )


@dataclass
class PrecisionConfig:
    """Numeric precision. `name` picks the plugin."""

    name: str = opt("fp32", "fp32, fp16, bf16, fp16-true, bf16-true, tf32, apex, fp8 or mxfp8.")
    tf32: Optional[bool] = opt(None, "Allow TF32 matmuls on Ampere+ GPUs (combinable with any plugin).")
    fp16_opt_level: str = opt("O1", "Apex AMP optimisation level O0-O3.")
    half_precision_backend: str = opt("auto", "auto, cpu_amp, cuda_amp or apex.")
    full_eval: Optional[str] = opt(None, "Run evaluation with the model cast to fp16 or bf16.")
    fp8: Float8Config = field(default_factory=Float8Config)
    mxfp8: MXFP8Config = field(default_factory=MXFP8Config)


@dataclass
class TaskConfig:
    """What to train, by import path (used by the CLI; the Python API passes objects instead)."""

    model: Optional[str] = opt(None, "'package.module:callable' returning the model.")
    model_args: Dict[str, Any] = opt({}, "Keyword arguments for the model callable.")
    data: Optional[str] = opt(None, "'package.module:callable' returning a dict with train_dataset, eval_dataset, ...")
    data_args: Dict[str, Any] = opt({}, "Keyword arguments for the data callable.")


@dataclass
class LauncherConfig:
    """What starts the processes when `kiln fit` runs this config (the command line's `--nproc` / `--ray`
    do the same without a config key). Empty: this process trains, or the launcher that started it
    (torchrun, srun, accelerate launch) decides."""

    name: Optional[str] = opt(
        None, "ray: train in Ray Train workers (a TorchTrainer); unset: no launcher of kiln's own."
    )
    num_workers: int = opt(1, "ray: the number of training workers (processes), like --nproc.")
    resources_per_worker: Dict[str, Any] = opt(
        {},
        "ray: Ray resources each worker asks for, e.g. {CPU: 2} or {GPU: 1} (a GPU makes Ray use NCCL); default 1 CPU.",
    )
    address: Optional[str] = opt(
        None,
        "ray: the cluster to join ('auto', or ray://host:port); unset: start a local Ray "
        "instance on this machine for this run.",
    )
    max_failures: int = opt(
        0,
        "ray: restart the workers up to this many times when one fails (Ray's FailureConfig); each "
        "restart resumes from the newest checkpoint reported to Ray.",
    )
    storage_path: Optional[str] = opt(
        None, "ray: where Ray keeps its copies of the checkpoints and the run's state (default output_dir/ray_results)."
    )
    num_to_keep: Optional[int] = opt(
        None, "ray: checkpoints Ray keeps in storage_path (CheckpointConfig.num_to_keep); unset: all."
    )
    checkpoint_score_attribute: Optional[str] = opt(
        None,
        "ray: the reported metric (e.g. eval_loss) that ranks checkpoints for num_to_keep and Result.best_checkpoints; "
        "unset: the newest are kept.",
    )
    checkpoint_score_order: str = opt("min", "ray: min or max: which checkpoint_score_attribute value is best.")


@dataclass
class ProfileConfig:
    """torch.profiler over chosen optimizer steps, a trace per rank under output_dir/profiles (TensorBoard's
    profiler plugin and chrome://tracing / Perfetto open it). accelerate's ProfileKwargs names are accepted."""

    active: int = opt(0, "Optimizer steps recorded per cycle; 0: no profiler (`kiln fit --profile` records 3).")
    wait: int = opt(1, "Steps skipped at the start of each cycle.")
    warmup: int = opt(1, "Steps profiled but discarded before the active ones (the profiler's own start-up cost).")
    repeat: int = opt(1, "Cycles of wait + warmup + active; 0: cycle until training ends.")
    skip_first: int = opt(0, "Steps skipped once, before the first cycle.")
    ranks: Optional[List[int]] = opt(None, "Global ranks that profile; unset: every rank.")
    activities: Optional[List[str]] = opt(
        None, "cpu, cuda, xpu: what is traced; unset: cpu, and the GPU when training on one."
    )
    record_shapes: bool = opt(False, "Record each operator's input shapes.")
    profile_memory: bool = opt(False, "Track tensor allocations and frees.")
    with_stack: bool = opt(False, "Record the Python source line of each operator.")
    with_flops: bool = opt(False, "Estimate the FLOPs of matmuls and convolutions.")
    with_modules: bool = opt(False, "Record the module hierarchy of each operator.")
    schedule_option: Optional[Dict[str, int]] = opt(
        None, "accelerate's form of the schedule ({wait, warmup, active, repeat, skip_first}); overrides those keys."
    )
    output_trace_dir: Optional[str] = opt(None, "Where the traces go (default output_dir/profiles).")


@dataclass
class MemorySnapshotConfig:
    """CUDA allocation history for PyTorch's memory viewer (pytorch.org/memory_viz); CUDA only."""

    steps: List[int] = opt([], "Optimizer steps (global_step, from 1) after which a snapshot is dumped.")
    on_oom: bool = opt(False, "Dump a snapshot when CUDA runs out of memory; the error then names it.")
    max_entries: int = opt(100000, "Allocation events kept in the history.")
    output_dir: Optional[str] = opt(None, "Where the snapshots go (default output_dir/memory_snapshots).")


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


@dataclass
class TrainingConfig:
    """The whole run. Flat Hugging Face TrainingArguments names are accepted too (see kiln.config.hf.aliases)."""

    output_dir: str = opt(
        "tmp_trainer",
        "Where checkpoints, logs and the final model go: a folder, or an fsspec URL (s3://bucket/run, gs://..., "
        "memory://...; file:// is a local folder) whose checkpoints and final model are written in save.staging_dir "
        "and uploaded (save.remote_dir).",
    )
    overwrite_output_dir: bool = opt(False, "Allow writing into an output_dir that holds checkpoints without resuming.")
    run_name: Optional[str] = opt(None, "Run name for trackers (default output_dir).")
    seed: int = opt(42, "Seed set before the model is built and before training.")
    data_seed: Optional[int] = opt(None, "Seed for data sampling (default seed).")
    full_determinism: bool = opt(False, "Deterministic algorithms everywhere (slow; for debugging).")
    resume_from_checkpoint: Optional[str] = opt(
        None,
        "A checkpoint path, or 'true' for the newest complete one in output_dir (an error when there is none, as "
        "in HF), or 'if_exists': the newest one if there is one, else start fresh (restarted and pre-empted jobs).",
    )
    train: TrainConfig = field(default_factory=TrainConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    torch_compile: TorchCompileConfig = field(default_factory=TorchCompileConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    log: LogConfig = field(default_factory=LogConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    memory_snapshot: MemorySnapshotConfig = field(default_factory=MemorySnapshotConfig)
