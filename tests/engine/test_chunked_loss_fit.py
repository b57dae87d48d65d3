"""`train.loss: {chunked: true}` through a whole fit of a tiny Llama on one process: the chunked loss runs
inside the model's own forward (so DDP's and FSDP's wrappers still call theirs), the fit's logged losses and
final weights equal the plain fit's within 1e-5, and no training forward builds more than one chunk's
logits. Evaluation keeps the logits. What it cannot stand in for is one sentence. DDP: the packed run of
tests/distributed/test_ddp_packing.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln import Trainer
from kiln.config import ConfigError, load_config
from kiln.engine.model.chunked_loss import use_chunked_loss
from tests.helpers import base_config, flat_params

transformers = pytest.importorskip("transformers")

VOCAB, TOKENS, BATCH, CHUNK = 96, 8, 4, 5


class Widest(TorchDispatchMode):
    """The most elements any matmul's output had with a VOCAB-wide last dimension (a logits tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.widest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if str(func) in ("aten.mm.default", "aten.addmm.default") and out.shape[-1] == VOCAB:
            self.widest = max(self.widest, out.numel())
        return out


def llama():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=VOCAB,
        )
    )


def data():  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    rows = []
    for ids in torch.randint(0, VOCAB, (12, TOKENS), generator=g):
        labels = ids.clone()
        labels[: int(torch.randint(0, 4, (1,), generator=g))] = -100  # uneven items per row
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def fit(tmp_path, **extra):  # type: ignore[no-untyped-def]
    cfg = base_config(
        tmp_path,
        max_steps=3,
        per_device_train_batch_size=BATCH // 2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        log={"history": [], "steps": 1},
        **extra,
    )
    trainer = Trainer(llama(), cfg, train_dataset=data(), eval_dataset=data()[:4])
    with Widest() as seen:
        trainer.fit()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h], seen.widest


@pytest.fixture(scope="module")
def plain(tmp_path_factory):  # type: ignore[no-untyped-def]
    return fit(tmp_path_factory.mktemp("plain"))


def test_a_chunked_fit_ends_where_the_plain_fit_does_without_building_the_logits(tmp_path, plain):
    trainer, losses, widest = fit(tmp_path, train={"loss": {"chunked": True, "chunk_size": CHUNK}})
    torch.testing.assert_close(flat_params(trainer.model), flat_params(plain[0].model), rtol=1e-5, atol=1e-5)
    assert losses == pytest.approx(plain[1], rel=1e-5) and len(losses) == 3
    assert plain[2] == BATCH // 2 * TOKENS * VOCAB and widest == CHUNK * VOCAB  # one chunk's logits at most
    model = trainer.model
    assert type(model).forward is not model.forward  # the instance's forward: the wrapper still calls it
    batch = {k: torch.stack([row[k] for row in data()[:2]]) for k in ("input_ids", "labels")}
    out = model(**batch)
    assert out.logits is None and torch.allclose(out.loss, plain[0].model(**batch).loss, atol=1e-6)
    with torch.no_grad():  # evaluation and prediction: the model's own forward, logits and all
        assert model(**batch).logits.shape == (2, TOKENS, VOCAB)
    assert model(input_ids=batch["input_ids"]).logits.shape == (2, TOKENS, VOCAB)  # no labels: the model's own
    assert trainer.evaluate()["eval_loss"] == pytest.approx(plain[0].evaluate()["eval_loss"], rel=1e-5)


def test_what_the_chunked_loss_cannot_do_is_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match=r"train.loss.chunked cannot smooth labels \(label_smoothing_factor"):
        load_config({"train": {"loss": {"chunked": True}}, "label_smoothing_factor": 0.1})
    with pytest.raises(ConfigError, match="train.loss.chunk_size is 0; it must be a positive number of tokens"):
        load_config({"train": {"loss": {"chunked": True, "chunk_size": 0}}})
    with pytest.raises(
        ConfigError, match="use_liger_kernel=True is not supported by kiln: Liger's Triton kernels need"
    ):
        load_config({"use_liger_kernel": True})
    scaled = llama()
    scaled.config.logit_scale = 2.0  # refused when the loss is set up, not at the first step
    with pytest.raises(
        ConfigError, match=r"LlamaForCausalLM transforms its logits after the LM head \(logit_scale=2.0\)"
    ):
        use_chunked_loss(scaled, CHUNK)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    trainer = Trainer(model, base_config(tmp_path, train={"loss": {"chunked": True}}), train_dataset=[{"x": 1}])
    with pytest.raises(ConfigError, match="train.loss.chunked needs a Transformers causal LM .* Sequential holds none"):
        trainer.fit()


def test_under_fsdp_a_chunked_fit_ends_where_the_plain_fit_does(tmp_path, plain):
    """FSDP2 on one rank: the root's all-gather runs before the replaced forward, which reads the LM head's
    whole weight (the 2-process FSDP path is the same hooks over two shards)."""
    cfg = {"strategy": {"name": "fsdp", "device": "cpu"}, "train": {"loss": {"chunked": True, "chunk_size": CHUNK}}}
    trainer, losses, _ = fit(tmp_path, **cfg)
    try:
        exported = trainer.strategy.model_state_for_export(trainer.model)
    finally:
        trainer.teardown()  # FSDP's process group: a later test in this process may need none to exist
    want = plain[0].model.state_dict()
    for name, value in exported.items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5)
    assert losses == pytest.approx(plain[1], rel=1e-5) and len(losses) == 3
