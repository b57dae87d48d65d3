"""`kiln estimate`: per-rank memory of a config's model for each strategy and mesh, before a launch.

states.py (parameters, gradients and optimizer state per layout), trace.py (activations, from a forward
and backward on fake tensors), layouts.py (the strategies and meshes for a number of processes),
report.py (the peak, what fits, the table), command.py (the command line)."""
