"""The one sharding strategy (strategy.py): a named DeviceMesh (dims.py), an `apply_*` function per
parallelism (tp_plan.py with sequence_parallel.py and loss_parallel.py, activation_checkpointing.py,
compile.py, fsdp.py, context_parallel.py), its settings (settings.py), precision (precision.py), rank-0
loading (loading.py) and one DCP checkpoint IO (checkpoint_io.py). `strategy: fsdp` and `strategy:
model_parallel` are its presets (kiln/strategies/fsdp/, kiln/strategies/model_parallel/)."""
