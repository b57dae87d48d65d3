"""An unknown `optim_args` key is refused with the keys the optimizer does accept: its own settings,
without the ones kiln sets itself (`params`, `weight_decay`, and what the config already supplies, such as
`lr`), which optim_args may not set. A list naming those would point the user at a key that is refused too."""

from __future__ import annotations

import pytest
from torch import nn

from kiln.config.schema.optim import OptimConfig
from kiln.optim.optimizers import build_optimizer


@pytest.mark.parametrize(
    "name,own,from_config",
    [
        ("sgd", {"momentum", "nesterov", "dampening"}, {"lr"}),
        ("adamw_torch", {"amsgrad", "maximize"}, {"lr", "betas", "eps"}),
    ],
)
def test_the_refusal_lists_only_keys_optim_args_may_set(name, own, from_config):
    with pytest.raises(ValueError) as err:
        build_optimizer(nn.Linear(2, 2), OptimConfig(name=name, optim_args="momentun=0.9"))
    accepted = set(str(err.value).split("it accepts: ", 1)[1].rstrip(".").split(", "))
    assert own <= accepted
    assert not accepted & ({"params", "weight_decay", "self"} | from_config)
