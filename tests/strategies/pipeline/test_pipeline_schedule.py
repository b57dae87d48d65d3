"""The pipeline's window in one process (kiln/strategies/mesh/pipeline_schedule.py): padding the
window's micro-batches to one shape leaves each micro-batch's loss and gradients as they were; torch's
class for each schedule name; one sentence for a batch a stage cannot read."""

from __future__ import annotations

import pytest
import torch

from kiln.strategies.mesh.pipeline_schedule import schedule_class, stack_window
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
    with pytest.raises(
        KilnError, match="reads only input_ids, labels, attention_mask of a batch, and it holds token_type_ids"
    ):
        stack_window(
            [{"input_ids": torch.zeros(1, 2), "labels": torch.zeros(1, 2), "token_type_ids": torch.zeros(1, 2)}]
        )
