"""Starting processes and knowing where this process sits: the local launcher behind `kiln fit
--nproc N` (local.py) and the shim its workers run under (worker.py), Ray Train's behind `kiln fit
--ray N` (ray.py), the cluster kinds a launcher
leaves behind, as a registry (environment/), and what an accelerate configuration asks of the run
(accelerate_config.py read once, settings.py for what it means in kiln keys). Below the strategies:
nothing here imports a strategy or the engine."""
