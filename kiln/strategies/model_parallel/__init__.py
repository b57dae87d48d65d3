"""`strategy: model_parallel`, the mesh strategy (kiln/strategies/mesh/) with its mesh written out
(`mesh: {dp_replicate, dp_shard, cp, tp}`): strategy.py."""
