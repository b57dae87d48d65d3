"""The model-parallel family (`strategy: model_parallel`): FSDP2 x tensor parallelism on one named
DeviceMesh. The strategy (strategy.py), the mesh's axes and sizes (mesh.py), the tensor-parallel plan
(tp_plan.py) and its DCP checkpoint format (checkpoint_io.py)."""
