"""What `kiln --help` and `kiln COMMAND --help` print."""

from __future__ import annotations

USAGE = """kiln: train PyTorch models from a YAML config.

commands:
  kiln fit CONFIG.yaml [key=value ...]        train (then evaluate and export the model)
  kiln evaluate CONFIG.yaml [key=value ...]   evaluate the run's trained weights (or --weights PATH)
  kiln predict CONFIG.yaml [key=value ...]    predict on the test/eval data with them, write predictions.npy
  kiln plot RUN_DIR [RUN_DIR ...] [-o PNG]    plot a run's curves
  kiln config-docs                            print the config reference (markdown)
  kiln convert CHECKPOINT OUT [--signing-key-env NAME]
                                              a checkpoint's full weights (FSDP or ZeRO shards merged) as
                                              OUT/model.safetensors (signed checkpoints: the key is in $NAME);
                                              CHECKPOINT may be a URL (s3://bucket/run/checkpoint-500)
  kiln estimate CONFIG.yaml [--nproc N] [--device-memory GiB] [--json] [key=value ...]
                                              per-rank memory for each strategy and mesh, and what fits
  kiln --version                              print kiln's version

options for fit/evaluate/predict:
  --nproc N                  start N local processes (data parallel) with torch's elastic launcher
  --max-restarts K           with --nproc: restart the processes up to K times when one fails (torchrun's flag)
  --ray N                    fit in N Ray Train workers (a local Ray instance, or launcher.address); pip install 'kiln[ray]'
  --accelerate-config FILE   honour an `accelerate config` YAML (mixed precision, FSDP, DeepSpeed, num_processes)
  --traceback                show the full traceback of an error (default: one line naming the problem)
  -h, --help                 list every config key with its default and meaning

options for fit:
  --profile                  profile 3 optimizer steps (profile.active=3) unless the config or a key=value sets it

options for evaluate/predict:
  --weights PATH             a checkpoint-<step> folder (or its URL on a store) or a folder written by save_model;
                             default: the run's best checkpoint, else its exported model, else its newest
                             checkpoint (in output_dir; for an output_dir URL, downloaded when none is local)
  --random-weights           score the untrained model (refused unless asked for)

examples:
  kiln fit examples/digits/config.yaml learning_rate=1e-3 train.max_steps=200 precision=bf16
  kiln evaluate examples/digits/config.yaml                    # the weights kiln fit left in runs/digits
  kiln predict examples/digits/config.yaml --weights runs/digits/checkpoint-400
"""


def command_help(command: str) -> str:
    """`kiln fit|evaluate|predict --help`: the command's options, then every config key with its default."""
    from kiln.config.docs import config_help

    scoring = command in ("evaluate", "predict")
    lines = [
        f"usage: kiln {command} CONFIG.yaml [--nproc N [--max-restarts K]] [--accelerate-config FILE]"
        f"{' [--weights PATH | --random-weights]' if scoring else ' [--profile]'} [key=value ...]",
        "",
        "options:",
        "  --nproc N                  start N local processes (data parallel)",
        "  --max-restarts K           with --nproc: restart them up to K times when one fails (with --ray: Ray's max_failures)",
        "  --ray N                    fit in N Ray Train workers (config launcher.* for resources and address)",
        "  --accelerate-config FILE   honour an `accelerate config` YAML",
        "  --traceback                show the full traceback of an error, not one line",
    ]
    if command == "fit":
        lines.append(
            "  --profile                  profile 3 optimizer steps (profile.active=3) unless the config or a key=value sets it"
        )
    if scoring:
        lines += [
            "  --weights PATH             a checkpoint-<step> folder or a save_model folder (default: the run's best",
            "                             checkpoint, else its exported model, else its newest checkpoint)",
            "  --random-weights           score the untrained model",
        ]
    lines += ["", "config keys (in the YAML, or key=value on the command line):", "", config_help()]
    return "\n".join(lines)
