"""Imported once by tests/world.py's forkserver: what every rank of a test world would import itself."""

import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (every torch optimizer imports it when it is built)
import torch.distributed  # noqa: F401
import transformers  # noqa: F401
from omegaconf import OmegaConf  # noqa: F401

import kiln.engine.trainer  # noqa: F401
