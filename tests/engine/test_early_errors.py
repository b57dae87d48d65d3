"""Bad input found before the expensive work, each as one sentence naming the problem and the fix:
tuple items where mappings are needed, a loss that is not one number, an output_dir that is a file,
a device this machine lacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import Trainer
from kiln.config import ConfigError, load_config
from kiln.utils.errors import KilnError
from tests.helpers import TinyRegressor, base_config


class HFModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.fc(x).squeeze(-1), labels)}


def _tuples(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4), torch.tensor(1.0)) for _ in range(n)]


def _mapping_collator(features):
    return {key: torch.stack([f[key] for f in features]) for key in features[0].keys()}


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_tuple_items_for_an_hf_model_are_refused_before_the_model_is_placed(tmp_path):
    trainer = Trainer(HFModel(), base_config(tmp_path, max_steps=1), train_dataset=_tuples())
    with pytest.raises(KilnError) as err:
        trainer.fit()
    assert _one_line(err) == (
        "The dataset's items are tuple (tensor[4], tensor[]), which the default collator turns into a list, but an "
        "HF-contract model is called as model(**batch) and needs a dict: return dicts such as {'input_ids': ..., "
        "'labels': ...} from __getitem__, pass a data_collator that builds one, or wrap the model in a TrainingModule "
        "whose training_step(batch) takes the tuple."
    )
    assert trainer.model_wrapped is trainer.model and trainer.state.global_step == 0  # never set up


def test_tuple_items_with_a_mapping_collator_say_what_the_collator_expects(tmp_path):
    trainer = Trainer(
        TinyRegressor(d_in=4),
        base_config(tmp_path, max_steps=1),
        train_dataset=_tuples(),
        data_collator=_mapping_collator,
    )
    with pytest.raises(KilnError) as err:
        trainer.fit()
    assert _one_line(err).startswith(
        "The data collator (function) failed on the dataset's items, which are tuple (tensor[4], tensor[]) (AttributeError: "
    )
    assert "it expects mappings such as {'input_ids': ..., 'labels': ...}; return dicts" in str(err.value)


def test_the_probe_draws_no_random_numbers():
    from kiln.engine.data.checks import check_first_item

    def masking(features):  # draws from every stream, then fails like a mapping collator
        torch.rand(3), __import__("random").random(), __import__("numpy").random.rand()
        return {k: None for k in features[0].keys()}

    data = _tuples()
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    with pytest.raises(KilnError):
        check_first_item(data, masking, training_module=True)
    assert torch.equal(torch.rand(2), expected)


class BareLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_bare_non_scalar_tensor_is_not_taken_for_a_loss(tmp_path):
    data = [{"x": torch.randn(4)} for _ in range(8)]
    trainer = Trainer(
        BareLogits(), base_config(tmp_path, max_steps=1, per_device_train_batch_size=8), train_dataset=data
    )
    with pytest.raises(ValueError) as err:
        trainer.fit()
    assert _one_line(err).startswith("The model returned a bare tensor has shape (8, 3), not a single loss value: ")
    assert "reduce per-item losses with .mean()" in str(err.value)


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("x")
    built = []
    with pytest.raises(ConfigError) as err:
        Trainer(model_init=lambda: built.append(1) or HFModel(), config={"output_dir": str(tmp_path / "taken")})
    assert _one_line(err) == f"output_dir {str(tmp_path / 'taken')!r} is a file, not a folder; pick another output_dir."
    assert built == []  # refused before the model was built


def _refused_before_the_model(config):
    """The Trainer's constructor refuses `config` before it builds the model (the strategy picks the
    device first); a config file itself still loads on any machine."""
    load_config(config)
    built = []
    with pytest.raises(ConfigError) as err:
        Trainer(model_init=lambda: built.append(1) or HFModel(), config=config)
    assert built == []
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda():
    err = _refused_before_the_model({"strategy": {"device": "cuda"}})
    assert _one_line(err).startswith(
        "strategy.device is 'cuda' but CUDA is not available on this machine; use strategy.device=cpu"
    )
    assert "CUDA is not available" in _one_line(_refused_before_the_model({"strategy": "cuda"}))


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without MPS")
def test_mps_device_without_mps():
    err = _refused_before_the_model({"strategy": {"device": "mps"}})
    assert _one_line(err).startswith("strategy.device is 'mps' but MPS (Apple silicon GPUs) is not available")
    assert "MPS (Apple silicon GPUs) is not available" in _one_line(_refused_before_the_model({"strategy": "mps"}))
    err = _refused_before_the_model({"strategy": {"device": "gpu"}})
    assert "is not a device; use cpu, cuda, cuda:<index> or mps" in _one_line(err)
