"""Weights in Hugging Face's sharded layout (`model.safetensors.index.json` + shards): read in
checkpoints, by load_best_model_at_end and by `kiln evaluate`; written by `save_model(max_shard_size=)`.
Truncated or corrupt shards are refused (a checkpoint whose weights were re-saved as shards after it was
sealed is refused as a whole: test_integrity_probes.py). A model overriding `load_state_dict` resumes
through it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kiln.engine.checkpoint.files import is_complete
from kiln.strategies.model_weights import WEIGHTS_SAFE, load_weights
from kiln.strategies.weights_files import INDEX, parse_size, save_sharded
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import Crash, Net, regression_data, train, weights


def reshard(ckpt: str, max_shard_size: int = 200) -> list[str]:
    """What a user does with safetensors/HF tools: replace model.safetensors by shards + index."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(ckpt, WEIGHTS_SAFE))
    os.remove(os.path.join(ckpt, WEIGHTS_SAFE))
    return save_sharded(tensors, ckpt, max_shard_size)


def test_parse_size_follows_hf():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(1234) == 1234
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("big")


def test_truncated_or_corrupt_shards_are_refused(tmp_path):
    out = str(tmp_path / "run")
    train(out, {"max_steps": 4, "save_steps": 4})
    ckpt = os.path.join(out, "checkpoint-4")
    shard = os.path.join(ckpt, reshard(ckpt)[0])
    with open(shard, "rb") as fh:
        data = fh.read()
    with open(shard, "wb") as fh:
        fh.write(data[:-7])  # truncated
    assert not is_complete(ckpt)
    with pytest.raises(CheckpointError, match="incomplete or damaged"):
        train(out, {"max_steps": 6, "save_steps": 4}, resume=ckpt)
    with open(shard, "wb") as fh:
        fh.write(data[:8] + b"#" * 20 + data[28:])  # same size, garbled header
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_weights(ckpt)
    os.remove(shard)
    assert not is_complete(ckpt)


def test_save_model_writes_shards_above_max_shard_size_that_load_back(tmp_path):
    out = str(tmp_path / "run")
    trainer = train(out, {"max_steps": 3, "save_strategy": "no"})
    trainer.save_model(str(tmp_path / "small"), max_shard_size="0.2KB")
    index = json.loads((tmp_path / "small" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) >= 2 and not (tmp_path / "small" / WEIGHTS_SAFE).exists()
    state = load_weights(str(tmp_path / "small"))
    assert all(torch.equal(state[k], v) for k, v in weights(trainer).items())
    trainer.save_model(str(tmp_path / "one"), max_shard_size="1GB")  # below the limit: one file, as HF
    assert (tmp_path / "one" / WEIGHTS_SAFE).exists() and not (tmp_path / "one" / INDEX).exists()


def test_load_best_model_at_end_reads_resharded_checkpoints(tmp_path):
    from kiln.engine.callbacks.base import Callback
    from tests.checkpoint.checkpoint_helpers import Scripted

    class Reshard(Callback):  # every checkpoint's weights become shards right after it is written
        def on_save(self, config, state, control, **kw):
            reshard(os.path.join(config.output_dir, f"checkpoint-{state.global_step}"))

    out = str(tmp_path / "run")
    trainer = train(
        out,
        {
            "max_steps": 6,
            "save_steps": 2,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "metric_for_best_model": "score",
            "load_best_model_at_end": True,
        },
        eval_data=lambda: regression_data(8, seed=5),
        compute_metrics=Scripted([1.0, 9.0, 2.0]),
        callbacks=[Reshard()],
    )
    best = os.path.join(out, "checkpoint-4")
    assert trainer.state.best_model_checkpoint == best and os.path.exists(os.path.join(best, INDEX))
    state = load_weights(best)
    assert all(torch.equal(state[k], v) for k, v in weights(trainer).items())


def test_kiln_evaluate_loads_sharded_weights(tmp_path):
    from kiln import Trainer

    out = str(tmp_path / "run")
    trainer = train(out, {"max_steps": 3, "save_strategy": "no"})
    trainer.save_model(str(tmp_path / "export"), max_shard_size=300)
    fresh = Trainer(Net(), {"output_dir": str(tmp_path / "eval"), "strategy": {"device": "cpu"}})
    fresh._load_from_checkpoint(str(tmp_path / "export"))  # what kiln evaluate/predict call
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in weights(trainer).items())


class Growing(Net):
    """Grows a buffer during training and resizes it on load (kiln's shape pre-check would refuse it)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.register_buffer("seen", torch.zeros(0))

    def training_step(self, batch):
        self.seen = torch.cat([self.seen, batch["y"][:1].detach()])
        return super().training_step(batch)

    def load_state_dict(self, state, strict=True, assign=False):
        self.seen = torch.zeros_like(state["seen"])
        return super().load_state_dict(state, strict=strict, assign=assign)


def test_model_with_its_own_load_state_dict_resumes_through_it(tmp_path, monkeypatch):
    import tests.checkpoint.checkpoint_helpers as helpers

    monkeypatch.setattr(helpers, "Net", Growing)
    cfg = {"max_steps": 8, "save_steps": 4}
    straight = train(str(tmp_path / "straight"), cfg)
    out = str(tmp_path / "crashed")
    with pytest.raises(Crash):
        train(out, cfg, crash_at=4)
    resumed = train(out, cfg, model_seed=3, resume=True)
    assert resumed.model.seen.shape == (8,)
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
