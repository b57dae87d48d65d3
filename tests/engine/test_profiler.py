"""`profile:` records torch.profiler traces of exactly the scheduled optimizer steps, one folder per rank,
in the format TensorBoard's profiler plugin and chrome://tracing read; a bad schedule is one sentence."""

from __future__ import annotations

import glob
import json
import os

import pytest
from omegaconf import OmegaConf

from kiln import Trainer
from kiln.config import load_config
from kiln.engine.callbacks.profiler import ProfilerCallback, profiler_callback
from kiln.utils.errors import ConfigError
from tests.helpers import TinyRegressor, base_config, regression_data


def fit(tmp_path, steps: int = 6, **profile):  # type: ignore[no-untyped-def]
    cfg = load_config(
        OmegaConf.create(
            base_config(tmp_path, profile=profile, train={"max_steps": steps}, data={"per_device_train_batch_size": 4})
        )
    )
    Trainer(TinyRegressor(), cfg, train_dataset=regression_data(32)).fit()
    return cfg


def traces(cfg, rank: int = 0) -> list[dict]:  # type: ignore[no-untyped-def]
    files = sorted(glob.glob(os.path.join(cfg.output_dir, "profiles", f"rank{rank}", f"rank{rank}.*.pt.trace.json")))
    return [json.load(open(f)) for f in files]


def profiled_steps(trace: dict) -> list[int]:
    return sorted(
        int(e["name"].split("#")[1]) for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")
    )


def test_the_active_steps_of_the_schedule_are_traced_with_their_operators(tmp_path):
    cfg = fit(tmp_path, wait=1, warmup=1, active=2)
    [trace] = traces(cfg)
    assert profiled_steps(trace) == [2, 3]  # step 0 waits, step 1 warms up
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") and ("mm" in n or "linear" in n) for n in names)  # the model's matmuls


def test_repeat_writes_one_trace_per_cycle_and_skip_first_shifts_them(tmp_path):
    cfg = fit(tmp_path, steps=8, wait=0, warmup=1, active=1, repeat=2, skip_first=2)
    assert [profiled_steps(t) for t in traces(cfg)] == [[3], [5]]


def test_accelerates_schedule_option_overrides_the_keys(tmp_path):
    cfg = fit(tmp_path, active=1, schedule_option={"wait": 0, "warmup": 0, "active": 3})
    assert [profiled_steps(t) for t in traces(cfg)] == [[0, 1, 2]]


def test_a_span_cut_short_by_the_end_of_training_is_still_written(tmp_path):
    cfg = fit(tmp_path, steps=3, wait=0, warmup=1, active=5)
    # steps 1 and 2, then the span torch opened after the last step (#3: the end of training, up to stop())
    assert [profiled_steps(t) for t in traces(cfg)] == [[1, 2, 3]]


def test_no_profile_section_means_no_profiler_and_no_folder(tmp_path):
    cfg = fit(tmp_path, steps=2)
    assert not os.path.exists(os.path.join(cfg.output_dir, "profiles"))


def config(tmp_path, **profile):  # type: ignore[no-untyped-def]
    return load_config(OmegaConf.create(base_config(tmp_path, profile=profile)))


def test_ranks_choose_who_profiles_and_each_rank_has_its_folder(tmp_path):
    cfg = config(tmp_path, active=1, ranks=[1], output_trace_dir=str(tmp_path / "traces"))
    assert profiler_callback(cfg, 0, "cpu") is None
    callback = profiler_callback(cfg, 1, "cpu")
    assert isinstance(callback, ProfilerCallback)
    assert callback.folder == str(tmp_path / "traces" / "rank1") and callback.worker_name == "rank1"
    every = profiler_callback(config(tmp_path, active=1), 3, "cpu")
    assert every is not None and every.folder == os.path.join(str(tmp_path / "out"), "profiles", "rank3")


def test_activities_default_to_cpu_and_the_training_device(tmp_path):
    cfg = config(tmp_path, active=1, record_shapes=True)
    assert profiler_callback(cfg, 0, "cpu").activities == ["cpu"]
    cuda = profiler_callback(cfg, 0, "cuda")
    assert cuda.activities == ["cpu", "cuda"] and cuda.options["record_shapes"] and not cuda.options["with_stack"]
    assert profiler_callback(config(tmp_path, active=1, activities=["cuda"]), 0, "cpu").activities == ["cuda"]


@pytest.mark.parametrize(
    "profile, words",
    [
        ({"active": 1, "schedule_option": {"steps": 3}}, "unknown key(s) ['steps']"),
        ({"active": 2, "wait": -1}, "profile.wait is -1"),
        ({"active": 1, "activities": ["gpu"]}, "profile.activities names ['gpu']"),
    ],
)
def test_a_bad_profile_setting_is_one_sentence(tmp_path, profile, words):
    with pytest.raises(ConfigError) as err:
        profiler_callback(config(tmp_path, **profile), 0, "cpu")
    assert words in str(err.value)
