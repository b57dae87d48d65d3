"""Dropout on: kiln's losses equal transformers.Trainer's, step for step, over two epochs with evaluations in
between. HF's loaders have no generator, so torch draws each new iterator's base seed from the global RNG (one
number per training epoch and per evaluation) and dropout draws its masks after it; kiln's loaders draw the
same number (kiln.engine.data.loaders.SeededLoader), while their own generator still seeds their workers."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from kiln import Trainer
from tests.engine.hf_compare import LENGTH, VOCAB, hf_args, kiln_config, max_diff

transformers = pytest.importorskip("transformers")


def _gpt2_with_dropout() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x} for x in ids]


def _logged(trainer) -> list[tuple[str, int, float]]:
    return [(key, h["step"], h[key]) for h in trainer.state.log_history for key in ("loss", "eval_loss") if key in h]


def test_losses_with_dropout_equal_hf_s_over_epochs_and_evaluations(tmp_path):
    """10 rows in batches of 4 (3 batches an epoch, the last one short), 7 steps: three epoch starts and
    evaluations at steps 3, 6 and 7 (the last) each move the global RNG once, in HF and in kiln."""
    model, data = _gpt2_with_dropout(), _rows(10)
    theirs_model, ours_model = copy.deepcopy(model), copy.deepcopy(model)
    settings = dict(per_device_train_batch_size=4, max_steps=7, seed=7, eval_strategy="steps", eval_steps=3)
    theirs = transformers.Trainer(
        model=theirs_model, args=hf_args(str(tmp_path / "hf"), **settings), train_dataset=data, eval_dataset=data[:4]
    )
    theirs.train()
    ours = Trainer(ours_model, kiln_config(tmp_path, **settings), train_dataset=data, eval_dataset=data[:4])
    ours.fit()
    want, got = _logged(theirs), _logged(ours)
    assert [(k, s) for k, s, _ in got] == [(k, s) for k, s, _ in want] and len(want) == 10
    assert [v for _, _, v in got] == pytest.approx([v for _, _, v in want], rel=1e-5)
    assert max_diff(ours_model, theirs_model) < 2e-5  # op order (clipping, fused sums) differs: roundoff only


def test_every_new_iterator_draws_once_from_the_global_rng_and_a_reused_one_does_not(tmp_path):
    """torch's rule for a loader without a generator: one draw per new iterator; persistent workers reuse
    theirs from the second epoch on."""
    from kiln.engine.data.loaders import build_dataloader

    def draws(loader) -> int:
        before = torch.get_rng_state()
        iter(loader)
        after = torch.get_rng_state()
        torch.set_rng_state(before)
        for n in range(3):
            if torch.equal(torch.get_rng_state(), after):
                return n
            torch.empty((), dtype=torch.int64).random_()
        return -1

    data = [{"x": torch.tensor([float(i)])} for i in range(8)]
    plain = SimpleNamespace(dataloader_num_workers=0, dataloader_pin_memory=False, dataloader_drop_last=False)
    loader = build_dataloader(data, 2, None, plain, seed=0, shuffle=True)
    assert [draws(loader), draws(loader)] == [1, 1]
    persistent = SimpleNamespace(
        **{**vars(plain), "dataloader_num_workers": 1},
        dataloader_persistent_workers=True,
        dataloader_prefetch_factor=None,
    )
    loader = build_dataloader(data, 2, None, persistent, seed=0, shuffle=True)
    assert [draws(loader), draws(loader)] == [1, 0]
    del loader


@pytest.mark.parametrize("rank", [0, 1])
def test_a_dispatched_loader_draws_on_every_rank_when_its_iterator_is_made(rank):
    """dispatch_batches: rank 0 alone reads the data, but every rank's global RNG moves as rank 0's, and at
    `iter()`, not at the first batch (a resumed run restores its RNG in between)."""
    from kiln.engine.data.dispatch_batches import DispatchedLoader
    from kiln.engine.data.loaders import build_dataloader

    data = [{"x": torch.tensor([float(i)])} for i in range(8)]
    cfg = SimpleNamespace(dataloader_num_workers=0, dataloader_pin_memory=False, dataloader_drop_last=False)
    sent = []

    def broadcast(batch):  # the strategy's broadcast_object: what rank 0 holds reaches every rank
        sent.append(batch)
        return {"x": torch.arange(4.0).unsqueeze(-1)}

    dispatched = DispatchedLoader(build_dataloader(data, 4, None, cfg, seed=0, shuffle=False), broadcast, 2, rank, True)
    torch.manual_seed(3)
    batches = iter(dispatched)
    moved = torch.get_rng_state()
    torch.manual_seed(3)
    torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(moved, torch.get_rng_state())
    assert next(batches)["x"].flatten().tolist() == [
        float(rank),
        float(rank + 2),
    ]  # this rank's rows of the global batch
    assert (sent[0] is not None) == (rank == 0)  # only rank 0 read the data
