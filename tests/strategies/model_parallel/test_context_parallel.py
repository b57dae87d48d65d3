"""Context parallelism's pieces that need no process group: which tokens a cp rank keeps (torch's
head-tail order, or contiguous), what is made before the split (shift_labels keep each chunk
boundary's target, position_ids keep true positions), which tensors are split, the Transformers
attention hook, and every refusal sentence (batches, models, meshes, options)."""

from __future__ import annotations

import pytest
import torch

from kiln.config import load_config
from kiln.strategies.mesh.context_parallel import causal_attention_hooks, check_model, chunk_indices, prepare_batch
from kiln.strategies.mesh.dims import parse_mesh
from kiln.utils.errors import ConfigError
from tests.strategies.model_parallel.cases import llama
from tests.strategies.model_parallel.cp_cases import TokenLocalLM

IDS = torch.arange(16).view(2, 8)  # row b, token t holds 8b + t: a chunk names its own token indices
LABELS = IDS + 100


@pytest.mark.parametrize("length, cp", [(8, 2), (12, 3), (16, 4)])
def test_load_balanced_chunks_are_torchs_head_tail_order(length, cp):
    """The ring kernels expect torch's split: its load balancer's order, cut in cp contiguous blocks."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    order = _HeadTailLoadBalancer(length, cp, "cpu")._generate_indices()[0].long()
    for rank in range(cp):
        assert torch.equal(chunk_indices(length, cp, rank, True), order.view(cp, -1)[rank])
        assert torch.equal(chunk_indices(length, cp, rank, False), torch.arange(length).view(cp, -1)[rank])


def test_load_balanced_rank_keeps_a_head_and_a_tail_piece_with_their_positions_and_targets():
    mine = prepare_batch({"input_ids": IDS, "labels": LABELS}, cp=2, rank=0, load_balance=True)
    assert mine["input_ids"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert mine["position_ids"].tolist() == [[0, 1, 6, 7], [0, 1, 6, 7]]
    assert mine["labels"].tolist() == [[100, 101, 106, 107], [108, 109, 114, 115]]
    # the target of token t is labels[t + 1]: token 1 keeps 102, which lives on rank 1; the row's last has none
    assert mine["shift_labels"].tolist() == [[101, 102, 107, -100], [109, 110, 115, -100]]
    other = prepare_batch({"input_ids": IDS, "labels": LABELS}, cp=2, rank=1, load_balance=True)
    assert other["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert other["shift_labels"].tolist() == [[103, 104, 105, 106], [111, 112, 113, 114]]


def test_contiguous_chunks_keep_true_positions_and_the_boundary_target():
    """Without load balancing rank 1 of cp 2 holds tokens L/2..L-1 at positions L/2..L-1, and rank 0's
    last token keeps its target (the first label of rank 1's chunk)."""
    first = prepare_batch({"input_ids": IDS, "labels": LABELS}, cp=2, rank=0, load_balance=False)
    second = prepare_batch({"input_ids": IDS, "labels": LABELS}, cp=2, rank=1, load_balance=False)
    assert first["input_ids"].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7], [4, 5, 6, 7]]
    assert first["shift_labels"][:, -1].tolist() == [104, 112]
    assert second["shift_labels"].tolist() == [[105, 106, 107, -100], [113, 114, 115, -100]]


def test_every_batch_by_sequence_tensor_is_split_and_the_rest_left_whole():
    batch = {
        "input_ids": IDS,
        "loss_mask": torch.ones(2, 8),
        "embeds": torch.zeros(2, 8, 3),
        "label": torch.tensor([1, 0]),
        "shift_labels": LABELS,
        "attention_mask": torch.ones(2, 8, dtype=torch.long),
        "position_ids": torch.arange(8),
    }
    mine = prepare_batch(batch, cp=2, rank=1, load_balance=False)
    assert (
        mine["loss_mask"].shape == (2, 4)
        and mine["embeds"].shape == (2, 4, 3)
        and mine["attention_mask"].shape == (2, 4)
    )
    assert torch.equal(mine["label"], batch["label"])  # per sample: whole
    assert mine["shift_labels"].tolist() == [[104, 105, 106, 107], [112, 113, 114, 115]]  # given ones are kept, split
    assert mine["position_ids"].tolist() == [[4, 5, 6, 7]] * 2  # a given 0..L-1 (broadcast) is split like the rest
    assert (
        "labels" not in mine and batch["input_ids"] is IDS and batch["input_ids"].shape == (2, 8)
    )  # the input is untouched


@pytest.mark.parametrize(
    "batch, words",
    [
        ({"input_ids": torch.zeros(2, 6, dtype=torch.long)}, r"sequence length 6, which 2 x cp = 4 \(load balancing"),
        (
            {"input_ids": IDS, "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])},
            "cannot apply a padding attention_mask",
        ),
        (
            {"input_ids": IDS, "position_ids": torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])},
            r"across the documents of a packed row .*; give one sequence per row under cp, or pack with "
            r"data.packing, whose rows cp masks per example.$",
        ),
        ([IDS], "batches must be dicts with input_ids"),
        ({"pixels": torch.zeros(2, 3, 8, 8)}, "needs input_ids"),
        ({"input_ids": torch.zeros(8, dtype=torch.long)}, "needs input_ids"),  # no batch dim
    ],
)
def test_a_batch_cp_cannot_split_exactly_is_one_sentence(batch, words):
    with pytest.raises(ConfigError, match=words) as err:
        prepare_batch(batch, cp=2, rank=0, load_balance=True)
    assert str(err.value).count(". ") == 0


def test_flex_attention_still_cannot_train_on_cpu():
    """Why kiln's cp attends packed rows through SDPA over gathered keys and values (packed_cp.py) and
    not through torch's own masked cp path, flex_attention over gathered keys and values
    (`_ContextParallel`'s FLEX input_fn with a `_create_cp_block_mask`): flex_attention refuses a
    backward on CPU (torch/nn/attention/flex_attention.py, `_validate_device`), eager or compiled, so
    that path could not be trained or tested here. Its forward runs. When this fails, torch can train
    it on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    query = torch.zeros(1, 1, 128, 8)
    assert flex_attention(query, query, query).shape == query.shape  # the forward runs
    query.requires_grad_()
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        flex_attention(query, query, query)


def test_without_load_balancing_cp_alone_must_divide_the_length():
    assert prepare_batch({"input_ids": torch.zeros(1, 6, dtype=torch.long)}, 2, 1, False)["input_ids"].shape == (1, 3)
    with pytest.raises(ConfigError, match="sequence length 6, which cp = 4 does not divide"):
        prepare_batch({"input_ids": torch.zeros(1, 6, dtype=torch.long)}, 4, 0, False)


# -- models -----------------------------------------------------------------------------------------


def _llama(impl: str):
    model = llama()
    model.config._attn_implementation = impl
    return model


@pytest.mark.parametrize(
    "impl, device, words",
    [
        (
            "eager",
            "cuda",
            "uses eager attention, which under context parallel would attend only within each rank's chunk",
        ),
        (
            "flash_attention_2",
            "cuda",
            "uses 'flash_attention_2' attention, but context parallel shards only torch's SDPA",
        ),
        (
            "sdpa",
            "cpu",
            "^context parallel's ring attention needs CUDA SDPA \\(flash/efficient/cudnn\\); on CPU use cp: 1.$",
        ),
    ],
)
def test_attention_cp_cannot_shard_is_refused(impl, device, words):
    with pytest.raises(ConfigError, match=words) as err:
        check_model(_llama(impl), device)
    assert str(err.value).count(". ") == 0


def test_a_transformers_model_inside_a_training_module_is_checked_too():
    from tests.strategies.model_parallel.cases import HookedLlama

    with pytest.raises(ConfigError, match=r"LlamaForCausalLM \(llm\) uses eager attention"):
        wrapped = HookedLlama()
        wrapped.llm.config._attn_implementation = "eager"
        check_model(wrapped, "cuda")
    assert check_model(TokenLocalLM(), "cpu") == 0  # no attention at all: nothing to refuse or hook


def test_sliding_window_and_non_causal_models_are_refused():
    model = _llama("sdpa")
    model.config.sliding_window = 4
    with pytest.raises(ConfigError, match="stricter than causal"):
        check_model(model, "cuda")
    with pytest.raises(ConfigError, match="LlamaModel is not a causal language model"):
        check_model(_llama("sdpa").model, "cuda")


def test_a_causal_sdpa_llama_on_cuda_passes_and_its_attention_drops_the_mask_in_training():
    model = _llama("sdpa")
    assert check_model(model, "cuda") == 2  # one hook per decoder layer's self_attn
    assert causal_attention_hooks(model) == 0  # set up again: no second hook
    seen = []
    attn = model.model.layers[0].self_attn
    attn.register_forward_pre_hook(lambda m, a, kw: seen.append(dict(kw)), with_kwargs=True)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4, dtype=torch.long))
    assert seen and seen[0]["attention_mask"] is None and seen[0]["is_causal"] is True
    model.eval()  # evaluation is not context parallel: a padded batch keeps its mask
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 0]]))
    assert seen[-1]["attention_mask"] is not None and "is_causal" not in seen[-1]


# -- the mesh and options ---------------------------------------------------------------------------


def test_cp_composes_with_the_data_parallel_axes_and_tp():
    shape = parse_mesh({"dp_shard": 2, "cp": 2}, 4)
    assert (shape.dp, shape.dp_cp, shape.model_ranks) == (2, 4, 2)
    assert [shape.data_rank(r) for r in range(4)] == [0, 0, 1, 1]  # a cp pair reads the same batches
    shape = parse_mesh({"cp": 2, "tp": 2}, 4)  # one data shard: the cp x tp block
    assert (shape.dp, shape.dp_cp, shape.model_ranks) == (1, 2, 4)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor with strategy.mesh.cp > 1 is not supported"),
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha with strategy.mesh.cp > 1 is not supported"),
        (
            {"strategy": {"name": "model_parallel", "device": "cpu", "mesh": {"cp": 2}, "cp_load_balance": "yes"}},
            "strategy.cp_load_balance is 'yes'; give true or false",
        ),
    ],
)
def test_what_cp_was_not_made_to_work_with_is_refused_before_any_group(extra, words):
    import torch.distributed as dist

    from kiln.strategies.model_parallel.strategy import ModelParallelStrategy

    cfg = load_config({"strategy": {"name": "model_parallel", "device": "cpu"}, **extra})
    strategy = ModelParallelStrategy.__new__(ModelParallelStrategy)
    strategy.config, strategy.shape = cfg, parse_mesh({"cp": 2}, 2)  # as on 2 processes, without starting them
    with pytest.raises(ConfigError, match=words):
        strategy._check_cp_config()
    assert not dist.is_initialized()
