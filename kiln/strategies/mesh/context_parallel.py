"""Context parallelism (`mesh: {cp: N}`, under `strategy: model_parallel`): the N ranks of a cp group read
the same batches and each trains on its own chunk of every sequence; attention becomes torch's ring
attention (`context_parallel`'s SDPA dispatcher), which passes the other chunks' keys and values
around the group, so each chunk attends to the whole causal prefix.

Three pieces, at the strategy's existing seams:

- `prepare_batch` (from `batch_to_device`, training batches only): before the sequence is split it
  adds what the split would lose, as HF's `Trainer._prepare_context_parallel_inputs` does --
  `shift_labels` (labels[t + 1], -100 last: the token at a chunk's end keeps its target, which sits
  in the next rank's chunk) and `position_ids` (0..L-1, so a chunk keeps its true positions) -- then
  keeps this rank's chunk of every tensor whose first two dims are the batch's (batch, sequence).
  With load balancing (torch's default for causal attention) the sequence is cut in 2N pieces and
  rank r keeps pieces r and 2N-1-r (torch's head-tail order, which its ring kernels expect); without
  it, piece r of N. Item counts, token counts and FLOPs are then counted on the chunk, so they add up
  over data shards x cp ranks (the strategy's `reduce` and `item_shards`); num_input_tokens_seen is
  counted on the batch as loaded, before this split and its padding (the engine's fit_meter.py).
- `ring_attention` (from `micro_batch_context`, around forward and backward): torch's dispatcher that
  turns `F.scaled_dot_product_attention` into ring attention over the cp axis, with the same load
  balancing flag the batch was split with.
- `check_model` (from `setup_module`, before the first step): refuse what CP cannot shard, one
  sentence each (eager or any non-SDPA attention would attend only within the local chunk: wrong
  results; SDPA on a device without torch's ring kernels; masks stricter than causal), and make the
  Transformers attention layers drop their attention mask for `is_causal` (accelerate's hook: the
  ring kernels take no mask).

Packed rows (data.packing) cannot go through the ring, which takes no mask: they keep their
per-example position_ids and attend with gathered keys and values and a per-example mask instead
(packed_cp.py; `prepare_batch(..., packed=True)`, `check_model(..., packed=True)`).

Evaluation and prediction are not context parallel: their batches are left whole, every cp rank
computes the same full-sequence outputs (with plain attention), and the strategy's gathers keep one
copy per data shard."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from kiln.utils.errors import ConfigError

#: the tensor whose (batch, sequence) shape decides which tensors are split along dim 1
REFERENCE_KEYS = ("input_ids", "inputs_embeds")


def pieces(cp: int, load_balance: bool) -> int:
    """How many equal pieces the sequence is cut into: 2 per rank with load balancing, else 1."""
    return 2 * cp if load_balance else cp


def chunk_indices(length: int, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """The token positions cp rank `rank` keeps of a sequence of `length` (torch's head-tail order
    with load balancing: pieces rank and 2cp-1-rank, which balances causal attention's work)."""
    size = length // pieces(cp, load_balance)
    if not load_balance:
        return torch.arange(rank * size, (rank + 1) * size)
    tail = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * size, (rank + 1) * size), torch.arange(tail * size, (tail + 1) * size)])


def prepare_batch(batch: Any, cp: int, rank: int, load_balance: bool, packed: bool = False) -> dict[str, Any]:
    """This cp rank's share of a training batch (see the module docstring); refuses, one sentence
    each, what cannot be split exactly. Checks read the batch before it moves to the device. With
    `packed` (data.packing) the rows keep their per-example position_ids and get the mask of
    packed_cp.py, for attention with gathered keys and values."""
    from kiln.strategies.mesh import packed_cp

    if not isinstance(batch, Mapping):
        raise ConfigError(
            f"strategy.mesh.cp is {cp}, so batches must be dicts with input_ids of shape (batch, sequence) "
            f"for kiln to split the sequence, not a {type(batch).__name__}."
        )
    ref = next((batch[k] for k in REFERENCE_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
    if ref is None or ref.dim() < 2:
        raise ConfigError(
            f"strategy.mesh.cp is {cp}, so each batch needs input_ids (or inputs_embeds) of shape (batch, "
            "sequence) to split along the sequence; this batch has none."
        )
    rows, length = ref.shape[0], ref.shape[1]
    out = dict(batch)
    positions = batch.get("position_ids")
    if packed:  # the whole batch's varlen arguments describe no chunk; rows padded to a length the split divides
        out = {k: v for k, v in out.items() if k not in packed_cp.VARLEN_KEYS}
        if isinstance(positions, torch.Tensor):
            out["position_ids"] = positions.to(ref.device).expand(rows, length).contiguous()
        out, length = packed_cp.pad_rows(out, rows, length, pieces(cp, load_balance))
        positions = out.get("position_ids")
    if length % pieces(cp, load_balance):
        how = f"2 x cp = {2 * cp} (load balancing cuts it in two pieces per rank)" if load_balance else f"cp = {cp}"
        raise ConfigError(
            f"a training batch has sequence length {length}, which {how} does not divide; pad or pack "
            f"sequences to a multiple of {pieces(cp, load_balance)}."
        )
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        raise ConfigError(
            "context parallel attends causally over whole rows and cannot apply a padding attention_mask "
            "(it has zeros); pad on the right with labels -100 and no attention_mask, or pack the sequences."
        )
    count = torch.arange(length, device=ref.device)
    if not packed and isinstance(positions, torch.Tensor) and not bool((positions.to(ref.device) == count).all()):
        raise ConfigError(
            "context parallel's causal ring attention would attend across the documents of a packed row "
            "(position_ids that do not count 0..L-1); give one sequence per row under cp, or pack with "
            "data.packing, whose rows cp masks per example."
        )
    labels = out.get("labels")
    # before the split: the boundary keeps its target
    if isinstance(labels, torch.Tensor) and "shift_labels" not in out:
        out["shift_labels"] = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    if not (packed and isinstance(positions, torch.Tensor)):
        # before the split, so a chunk keeps its true positions (given ones equal these: checked above)
        out["position_ids"] = count.expand(rows, length).contiguous()
    docs = packed_cp.documents(out["position_ids"]) if packed else None  # of the whole rows
    keep = chunk_indices(length, cp, rank, load_balance).to(ref.device)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, length):
            out[key] = value.index_select(1, keep.to(value.device))
    if docs is not None:
        order = torch.cat([chunk_indices(length, cp, r, load_balance) for r in range(cp)]).to(ref.device)
        out["attention_mask"] = packed_cp.gathered_mask(docs, keep, order)
    return out


@contextlib.contextmanager
def ring_attention(cp_mesh: Any, load_balance: bool) -> Iterator[None]:
    """torch's CP dispatcher around one micro-batch's forward and backward: SDPA calls become ring
    attention over `cp_mesh` (its backward too, hence around both). What `context_parallel()` does,
    minus splitting buffers (prepare_batch did, with the same `load_balance`); on a device without
    ring kernels (CPU) an SDPA call fails with a sentence instead of computing something else."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    previous = (cp._dispatch_mode, cp._cp_options.enable_load_balance)
    cp._dispatch_mode = (
        cp._DispatchMode.MONKEY_PATCH
    )  # F.scaled_dot_product_attention is swapped, as context_parallel does
    cp._cp_options.enable_load_balance = load_balance
    cp._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=cp_mesh)
    try:
        yield
    except NotImplementedError as err:
        if "scaled_dot_product" in str(err):  # torch registers ring handlers only for the CUDA SDPA kernels
            raise ConfigError(
                "context parallel's ring attention needs CUDA SDPA (flash/efficient/cudnn); on CPU use cp: 1."
            ) from err
        raise
    finally:
        cp._disable_context_parallel_dispatcher_impl()
        cp._dispatch_mode, cp._cp_options.enable_load_balance = previous


def transformers_models(root: nn.Module) -> list[tuple[str, Any]]:
    """The outermost Transformers models inside `root` (modules with a config that names its attention:
    duck-typed, so Any)."""
    found: list[tuple[str, Any]] = []
    for name, sub in root.named_modules():
        if hasattr(getattr(sub, "config", None), "_attn_implementation") and not any(
            name.startswith(f"{outer}.") or not outer for outer, _ in found
        ):
            found.append((name, sub))
    return found


def check_model(root: nn.Module, device_type: str, packed: bool = False) -> int:
    """Refuse, before the first step, a model whose attention CP cannot shard; then make its attention
    layers causal without a mask (see `causal_attention_hooks`). Returns how many layers got the hook.
    A module of your own must call `F.scaled_dot_product_attention` (causal) for its attention:
    attention written by hand would see only the local chunk, which kiln cannot detect. With `packed`
    (data.packing) attention is SDPA over gathered keys and values with a per-example mask
    (packed_cp.py), on any device, and keeps its mask (no hook)."""
    hooked = 0
    for name, model in transformers_models(root):
        what = f"{type(model).__name__}{f' ({name})' if name else ''}"
        config = model.config
        impl = config._attn_implementation
        if packed and impl != "sdpa":
            raise ConfigError(
                f"{what} uses {impl!r} attention, but under context parallel kiln attends packed rows "
                "(data.packing) through SDPA over the gathered keys and values of the cp ranks; load it with "
                "attn_implementation='sdpa'."
            )
        if impl == "eager":
            raise ConfigError(
                f"{what} uses eager attention, which under context parallel would attend only within each "
                "rank's chunk of the sequence (wrong results); load it with attn_implementation='sdpa'."
            )
        if impl != "sdpa":
            raise ConfigError(
                f"{what} uses {impl!r} attention, but context parallel shards only torch's SDPA attention; "
                "load it with attn_implementation='sdpa'."
            )
        if device_type != "cuda" and not packed:
            raise ConfigError(
                "context parallel's ring attention needs CUDA SDPA (flash/efficient/cudnn); on CPU use cp: 1."
            )
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        kinds = set(getattr(text, "layer_types", None) or ()) - {"full_attention"}
        if kinds or (getattr(text, "layer_types", None) is None and getattr(text, "sliding_window", None)):
            raise ConfigError(
                f"{what} has attention layers stricter than causal ({', '.join(sorted(kinds)) or 'sliding window'}), "
                "which context parallel's ring (causal over the whole row) would train as full causal; use cp: 1."
            )
        if not type(model).__name__.endswith("ForCausalLM"):  # encoder-decoders are ...ForConditionalGeneration
            raise ConfigError(
                f"{what} is not a causal language model; kiln's context parallel is built for causal "
                "attention and the shifted-label loss (…ForCausalLM models with sdpa)."
            )
        if not _takes(model.forward, "shift_labels"):
            raise ConfigError(
                f"{what}.forward does not take shift_labels, which context parallel needs to keep the "
                "target of each chunk's last token; use a model whose forward passes **kwargs to its loss."
            )
        if not packed:
            hooked += causal_attention_hooks(model)
    return hooked


def causal_attention_hooks(model: nn.Module) -> int:
    """accelerate's `_attach_context_parallel_hooks`: in training, every `self_attn` layer gets no
    attention mask and `is_causal=True`, since the ring kernels take no mask (training batches have
    no padding: prepare_batch checks). Evaluation is not context parallel and keeps its masks."""

    def causal(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if module.training and "attention_mask" in kwargs:
            kwargs["attention_mask"], kwargs["is_causal"] = None, True
        return args, kwargs

    count = 0
    for name, sub in model.named_modules():
        if name.endswith("self_attn") and not getattr(sub, "_kiln_cp_causal", False):
            sub.register_forward_pre_hook(causal, with_kwargs=True)
            sub._kiln_cp_causal = True  # set up twice (a second train()): one hook
            count += 1
    return count


def _takes(method: Any, name: str) -> bool:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
