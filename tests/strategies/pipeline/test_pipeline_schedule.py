"""The pipeline's window in one process (kiln/strategies/mesh/pipeline_schedule.py and
`PipelineStrategy.run_window`): the window's micro-batches padded to one shape (ids with 0, labels with
-100, the attention mask with 0 on the real rows and 1 on the rows added), which leaves each
micro-batch's loss and gradients as they were; the mask handed to the schedule on every stage; a new
schedule for each new shape, a window with a mask and one without included, which measures the stages
again (torch 2.11's keep their first shapes); torch's class for each schedule name; one sentence for a
batch a stage cannot read; no warm-up send from a stage to a neighbour on its own rank (zbv on gloo under
torch 2.11)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.strategies.mesh import pipeline_schedule
from kiln.strategies.mesh.pipeline import PipelineStrategy
from kiln.strategies.mesh.pipeline_schedule import WindowSchedule, schedule_class, stack_window
from kiln.utils.errors import KilnError
from tests.strategies.pipeline.cases import VOCAB, llama


def test_each_schedule_name_picks_torchs_class_and_a_short_window_its_gpipe_order():
    from torch.distributed import pipelining as p

    assert schedule_class("gpipe", 1, 2) is p.ScheduleGPipe
    assert schedule_class("1f1b", 2, 2) is p.Schedule1F1B and schedule_class("1f1b", 1, 2) is p.ScheduleGPipe
    assert schedule_class("interleaved_1f1b", 4, 2) is p.ScheduleInterleaved1F1B
    assert schedule_class("interleaved_zb", 3, 2) is p.ScheduleInterleavedZeroBubble  # 1 round of 3
    assert schedule_class("interleaved_1f1b", 5, 2) is p.ScheduleLoopedBFS  # 5 is not 2 whole rounds
    assert schedule_class("interleaved_zb", 5, 2) is p.ScheduleLoopedBFS
    assert schedule_class("zbv", 1, 2) is p.ScheduleZBVZeroBubble


def test_padding_a_window_to_one_shape_keeps_each_micro_batchs_loss_and_gradients():
    g = torch.Generator().manual_seed(1)
    window = [
        {"input_ids": torch.randint(0, VOCAB, (3, 6), generator=g)},
        {
            "input_ids": torch.randint(0, VOCAB, (2, 9), generator=g),
            "attention_mask": torch.ones(2, 9, dtype=torch.long),
        },
    ]
    window[1]["attention_mask"][0, 7:] = 0
    for b in window:
        b["labels"] = b["input_ids"].roll(-1, 1)
    ids, mask, labels = stack_window(window)
    assert ids.shape == (6, 9) and mask is not None and mask.shape == (6, 9) and len(labels) == 2
    assert bool((labels[1][2:] == -100).all()) and bool((labels[0][:, 6:] == -100).all())
    assert bool((mask[0:3, 6:] == 0).all()) and bool((mask[3, 7:] == 0).all()) and bool((mask[4] == 1).all())
    assert bool((mask[5] == 1).all())  # a row added for the shape attends normally
    for i, b in enumerate(window):
        model = llama()
        want = model(**b).loss
        want.backward()
        want_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        rows = slice(3 * i, 3 * i + 3)
        logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits
        got = model.loss_function(logits=logits, labels=labels[i], vocab_size=VOCAB)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for p, w in zip(model.parameters(), want_grads):
            torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)


def test_a_batch_a_stage_cannot_read_is_one_sentence():
    with pytest.raises(KilnError, match="dict batches with input_ids and labels"):
        stack_window([(torch.zeros(2, 3),)])
    with pytest.raises(KilnError, match="this batch is a dict with keys input_ids: use a causal-LM collator"):
        stack_window([{"input_ids": torch.zeros(1, 2)}])  # no labels: the last stage has no loss to compute
    with pytest.raises(
        KilnError, match="reads only input_ids, labels, attention_mask of a batch, and it holds token_type_ids"
    ):
        stack_window(
            [{"input_ids": torch.zeros(1, 2), "labels": torch.zeros(1, 2), "token_type_ids": torch.zeros(1, 2)}]
        )


def test_a_window_is_padded_with_0_ids_minus_100_labels_and_a_mask_that_hides_the_padding_alone():
    """Micro-batch 0 (2 rows of 2, no mask) and 1 (1 row of 3, left-padded): both padded to 2 rows of
    3. The padding is masked out (0) where a row is real, and a row added for the shape attends
    normally (1: a row attending to nothing is NaN); a micro-batch without a mask gets ones."""
    long = dict(dtype=torch.long)
    window = [
        {"input_ids": torch.tensor([[1, 2], [3, 4]]), "labels": torch.tensor([[5, 6], [7, 8]])},
        {
            "input_ids": torch.tensor([[0, 10, 11]]),
            "labels": torch.tensor([[-100, 13, 14]]),
            "attention_mask": torch.tensor([[0, 1, 1]]),
        },
    ]
    ids, mask, labels = stack_window(window)
    assert torch.equal(ids, torch.tensor([[1, 2, 0], [3, 4, 0], [0, 10, 11], [0, 0, 0]], **long))
    assert mask is not None and torch.equal(mask, torch.tensor([[1, 1, 0], [1, 1, 0], [0, 1, 1], [1, 1, 1]], **long))
    assert len(labels) == 2
    assert torch.equal(labels[0], torch.tensor([[5, 6, -100], [7, 8, -100]], **long))
    assert torch.equal(labels[1], torch.tensor([[-100, 13, 14], [-100, -100, -100]], **long))
    assert [b["attention_mask"].tolist() for b in window[1:]] == [[[0, 1, 1]]]  # the batch itself is left as it was

    # no micro-batch with a mask: none is made; micro-batches of one shape are stacked as they are
    plain = [{"input_ids": torch.full((2, 3), i), "labels": torch.full((2, 3), 9 - i)} for i in range(2)]
    ids, mask, labels = stack_window(plain)
    assert mask is None and torch.equal(ids, torch.tensor([[0] * 3] * 2 + [[1] * 3] * 2))
    assert labels[0] is plain[0]["labels"] and labels[1] is plain[1]["labels"]


class Recorder:
    """A stand-in for torch's schedule classes: what each was built with, and each step's inputs."""

    built: list[dict] = []

    def __init__(self, stages, n_microbatches, loss_fn, scale_grads):
        self.steps: list[tuple] = []
        Recorder.built.append(dict(stages=stages, n=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads))

    def step(self, *args, target, losses, return_outputs, **kwargs):
        self.steps.append((args, kwargs))
        if losses is not None:
            losses.extend(torch.zeros(()) for _ in range(len(target)))


@pytest.mark.parametrize("ends", [(True, False), (False, True)], ids=["first stage", "last stage"])
def test_the_mask_reaches_the_schedule_on_every_stage_and_a_window_with_or_without_one_gets_its_own(monkeypatch, ends):
    """run_window hands the stacked mask to the schedule (the first stage gets the ids too): the
    schedule gives every stage its micro-batch's slice. The stages' buffers are sized by the first
    micro-batch they see, so a window with a mask and one without, of one shape, need two schedules."""
    classes = []
    monkeypatch.setattr(pipeline_schedule, "schedule_class", lambda *a: classes.append(a) or Recorder)
    Recorder.built = []
    strategy = PipelineStrategy.__new__(PipelineStrategy)
    strategy._ends = ends
    strategy._model = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB), loss_function=None)
    stage = object()
    strategy._schedule_for = WindowSchedule("1f1b", [stage], 2, strategy._loss)

    def window(masked: bool) -> list[dict]:
        out = [{"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(2, 3, dtype=torch.long)}]
        out.append({**out[0], "input_ids": torch.full((2, 3), 2)})
        if masked:
            out[1]["attention_mask"] = torch.tensor([[0, 1, 1], [1, 1, 1]])
        return out

    schedules = []
    for masked in (False, False, True, True, False):
        strategy.run_window(None, window(masked), None)  # type: ignore[arg-type]
        schedules.append(strategy._schedule_for._schedule)
    first, second, third = schedules[0], schedules[2], schedules[4]
    assert schedules == [first, first, second, second, third] and len({id(s) for s in schedules}) == 3
    assert classes == [("1f1b", 2, 2)] * 3
    assert Recorder.built == [dict(stages=stage, n=2, loss_fn=strategy._loss, scale_grads=False)] * 3

    ids = torch.tensor([[1, 1, 1]] * 2 + [[2, 2, 2]] * 2)
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    for schedule, masked in ((first, False), (second, True), (third, False)):
        for args, kwargs in schedule.steps:
            assert len(args) == ends[0] and all(torch.equal(a, ids) for a in args)
            assert sorted(kwargs) == (["attention_mask"] if masked else [])
            if masked:
                assert torch.equal(kwargs["attention_mask"], mask)
    assert [len(s.steps) for s in (first, second, third)] == [2, 2, 1]


def test_a_new_shape_or_count_of_micro_batches_gets_a_new_schedule_and_several_stages_go_as_a_list(monkeypatch):
    monkeypatch.setattr(pipeline_schedule, "schedule_class", lambda *a: Recorder)
    Recorder.built = []
    stages = [object(), object()]
    schedules = WindowSchedule("zbv", stages, 2, print)
    got = [schedules(key) for key in ((2, (4, 3), True), (2, (4, 3), True), (2, (4, 5), True), (1, (4, 5), True))]
    assert got[0] is got[1] and len({id(s) for s in got}) == 3
    assert [b["n"] for b in Recorder.built] == [2, 2, 1] and all(b["stages"] == stages for b in Recorder.built)


class _Op:
    def __init__(self, peer: int) -> None:
        self.group_peer = peer


def test_the_warm_up_leaves_out_the_neighbour_stages_on_the_stages_own_rank_and_keeps_the_others():
    """zbv on 2 ranks: rank 1 holds stages 1 and 2; torch's warm-up (torch 2.11's schedules run it) would
    send stage 1's dummy to stage 2 on its own rank, which gloo cannot."""
    owners = {0: 0, 1: 1, 2: 1, 3: 0}

    def stage(index: int) -> SimpleNamespace:
        s = SimpleNamespace(stage_index=index, group_rank=owners[index])
        peers = [owners[n] for n in (index - 1, index + 1) if n in owners]
        s._get_init_p2p_neighbors_ops = lambda: [_Op(p) for p in peers for _ in range(2)]  # a send and a receive
        return s

    stages = [stage(1), stage(2)]
    WindowSchedule("zbv", stages, 2, print)
    assert [[op.group_peer for op in s._get_init_p2p_neighbors_ops()] for s in stages] == [[0, 0], [0, 0]]
    bare = SimpleNamespace(group_rank=0)  # a stage without the warm-up (torch's newer ones) is left as it is
    WindowSchedule("zbv", [bare], 2, print)
    assert vars(bare) == {"group_rank": 0}


def test_a_new_shape_makes_a_stage_that_keeps_its_first_shapes_measure_again(monkeypatch):
    """torch 2.11's PipelineStage keeps the shapes it measured first (inputs_meta, _outputs_meta) and
    refuses another ("shape mismatch"); the next window's schedule must measure it again."""
    monkeypatch.setattr(pipeline_schedule, "schedule_class", lambda *a: Recorder)
    Recorder.built = []
    kept = SimpleNamespace(group_rank=0, inputs_meta=("in",), _outputs_meta=("out",))
    newer = SimpleNamespace(group_rank=0)  # torch 2.13's measures each window itself: nothing to forget
    schedules = WindowSchedule("1f1b", [kept, newer], 2, print)
    schedules((2, (4, 3), True))
    assert kept.inputs_meta is None and kept._outputs_meta is None and vars(newer) == {"group_rank": 0}
    kept.inputs_meta, kept._outputs_meta = ("in",), ("out",)
    schedules((2, (4, 3), True))  # the same shape: the same schedule, the shapes kept
    assert kept.inputs_meta == ("in",) and kept._outputs_meta == ("out",)
    schedules((2, (4, 5), True))
    assert kept.inputs_meta is None and kept._outputs_meta is None


def test_two_stages_on_one_gloo_rank_run_windows_of_two_shapes_as_their_modules_do():
    """Real torch stages (2 of them on the one rank of a gloo group, as zbv places 2 on each): the warm-up
    sends nothing to the rank itself, and a window of another shape is measured again. Each
    micro-batch's loss is the two modules' own."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(0)
    mods = [nn.Linear(4, 4), nn.Linear(4, 4)]
    loss = lambda out, target: ((out - target) ** 2).sum()  # noqa: E731
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(mods)]
        schedules = WindowSchedule("zbv", stages, 1, loss)
        for rows in (3, 5):
            x, y = torch.randn(2 * rows, 4), torch.randn(2 * rows, 4)
            losses: list[torch.Tensor] = []
            schedules((2, tuple(x.shape), True)).step(x, target=y, losses=losses)
            with torch.no_grad():
                want = [loss(mods[1](mods[0](x[i : i + rows])), y[i : i + rows]) for i in (0, rows)]
            torch.testing.assert_close(torch.stack(losses).detach(), torch.stack(want))
    finally:
        dist.destroy_process_group()
