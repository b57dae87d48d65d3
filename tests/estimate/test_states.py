"""The model-state rules of `kiln estimate` (states.py, layouts.py, report.py): DeepSpeed's stages equal
DeepSpeed's own estimators (the anchors), the optimizer state each optimizer keeps, each layout's share
per rank, and which peak fits the device."""

from __future__ import annotations

import pytest

from kiln.estimate.layouts import Setting, layouts
from kiln.estimate.report import GIB, peak, rows
from kiln.estimate.states import (
    Counts,
    deepspeed_states,
    deepspeed_width,
    optimizer_bytes,
    reduce_bucket,
    torch_states,
)
from kiln.estimate.trace import Activations
from kiln.utils.errors import ConfigError

MATRIX = Counts((((1000, 600), True), ((600,), True), ((50, 50), False)), largest_layer=600_600)


@pytest.mark.parametrize("ranks", [1, 4, 16])
def test_deepspeed_stages_2_and_3_equal_deepspeeds_own_estimates(ranks):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as zero3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as zero2

    total, largest = MATRIX.total, MATRIX.largest_layer
    cases = [
        (deepspeed_states(MATRIX, 2, ranks, "adamw_torch"), zero2(total, ranks, cpu_offload=False)[1]),
        (deepspeed_states(MATRIX, 2, ranks, "adamw_torch", offload_optimizer=True), zero2(total, ranks)[1]),
        (deepspeed_states(MATRIX, 3, ranks, "adamw_torch"), zero3(total, largest, ranks, cpu_offload=False)[1]),
        (
            deepspeed_states(MATRIX, 3, ranks, "adamw_torch", offload_optimizer=True),
            zero3(total, largest, ranks, cpu_offload_params=False)[1],
        ),
        (
            deepspeed_states(MATRIX, 3, ranks, "adamw_torch", offload_optimizer=True, offload_params=True),
            zero3(total, largest, ranks)[1],
        ),
    ]
    for ours, theirs in cases:
        assert ours.total == pytest.approx(theirs, abs=1)


def test_stages_0_and_1_shard_less_and_offload_moves_the_fp32_part_to_the_host():
    p = MATRIX.total
    assert deepspeed_states(MATRIX, 0, 4, "adamw_torch").total == 20 * p  # nothing sharded
    assert deepspeed_states(MATRIX, 1, 4, "adamw_torch").total == 2 * p + 2 * p + 16 * p / 4
    offloaded = deepspeed_states(MATRIX, 2, 4, "adamw_torch", offload_optimizer=True)
    assert offloaded.host == 18 * p
    sgd = deepspeed_states(MATRIX, 2, 1, "sgd")  # no optimizer state: 10 bytes beside the 16-bit weights
    assert sgd.total == 2 * p + 10 * p


def test_an_fp32_run_keeps_4_byte_weights_and_gradients_beside_deepspeeds_fp32_part():
    p, largest = MATRIX.total, MATRIX.largest_layer
    assert [deepspeed_width(name) for name in ("fp32", "tf32", "bf16", "fp16", "bf16-true", "fp16-true")] == [
        4,
        4,
        2,
        2,
        2,
        2,
    ]
    zero2 = deepspeed_states(MATRIX, 2, 1, "adamw_torch", w=4)  # measured: weights 4, gradients 4, fp32 part 16
    assert (zero2.params, zero2.grads, zero2.optimizer) == (4 * p, 4 * p, 16 * p)
    zero3 = deepspeed_states(MATRIX, 3, 2, "adamw_torch", w=4)
    assert (zero3.params, zero3.grads, zero3.optimizer, zero3.gathered) == (2 * p, 2 * p, 6 * p, 8 * largest)
    offloaded = deepspeed_states(MATRIX, 3, 2, "adamw_torch", None, True, True, w=4)
    assert offloaded.host == 24 * p


def test_deepspeeds_reduce_bucket_follows_the_config_and_deepspeeds_defaults():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    defaults = {stage: DeepSpeedZeroConfig(stage=stage) for stage in (1, 2, 3)}
    assert all(c.contiguous_gradients for c in defaults.values())
    assert (defaults[2].overlap_comm, defaults[3].overlap_comm) == (False, True)
    assert reduce_bucket(2, {}, 4) == defaults[2].reduce_bucket_size * 4  # 2 GB for an fp32 run
    assert reduce_bucket(1, {}, 2) == defaults[1].reduce_bucket_size * 2
    assert reduce_bucket(3, {}, 2) == defaults[3].reduce_bucket_size * 2  # overlap_comm adds no second one
    assert reduce_bucket(0, {}, 4) == 0  # no ZeRO optimizer
    small = {"reduce_bucket_size": 1000}
    assert reduce_bucket(2, {**small, "overlap_comm": True}, 2) == 2 * 1000 * 2  # double buffered
    assert reduce_bucket(3, {**small, "overlap_comm": True}, 4) == 1000 * 4
    apart = {**small, "contiguous_gradients": False}
    assert reduce_bucket(2, apart, 4) == reduce_bucket(3, apart, 4) == 0
    offload = {**apart, "offload_optimizer": {"device": "cpu"}}  # stages 1-2 make gradients contiguous to offload
    assert (reduce_bucket(1, offload, 4), reduce_bucket(2, offload, 4), reduce_bucket(3, offload, 4)) == (4000, 4000, 0)
    assert reduce_bucket(2, {**apart, "offload_optimizer": {"device": "none"}}, 4) == 0
    for stage, optimizer, params in ((1, False, False), (2, True, False), (3, False, False), (3, True, True)):
        states = deepspeed_states(MATRIX, stage, 4, "adamw_torch", None, optimizer, params, bucket=7.0)
        assert states.buckets == 7.0
        assert states.total == deepspeed_states(MATRIX, stage, 4, "adamw_torch", None, optimizer, params).total + 7


def test_each_optimizer_keeps_its_own_state():
    trainable = MATRIX.trainable
    assert optimizer_bytes(MATRIX, "fp32", "adamw_torch_fused") == 2 * 4 * trainable
    assert optimizer_bytes(MATRIX, "bf16", "adamw_torch") == 2 * 4 * trainable  # mixed: fp32 weights and state
    assert optimizer_bytes(MATRIX, "bf16-true", "adamw_torch") == 2 * 2 * trainable  # the weights' width
    assert optimizer_bytes(MATRIX, "fp32", "sgd") == 0
    assert optimizer_bytes(MATRIX, "fp32", "sgd", "momentum=0.9") == 4 * trainable
    assert optimizer_bytes(MATRIX, "fp32", "sgd", "momentum=0") == 0
    assert optimizer_bytes(MATRIX, "fp32", "adamw_bnb_8bit") == 2 * trainable  # one byte a state
    assert optimizer_bytes(MATRIX, "fp32", "paged_adamw_8bit") == 2 * trainable
    assert optimizer_bytes(MATRIX, "fp32", "lion_32bit") == 4 * trainable
    assert optimizer_bytes(MATRIX, "fp32", "schedule_free_adamw") == 3 * 4 * trainable
    assert optimizer_bytes(MATRIX, "fp32", "adafactor") == 4 * (1000 + 600 + 600)  # a row and a column; a vector
    with pytest.raises(ConfigError, match="does not know how much state optimizer 'mystery'"):
        optimizer_bytes(MATRIX, "fp32", "mystery")


def test_torch_layouts_share_the_states_and_offload_keeps_them_on_the_host():
    w = 4
    single = torch_states(MATRIX, "fp32", "adamw_torch", None)
    assert (single.params, single.grads, single.optimizer) == (
        MATRIX.total * w,
        MATRIX.trainable * w,
        8 * MATRIX.trainable,
    )
    sharded = torch_states(MATRIX, "fp32", "adamw_torch", None, shard=4, gathered_params=100)
    assert sharded.params == single.params / 4 and sharded.optimizer == single.optimizer / 4
    assert sharded.gathered == 3 * 100 * w  # the unit's weights, gradients and FSDP2's all-gather buffer
    one_rank = torch_states(MATRIX, "fp32", "adamw_torch", None, shard=1, gathered_params=100)
    assert one_rank.gathered == 2 * 100 * w  # on one rank FSDP2 gathers into no buffer
    off = torch_states(MATRIX, "fp32", "adamw_torch", None, shard=4, gathered_params=100, offload=True)
    assert (
        off.params == off.grads == off.optimizer == 0 and off.host == sharded.params + sharded.grads + sharded.optimizer
    )
    ddp = torch_states(MATRIX, "bf16-true", "adamw_torch", None, buckets=True)
    assert ddp.buckets == ddp.grads == MATRIX.trainable * 2


def test_the_layouts_for_8_processes_and_their_peaks():
    setting = Setting("fp32", "adamw_torch", None, largest_unit=1000)
    found = {(r.strategy, r.mesh): r for r in layouts(MATRIX, 8, setting)}
    assert ("single", "1 device") not in found  # one device only with one process
    no_shard = found[("fsdp no_shard", "dp_replicate=8")].states  # replicated: every rank holds it all
    assert (no_shard.params, no_shard.gathered) == (MATRIX.total * 4, 2 * 1000 * 4)
    one = {(r.strategy, r.mesh): r.states for r in layouts(MATRIX, 1, setting)}
    assert one[("single", "1 device")] == torch_states(MATRIX, "fp32", "adamw_torch", None)
    assert {m for s, m in found if s == "fsdp hybrid_shard"} == {
        "dp_replicate=4, dp_shard=2",
        "dp_replicate=2, dp_shard=4",
    }
    assert {m for s, m in found if s == "model_parallel"} == {
        "dp_shard=4 x tp=2",
        "dp_shard=2 x tp=4",
        "dp_shard=1 x tp=8",
    }
    assert found[("model_parallel", "dp_shard=1 x tp=8")].states.gathered == 0  # tp alone: no FSDP unit to gather
    assert found[("model_parallel", "dp_shard=2 x tp=4")].states.gathered == 3 * (1000 // 4) * 4
    assert {m for s, m in found if s == "deepspeed"} >= {"ZeRO-0", "ZeRO-3", "ZeRO-3 offload optimizer and parameters"}
    zero2 = found[("deepspeed", "ZeRO-2")]  # fp32: 4-byte weights, DeepSpeed's default bucket in fp32
    assert zero2.states == deepspeed_states(MATRIX, 2, 8, "adamw_torch", w=4, bucket=5e8 * 4)
    assert zero2.step_temporaries == 4 * MATRIX.trainable / 8  # foreach AdamW over the fp32 partition
    assert found[("deepspeed", "ZeRO-0")].step_temporaries == 4 * MATRIX.trainable
    # ZeRO-3 flattens its gradient partitions into a new fp32 gradient at the step, beside AdamW's temporaries
    assert found[("deepspeed", "ZeRO-3")].step_temporaries == 2 * 4 * MATRIX.trainable / 8
    assert zero2.grad_share == zero2.states.grads / (MATRIX.trainable * 4)  # the share of backward's gradients
    offloaded = found[("deepspeed", "ZeRO-2 offload optimizer")]
    assert offloaded.states == deepspeed_states(MATRIX, 2, 8, "adamw_torch", None, True, False, 4, 5e8 * 4)
    small = Setting("bf16", "adamw_torch", None, 1000, {"reduce_bucket_size": 1000, "overlap_comm": True})
    configured = {(r.strategy, r.mesh): r.states for r in layouts(MATRIX, 8, small)}
    assert configured[("deepspeed", "ZeRO-2")].buckets == 2 * 1000 * 2
    assert configured[("deepspeed", "ZeRO-3 offload optimizer")].buckets == 1000 * 2
    assert configured[("deepspeed", "ZeRO-2")].params == 2 * MATRIX.total  # bf16: DeepSpeed's 16-bit weights
    traced = Activations(peak=10_000_000, grads=1_000_000)
    tp4 = found[("model_parallel", "dp_shard=2 x tp=4")]
    activations, total = peak(tp4, traced)
    assert activations == 10_000_000 / 4
    s = tp4.states
    assert total == s.params + s.optimizer + max(
        s.gathered + activations + 1_000_000 / 8, s.grads + tp4.step_temporaries
    )
    # with a trace of the model split 4 ways, its activations are one tp rank's as they are, and its gradients
    # (one tp rank's too) are divided by the dp shard alone
    split = Activations(peak=3_000_000, grads=400_000)
    activations, total = peak(tp4, traced, split)
    assert activations == 3_000_000
    assert total == s.params + s.optimizer + max(s.gathered + 3_000_000 + 400_000 / 2, s.grads + tp4.step_temporaries)
    by_tp = {r.layout.mesh: r for r in rows(list(found.values()), traced, None, {4: split})}
    assert by_tp["dp_shard=2 x tp=4"].activations == 3_000_000
    assert by_tp["dp_shard=4 x tp=2"].activations == 10_000_000 / 2  # no split trace for tp 2: the share 1/tp
    assert by_tp["dp_replicate=8"].activations == 10_000_000  # DDP (tp 1) never takes a split trace
    ddp = found[("ddp", "dp_replicate=8")]
    assert peak(ddp, traced)[1] == ddp.states.params + ddp.states.optimizer + ddp.states.buckets + 11_000_000
    quiet = Activations(peak=0, grads=0)  # no activations: the optimizer step is the peak, foreach AdamW's temporaries
    assert peak(ddp, quiet)[1] == ddp.states.total + MATRIX.trainable * 4
    small_bucket = Setting("fp32", "adamw_torch", None, 1000, {"reduce_bucket_size": 10**6})
    found = {(r.strategy, r.mesh): r for r in layouts(MATRIX, 8, small_bucket)}
    fits = rows(list(found.values()), traced, device_memory_gib=0.05)
    assert {r.layout.strategy: r.fits for r in fits}["deepspeed"] is True  # ZeRO-3 offload fits 50 MiB
    assert [r.fits for r in fits if r.layout.mesh == "ZeRO-0"] == [
        r.peak <= 0.05 * GIB for r in fits if r.layout.mesh == "ZeRO-0"
    ]
    assert all(r.fits is None for r in rows(list(found.values()), traced, None))


def test_the_table_gives_sizes_in_binary_units_under_aligned_columns():
    from kiln.estimate.report import _size, table

    assert [_size(n) for n in (512, 1024, 1536, 2**20, 3 * 2**30)] == [
        "512 B",
        "1.00 KiB",
        "1.50 KiB",
        "1.00 MiB",
        "3.00 GiB",
    ]
    setting = Setting("fp32", "adamw_torch", None, largest_unit=1000)
    result = rows(layouts(MATRIX, 2, setting), Activations(peak=2**20, grads=0), 1.0)
    lines = table(result, ["head"], configured="fsdp").splitlines()
    assert lines[:2] == ["head", ""]
    header, rule, body = lines[2], lines[3], lines[4:]
    assert set(rule) == {"-", " "} and len(rule) >= len(header)
    starts = [i for i in range(1, len(rule)) if rule[i] == "-" and rule[i - 1] == " "]  # each column's first character
    assert len(starts) == 7 and all(row[i] != " " for row in (header, *body) for i in starts)
    assert all(line.startswith("*fsdp") for line in body if line.startswith("*"))
    fsdp = next(line for line in body if line.startswith("*fsdp full_shard"))
    # 1000 fp32 weights, their gradients and the all-gather buffer
    assert "+7.81 KiB gathered" not in fsdp and "+11.72 KiB gathered" in fsdp
    assert fsdp.split()[-1] == "yes"
