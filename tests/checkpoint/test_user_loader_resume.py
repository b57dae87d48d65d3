"""A DataLoader passed as train_dataset is used as given: its generator is not re-seeded, so its order
is the loader's own (the stream continues into the next epoch, and differently seeded generators give
different orders), and a resume inside or at the end of an epoch is still bitwise exact."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from kiln.engine.trainer import Trainer
from tests.checkpoint.checkpoint_helpers import (
    config,
    make_model,
    numeric_history,
    regression_data,
    straight_vs_resumed,
    weights,
)


def seeded_loader(seed: int = 3):
    rows = [dict(r, i=torch.tensor(i)) for i, r in enumerate(regression_data())]
    return DataLoader(rows, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))


def unseeded_loader():  # shuffles from the global torch RNG, which kiln seeds
    rows = [dict(r, i=torch.tensor(i)) for i, r in enumerate(regression_data())]
    return DataLoader(rows, batch_size=4, shuffle=True)


def _order_seen(tmp_path, loader, epochs=2):
    seen = []

    class Spy(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(inputs["i"].tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    cfg = config(str(tmp_path / "out"), max_steps=-1, num_train_epochs=epochs, save_strategy="no")
    Spy(make_model(), cfg, train_dataset=loader).fit()
    return seen


def test_the_loaders_own_order_over_epochs(tmp_path):
    ours = _order_seen(tmp_path, seeded_loader(3))
    own = seeded_loader(3)
    expected = [b["i"].tolist() for _ in range(2) for b in own]  # the loader iterated twice on its own
    assert ours == expected
    assert ours[:10] != ours[10:]  # the stream continued: epoch 2 is not epoch 1 again
    assert _order_seen(tmp_path / "b", seeded_loader(4), epochs=1) != ours[:10]  # another seed, another order


CASES = {
    "seeded-mid-second-epoch": (seeded_loader, 13),
    "seeded-at-epoch-boundary": (seeded_loader, 10),
    "unseeded-mid-second-epoch": (unseeded_loader, 13),
    "unseeded-at-epoch-boundary": (unseeded_loader, 10),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_with_a_users_shuffling_loader_is_exact(tmp_path, case):
    loader, crash_at = CASES[case]
    # 10 batches per epoch; the boundary case saves at the epoch end, so the resume starts a new epoch
    cfg = {"max_steps": 25, "save_steps": crash_at} if crash_at % 10 else {"max_steps": 25, "save_strategy": "epoch"}
    straight, resumed = straight_vs_resumed(tmp_path, cfg, crash_at, loader)
    a, b = weights(straight), weights(resumed)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{case}: {name} differs after resume"
    assert numeric_history(resumed) == numeric_history(straight)
