"""The model, data and settings shared by the SPMD worker and the CPU reference it is compared to."""

from __future__ import annotations

import pathlib

import torch

from tests.helpers import TinyRegressor, base_config, regression_data


def model(seed: int = 0) -> TinyRegressor:
    torch.manual_seed(seed)
    return TinyRegressor()


def train_data():
    return regression_data(n=48)


def config(output_dir: str, strategy: str = "xla_fsdp", **over) -> dict:
    settings = dict(
        max_steps=6,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        dataloader_drop_last=True,
        overwrite_output_dir=True,
    )
    cfg = base_config(pathlib.Path(output_dir), strategy={"name": strategy}, **{**settings, **over})
    cfg["output_dir"] = output_dir
    if strategy == "single":
        cfg["strategy"]["device"] = "cpu"
    return cfg
