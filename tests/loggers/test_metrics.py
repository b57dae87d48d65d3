"""Speed and memory metrics with HF's names, and the aligned block log_metrics prints."""

from __future__ import annotations

import pytest
import torch

from kiln.loggers.metrics import MemoryTracker, format_log_metrics, metrics_format, speed_metrics


def test_speed_metrics_names_and_values():
    m = speed_metrics("train", 100.0, num_samples=64, num_steps=8, num_tokens=1000, end_time=104.0)
    assert m == {
        "train_runtime": 4.0,
        "train_samples_per_second": 16.0,
        "train_steps_per_second": 2.0,
        "train_tokens_per_second": 250.0,
    }
    assert speed_metrics("eval", 10.0, num_samples=3, end_time=13.0) == {
        "eval_runtime": 3.0,
        "eval_samples_per_second": 1.0,
    }
    assert speed_metrics("test", 5.0, num_samples=3, end_time=5.0) == {"test_runtime": 0.0}
    assert set(speed_metrics("eval", 0.0)) == {"eval_runtime"}  # now - 0: only the runtime
    assert speed_metrics("eval", 0.0, num_samples=10, end_time=3.0)["eval_samples_per_second"] == 3.333  # HF: 3 places
    assert speed_metrics("eval", 0.0, num_samples=1, end_time=1 / 3) == {
        "eval_runtime": 0.3333,
        "eval_samples_per_second": 3.0,
    }


def test_metrics_format_and_aligned_block():
    metrics = {
        "train_runtime": 3725.5,
        "train_mem_gpu_alloc_delta": 693 * 2**20,
        "total_flos": 3 * 2**30,
        "train_loss": 0.123456789,
        "epoch": 3.0,
        "train_samples": 1000,
    }
    formatted = metrics_format(metrics)
    assert formatted == {
        "train_runtime": "1:02:05.50",
        "train_mem_gpu_alloc_delta": "693MB",
        "total_flos": "3GF",
        "train_loss": 0.1235,
        "epoch": 3.0,
        "train_samples": 1000,
    }
    lines = format_log_metrics("train", metrics).splitlines()
    assert lines[0] == "***** train metrics *****"
    body = lines[1:]
    assert [line.split("=")[0].strip() for line in body] == sorted(metrics)
    assert len({line.index(" = ") for line in body}) == 1  # the '=' signs line up
    assert len({len(line) for line in body}) == 1  # values right-aligned to one column
    assert body[sorted(metrics).index("train_mem_gpu_alloc_delta")].endswith("  693MB")
    assert format_log_metrics("eval", {}) == "***** eval metrics *****"


def test_memory_tracker_is_a_no_op_when_skipped():
    tracker = MemoryTracker(skip_memory_metrics=True)
    tracker.start("train")
    metrics: dict = {}
    tracker.stop_and_update("train", metrics)
    assert metrics == {} and tracker._thread is None


def test_memory_tracker_reports_deltas_with_init_folded_into_the_first_stage():
    tracker = MemoryTracker()
    tracker.start("init")
    tracker.stop("init")
    init_metrics: dict = {}
    tracker.update_metrics("init", init_metrics)  # init reports nothing itself (HF), and keeps its figures for later
    assert init_metrics == {}
    tracker.start("train")
    tracker.start("eval")  # nested: ignored, counted in train
    block = torch.ones(64 * 2**20 // 4)  # 64 MB kept alive
    peak = torch.ones(128 * 2**20 // 4)  # 128 MB freed before the end
    del peak
    eval_metrics: dict = {}
    tracker.stop_and_update("eval", eval_metrics)
    assert eval_metrics == {}
    metrics: dict = {}
    tracker.stop_and_update("train", metrics)
    for key in (
        "init_mem_cpu_alloc_delta",
        "init_mem_cpu_peaked_delta",
        "train_mem_cpu_alloc_delta",
        "train_mem_cpu_peaked_delta",
        "before_init_mem_cpu",
    ):
        assert key in metrics, key
    assert metrics["train_mem_cpu_alloc_delta"] > 32 * 2**20
    assert metrics["train_mem_cpu_peaked_delta"] >= 0
    again: dict = {}
    tracker.start("eval")
    tracker.stop_and_update("eval", again)
    assert "init_mem_cpu_alloc_delta" not in again and "eval_mem_cpu_alloc_delta" in again
    del block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_tracker_gpu_deltas():
    tracker = MemoryTracker()
    tracker.start("train")
    kept = torch.ones(16 * 2**20 // 4, device="cuda")  # 16 MB kept
    peak = torch.ones(64 * 2**20 // 4, device="cuda")  # 64 MB freed
    del peak
    metrics: dict = {}
    tracker.stop_and_update("train", metrics)
    assert metrics["train_mem_gpu_alloc_delta"] == 16 * 2**20
    assert metrics["train_mem_gpu_peaked_delta"] == 64 * 2**20
    del kept
