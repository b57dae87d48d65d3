"""Loggers, chosen by name (`report_to: [tensorboard, mlflow]`). Each file registers itself; files
import their tracker package only when a config names them."""

from kiln.registry import Registry, publish

LOGGERS: Registry[type] = publish(Registry("logger", "log.report_to"))

for _name, _module in (
    ("csv", "kiln.loggers.csv"),
    ("jsonl", "kiln.loggers.jsonl"),
    ("tensorboard", "kiln.loggers.tensorboard"),
    ("mlflow", "kiln.loggers.mlflow"),
    ("wandb", "kiln.loggers.wandb"),
    ("comet_ml", "kiln.loggers.comet"),
    ("clearml", "kiln.loggers.clearml"),
    ("dvclive", "kiln.loggers.dvclive"),
    ("aim", "kiln.loggers.aim"),
    ("trackio", "kiln.loggers.trackio"),
    ("swanlab", "kiln.loggers.swanlab"),
    ("codecarbon", "kiln.loggers.codecarbon"),
    ("neptune", "kiln.loggers.neptune"),
):
    LOGGERS.add_lazy(_name, _module)

#: what `report_to: all` means (as HF): every tracker whose package is installed; each name is its package's
TRACKERS = (
    "tensorboard",
    "mlflow",
    "wandb",
    "comet_ml",
    "clearml",
    "dvclive",
    "aim",
    "trackio",
    "swanlab",
    "codecarbon",
    "neptune",
)
