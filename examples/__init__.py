"""Runnable kiln examples; each sub-package is named by import path from its `config.yaml`."""
