"""Nested outputs (tensors or numpy arrays in tuples, lists and dicts, as a model returns them): walking them,
per-leaf conversions (detach, to CPU, to numpy, truncate) and concatenating ragged batches in one allocation,
right-padding their trailing dims with `padding_index`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

Array = torch.Tensor | np.ndarray
ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)


# -- walking nested structures ------------------------------------------------------------------
def nested_map(fn: Callable[..., Any], *trees: Any) -> Any:
    """Apply `fn` leaf-wise to structurally identical trees of tuples/lists/dicts; None stays None."""
    first = trees[0]
    if first is None:
        return None
    if isinstance(first, Mapping):
        return {key: nested_map(fn, *(tree[key] for tree in trees)) for key in first}
    if isinstance(first, (list, tuple)):
        values = [nested_map(fn, *items) for items in zip(*trees)]
        return type(first)(*values) if hasattr(first, "_fields") else type(first)(values)
    return fn(*trees)


def nested_leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, Mapping):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        for item in tree:
            yield from nested_leaves(item)
    elif tree is not None:
        yield tree


def nested_rows(tree: Any) -> int:
    """Rows (dim 0) of the first leaf of a tree; every leaf of one batch has the same count."""
    return next((int(leaf.shape[0]) if leaf.ndim else 1 for leaf in nested_leaves(tree)), 0)


# -- per-leaf conversions -----------------------------------------------------------------------
def nested_detach(tensors: Any) -> Any:
    """Detach every tensor, so that kept outputs do not hold the autograd graph alive."""
    return nested_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tensors)


def nested_to_cpu(tensors: Any) -> Any:
    """Detach and move every tensor to the CPU (other leaves are returned as they are)."""
    return nested_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tensors)


def _numpify(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().cpu()
    if t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()  # bfloat16 and float8 have no numpy dtype
    return t.numpy()


def nested_numpify(tensors: Any) -> Any:
    """Move every tensor to CPU numpy; bf16 (and float8) become float32, which numpy can hold."""
    return nested_map(_numpify, tensors)


def nested_truncate(tensors: Any, limit: int) -> Any:
    """Keep the first `limit` rows of every leaf (drops the sampler's padding duplicates)."""
    return nested_map(lambda t: t[:limit], tensors)


# -- padding and concatenation ------------------------------------------------------------------
def pad_to(x: ArrayT, shape: Sequence[int], padding_index: float) -> ArrayT:
    """`x` grown to `shape` with `padding_index` after the existing values in every dimension."""
    shape = tuple(int(s) for s in shape)
    if tuple(x.shape) == shape:
        return x
    if isinstance(x, torch.Tensor):
        out = x.new_full(shape, padding_index)
    else:
        out = np.full(shape, padding_index, dtype=x.dtype)
    out[tuple(slice(0, s) for s in x.shape)] = x
    return out


def concat_padded(arrays: Sequence[Array], padding_index: float = -100) -> Array:
    """Concatenate along dim 0 in ONE allocation, right-padding trailing dims to their maximum.

    Used instead of repeated pairwise concatenation so that joining n batches costs O(n), not O(n^2).
    0-d tensors (a scalar loss) count as one row.
    """
    if not arrays:
        raise ValueError("concat_padded needs at least one array.")
    if all(isinstance(a, torch.Tensor) for a in arrays):
        tensors = [torch.atleast_1d(a) for a in arrays]
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))

        def new_full(shape: tuple[int, ...]) -> Array:
            return tensors[0].new_full(shape, padding_index, dtype=dtype)
    elif all(isinstance(a, np.ndarray) for a in arrays):
        tensors = [np.atleast_1d(a) for a in arrays]
        np_dtype = np.result_type(*tensors)

        def new_full(shape: tuple[int, ...]) -> Array:
            return np.full(shape, padding_index, dtype=np_dtype)
    else:
        kinds = sorted({type(a).__name__ for a in arrays})
        raise TypeError(
            f"Cannot concatenate {kinds}: pass all torch tensors or all numpy arrays (nested_numpify first)"
        )
    if len({t.ndim for t in tensors}) != 1:
        raise ValueError(f"Cannot concatenate arrays with different ranks: {[tuple(t.shape) for t in tensors]}.")
    if len(tensors) == 1:
        return tensors[0]
    trailing = tuple(max(t.shape[d] for t in tensors) for d in range(1, tensors[0].ndim))
    if all(tuple(t.shape[1:]) == trailing for t in tensors):
        return torch.cat(tensors) if isinstance(tensors[0], torch.Tensor) else np.concatenate(tensors)
    out = new_full((sum(t.shape[0] for t in tensors), *trailing))
    row = 0
    for t in tensors:
        out[(slice(row, row + t.shape[0]), *(slice(0, s) for s in t.shape[1:]))] = t
        row += t.shape[0]
    return out


def pad_and_concat(a: Array, b: Array, padding_index: float = -100) -> Array:
    """Concatenate two tensors or two numpy arrays along dim 0; if their other dims differ
    (sequence lengths of two batches), pad both on the RIGHT with `padding_index` first."""
    return concat_padded([a, b], padding_index)


def nested_concat(a: Any, b: Any, padding_index: float = -100) -> Any:
    """`pad_and_concat` leaf-wise over matching tuples/lists/dicts; if `a` is None, returns `b`."""
    if a is None:
        return b
    return nested_map(lambda x, y: concat_padded([x, y], padding_index), a, b)


def nested_concat_all(items: Sequence[Any], padding_index: float = -100) -> Any:
    """Concatenate a list of same-structured batches leaf-wise in one allocation per leaf."""
    if not items:
        return None
    return nested_map(lambda *leaves: concat_padded(leaves, padding_index), *items)
