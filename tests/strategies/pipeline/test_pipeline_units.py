"""The pipeline axis's parts, in one process: which decoder layers each stage holds (`stage_layers`,
`keep_stage`), that two pruned copies of a model chained stage to stage compute the full model's
logits, and the refusals at config load, one sentence each (the window's schedule and stacked
inputs: test_pipeline_schedule.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from kiln.strategies.mesh.dims import ParallelDims, parse_mesh
from kiln.strategies.mesh.pipeline_settings import PipelineSettings, check_pipeline, read_pipeline
from kiln.strategies.mesh.pipeline_split import (
    StageForward,
    auto_costs,
    decoder_of,
    keep_stage,
    stage_decoder,
    stage_layers,
    stage_owners,
    stage_ranges,
)
from kiln.strategies.mesh.settings import MeshSettings
from kiln.utils.errors import ConfigError, KilnError
from tests.strategies.pipeline.cases import VOCAB, llama

FP32 = SimpleNamespace(forward_context=lambda: torch.autocast("cpu", enabled=False))


def test_auto_split_balances_parameters_then_layer_count():
    assert stage_layers([10] * 4, 2, None) == [range(0, 2), range(2, 4)]
    assert stage_layers([10] * 5, 2, None) == [range(0, 2), range(2, 5)]  # ties: the earliest cut
    # heavy embeddings on stage 0 push layers to the later stages
    assert stage_layers([10] * 6, 3, None, first=25) == [range(0, 1), range(1, 3), range(3, 6)]
    assert stage_layers([10] * 6, 2, None, last=20) == [range(0, 4), range(4, 6)]
    assert stage_layers([1, 1, 10, 1], 2, None) == [range(0, 2), range(2, 4)]
    assert stage_layers([10] * 4, 2, [1]) == [range(0, 1), range(1, 4)]  # the user's cut wins
    assert stage_layers([10] * 4, 4, None) == [range(i, i + 1) for i in range(4)]


@pytest.mark.parametrize(
    ("split", "stages", "match"),
    [
        ([0], 2, r"split is \[0\]; give 1 increasing layer index\(es\) between 1 and 3"),
        ([4], 2, "between 1 and 3"),
        ([2, 1], 3, "increasing"),
        ([1, 1], 3, "increasing"),
        ([1, 2], 2, "give 1 increasing"),
        (["1"], 2, "give 1 increasing"),
    ],
)
def test_a_bad_split_is_one_sentence(split, stages, match):
    with pytest.raises(ConfigError, match=match):
        stage_layers([10] * 4, stages, split)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="the model has 4 decoder layer"):
        stage_layers([10] * 4, 5, None)


def _stages(model, ranges, mine, count):
    """The StageForwards of stages `mine` of `count`, the model pruned to them, as setup_module builds them."""
    decoder = decoder_of(model)
    layers = list(decoder.layers)
    forwards = [
        StageForward(
            stage_decoder(decoder, [layers[i] for i in ranges[s]], first=s == 0, last=s == count - 1),
            model.lm_head,
            FP32,
            first=s == 0,
            last=s == count - 1,
        )
        for s in mine
    ]
    keep_stage(model, decoder, [i for s in mine for i in ranges[s]], first=0 in mine, last=count - 1 in mine)
    return forwards


def test_each_stage_keeps_its_layers_under_the_full_models_names_and_chained_they_compute_its_logits():
    full = llama()
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    want = full(input_ids=ids, attention_mask=mask).logits
    ranges = stage_layers([1] * 4, 2, None)
    models = [llama(), llama()]
    stages = [_stages(models[index], ranges, [index], 2)[0] for index in range(2)]
    first, last = (sorted(model.state_dict()) for model in models)
    assert "model.embed_tokens.weight" in first and "model.layers.1.mlp.up_proj.weight" in first
    assert not any(k.startswith(("model.layers.2.", "model.layers.3.", "model.norm", "lm_head")) for k in first)
    assert "model.layers.2.self_attn.q_proj.weight" in last and "lm_head.weight" in last and "model.norm.weight" in last
    assert not any(k.startswith(("model.layers.0.", "model.layers.1.", "model.embed")) for k in last)
    assert sorted(first + last) == sorted(full.state_dict())
    got = stages[1](stages[0](ids, attention_mask=mask), attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style", ["loop", "v"])
def test_two_stages_a_rank_hold_their_own_parameters_and_chained_compute_the_logits(style):
    """Each rank holds 2 of 4 one-layer stages, as torch's schedules place them; a stage's parameters
    are its own (a zero-bubble schedule computes weight gradients over exactly those)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    owners = stage_owners(2, 4, style)
    assert owners == list(generate_stage_to_rank_mapping(2, 4, style).values())
    assert owners == ([0, 1, 0, 1] if style == "loop" else [0, 1, 1, 0])
    full = llama()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    want = full(input_ids=ids).logits
    ranges = stage_layers([1] * 4, 4, None)
    models = [llama(), llama()]
    forwards = {}
    for rank, model in enumerate(models):
        mine = [s for s in range(4) if owners[s] == rank]
        forwards.update(zip(mine, _stages(model, ranges, mine, 4)))
    held = [sorted({int(k.split(".")[2]) for k in m.state_dict() if ".layers." in k}) for m in models]
    assert held == ([[0, 2], [1, 3]] if style == "loop" else [[0, 3], [1, 2]])
    for s, forward in forwards.items():
        names = {n.split(".")[0] for n, _ in forward.named_parameters()}
        layers = {n for n, _ in forward.decoder.layers.named_parameters()}
        assert names == {"decoder"} | ({"head"} if s == 3 else set())
        assert sum(p.numel() for p in forward.parameters()) == sum(
            p.numel() for p in full.model.layers[s].parameters()
        ) + (VOCAB * 32 if s == 0 else 0) + (32 + 32 * VOCAB if s == 3 else 0)
        assert len(layers) == len(list(full.model.layers[s].parameters()))
        # before the last stage the final norm is no module (torch's stage lists every module of a stage
        # in each FSDP setter, 3 times a backward), nor the embeddings after the first
        children = dict(forward.decoder.named_children())
        assert ("norm" in children) is (s == 3) and ("embed_tokens" in children) is (s == 0), children
    x = ids
    for s in range(4):
        x = forwards[s](x)
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-6)


def test_a_hook_on_one_stages_view_runs_for_that_stage_alone():
    """Under FSDP each stage's root gathers its parameters around calls of its decoder view
    (direct_calls.py). Views that shared the decoder's hook tables ran every stage's hooks on every
    view: stage 1's forward resharded stage 3's root between its input and weight backwards, and
    interleaved_zb beside dp_shard failed (torch's KeyError on an AccumulateGrad node)."""
    model = llama()
    decoder = decoder_of(model)
    ranges = stage_layers([1] * 4, 4, None)
    one, three = _stages(model, ranges, [1, 3], 4)  # rank 1 of a loop-style pp 2
    ran: list[str] = []
    three.decoder.register_forward_pre_hook(lambda *_: ran.append("pre"))
    three.decoder.register_forward_hook(lambda *_: ran.append("post"), always_call=True)
    three.decoder.register_buffer("extra", torch.zeros(1), persistent=False)
    hidden = torch.randn(2, 5, 32)
    one(hidden)
    assert ran == []
    three(hidden)
    assert ran == ["pre", "post"]
    for other in (one.decoder, decoder):  # nothing registered on the view leaks into the others
        assert not other._forward_hooks and not other._forward_pre_hooks and not other._forward_hooks_always_called
        assert "extra" not in dict(other.named_buffers()) and "extra" not in other._non_persistent_buffers_set


def test_configure_pipeline_gives_the_split_and_a_bad_one_is_one_sentence():
    model = llama()
    decoder = decoder_of(model)
    assert stage_ranges(model, decoder, 2, None, None) == [range(0, 2), range(2, 4)]  # auto
    assert stage_ranges(model, decoder, 2, (1,), None) == [range(0, 1), range(1, 4)]  # the config's split
    seen = []
    model.configure_pipeline = lambda mesh: seen.append(mesh) or [[0], [1, 2], [3]]
    assert stage_ranges(model, decoder, 3, None, "the mesh") == [range(0, 1), range(1, 3), range(3, 4)]
    assert seen == ["the mesh"]
    with pytest.raises(ConfigError, match="defines configure_pipeline.*strategy.pipeline.split is set too"):
        stage_ranges(model, decoder, 3, (1, 2), None)
    for bad in ([[0, 1], [2, 3]], [[0], [2, 1], [3]], [[0], [], [1, 2, 3]], [[0], [1, 3], [2]], [[0], [1], [2]]):
        model.configure_pipeline = lambda mesh, bad=bad: bad
        with pytest.raises(
            ConfigError, match=r"configure_pipeline\(mesh\) returned .*; return 3 list\(s\).* together 0 to 3\."
        ):
            stage_ranges(model, decoder, 3, None, None)


def test_auto_costs_count_embeddings_first_and_norm_and_head_last():
    model = llama()
    costs, first, last = auto_costs(model, decoder_of(model))
    assert len(costs) == 4 and first == VOCAB * 32 and last == 32 + 32 * VOCAB


def test_a_model_kiln_cannot_split_is_one_sentence():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(
        ConfigError, match="cannot split GPT2LMHeadModel: kiln splits Transformers decoders shaped as Llama"
    ):
        decoder_of(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32)))
    tied = llama()
    tied.config.tie_word_embeddings = True
    tied.lm_head.weight = tied.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="shares its weight with the embeddings"):
        decoder_of(tied)
    mixed = llama()
    mixed.config.layer_types = ["full_attention", "sliding_attention"] * 2
    with pytest.raises(ConfigError, match="mix attention types"):
        decoder_of(mixed)


def test_the_pipeline_settings_are_read_once_with_one_sentence_per_mistake():
    assert read_pipeline(None) == PipelineSettings("1f1b", None, None)
    assert read_pipeline({"schedule": "GPipe", "microbatches": 4, "split": [2]}) == PipelineSettings("gpipe", 4, (2,))
    assert read_pipeline({"schedule": "zbv"}) == PipelineSettings("zbv", None, None, 2)
    assert read_pipeline({"schedule": "interleaved_1f1b", "stages_per_rank": 3}).stages(2) == 6
    assert (
        read_pipeline({"schedule": "interleaved_zb"}).style == "loop"
        and read_pipeline({"schedule": "zbv"}).style == "v"
    )
    given = OmegaConf.create({"microbatches": 1, "split": [1, 3]})  # as the config holds it
    assert read_pipeline(given) == PipelineSettings("1f1b", 1, (1, 3))
    for bad, match in [
        ({"schedule": "dualpipev"}, "schedule is 'dualpipev'; choose one of gpipe, 1f1b, interleaved_1f1b"),
        ({"schedule": "zbv", "stages_per_rank": 3}, "stages_per_rank is 3, but schedule zbv runs exactly 2 stages"),
        ({"schedule": "interleaved_zb", "stages_per_rank": 1}, "runs 2 or more stages on each rank; give 2 or more"),
        ({"stages_per_rank": 2}, "schedule 1f1b runs one stage on each rank; drop it, or choose interleaved_1f1b"),
        ({"schedule": "gpipe", "stages_per_rank": True}, "stages_per_rank is True"),
        ({"microbatches": 0}, "microbatches is 0; give a positive"),
        ({"split": "even"}, "split is 'even'; give auto or a list"),
        ({"split": 2}, "split is 2; give auto or a list"),
        ({"microbatches": -1}, "microbatches is -1; give a positive"),
        ({"stages": 2}, "unknown key"),
        ("1f1b", "give a mapping"),
    ]:
        with pytest.raises(ConfigError, match=match):
            read_pipeline(bad)


def _config(**train):
    base = {
        "gradient_accumulation_steps": 2,
        "torch_compile": False,
        "torch_compile_backend": None,
        "torch_compile_mode": None,
        "gradient_checkpointing": False,
        "label_smoothing_factor": 0.0,
        "neftune_noise_alpha": None,
    }
    return OmegaConf.create(
        {"train": {**base, **train}, "eval": {"strategy": "no", "compile": False, "predict_with_generate": False}}
    )


def test_what_the_pipeline_cannot_run_yet_is_refused_at_config_load():
    pp2, ok = ParallelDims(pp=2), PipelineSettings()
    check_pipeline(ok, pp2, MeshSettings(), _config(), "bf16")  # what runs passes
    for one in ({"dp_shard": 2}, {"dp_replicate": 2}, {"tp": 2}):  # FSDP, HSDP or the tp plan on each stage
        check_pipeline(ok, ParallelDims(pp=2, **one), MeshSettings(), _config(), "fp32")
    for dims, given in (
        (ParallelDims(pp=2, cp=2), "cp 2"),
        (ParallelDims(pp=2, dp_shard=2, cp=2), "dp_shard 2 and cp 2"),
        (ParallelDims(pp=2, dp_replicate=2, dp_shard=2), "dp_replicate 2 and dp_shard 2"),
        (ParallelDims(pp=2, dp_shard=2, tp=2), "dp_shard 2 and tp 2"),
        (ParallelDims(pp=2, dp_replicate=2, tp=2), "dp_replicate 2 and tp 2"),
    ):
        with pytest.raises(
            ConfigError,
            match=rf"combines pp 2 with {given}, .*alone or with one of dp_shard, dp_replicate or tp beside it so far "
            r"\(not with cp, nor with two of them together\); set all but one",
        ):
            check_pipeline(ok, dims, MeshSettings(), _config(), "fp32")
    tp2 = ParallelDims(pp=2, tp=2)  # the plan is the model's own; the tp options that split activations are not
    with pytest.raises(ConfigError, match=r"pp 2 does not run with sequence_parallel, loss_parallel yet; drop them"):
        check_pipeline(ok, tp2, MeshSettings(sequence_parallel=True, loss_parallel=True), _config(), "fp32")
    check_pipeline(ok, tp2, MeshSettings(tp_plan="auto"), _config(), "fp32")
    with pytest.raises(
        ConfigError,
        match=r"pp 2 does not run with tp_plan as a mapping \(the model's own plan, auto, runs beside tp\) yet; drop it",
    ):
        check_pipeline(ok, tp2, MeshSettings(tp_plan={"model.layers.*.mlp.up_proj": "colwise"}), _config(), "fp32")
    with pytest.raises(ConfigError, match=r"does not run with offload, train.torch_compile yet; drop them"):
        check_pipeline(ok, pp2, MeshSettings(offload=True), _config(torch_compile=True), "fp32")
    with pytest.raises(ConfigError, match=r"precision fp16"):
        check_pipeline(ok, pp2, MeshSettings(), _config(), "fp16")
    for mode in ("full", "selective"):  # the config's section, as its alias gradient_checkpointing
        checkpointing = OmegaConf.merge(_config(), {"activation_checkpointing": {"mode": mode}})
        with pytest.raises(ConfigError, match=r"pp 2 does not run with activation_checkpointing yet; drop it"):
            check_pipeline(ok, pp2, MeshSettings(), checkpointing, "fp32")
    check_pipeline(ok, pp2, MeshSettings(), OmegaConf.merge(_config(), {"eval": {"strategy": "steps"}}), "fp32")
    with pytest.raises(ConfigError, match=r"does not run with eval.compile, eval.predict_with_generate \(generation"):
        generate = {"eval": {"compile": True, "predict_with_generate": True}}
        check_pipeline(ok, pp2, MeshSettings(), OmegaConf.merge(_config(), generate), "fp32")
    interleaved = PipelineSettings("interleaved_1f1b", stages_per_rank=2)
    check_pipeline(interleaved, pp2, MeshSettings(), _config(gradient_accumulation_steps=3), "fp32")  # 1 round
    with pytest.raises(ConfigError, match=r"has 5 for pp 2, not a whole number of rounds; .* multiple of 2"):
        check_pipeline(interleaved, pp2, MeshSettings(), _config(gradient_accumulation_steps=5), "fp32")
    with pytest.raises(
        ConfigError, match=r"microbatches is 4, but .* window's \(2\); set train.gradient_accumulation_steps to 4"
    ):
        check_pipeline(PipelineSettings(microbatches=4), pp2, MeshSettings(), _config(), "fp32")
    with pytest.raises(ConfigError, match=r"1f1b needs at least as many micro-batches as stages"):
        check_pipeline(ok, ParallelDims(pp=4), MeshSettings(), _config(), "fp32")
    check_pipeline(PipelineSettings("gpipe"), ParallelDims(pp=4), MeshSettings(), _config(), "fp32")


@pytest.mark.parametrize("mesh", [{"pp": 2, "dp_shard": 2}, {"pp": 2, "tp": 2}])
def test_offload_under_pp_is_refused_in_pps_sentence(monkeypatch, mesh):
    """pp's refusals come before the mesh's, whose offload sentence ("tensor parallel alone") would be false here."""
    from kiln.config import load_config
    from kiln.precision import build_precision
    from kiln.strategies import build_strategy

    for name, value in (("WORLD_SIZE", "4"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)  # rank 0 of a torchrun world of 4: no process group starts
    cfg = load_config(
        {"strategy": {"name": "model_parallel", "mesh": mesh, "offload": True}, "gradient_accumulation_steps": 2}
    )
    with pytest.raises(ConfigError, match=r"^strategy.mesh.pp 2 does not run with offload yet; drop it, or drop pp.$"):
        build_strategy(cfg, build_precision(cfg))


def test_pp_is_the_outermost_axis_and_must_divide_the_world():
    dims = parse_mesh({"pp": 2}, 2)
    assert dims.pp == 2 and dims.stage_ranks == 1 and [dims.stage(r) for r in range(2)] == [0, 1]
    assert dims.data_rank(1) == 0 and not dims.fsdp and dims.describe() == "pp 2"
    four = parse_mesh({"pp": 2, "dp_shard": -1}, 4)
    assert [four.stage(r) for r in range(4)] == [0, 0, 1, 1] and [four.data_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert four.mesh_axes() == (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 1, 2, 1, 1))
    with pytest.raises(ConfigError, match="multiplies to 2 processes but this run has 3"):
        parse_mesh({"pp": 2}, 3)
    with pytest.raises(ConfigError, match="fixed axes multiply to 2, which does not divide the world size 3"):
        parse_mesh({"pp": 2, "dp_shard": -1}, 3)


def test_model_parallel_picks_the_pipeline_for_a_pp_axis_and_refuses_a_pipeline_without_one():
    from kiln.strategies.model_parallel.strategy import ModelParallelPipeline, ModelParallelStrategy

    def cfg(options):
        return OmegaConf.create({"strategy": {"name": "model_parallel", "options": options}})

    assert ModelParallelStrategy.resolve(cfg({"mesh": {"pp": 2}})) is ModelParallelPipeline
    assert ModelParallelStrategy.resolve(cfg({"mesh": {"tp": 2}})) is ModelParallelStrategy
    with pytest.raises(ConfigError, match="strategy.pipeline is set, but strategy.mesh has no pp axis"):
        ModelParallelStrategy.resolve(cfg({"pipeline": {"schedule": "gpipe"}}))


def test_a_stage_output_travels_with_its_dtype_and_shape_and_a_batch_evaluation_cannot_read_is_one_sentence():
    from kiln.strategies.mesh.pipeline_forward import ChainedForward, _empty, _header

    for t in (torch.zeros(2, 3, 4), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(1, 0, 2, 3, dtype=torch.float16)):
        got = _empty(_header(t), torch.device("cpu"))
        assert got.shape == t.shape and got.dtype == t.dtype
    with pytest.raises(KilnError, match="a torch.int64 tensor of 2 dimensions, which kiln cannot send"):
        _header(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(
        KilnError, match="evaluates from input_ids, attention_mask and labels, and the batch holds pixel"
    ):
        ChainedForward(None, None)(torch.zeros(1, 2), pixel_values=torch.zeros(1), return_dict=True)


def test_the_losses_ride_in_the_norms_all_reduce_only_where_a_sum_of_two_leaves_the_norm_as_it_was():
    """pp 2 without tp: the two stages' squares sum in either order alike, and the norm is pp's own
    all-reduce; with tp the norm is clip.py's (the losses go by broadcast), and with more stages the
    order of the sum could change the norm's last bit (they go by broadcast too)."""
    from kiln.strategies.mesh.pipeline import PipelineStrategy

    folds = PipelineStrategy._folds_losses.fget  # type: ignore[attr-defined]
    assert folds(SimpleNamespace(shape=ParallelDims(pp=2))) is True
    assert folds(SimpleNamespace(shape=ParallelDims(pp=2, dp_shard=2))) is True
    assert folds(SimpleNamespace(shape=ParallelDims(pp=2, tp=2))) is False
    assert folds(SimpleNamespace(shape=ParallelDims(pp=4))) is False


def test_a_stage_view_runs_the_decoders_forward_beneath_transformers_inert_wrappers():
    """A stage runs 8 times a rank in a step of interleaved 1F1B at pp 2; Transformers' wrappers around
    the decoder's forward cost some 80 Python calls a run and do nothing for a stage's call. The view
    runs the forward beneath them, to the same hidden states; beside any other wrapper, or with a config
    that sets is_causal (which a wrapper hands the layers), it keeps the decorated forward."""
    import functools
    import inspect
    import sys

    import transformers

    from kiln.strategies.mesh.pipeline_split import _inert_code, bare_forward

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("Transformers 4 wraps LlamaModel.forward in check_model_inputs, which kiln does not skip")
    decoder = decoder_of(llama())
    decorated = type(decoder).forward
    view = stage_decoder(decoder, list(decoder.layers)[1:3], first=False, last=False)
    assert vars(view)["forward"].__func__ is inspect.unwrap(decorated) is not decorated
    wrappers, f = 0, decorated
    while hasattr(f, "__wrapped__"):
        wrappers, f = wrappers + 1, f.__wrapped__
    hidden = torch.randn(2, 5, 32)

    def run() -> tuple[torch.Tensor, int]:
        """The view's hidden states, and how many of the inert wrappers ran around the view itself
        (the layers' forwards have deprecate_kwarg's too)."""
        ran = []

        def profile(frame, event, arg):
            if event == "call" and frame.f_code in _inert_code():
                args = frame.f_locals.get("args") or (None,)
                ran.append(frame.f_locals.get("self", args[0]) is view)

        sys.setprofile(profile)
        try:
            out = view(inputs_embeds=hidden, use_cache=False).last_hidden_state
        finally:
            sys.setprofile(None)
        return out, sum(ran)

    got, ran = run()
    assert ran == 0
    del view.forward  # the class's decorated forward again
    want, ran = run()
    # 3 in Transformers 5: deprecate_kwarg, merge_with_config_defaults, capture_outputs
    assert ran == wrappers and torch.equal(got, want)
    assert "forward" not in vars(decoder)  # the model's own decoder keeps its forward

    def other(f):
        @functools.wraps(f)
        def wrapper(self, *args, **kwargs):
            return f(self, *args, **kwargs)

        return wrapper

    def fake(forward, **config):
        return type("Decoder", (), {"forward": forward, "config": SimpleNamespace(**config)})()

    assert bare_forward(fake(decorated)).__func__ is inspect.unwrap(decorated)
    assert bare_forward(fake(other(decorated))) is None
    assert bare_forward(fake(decorated, is_causal=False)) is None
    assert bare_forward(fake(inspect.unwrap(decorated))) is None  # nothing to skip


def test_the_last_stage_reads_the_models_loss_function_once_a_window():
    """`_loss` runs once a micro-batch; the model's loss_function (a property that looks it up) and
    vocab_size are read once a window, before the schedule runs, and dropped after it."""
    from kiln.strategies.mesh.pipeline import PipelineStrategy

    reads: list[str] = []

    class Model:
        config = SimpleNamespace(vocab_size=VOCAB)

        @property
        def loss_function(self):
            reads.append("loss_function")
            return lambda logits, labels, vocab_size, num_items_in_batch: labels.float().sum() + vocab_size

    class Schedule:
        def step(self, *args, target, losses, **kwargs):
            losses.extend(strategy._loss(torch.zeros(1), t) for t in target.split(1))

    strategy = PipelineStrategy.__new__(PipelineStrategy)
    strategy._model, strategy._ends = Model(), (True, True)
    strategy._schedule_for = lambda key: Schedule()  # type: ignore[method-assign]
    window = [{"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), i)} for i in range(4)]
    out = strategy.run_window(None, window, None)  # type: ignore[arg-type]
    assert reads == ["loss_function"]
    assert [float(x) for x in out] == [VOCAB + 6.0 * i for i in range(4)]
    assert strategy._window[2] is None  # nothing of the model is held between windows
