"""Every strategy's `save_model` stores a tied weight once (issue 52 item 15): under FSDP and ZeRO-3 the
gathered state held a separate copy per name, so GPT-2's model.safetensors had 29 tensors against 28
under single/DDP and `safetensors.torch.load_model(model, file)` failed with an unexpected key. A tiny
GPT-2 trained 2 steps under single, DDP, FSDP (sharded and full state dicts), model_parallel and
DeepSpeed ZeRO-2 / ZeRO-3 on 2 gloo processes, and a tied Llama under model_parallel's tp 2: each
export holds the keys a `single` export holds, loads with both loaders -- `safetensors.torch.load_model`
(strict) and `from_pretrained` -- into a model whose tie still holds, and gives the logits of the
weights the strategy trained. (xla's export keeps ties by its own tested path, tests/xla/.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

from tests.strategies.export import cases
from tests.world import run_world

pytestmark = pytest.mark.distributed
HERE = Path(__file__).resolve().parent
DISTRIBUTED = ["ddp", "fsdp", "fsdp_full", "model_parallel", "model_parallel_tp", "deepspeed", "deepspeed_stage_3"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tied_exports")
    run_world(HERE / "worker.py", out, *DISTRIBUTED, timeout=1500, env={"DS_ACCELERATOR": "cpu"})
    for name in ("single", "single_llama"):
        weights = cases.train_and_export(name, str(out), 1)
        from safetensors.torch import save_file

        save_file({k: v.clone().contiguous() for k, v in weights.items()}, str(out / f"{name}.safetensors"))
    return out


def _keys(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        return set(fh.keys())


@pytest.mark.parametrize("name", ["single", *DISTRIBUTED])
def test_an_export_stores_a_tie_once_and_loads_with_both_loaders(exports, name):
    from transformers import AutoModelForCausalLM

    family = cases.CASES[name][1]
    folder = exports / name
    reference = exports / ("single" if family == "gpt2" else "single_llama")
    assert _keys(folder) == _keys(reference)  # the tie stored once, under the name single's export uses
    tie = {
        "gpt2": ("transformer.wte.weight", "lm_head.weight"),
        "llama": ("model.embed_tokens.weight", "lm_head.weight"),
    }
    assert sum(key in _keys(folder) for key in tie[family]) == 1
    plain = AutoModelForCausalLM.from_config(cases.model_config(family))
    missing, unexpected = load_model(plain, str(folder / "model.safetensors"))  # strict: raises on a foreign key
    assert not unexpected
    pretrained = AutoModelForCausalLM.from_pretrained(str(folder))
    for model in (plain, pretrained):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    trained = AutoModelForCausalLM.from_config(cases.model_config(family))
    trained.load_state_dict(load_file(str(exports / f"{name}.safetensors")))  # what the strategy gathered
    want = cases.logits(trained)
    for model in (plain, pretrained):
        torch.testing.assert_close(cases.logits(model), want, rtol=0, atol=0)
    assert not torch.equal(want, cases.logits(cases.build(family)))  # it trained
