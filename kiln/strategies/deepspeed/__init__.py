"""The DeepSpeed family (`strategy: deepspeed`, `deepspeed_stage_*`): the strategy (strategy.py), the
precision plugin it runs (precision.py), the optimizer ZeRO-Offload steps (optimizer.py), what it asks of
the `deepspeed` package (runtime.py), ZeRO-3 model building (zero_init.py) and its checkpoint format
(checkpoint_io.py); the DeepSpeed config it builds is kiln.config.hf.deepspeed. Named like the
`deepspeed` package, but imports are absolute: `import deepspeed` in these files is always DeepSpeed
itself."""
