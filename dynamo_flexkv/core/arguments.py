"""Checks of the arguments KVManager's public calls take: device block ids, skip_blocks, timeouts.
Each refusal names the argument and what to pass instead."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from dynamo_flexkv.core.hashing import TokenIds

# Device block ids as callers pass them: a list or tuple, a numpy array or a tensor of integers.
BlockIds = Sequence[int] | np.ndarray | torch.Tensor


def device_ids(token_ids: TokenIds, device_block_ids: BlockIds, tokens_per_block: int, num_blocks: int) -> np.ndarray:
    """The ids of the full blocks, as int64; refuses non-integers and repeated ids (one device
    block cannot hold two blocks: a put would store its bytes under both hashes, a get would
    scatter both blocks into it)."""
    n_tokens = len(token_ids)
    full, covering = n_tokens // tokens_per_block, -(-n_tokens // tokens_per_block)
    ids = integer_array(device_block_ids, num_blocks)
    if ids.size not in (full, covering):
        raise ValueError(
            f"{ids.size} device block ids for {n_tokens} tokens: pass one id per block "
            f"({full} full blocks, or {covering} with the partial one)"
        )
    ids = ids[:full]
    values, counts = np.unique(ids, return_counts=True)
    if values.size < ids.size:
        dup = int(values[counts > 1][0])
        raise ValueError(
            f"device_block_ids repeats block {dup} (at positions "
            f"{np.flatnonzero(ids == dup).tolist()}): pass a distinct device block per block"
        )
    return ids


def layer_index(value: Any, num_layers: int) -> int:
    """``layer`` of wait_for_layer: an int in [0, num_layers)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"wait_for_layer(layer={value!r}): layer must be an int in [0, {num_layers}), got {type(value).__name__}"
        )
    if not 0 <= value < num_layers:
        raise ValueError(f"layer {value} outside [0, {num_layers})")
    return int(value)


def task_id_list(task_ids: Any, call: str) -> list[Any]:
    """The ids a wait/cancel call takes: an iterable of task ids (one id alone is refused, naming
    the fix, rather than read as characters or failing as 'not iterable')."""
    if isinstance(task_ids, (str, bytes, int, np.integer)) or task_ids is None:
        raise TypeError(f"{call}(task_ids={task_ids!r}): pass a list of task ids, e.g. {call}([tid])")
    try:
        return list(task_ids)
    except TypeError:
        raise TypeError(f"{call}(task_ids={task_ids!r}): pass a list of task ids, e.g. {call}([tid])") from None


def skip_blocks(value: Any, n_tokens: int, tokens_per_block: int) -> int:
    """``skip_blocks`` of a get: an int in [0, the prompt's blocks]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"skip_blocks must be an int (the number of leading blocks the engine already "
            f"holds), got {type(value).__name__} {value!r}"
        )
    blocks = -(-n_tokens // tokens_per_block)
    if value < 0:
        raise ValueError(f"skip_blocks={value} must be >= 0: the number of leading blocks the engine already holds")
    if value > blocks:
        raise ValueError(
            f"skip_blocks={value} is past this {n_tokens}-token prompt's {blocks} "
            "blocks: pass the number of its leading blocks the engine already holds"
        )
    return int(value)


def integer_array(device_block_ids: BlockIds, num_blocks: int) -> np.ndarray:
    """device_block_ids (list, tuple, numpy array or tensor of integers, each in [0, num_blocks))
    as a flat int64 array."""
    if isinstance(device_block_ids, torch.Tensor):
        device_block_ids = device_block_ids.detach().cpu().numpy()
    if isinstance(device_block_ids, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in device_block_ids):
        pos = next(i for i, v in enumerate(device_block_ids) if isinstance(v, (bool, np.bool_)))
        raise TypeError(f"device_block_ids[{pos}] is {device_block_ids[pos]!r}, a bool: pass integer block ids")
    try:
        ids = (
            None
            if device_block_ids is None or isinstance(device_block_ids, (str, bytes))
            else np.asarray(device_block_ids)
        )
    except ValueError:  # ragged nesting
        raise TypeError(
            "device_block_ids must be a flat sequence of integers (one id per block), got a "
            f"ragged {type(device_block_ids).__name__}"
        ) from None
    if ids is not None and ids.dtype.kind in "fO" and ids.ndim == 1:
        # Python ints past int64 turn a list into float64 or object: name the id, not the dtype.
        for pos, v in enumerate(device_block_ids):
            if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and not 0 <= v < num_blocks:
                out_of_range(int(v), pos, num_blocks)
    if ids is None or ids.dtype == object or ids.ndim == 0:
        raise TypeError(f"device_block_ids must be a sequence of integers, got {type(device_block_ids).__name__}")
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.dtype.kind not in "iu":  # floats would be truncated, bools read as blocks 0 and 1
        raise TypeError(f"device_block_ids must be integers, got dtype {ids.dtype}")
    if ids.ndim != 1:  # a [n, 1] array is not one id per block by accident
        raise TypeError(f"device_block_ids must be one-dimensional (one id per block), got shape {ids.shape}")
    bad = np.flatnonzero((ids < 0) | (ids >= num_blocks))  # in the ids' own dtype: uint64 does not wrap
    if bad.size:
        out_of_range(int(ids[bad[0]]), int(bad[0]), num_blocks)
    return ids.astype(np.int64, copy=False)


def out_of_range(block_id: int, pos: int, num_blocks: int) -> NoReturn:
    raise IndexError(
        f"device block id out of range [0, {num_blocks}): got {block_id} (position {pos}); pass "
        "ids of blocks of the registered device cache"
    )


def deadline(timeout: Any, call: str) -> float | None:
    """time.monotonic() deadline of a public call's ``timeout`` seconds; None (no limit) for None,
    inf, or past what threads can wait. A negative timeout polls once."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{call}(timeout={timeout!r}): timeout must be a number of seconds or None (no limit), "
            f"got {type(timeout).__name__}"
        )
    if math.isnan(timeout):
        raise ValueError(f"{call}(timeout=nan): pass a number of seconds, or None (or inf) to wait without limit")
    if timeout >= threading.TIMEOUT_MAX:
        return None
    return time.monotonic() + float(timeout)


def left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def int_list(hashes: Sequence[int] | np.ndarray) -> list[int]:
    return hashes.tolist() if isinstance(hashes, np.ndarray) else [int(x) for x in hashes]
