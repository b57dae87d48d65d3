"""`strategy: xla` on one XLA device (PJRT CPU): same numbers as the CPU, exact resume (XLA RNG
included), full-weight export, no host reads between logging steps, one-sentence refusals."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")

import torch  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

from kiln import Trainer  # noqa: E402
from kiln.engine.callbacks.base import Callback  # noqa: E402
from kiln.utils.errors import CapabilityError, ConfigError  # noqa: E402
from tests.helpers import TinyRegressor, base_config, flat_params, regression_data  # noqa: E402


def _config(tmp_path, name, strategy="xla", **over):
    settings = dict(
        max_steps=6, per_device_train_batch_size=8, learning_rate=1e-2, max_grad_norm=0.5, dataloader_drop_last=True
    )
    cfg = base_config(tmp_path, strategy={"name": strategy}, **{**settings, **over})
    cfg["output_dir"] = str(tmp_path / name)
    if strategy == "single":
        cfg["strategy"]["device"] = "cpu"
    return cfg


def _train(tmp_path, name, strategy="xla", dropout=0.0, **over):
    torch.manual_seed(0)
    model = TinyRegressor(dropout=dropout)
    trainer = Trainer(model, _config(tmp_path, name, strategy, **over), train_dataset=regression_data(n=64))
    out = trainer.fit()
    return trainer, out


def test_xla_trains_like_the_cpu(tmp_path):
    xla, out_xla = _train(tmp_path, "xla")
    cpu, out_cpu = _train(tmp_path, "cpu", strategy="single")
    assert next(xla.model.parameters()).device.type == "xla"
    # same maths on another backend: equal to float32 rounding (the reference measured 6e-8)
    assert torch.allclose(flat_params(xla.model).cpu(), flat_params(cpu.model), atol=1e-6, rtol=1e-5)
    assert out_xla.training_loss == pytest.approx(out_cpu.training_loss, rel=1e-5)


def test_resume_is_exact_with_dropout_drawing_from_the_xla_rng(tmp_path):
    full, _ = _train(tmp_path, "full", dropout=0.2, max_steps=8)
    _train(tmp_path, "part", dropout=0.2, max_steps=8, save_steps=4, save_strategy="steps")
    torch.manual_seed(123)  # the resumed run must not depend on the process's RNG state
    model = TinyRegressor(dropout=0.2)
    cfg = _config(tmp_path, "part", max_steps=8, save_steps=4, save_strategy="steps", overwrite_output_dir=True)
    resumed = Trainer(model, cfg, train_dataset=regression_data(n=64))
    resumed.fit(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-4"))
    assert torch.equal(flat_params(resumed.model).cpu(), flat_params(full.model).cpu())


def test_save_model_writes_full_cpu_weights(tmp_path):
    from safetensors.torch import load_file

    trainer, _ = _train(tmp_path, "export", max_steps=2)
    trainer.save_model(str(tmp_path / "model"))
    saved = load_file(str(tmp_path / "model" / "model.safetensors"))
    own = trainer.model.state_dict()
    assert set(saved) == set(own)
    assert all(torch.equal(saved[k], own[k].cpu()) for k in own)


class _Counters(Callback):
    """(compilations, device->host transfers) after every optimizer step."""

    def __init__(self):
        self.rows = []

    def on_step_end(self, args, state, control, **kw):
        compiles = met.metric_data("CompileTime")
        transfers = met.metric_data("TransferFromDeviceTime")
        self.rows.append((state.global_step, compiles[0] if compiles else 0, transfers[0] if transfers else 0))


def test_no_host_reads_and_no_recompilation_between_logging_steps(tmp_path):
    met.clear_all()
    counters = _Counters()
    torch.manual_seed(0)
    trainer = Trainer(
        TinyRegressor(),
        _config(tmp_path, "sync", max_steps=16, logging_steps=5),
        train_dataset=regression_data(n=64),
        callbacks=[counters],
    )
    trainer.fit()
    rows = counters.rows
    # the loop reads loss and grad norm back on logging steps only (steps 5, 10, 15, after on_step_end)
    read_after = {step for (step, _, t), (_, _, before) in zip(rows[1:], rows[:-1]) if t != before}
    assert read_after <= {6, 11, 16}, rows
    assert read_after, "the logging steps must read the loss back (the counter works)"
    # compilation: once the first logging step's graphs exist, every step replays cached graphs
    after_warmup = [c for step, c, _ in rows if step >= 7]
    assert len(set(after_warmup)) == 1, rows


def test_refusals_are_one_sentence(tmp_path):
    with pytest.raises(CapabilityError, match="bf16"):
        Trainer(TinyRegressor(), _config(tmp_path, "fp16", fp16=True), train_dataset=regression_data(n=8))
    with pytest.raises(ConfigError, match="strategy.device='cpu'"):
        cfg = _config(tmp_path, "dev")
        cfg["strategy"]["device"] = "cpu"
        Trainer(TinyRegressor(), cfg, train_dataset=regression_data(n=8))
    # declared (Capabilities.torch_compile), so refused by the constructor, before anything starts
    with pytest.raises(
        CapabilityError,
        match=r"^torch_compile cannot be used with strategy 'xla': XLA already compiles "
        r"every step into one graph; drop torch_compile\.$",
    ):
        Trainer(TinyRegressor(), _config(tmp_path, "compile", torch_compile=True), train_dataset=regression_data(n=8))


def test_tpu_metrics_debug_prints_the_xla_report_after_evaluation_and_training(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = _config(tmp_path, "report", max_steps=2, tpu_metrics_debug=True)
    trainer = Trainer(TinyRegressor(), cfg, train_dataset=regression_data(n=64), eval_dataset=regression_data(n=16))
    trainer.evaluate()
    assert capsys.readouterr().out.count("Metric: CompileTime") == 1
    trainer.fit()
    assert capsys.readouterr().out.count("Metric: CompileTime") == 1


@pytest.mark.parametrize("precision", ["bf16", "bf16-true"])
def test_bf16_and_bf16_true_train_on_xla(tmp_path, precision):
    torch.manual_seed(0)
    model = TinyRegressor()
    seen = []
    model.net[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    trainer = Trainer(
        model, _config(tmp_path, precision, max_steps=2, precision=precision), train_dataset=regression_data(n=64)
    )
    out = trainer.fit()
    assert set(seen) == {torch.bfloat16}, precision  # the matmuls ran in bf16 on the XLA device
    assert torch.isfinite(torch.tensor(out.training_loss))


class _WithUnusedHead(TinyRegressor):
    """A parameter no loss reaches: with weight decay it must still stay untouched, as on the CPU."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(4, 4)


def test_a_parameter_without_gradients_is_not_stepped(tmp_path):
    trained = {}
    for strategy in ("xla", "single"):
        torch.manual_seed(0)
        model = _WithUnusedHead()
        before = model.unused.weight.detach().clone()
        trainer = Trainer(
            model, _config(tmp_path, strategy, strategy, weight_decay=0.1), train_dataset=regression_data(n=64)
        )
        trainer.fit()
        assert torch.equal(model.unused.weight.detach().cpu(), before), strategy  # weight decay did not shrink it
        trained[strategy] = flat_params(model).cpu()
    assert torch.allclose(trained["xla"], trained["single"], atol=1e-6, rtol=1e-5)
