"""Bad inputs that used to end in a traceback from inside torch (issue 52 item 8) get one sentence that
names the problem and the fix: `output_dir: ""`, rows of unequal length under kiln's default collator,
a loss without a grad_fn, a data_collator that returns a list or a dict of lists, an empty eval_dataset.
The checks cost a working run nothing: they are made at set-up, or only once something has raised."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import Trainer
from kiln.config import load_config
from kiln.engine.data.collator import default_data_collator
from kiln.utils.errors import ConfigError, KilnError
from tests.helpers import TinyRegressor, TokenModel, base_config, regression_data


def fit(tmp_path, model, data, **kw) -> Trainer:
    collator, optimizers = kw.pop("data_collator", None), kw.pop("optimizers", (None, None))
    trainer = Trainer(
        model,
        base_config(tmp_path, **{"max_steps": 2, "per_device_train_batch_size": 4, **kw}),
        train_dataset=data,
        data_collator=collator,
        optimizers=optimizers,
    )
    trainer.fit()
    return trainer


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# -- output_dir -------------------------------------------------------------------------------
def test_an_empty_output_dir_is_refused_at_load():
    with pytest.raises(ConfigError) as err:
        load_config({"output_dir": ""})
    assert one_line(err) == (
        "output_dir is empty (''); name the folder for checkpoints and logs, e.g. output_dir: out "
        "(leave the key out for the default 'tmp_trainer')."
    )


# -- rows of unequal length under the default collator ------------------------------------------
def _rows(kind: str) -> list[dict]:
    lengths = [3, 3, 4, 3, 5, 3, 3, 3]
    if kind == "tensors":
        return [{"input_ids": torch.arange(n), "labels": torch.arange(n)} for n in lengths]
    if kind == "lists":  # a `datasets` row without a format
        return [{"input_ids": list(range(n)), "labels": list(range(n))} for n in lengths]
    return [{"label": 1, "input_ids": list(range(n))} for n in lengths]  # HF's `label` key takes its own path


@pytest.mark.parametrize("kind", ["tensors", "lists", "label key"])
def test_rows_of_unequal_length_name_the_key_and_the_lengths(tmp_path, kind):
    with pytest.raises(KilnError) as err:
        fit(tmp_path, TokenModel(), _rows(kind), per_device_train_batch_size=8)  # one batch holds every row
    assert one_line(err).startswith(
        "The rows of a batch have different lengths under 'input_ids' (3, 4 and 5), and "
        "kiln's default collator stacks rows as they are: pad them to one length"
    )
    assert "pass a data_collator that pads each batch (e.g. transformers' DataCollatorWithPadding)" in str(err.value)


def test_unequal_shapes_beyond_the_first_dimension_and_tuples():
    rows = [
        (torch.zeros(2, 3), torch.zeros(())),
        (torch.zeros(2, 4), torch.zeros(())),
        (torch.zeros(2, 5), torch.zeros(())),
        (torch.zeros(2, 6), torch.zeros(())),
    ]
    with pytest.raises(
        KilnError,
        match=r"different shapes under position 0 of the items \(\[2, 3\], \[2, 4\] and \[2, 5\], "
        r"\.\.\.\)",
    ):
        default_data_collator(rows)
    with pytest.raises(KilnError, match=r"different lengths under the items \(2 and 3\)"):
        default_data_collator([torch.zeros(2), torch.zeros(3)])


def test_a_collator_failure_of_another_kind_is_left_as_it_was():
    with pytest.raises(TypeError):  # not raggedness: torch's own error stays
        default_data_collator([{"x": object()}, {"x": object()}])
    assert default_data_collator([{"x": torch.ones(2)}, {"x": torch.ones(2)}])["x"].shape == (2, 2)


# -- a loss without a grad_fn ------------------------------------------------------------------
class Detached(TinyRegressor):
    def training_step(self, batch):
        return F.mse_loss(self(batch["x"]), batch["y"]).detach()


class HFDetached(nn.Module):
    """HF contract: returns the loss, but computed under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, y):
        with torch.no_grad():
            return {"loss": F.mse_loss(self.lin(x).squeeze(-1), y)}


class OwnLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return torch.tensor(1.0)


class OwnStep(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


class Frozen(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)


@pytest.mark.parametrize(
    "make, model, maker",
    [
        (Trainer, Detached, "Detached.training_step"),
        (Trainer, HFDetached, "HFDetached.forward (read by Trainer.compute_loss)"),
        (OwnLoss, TinyRegressor, "OwnLoss.compute_loss"),
        (OwnStep, Detached, "OwnStep.training_step"),
    ],
)
def test_a_loss_without_grad_fn_names_what_computed_it(tmp_path, make, model, maker):
    trainer = make(
        model(), base_config(tmp_path, max_steps=2, per_device_train_batch_size=4), train_dataset=regression_data(8)
    )
    with pytest.raises(KilnError) as err:
        trainer.fit()
    assert one_line(err) == (
        f"The loss from {maker} has no grad_fn, so backward() has nothing to differentiate: compute "
        "it from the model's outputs without .detach(), .item(), a new torch.tensor(...) or "
        "torch.no_grad()."
    )
    assert "does not require grad" in str(err.value.__cause__)  # torch's error stays attached


def test_a_model_without_trainable_parameters_is_told_so(tmp_path):
    """(kiln's own optimizer refuses such a model earlier; a user's optimizer may not)"""
    model = Frozen()
    with pytest.raises(
        KilnError,
        match=r"The loss from Frozen.training_step has no grad_fn, so backward\(\) has nothing "
        r"to differentiate: unfreeze some parameters \(none of the model's requires grad\)",
    ):
        fit(tmp_path, model, regression_data(8), optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))


# -- a data_collator's output ------------------------------------------------------------------
def as_list(items):
    return [torch.stack([i["x"] for i in items]), torch.stack([i["y"] for i in items])]


def as_tuple(items):
    return tuple(as_list(items))


def dict_of_lists(items):
    return {"x": [i["x"] for i in items], "y": [i["y"] for i in items]}


def one_list(items):
    return {"x": torch.stack([i["x"] for i in items]), "y": [float(i["y"]) for i in items]}


@pytest.mark.parametrize(
    "collator, sentence",
    [
        (
            as_list,
            r"TinyRegressor.training_step reads the batch by key, but the batch is a list \(tensor\[4, 8\], tensor\[4\]\) "
            r"\(TypeError: list indices must be integers or slices, not str\): have the data_collator return a dict of "
            r"tensors",
        ),
        (
            as_tuple,
            r"TinyRegressor.training_step reads the batch by key, but the batch is a tuple \(tensor\[4, 8\], tensor\[4\]\)",
        ),
        (
            dict_of_lists,
            r"TinyRegressor.training_step failed on a batch whose 'x' and 'y' are Python lists of 4 rows, not a "
            r"tensor \(TypeError: .*\): stack the rows in the data_collator \(torch.stack or torch.tensor\), or leave "
            r"data_collator out for kiln's default collator, which does.",
        ),
        (one_list, r"failed on a batch whose 'y' is a Python list of 4 rows, not a tensor"),
    ],
)
def test_a_collator_that_returns_lists_is_one_sentence(tmp_path, collator, sentence):
    with pytest.raises(KilnError, match=sentence) as err:
        fit(tmp_path, TinyRegressor(), regression_data(8), data_collator=collator)
    one_line(err)


class Positional(TinyRegressor):
    """Reads a list batch by position: a list from the collator is what it wants."""

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self(x), y)


class TakesLists(TinyRegressor):
    def training_step(self, batch):
        return F.mse_loss(self(torch.stack(batch["x"])), torch.stack(batch["y"]))


@pytest.mark.parametrize("model, collator", [(Positional, as_list), (TakesLists, dict_of_lists)])
def test_a_step_that_reads_what_its_collator_returns_trains(tmp_path, model, collator):
    assert fit(tmp_path, model(), regression_data(8), data_collator=collator).state.global_step == 2


class Buggy(TinyRegressor):
    def training_step(self, batch):
        raise TypeError("a bug of the step's own")


def test_an_unrelated_step_error_is_left_as_it_was(tmp_path):
    with pytest.raises(TypeError, match="^a bug of the step's own$"):
        fit(tmp_path, Buggy(), regression_data(8), data_collator=as_list)


# -- an empty eval_dataset ---------------------------------------------------------------------
class Counting(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def training_step(self, batch):
        self.steps += 1
        return super().training_step(batch)


@pytest.mark.parametrize(
    "eval_dataset, name",
    [
        ([], "eval_dataset"),
        ({"a": regression_data(4), "b": []}, "eval_dataset 'b'"),
        (torch.utils.data.DataLoader([]), "eval_dataset"),
    ],
)
def test_an_empty_eval_dataset_is_refused_before_fit_trains(tmp_path, eval_dataset, name):
    model = Counting()
    trainer = Trainer(
        model,
        base_config(tmp_path, max_steps=2, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=1),
        train_dataset=regression_data(8),
        eval_dataset=eval_dataset,
    )
    with pytest.raises(KilnError) as err:
        trainer.fit()
    assert one_line(err) == (
        f"{name} is empty (0 items), so there would be no eval_loss to report: pass a dataset with "
        "items, or set eval_strategy='no'."
    )
    assert model.steps == 0


def test_an_empty_eval_dataset_is_refused_by_evaluate(tmp_path):
    trainer = Trainer(TinyRegressor(), base_config(tmp_path), eval_dataset={"a": regression_data(4), "b": []})
    with pytest.raises(
        KilnError,
        match=r"^eval_dataset 'b' is empty \(0 items\), so there would be no eval_loss to report: "
        r"pass evaluate\(\) a dataset with items\.$",
    ):
        trainer.evaluate()
    with pytest.raises(KilnError, match=r"^eval_dataset is empty \(0 items\)"):
        trainer.evaluate([])
    assert "eval_loss" in trainer.evaluate(regression_data(4))
    # not evaluating during fit: an empty eval_dataset is not in the way
    quiet = Trainer(
        TinyRegressor(), base_config(tmp_path, max_steps=1), train_dataset=regression_data(8), eval_dataset=[]
    )
    assert quiet.fit().global_step == 1
