"""MFU's FLOP count (6 N + 12 L d T per token, N the parameters a token multiplies), the peak table, and
the logged figures, checked against counts written out by hand for GPT-2 (tied LM head), Llama (untied,
head_dim of its own), a model that counts itself and a plain module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.accelerators.peaks import peak_tflops
from kiln.engine.loop.throughput import ModelFlops, Throughput, matmul_parameters

transformers = pytest.importorskip("transformers")


def gpt2():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=50, n_positions=64)
    )


def test_gpt2_counts_its_tied_head_and_not_its_position_table():
    model = gpt2()
    every = sum(p.numel() for p in model.parameters())  # the tied head/token table once
    assert matmul_parameters(model) == every - model.transformer.wpe.weight.numel()
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    tokens, flops = ModelFlops(model).count(batch)
    assert tokens == 32
    assert flops == 32 * (6 * matmul_parameters(model) + 12 * 3 * 32 * 16)
    one_row = ModelFlops(model).count({"input_ids": torch.zeros(16, dtype=torch.long)})  # unbatched: T is its length
    assert one_row == (16, 16 * (6 * matmul_parameters(model) + 12 * 3 * 32 * 16))
    assert ModelFlops(model).count({"input_ids": torch.tensor(3)}) == (1, 6 * matmul_parameters(model))  # T = 0


def test_llama_counts_an_untied_head_and_its_own_head_dim():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=40,
    )
    model = transformers.LlamaForCausalLM(config)
    every = sum(p.numel() for p in model.parameters())
    assert matmul_parameters(model) == every - model.model.embed_tokens.weight.numel()
    tokens, flops = ModelFlops(model).count({"input_ids": torch.zeros(1, 10, dtype=torch.long)})
    assert (tokens, flops) == (10, 10 * (6 * matmul_parameters(model) + 12 * 2 * (4 * 16) * 10))


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def floating_point_ops(self, batch):  # type: ignore[no-untyped-def]
        return 1234.0


def test_a_models_own_count_wins_and_a_plain_module_counts_6n_per_token():
    assert ModelFlops(Counts()).count({"input_ids": torch.zeros(3, 5)}) == (15, 1234.0)
    plain = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
    assert ModelFlops(plain).count({"input_ids": torch.zeros(2, 7, dtype=torch.long)}) == (14, 14 * 6.0 * (4 * 3 + 3))
    assert ModelFlops(plain).count({"x": torch.zeros(2, 7)}) == (0, 0.0)  # no main input: nothing counted


@pytest.mark.parametrize(
    "name, precision, tf32, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989.4),
        ("NVIDIA H100 PCIe", "bf16", False, 756.0),
        ("NVIDIA H200", "fp8", False, 1978.9),
        ("NVIDIA A100-SXM4-80GB", "fp16", False, 312.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", True, 156.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5),
        ("NVIDIA A100-SXM4-80GB", "fp8", False, None),  # no fp8 on Ampere
        ("NVIDIA L4", "bf16-true", False, 121.0),
        ("AMD Instinct MI300X", "bf16", False, 1307.4),
        ("NVIDIA GeForce GTX 1080", "bf16", False, None),
        (None, "bf16", False, None),  # the CPU
    ],
)
def test_the_peak_is_the_devices_dense_rate_for_the_runs_number_format(name, precision, tf32, peak):
    assert peak_tflops(name, precision, tf32) == peak
    if not tf32:
        assert peak_tflops(name, precision) == peak  # TF32 is off unless the run allows it


def test_figures_give_the_job_and_each_rank_and_mfu_against_the_peak():
    meter = Throughput(nn.Linear(2, 2), peak_tflops=100.0)
    out = meter.figures(tokens=4000, flops=6e14, elapsed=2.0, ranks=2)
    assert out == pytest.approx(
        {
            "train_tokens_per_second": 2000.0,
            "train_tokens_per_second_per_rank": 1000.0,
            "train_tflops": 300.0,
            "train_tflops_per_rank": 150.0,
            "mfu": 1.5,
        }
    )
    no_peak = Throughput(nn.Linear(2, 2), peak_tflops=None).figures(tokens=0, flops=1e12, elapsed=1.0, ranks=1)
    assert no_peak == {"train_tflops": 1.0, "train_tflops_per_rank": 1.0}


def test_take_returns_the_windows_counts_and_starts_a_new_window():
    meter = Throughput(nn.Embedding(10, 4), peak_tflops=None)
    meter.count({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    meter.count({"input_ids": torch.zeros(1, 3, dtype=torch.long)})
    assert meter.take() == (9, 0.0)  # an embedding table alone multiplies nothing
    assert meter.take() == (0, 0.0)


class Clock:
    """The fit loop's clock (`time.perf_counter` as kiln.engine.loop.fit and fit_meter read it): each read is 0.5 s after
    the one before, so every elapsed time the loop measures is known exactly."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        self.now += 0.5
        return self.now


def test_a_fit_logs_throughput_and_mfu_against_the_configured_peak(tmp_path, monkeypatch):
    from kiln import Trainer
    from kiln.engine.callbacks.base import Callback
    from kiln.engine.loop import fit, fit_meter
    from tests.helpers import TokenModel, base_config, padded_token_data

    seen = []

    class Figures(Callback):
        def on_log(self, config, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if "loss" in logs:
                seen.append(logs)

    # the clock is read at the start, at each of the 2 logging steps and at the end: each window lasts
    # 0.5 s and the run 1.5 s
    clock = Clock()
    monkeypatch.setattr(fit, "time", clock)
    monkeypatch.setattr(fit_meter, "time", clock)
    model = TokenModel()
    cfg = base_config(tmp_path, max_steps=2, per_device_train_batch_size=2)
    cfg["log"].update(steps=1, mfu_peak_tflops=1e-6)
    out = Trainer(model, cfg, train_dataset=padded_token_data(n=8, length=12), callbacks=[Figures()]).fit()
    assert len(seen) == 2
    for logs in seen:  # one process: the job's figures are the rank's; a window is 1 step, 2 rows of 12 tokens
        assert logs["steps_per_second"] == 2.0
        assert logs["samples_per_second"] == 4.0
        assert logs["train_tokens_per_second"] == logs["train_tokens_per_second_per_rank"] == 48.0
        assert logs["train_tflops_per_rank"] == logs["train_tflops"]
        assert logs["mfu"] == pytest.approx(logs["train_tflops"] / 1e-6)
    assert out.metrics["train_runtime"] == 1.5
    assert out.metrics["train_steps_per_second"] == pytest.approx(2 / 1.5)
    assert out.metrics["train_samples_per_second"] == pytest.approx(4 / 1.5)
    assert out.metrics["train_tokens_per_second"] == pytest.approx(48 / 1.5)


class FakeCounters:
    """An accelerator's allocator counters (CUDA's max_memory_allocated / reset_peak_memory_stats): each
    window's peak is the next of `peaks`, until the counter is reset."""

    def __init__(self, *peaks: int) -> None:
        self.peaks, self.resets = list(peaks), 0

    def has_memory_stats(self) -> bool:
        return True

    def max_memory_allocated(self) -> int:
        return self.peaks[self.resets]

    def memory_allocated(self) -> int:
        return 0

    def reset_peak_memory_stats(self) -> None:
        self.resets += 1

    def empty_cache(self) -> None:
        pass


def test_the_end_of_run_summary_gives_the_whole_fits_tflops_and_mfu_and_each_window_its_peak_memory(
    tmp_path, monkeypatch
):
    from kiln import Trainer
    from kiln.engine.callbacks.base import Callback
    from kiln.engine.loop import fit, fit_meter
    from kiln.engine.loop.peak_memory import WindowPeakMemory
    from kiln.loggers.metrics import MemoryTracker
    from tests.helpers import TokenModel, base_config, padded_token_data

    seen = []

    class Figures(Callback):
        def on_log(self, config, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            seen.append(logs)

    counters = FakeCounters(3 * 2**30, 2**29, 2**28)  # a device with counters (CUDA) under the CPU run
    tracker = MemoryTracker()
    clock = Clock()
    monkeypatch.setattr(fit, "time", clock)
    monkeypatch.setattr(fit_meter, "time", clock)
    monkeypatch.setattr(fit_meter, "WindowPeakMemory", lambda accelerator, _: WindowPeakMemory(counters, tracker))
    model = TokenModel()
    cfg = base_config(tmp_path, max_steps=3, per_device_train_batch_size=2)
    cfg["log"].update(steps=2, mfu_peak_tflops=1e-6)  # step 3 is never logged: the summary still counts it
    out = Trainer(model, cfg, train_dataset=padded_token_data(n=8, length=12), callbacks=[Figures()]).fit()
    per_step = ModelFlops(model).count({"input_ids": torch.zeros(2, 12, dtype=torch.long)})[1]
    runtime = out.metrics["train_runtime"]
    assert out.metrics["train_tflops"] == pytest.approx(3 * per_step / runtime / 1e12)
    assert out.metrics["train_tflops_per_rank"] == out.metrics["train_tflops"]
    assert out.metrics["train_mfu"] == pytest.approx(out.metrics["train_tflops"] / 1e-6)
    assert "mfu" not in out.metrics  # the summary's figures are train_*
    windows = [logs for logs in seen if "loss" in logs]
    assert [logs["peak_memory_gib"] for logs in windows] == [3.0]  # the first window's peak, then a new window
    assert counters.resets == 1
    device = FakeCounters(0, 1, 3)
    monkeypatch.setattr(MemoryTracker, "_device", staticmethod(lambda: device))
    tracker.start("t")  # the stage peak HF's memory metrics report is the largest window's, not the last one's
    tracker.note_device_peak(5)
    tracker.note_device_peak(2)
    tracker.stop("t")
    assert tracker.gpu["t"]["peak"] == 5
    tracker.start("u")
    tracker.stop("u")
    assert tracker.gpu["u"]["peak"] == 3  # a new stage forgets the last one's window peaks
    no_peak = Trainer(TokenModel(), base_config(tmp_path / "b", max_steps=1), train_dataset=padded_token_data(n=4))
    assert "train_mfu" not in no_peak.fit().metrics  # the CPU has no peak unless log.mfu_peak_tflops names one


def test_a_device_without_counters_logs_no_peak_memory():
    from kiln.accelerators.cpu import CPUAccelerator
    from kiln.engine.loop.peak_memory import WindowPeakMemory

    assert WindowPeakMemory(CPUAccelerator(), None).take() == {}


def test_each_windows_peak_goes_to_the_memory_tracker_before_the_counter_is_reset():
    from kiln.engine.loop.peak_memory import WindowPeakMemory

    noted: list[int] = []

    class Tracker:
        def note_device_peak(self, peak: int) -> None:
            noted.append(peak)

    meter = WindowPeakMemory(FakeCounters(7 * 2**30, 2**29), Tracker())
    assert meter.take() == {"peak_memory_gib": 7.0}
    assert meter.take() == {"peak_memory_gib": 0.5}
    assert noted == [7 * 2**30, 2**29]
