"""The DDP family: `strategy: ddp` (strategy.py) and its first-step choice of
`find_unused_parameters` (unused_parameters.py)."""
