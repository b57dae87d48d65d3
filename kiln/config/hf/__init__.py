"""Hugging Face's dialects, translated both ways in one place, so that the strategies and the checkpoint
writer read and write kiln's own settings only:

- fsdp.py: TrainingArguments' `fsdp` flag string and `fsdp_config` (a mapping or a JSON file) -> the
  FSDP strategies' option names;
- deepspeed.py: a DeepSpeed config's `"auto"` values filled from kiln's config (HF's
  `HfTrainerDeepSpeedConfig`), and its numbers checked against kiln's;
- training_args.py: kiln's config -> `TrainingArguments` values under HF's names (training_args.bin).

The flat TrainingArguments names of a config (`learning_rate`, `per_device_train_batch_size`, ...) are
read by kiln.config.hf.aliases, kiln.config.hf.args and kiln.config.hf.rewrites as the config loads."""
