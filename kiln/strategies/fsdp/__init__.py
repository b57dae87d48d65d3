"""The FSDP family (`strategy: fsdp`, PyTorch's FSDP2): the strategy (strategy.py), its settings
(options.py), auto-wrap (wrap.py), mixed precision (precision.py), rank-0 loading (loading.py) and
its checkpoint formats (checkpoint_io.py)."""
