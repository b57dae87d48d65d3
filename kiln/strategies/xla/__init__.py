"""The XLA family (torch_xla): `strategy: xla` (strategy.py, its loader, gradients and checkpoint
format) and `strategy: xla_fsdp` (fsdp.py, its options and checkpoint formats)."""
