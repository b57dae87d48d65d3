"""Starting processes and knowing where this process sits: the local launcher behind `kiln fit
--nproc N` (local.py), the cluster environments a launcher leaves behind (environment.py), and the
settings a launcher's config file asks of the run (settings.py). Below the strategies: nothing here
imports a strategy or the engine."""
