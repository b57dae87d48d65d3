"""`strategy: fsdp` (PyTorch's FSDP2), a preset of the mesh strategy (kiln/strategies/mesh/): the preset
(strategy.py) writes the mesh from HF's sharding names, and its settings arrive in kiln's keys or HF's
`fsdp` / `fsdp_config` forms (options.py; kiln.config.hf.fsdp translates HF's)."""
