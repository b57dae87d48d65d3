"""`kiln convert` output loads as promised (issue 30 item 12c): `from_pretrained(OUT)` builds the trained
model (its config.json, generation_config.json and tokenizer files are written beside the weights),
and each tied weight is stored once, as `save_pretrained` stores it, so `safetensors.torch.load_model`
works too — for a single-process checkpoint and for a 2-process FSDP sharded one of a tied GPT-2."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

transformers = pytest.importorskip("transformers")

from kiln import cli  # noqa: E402
from kiln.engine.trainer import Trainer  # noqa: E402

VOCAB = 32
INPUT = torch.tensor([[1, 5, 9, 3, 7, 2, 30, 11]])


def gpt2_config():
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True
    )


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(VOCAB - 1)}
    backend = Tokenizer(models.WordLevel({**words, "[UNK]": VOCAB - 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(INPUT).logits


def check_loadable(converted: str, expected: torch.Tensor) -> None:
    """from_pretrained and safetensors' load_model both give the trained model's logits, exactly."""
    with safe_open(os.path.join(converted, "model.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())  # noqa: SIM118 - safe_open is no dict
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # stored once, as save_pretrained does
    assert json.loads(open(os.path.join(converted, "config.json")).read())["n_embd"] == 16
    assert os.path.exists(os.path.join(converted, "generation_config.json"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(converted)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(logits(loaded), expected, rtol=0, atol=0)
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(converted))
    load_model(plain, os.path.join(converted, "model.safetensors"))  # strict: no missing, no unexpected key
    torch.testing.assert_close(logits(plain), expected, rtol=0, atol=0)


def test_single_process_checkpoint_converts_to_a_loadable_folder(tmp_path):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config())
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": (ids := torch.randint(0, VOCAB, (12,), generator=g)), "labels": ids.clone()} for _ in range(16)
    ]
    trainer = Trainer(
        model,
        {
            "output_dir": str(tmp_path / "run"),
            "max_steps": 2,
            "save_steps": 2,
            "learning_rate": 1e-2,
            "per_device_train_batch_size": 4,
            "report_to": "none",
            "disable_tqdm": True,
            "log": {"history": []},
        },
        train_dataset=data,
        processing_class=tokenizer(),
    )
    trainer.fit()
    converted = str(tmp_path / "converted")
    assert cli.main(["convert", str(tmp_path / "run" / "checkpoint-2"), converted]) == 0
    check_loadable(converted, logits(trainer.model))
    reloaded = transformers.AutoTokenizer.from_pretrained(converted)
    assert reloaded("w3 w7 w1")["input_ids"] == tokenizer()("w3 w7 w1")["input_ids"] == [3, 7, 1]


@pytest.mark.distributed
def test_fsdp_sharded_checkpoint_converts_to_a_loadable_folder(tmp_path):
    from tests.strategies.fsdp.conftest import torchrun

    torchrun(2, "worker_gpt2.py", tmp_path, timeout=900)  # tied GPT-2, FSDP on 2 processes, sharded checkpoints
    checkpoint = tmp_path / "run" / "checkpoint-4"
    assert json.loads((checkpoint / "COMPLETE").read_text())["format"] == "fsdp-sharded"
    trained = transformers.GPT2LMHeadModel(gpt2_config_of(checkpoint))
    missing, unexpected = trained.load_state_dict(load_file(str(tmp_path / "live.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # the weights training ended with (tied)
    converted = str(tmp_path / "converted")
    assert cli.main(["convert", str(checkpoint), converted]) == 0
    check_loadable(converted, logits(trained))


def gpt2_config_of(checkpoint) -> transformers.GPT2Config:
    config = transformers.GPT2Config.from_pretrained(str(checkpoint))
    assert (config.n_embd, config.n_layer, config.vocab_size) == (16, 2, 64)  # worker_gpt2.py's model
    return config


class HeadFirst(torch.nn.Module):
    """A tie whose copy is registered before its source: the stored name is still the source's."""

    _tied_weights_keys = {"head.weight": "emb.weight"}  # transformers 5's form: {copy: source}

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.emb = torch.nn.Embedding(6, 4)
        self.head.weight = self.emb.weight


def test_ties_are_recorded_source_first_and_applied_only_where_the_tensors_agree():
    from kiln.strategies.weights_files import share_tied, tie_groups

    model = HeadFirst()
    assert [name for name, _ in model.named_parameters(remove_duplicate=False)][0] == "head.weight"
    groups = tie_groups(model)
    assert groups == [["emb.weight", "head.weight"]]
    weight = torch.arange(24.0).reshape(6, 4)
    state = share_tied({"head.weight": weight.clone(), "emb.weight": weight.clone(), "other": torch.ones(2)}, groups)
    assert list(state) == ["emb.weight", "other", "head.weight"] and state["head.weight"] is state["emb.weight"]
    damaged = {"head.weight": weight + 1, "emb.weight": weight.clone()}
    assert share_tied(damaged, groups)["head.weight"] is damaged["head.weight"]  # not one tensor: both kept
    assert share_tied(damaged, None) is damaged and tie_groups(torch.nn.Linear(2, 2)) == []
    # a marker whose record is not lists of names (edited, or of another version) ties nothing, and fails nothing
    plain = {"head.weight": weight.clone(), "emb.weight": weight.clone()}
    for record in (
        [["absent", "emb.weight", "head.weight"]],
        [("emb.weight", "head.weight")],
        [{"emb.weight": "head.weight"}],
        [[]],
        [["emb.weight", 3]],
    ):
        out = share_tied(plain, record)
        assert out["head.weight"] is plain["head.weight"] and out["emb.weight"] is plain["emb.weight"], record
