"""Size-based auto-wrap at its boundary: a submodule holding exactly `min_num_params` not-yet-wrapped
parameters is its own FSDP unit, as in torch's `size_based_auto_wrap_policy` and HF's
`fsdp_min_num_params` (both `>=`). Training results cannot see the difference (the unit boundaries
change communication, not the maths), so the chosen blocks are asserted directly."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

from kiln.strategies.wrap_policy import blocks_to_wrap


def _model() -> nn.Module:
    """exact: 3*4 + 4 = 16 parameters; small: 3*3 + 3 = 12; the root holds both plus its own head."""
    return nn.ModuleDict({"exact": nn.Linear(3, 4), "small": nn.Linear(3, 3), "head": nn.Linear(4, 1, bias=False)})


def test_a_module_with_exactly_min_num_params_is_its_own_unit():
    model = _model()
    assert sum(p.numel() for p in model["exact"].parameters()) == 16
    assert blocks_to_wrap(model, None, 16) == [model["exact"]]
    assert blocks_to_wrap(model, None, 17) == []  # one more than it holds: left to the root unit
    assert blocks_to_wrap(model, None, 12) == [model["exact"], model["small"]]


def test_the_boundary_is_torchs_size_based_policy():
    """torch's FSDP1 policy answers the same question for a leaf with `nonwrapped_numel` parameters."""
    model = _model()
    for min_num_params in (11, 12, 13, 15, 16, 17):
        torch_wraps = {
            name
            for name, m in model.items()
            if size_based_auto_wrap_policy(
                m, recurse=False, nonwrapped_numel=sum(p.numel() for p in m.parameters()), min_num_params=min_num_params
            )
        }
        kiln_wraps = {
            name for name, m in model.items() if any(m is b for b in blocks_to_wrap(model, None, min_num_params))
        }
        assert kiln_wraps == torch_wraps, min_num_params
