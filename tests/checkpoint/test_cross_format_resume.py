"""A checkpoint resumes under a strategy that writes another format (kiln.strategies.format_translation):
single/DDP's `full` under FSDP (`fsdp-full`, `fsdp-sharded`) and model_parallel, and back, optimizer
state included; a format that cannot be translated is refused in one sentence naming the fix.

In one process (gloo, world size 1) FSDP computes exactly what the single strategy does, so a run resumed
across formats ends bit for bit equal to the uninterrupted run: weights, AdamW moments and step counts,
schedule, RNG (the model has dropout) and data position all come through. The 1 -> 2 -> 1 process chain is
`test_one_two_one_processes_across_formats` (2 gloo processes)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kiln.docgen.format_table import format_rows
from kiln.engine.checkpoint.files import MARKER
from kiln.engine.checkpoint.loading import check_data_shards
from kiln.strategies.checkpoint_io import FORMATS, CheckpointIO
from kiln.strategies.format_translation import route
from kiln.strategies.full_checkpoint_io import FullStateCheckpointIO
from kiln.strategies.mesh.checkpoint_io import FullCheckpointIO, ShardedCheckpointIO
from kiln.strategies.mesh.pipeline_checkpoint import PipelineCheckpointIO
from kiln.strategies.portable_state import keyed_by_index, keyed_by_name, optimizer_names
from kiln.strategies.single import SingleDeviceStrategy
from kiln.utils.errors import CheckpointError
from tests.checkpoint.checkpoint_helpers import Crash, numeric_history, train
from tests.strategies.test_ddp_strategy import no_launcher  # noqa: F401 (autouse fixture: no torchrun variables)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STRATEGIES = {
    "single": {"name": "single", "device": "cpu"},
    "ddp": {"name": "ddp", "device": "cpu"},
    "fsdp-full": {"name": "fsdp", "device": "cpu", "state_dict_type": "full"},
    "fsdp-sharded": {"name": "fsdp", "device": "cpu", "state_dict_type": "sharded"},
    "model_parallel": {"name": "model_parallel", "device": "cpu"},
}
FORMAT_OF = {  # the format each strategy setting writes
    "single": "full",
    "ddp": "full",
    "fsdp-full": "fsdp-full",
    "fsdp-sharded": "fsdp-sharded",
    "model_parallel": "fsdp-sharded",
}
CFG = {"max_steps": 4, "save_steps": 2, "logging_steps": 1}
#: the 1 -> 2 -> 1 process chain: 6 steps, no dropout (each rank's random stream cannot follow a change
#: of process count), stopped after saving step 4 in the 2-process leg
CHAIN = {"cfg": {**CFG, "max_steps": 6}, "model_kw": {"dropout": 0.0}}


def fit(
    out: str,
    strategy: str,
    resume: str | None = None,
    *,
    cfg: dict = CFG,
    batch: int = 4,
    crash_at: int | None = None,
    model_kw: dict | None = None,
):
    """One run under `strategy` with `batch` samples per process, stopped (Crash) after saving `crash_at`;
    without a launcher its one-process group is freed after it (the next run makes its own)."""
    config = {**cfg, "strategy": STRATEGIES[strategy], "per_device_train_batch_size": batch}
    try:
        return train(
            out, config, resume=resume, model_seed=0 if resume is None else 99, crash_at=crash_at, model_kw=model_kw
        )
    except Crash:
        return None
    finally:
        if dist.is_initialized() and "RANK" not in os.environ:
            dist.destroy_process_group()


def saved_weights(path: str) -> dict[str, torch.Tensor]:
    """The full weights a checkpoint holds, whatever its format (the registry's `consolidate`)."""
    return FORMATS.get(json.loads(Path(path, MARKER).read_text())["format"]).consolidate(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted single-process run, and a finished run of each saving strategy (its checkpoint-2)."""
    root = tmp_path_factory.mktemp("xfmt")
    done = {name: str(root / name) for name in ("single", "fsdp-full", "fsdp-sharded")}
    reference = None
    for name, out in done.items():
        trainer = fit(out, name)
        reference = reference or trainer
    return reference, done


@pytest.mark.parametrize(
    "saved, resumed",
    [
        ("single", "fsdp-full"),
        ("single", "fsdp-sharded"),
        pytest.param("single", "model_parallel", marks=pytest.mark.heavy),  # single -> fsdp-sharded's IO
        ("fsdp-sharded", "single"),
        ("fsdp-full", "ddp"),
        pytest.param("fsdp-sharded", "fsdp-full", marks=pytest.mark.heavy),  # both directions covered above
    ],
)
def test_a_resume_across_formats_ends_bitwise_equal_to_the_uninterrupted_run(runs, tmp_path, caplog, saved, resumed):
    reference, done = runs
    out = str(tmp_path / "run")
    shutil.copytree(done[saved], out)
    shutil.rmtree(os.path.join(out, "checkpoint-4"))
    assert json.loads(Path(out, "checkpoint-2", MARKER).read_text())["format"] != FORMAT_OF[resumed]
    with caplog.at_level(logging.INFO, logger="kiln.strategies.format_translation"):
        trainer = fit(out, resumed, resume=os.path.join(out, "checkpoint-2"))
    assert (
        f"a {FORMAT_OF[saved]!r} checkpoint, through its full state into this run's {FORMAT_OF[resumed]!r}"
        in caplog.text
    )
    got = saved_weights(os.path.join(out, "checkpoint-4"))
    for key, value in saved_weights(os.path.join(done["single"], "checkpoint-4")).items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0)
    assert numeric_history(trainer)[2:] == numeric_history(reference)[2:]  # steps 3, 4 and the summary


def test_one_two_one_processes_across_formats(tmp_path):
    """single on 1 process (`full`) -> FSDP on 2 (`fsdp-sharded`) -> single on 1: ends where the uninterrupted
    1-process run does, within float reduction order (2 ranks sum each gradient in another order; the global
    batch, its samples and the data position are the same). On 2 processes DDP -> FSDP (`full` ->
    `fsdp-full`, same data shards) is bitwise equal to DDP uninterrupted."""
    from tests.world import run_world

    reference, chain = str(tmp_path / "reference"), str(tmp_path / "chain")
    fit(reference, "single", **CHAIN)
    os.makedirs(chain)
    shutil.copytree(os.path.join(reference, "checkpoint-2"), os.path.join(chain, "checkpoint-2"))
    run_world(os.path.join(os.path.dirname(__file__), "cross_format_worker.py"), tmp_path, timeout=600)
    assert json.loads(Path(chain, "checkpoint-4", MARKER).read_text())["format"] == "fsdp-sharded"
    with pytest.warns(
        UserWarning, match=r"saved by 2 processes and this run has 1 \(2 and 1 reading distinct batches\)"
    ):
        fit(chain, "single", os.path.join(chain, "checkpoint-4"), **CHAIN)
    want, got = (
        saved_weights(os.path.join(reference, "checkpoint-6")),
        saved_weights(os.path.join(chain, "checkpoint-6")),
    )
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    ddp, fsdp = (
        saved_weights(str(tmp_path / "ddp" / "checkpoint-4")),
        saved_weights(str(tmp_path / "fsdp" / "checkpoint-4")),
    )
    for key, value in ddp.items():
        torch.testing.assert_close(fsdp[key], value, rtol=0, atol=0)
    assert json.loads(Path(tmp_path, "fsdp", "checkpoint-4", MARKER).read_text())["format"] == "fsdp-full"


# -- refusals and routes ----------------------------------------------------------------------------
def _as_format(runs, tmp_path, fmt: str) -> str:
    """A copy of the single run's checkpoint-2 whose marker names format `fmt` (the refusal reads no file)."""
    out = str(tmp_path / "run")
    shutil.copytree(runs[1]["single"], out)
    shutil.rmtree(os.path.join(out, "checkpoint-4"))
    marker = Path(out, "checkpoint-2", MARKER)
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "format": fmt}))
    return out


@pytest.mark.parametrize("resumed", ["fsdp-sharded", "single"])
def test_a_deepspeed_checkpoint_is_refused_in_one_sentence_naming_kiln_convert(runs, tmp_path, resumed):
    out = _as_format(runs, tmp_path, "deepspeed")
    before = sorted(os.listdir(os.path.join(out, "checkpoint-2")))
    with pytest.raises(CheckpointError) as err:
        fit(out, resumed, resume=os.path.join(out, "checkpoint-2"))
    message = str(err.value)
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence
    assert f"'deepspeed' checkpoint format, but this run uses '{FORMAT_OF[resumed]}'" in message
    assert "kiln convert" in message and "strategy deepspeed" in message
    assert sorted(os.listdir(os.path.join(out, "checkpoint-2"))) == before  # nothing saved is touched


def test_an_unknown_format_is_refused(runs, tmp_path):
    out = _as_format(runs, tmp_path, "no-such-format")
    with pytest.raises(
        CheckpointError,
        match="'no-such-format' checkpoint format, but this run uses 'fsdp-full'; resume with the strategy that saved it",
    ):
        fit(out, "fsdp-full", resume=os.path.join(out, "checkpoint-2"))


def test_routes_through_the_registry():
    assert route(FullStateCheckpointIO, "full") == "native"
    assert route(ShardedCheckpointIO, "model-parallel-dcp") == "native"  # also_resumes
    assert route(ShardedCheckpointIO, "full") == route(FullStateCheckpointIO, "fsdp-sharded") == "translated"
    assert route(FullCheckpointIO, "fsdp-sharded") == "translated"
    assert route(FullStateCheckpointIO, "deepspeed") is None  # DeepSpeed's state is not translatable
    assert route(FullStateCheckpointIO, "xla-full") is None  # nor XLA's (no translation tested for it)
    assert route(PipelineCheckpointIO, "full") is None  # a stage holds part of the model
    assert route(PipelineCheckpointIO, "fsdp-sharded") == "native"
    assert route(CheckpointIO, "fsdp-full") is None  # an IO that does not opt in
    assert route(FullStateCheckpointIO, "unknown") is None


# -- the data-order warning counts data shards, not processes ------------------------------------------
class TwoShards(SingleDeviceStrategy):
    """Reads every other batch, as one of two data-parallel ranks would."""

    @property
    def data_shards(self) -> int:
        return 2


def test_the_marker_records_the_data_shards_and_a_pipeline_resume_on_one_process_does_not_warn(runs, tmp_path):
    out = str(tmp_path / "run")
    train(out, {**CFG, "max_steps": 2}, strategy=TwoShards)
    meta = json.loads(Path(out, "checkpoint-2", MARKER).read_text())
    assert (meta["world_size"], meta["data_shards"]) == (1, 2)
    # pp 2 -> 1: two processes that read one data shard together, resumed by one process (under another
    # format: a translated checkpoint loads on any process count)
    out = _as_format(runs, tmp_path / "pp", "full")
    marker = Path(out, "checkpoint-2", MARKER)
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "world_size": 2, "data_shards": 1}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(out, "fsdp-full", resume=os.path.join(out, "checkpoint-2"))
    assert not [w for w in caught if "reading distinct batches" in str(w.message)]
    assert json.loads(Path(out, "checkpoint-4", MARKER).read_text())["format"] == "fsdp-full"


@pytest.mark.parametrize(
    "meta, warns",
    [
        ({"world_size": 2, "data_shards": 1}, False),  # pp or tp 2 -> 1
        ({"world_size": 1, "data_shards": 2}, True),
        ({"world_size": 4, "data_shards": 2}, True),  # dp 2 x tp 2 -> 1
        ({"world_size": 2}, True),  # a marker from before data_shards: the process count is all it says
        ({"world_size": 1}, False),
    ],
)
def test_the_data_order_warning_compares_data_shards(meta, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_data_shards("ckpt", meta, 1, 1)
    shards = meta.get("data_shards", meta["world_size"])
    assert [str(w.message).split(":")[0] for w in caught] == (
        [
            f"ckpt was saved by {meta['world_size']} processes and this run has 1 ({shards} and 1 reading distinct batches)"
        ]
        if warns
        else []
    )


# -- the optimizer state's two keyings, and the generated table ---------------------------------------
def _adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.AdamW(
        [{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias, model[1].bias]}]
    )
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_optimizer_state_is_rekeyed_by_name_and_back():
    model, optimizer = _adamw()
    names = optimizer_names(model, optimizer)
    assert names == ["0.weight", "1.weight", "0.bias", "1.bias"]  # the optimizer's order, not the module's
    saved = optimizer.state_dict()
    by_name = keyed_by_name(saved, names, "ckpt")
    assert [g["params"] for g in by_name["param_groups"]] == [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    assert by_name["state"]["0.bias"] is saved["state"][2]
    assert keyed_by_name(by_name, names, "ckpt") is by_name and keyed_by_index(saved, names, "ckpt") is saved
    back = keyed_by_index(by_name, names, "ckpt")
    assert back["param_groups"] == saved["param_groups"] and back["state"].keys() == saved["state"].keys()
    assert all(back["state"][i] is saved["state"][i] for i in saved["state"])


def test_optimizer_state_of_other_parameters_is_refused_in_one_sentence():
    model, optimizer = _adamw()
    names = optimizer_names(model, optimizer)
    with pytest.raises(CheckpointError, match=r"holds 3 parameters and this run's optimizer has 4; was the set of"):
        keyed_by_name({"state": {}, "param_groups": [{"params": [0, 1, 2]}]}, names, "ckpt")
    with pytest.raises(CheckpointError, match=r"parameters this run's optimizer does not have \(2\.weight\); was the"):
        keyed_by_index({"state": {}, "param_groups": [{"params": ["0.weight", "2.weight"]}]}, names, "ckpt")


def test_the_generated_table_says_which_formats_translate():
    rows = {row["format"]: row for row in format_rows()}
    assert rows["full"]["translated"] == ["fsdp", "model_parallel"]
    assert rows["fsdp-sharded"]["translated"] == rows["fsdp-full"]["translated"] == ["ddp", "mps", "single"]
    assert rows["fsdp-full"]["resumed"] == ["fsdp", "model_parallel"]  # natively: not listed twice
    assert rows["deepspeed"]["translated"] == rows["xla-full"]["translated"] == []
