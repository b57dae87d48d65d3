"""`kiln estimate CONFIG [--nproc N] [--device-memory GiB] [--json]`: the table and the JSON for a small
model, and one sentence for each bad input (no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kiln.cli import main

TASK = {"model": "tests.estimate.models:mlp", "data": "tests.estimate.models:vectors"}


def write(tmp_path: Path, **tree) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "run"), "task": TASK, **tree}))
    return str(path)


def test_the_table_and_the_json_name_every_layout_and_what_fits(tmp_path, capsys):
    config = write(
        tmp_path, data={"per_device_train_batch_size": 4}, optim={"name": "adamw_torch"}, strategy={"name": "ddp"}
    )
    assert main(["estimate", config, "--nproc", "2", "--device-memory", "0.017", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"] == 2 * (256 * 1024 + 1024 + 1024 * 256 + 256) + 257
    assert (out["nproc"], out["micro_batch_size"], out["precision"]) == (2, 4, "fp32")
    by = {(r["strategy"], r["mesh"]): r for r in out["layouts"]}
    assert ("single", "1 device") not in by  # two processes
    ddp, fsdp = by[("ddp", "dp_replicate=2")], by[("fsdp full_shard", "dp_shard=2")]
    assert ddp["params"] == 4 * out["parameters"] and fsdp["params"] == ddp["params"] / 2
    assert ddp["fits"] is False and fsdp["fits"] is True  # 17 MiB: 1.1M fp32 AdamW parameters need ~21 MiB unsharded
    # the MLP has no tp plan of its own: model_parallel's rows are left out, with kiln's sentence why
    assert not [mesh for strategy, mesh in by if strategy == "model_parallel"]
    assert "holds no Transformers model with a tensor-parallel plan" in out["tensor_parallel_refused"]["2"]
    assert main(["estimate", config, "--nproc", "2", "--device-memory", "0.017"]) == 0
    table = capsys.readouterr().out
    assert "model_parallel tp=2 left out: strategy.tp_plan is auto but MLP holds no" in table
    assert "strategy" in table and "peak/rank" in table and "ZeRO-3 offload optimizer and parameters" in table
    ddp_line = next(line for line in table.splitlines() if line.startswith("*ddp "))  # the config's strategy
    assert ddp_line.split()[-1] == "no"
    assert not [line for line in table.splitlines() if line.startswith("*") and "ddp" not in line]


def test_the_configured_deepspeed_runs_reduce_bucket_is_its_config_with_hfs_auto_size(tmp_path, capsys):
    zero = {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True}
    config = write(
        tmp_path,
        task={"model": "tests.estimate.models:gpt2", "data": "tests.estimate.models:tokens"},
        precision={"name": "bf16"},
        strategy={"name": "deepspeed", "config": {"zero_optimization": zero}},
    )
    assert main(["estimate", config, "--json"]) == 0
    by = {r["mesh"]: r for r in json.loads(capsys.readouterr().out)["layouts"] if r["strategy"] == "deepspeed"}
    hidden = 32  # HF's "auto": hidden_size squared, two buffers with overlap_comm, 16-bit
    assert by["ZeRO-2"]["buckets"] == by["ZeRO-1"]["buckets"] == 2 * hidden * hidden * 2
    assert (by["ZeRO-0"]["buckets"], by["ZeRO-3"]["buckets"]) == (0, hidden * hidden * 2)


def test_model_parallel_rows_take_the_activations_of_the_model_split_by_the_configured_plan(tmp_path, capsys):
    plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    config = write(
        tmp_path,
        data={"per_device_train_batch_size": 4},
        strategy={"name": "model_parallel", "options": {"mesh": {"tp": 2}, "tp_plan": plan}},
    )
    assert main(["estimate", config, "--nproc", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    by = {(r["strategy"], r["mesh"]): r for r in out["layouts"]}
    tp, ddp = by[("model_parallel", "dp_shard=1 x tp=2")], by[("ddp", "dp_replicate=2")]
    assert out["tensor_parallel_refused"] == {}
    # the blocks' hidden activations are split, the blocks' inputs, outputs and the head's are whole on each rank
    assert ddp["activations"] / 2 < tp["activations"] < ddp["activations"]
    assert tp["gathered"] == 0  # tp alone: no FSDP unit to gather


@pytest.mark.parametrize(
    "tree, args, sentence",
    [
        ({"strategy": {"name": "magic"}}, [], "Unknown strategy 'magic' in `strategy.name`"),
        (
            {"strategy": {"name": "fsdp", "options": {"tp": 3}}},
            ["--nproc", "4"],
            "strategy.options.tp is 3, which does not divide --nproc 4",
        ),
        (
            {"strategy": {"name": "model_parallel", "options": {"mesh": {"dp_shard": 2, "tp": 2}}}},
            ["--nproc", "2"],
            "mesh",
        ),
        ({}, ["--nproc", "0"], "--nproc is 0; give the number of processes"),
        ({"task": {"model": None, "data": TASK["data"]}}, [], "the config must name task.model and task.data"),
        ({"task": {"model": "tests.estimate.models:nothing", "data": TASK["data"]}}, [], "nothing"),
        ({}, ["--bogus"], "unrecognised argument '--bogus'"),
        ({"task": {**TASK, "data": "tests.estimate.models:no_data"}}, [], "returned no train_dataset or eval_dataset"),
        (  # the MLP has no config.hidden_size for HF's "auto" bucket size
            {"strategy": {"name": "deepspeed", "config": {"zero_optimization": {"reduce_bucket_size": "auto"}}}},
            [],
            'the DeepSpeed "auto" values zero_optimization.reduce_bucket_size cannot be filled',
        ),
    ],
)
def test_bad_input_is_one_sentence(tmp_path, capsys, tree, args, sentence):
    config = write(tmp_path, **tree)
    assert main(["estimate", config, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln estimate: error: ") and sentence in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
