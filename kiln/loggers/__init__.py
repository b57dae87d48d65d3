"""Loggers, chosen by name (`report_to: [tensorboard, mlflow]`). Each file registers itself; files
import their tracker package only when a config names them."""

from kiln.registry import Registry

LOGGERS: Registry[type] = Registry("logger", "log.report_to")

for _name, _module in (
    ("csv", "kiln.loggers.csv"),
    ("jsonl", "kiln.loggers.jsonl"),
    ("tensorboard", "kiln.loggers.tensorboard"),
    ("mlflow", "kiln.loggers.mlflow"),
    ("wandb", "kiln.loggers.wandb"),
):
    LOGGERS.add_lazy(_name, _module)

#: what `report_to: all` means: every tracker whose package is installed
TRACKERS = ("tensorboard", "mlflow", "wandb")
