"""The DeepSpeed family (`strategy: deepspeed`, `deepspeed_stage_*`): the strategy (strategy.py), the
DeepSpeed config it builds (config.py), ZeRO-3 model building (zero_init.py) and its checkpoint format
(checkpoint_io.py). Named like the `deepspeed` package, but imports are absolute: `import deepspeed`
in these files is always DeepSpeed itself."""
