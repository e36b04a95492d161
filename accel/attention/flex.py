"""Masked attention from a mask kind (:func:`masked_sdpa`): ``torch.compile(flex_attention)`` on a
block mask made once, the manual reference beside it, SDPA on the dense mask where FlexAttention
cannot run. A dense mask costs ``Sq x Sk`` memory, takes SDPA off flash and computes every tile
of scores; FlexAttention's block mask (which 128 x 128 tiles keep any key, which keep all) lets
it skip the empty tiles, so its time follows the fraction of tiles kept.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from accel import triton_support
from accel.attention.backends import BackendUnavailableError, run
from accel.attention.masks import AttentionMask, dense_mask
from accel.attention.reference import attention_reference, check_inputs
from accel.errors import checked_count, warn_once

__all__ = [
    "BLOCK_SIZE", "MASKED_BACKENDS", "block_mask", "clear_masked_cache", "flex_unavailable",
    "masked_reference", "masked_sdpa", "room_to_compile"
]  # fmt: skip

MASKED_BACKENDS = ("default", "flex", "dense")
BLOCK_SIZE = 128  # the block mask's tile, FlexAttention's default
FLEX_COMPILE_ON_CPU = False
# compiled variants allowed per function (torch's default 8): one per mask kind, head size, grad
RECOMPILE_ROOM = 64
_BLOCK_MASKS_KEPT = 64  # KiB each (a document's: its ids too, 4 bytes a token)
_DENSE_MASKS_KEPT = 4  # Sq x Sk each
_READY_KEPT = 64

_BLOCK_MASKS: dict[Hashable, Any] = {}
_DENSE_MASKS: dict[Hashable, torch.Tensor] = {}
_FLEX: dict[str, Callable[..., torch.Tensor]] = {}  # "cuda", "cpu", "uncompiled" -> the call
# (backend, mask.cache_key, q's and k's shapes, dtype, device, grad) -> the bound call
_READY: dict[tuple, Callable[..., torch.Tensor]] = {}


def clear_masked_cache() -> None:
    """Forget every block mask, dense mask and bound call kept."""
    for cache in (_BLOCK_MASKS, _DENSE_MASKS, _READY):
        cache.clear()


def _kept(cache: dict, key: Hashable, make: Callable[[], Any], limit: int) -> Any:
    """``cache[key]``, made on a miss; the oldest entry goes when ``limit`` are kept."""
    value = cache.get(key)
    if value is None:
        value = make()
        if len(cache) >= limit:
            del cache[next(iter(cache))]
        cache[key] = value
    return value


# ---- the block mask, from each query's key range ----------------------------------------------
def block_mask(mask: AttentionMask, q: torch.Tensor, k: torch.Tensor, *, block_size=BLOCK_SIZE):
    """FlexAttention's ``BlockMask`` of ``mask`` for q (B, H, Sq, D) and k (B, H, Sk, D), equal
    to ``create_block_mask``'s but built from each query's key range: Sq x Sk / block_size
    booleans, never Sq x Sk, and no host read."""
    from torch.nn.attention.flex_attention import BlockMask

    block_size = checked_count(block_size, "block_size", at_least=1)
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    partial_tiles, full = _block_states(mask, seq_q, seq_k, q.device, block_size)
    kv_partial, kv_full = _ordered(partial_tiles), _ordered(full)
    # the backward's tiles by key block: the states transposed (from_kv_blocks costs a ms)
    q_partial = _ordered(partial_tiles.transpose(-2, -1))
    q_full = _ordered(full.transpose(-2, -1))
    return BlockMask(
        seq_lengths=(seq_q, seq_k), BLOCK_SIZE=(block_size, block_size),
        kv_num_blocks=kv_partial[0], kv_indices=kv_partial[1],
        full_kv_num_blocks=kv_full[0], full_kv_indices=kv_full[1],
        q_num_blocks=q_partial[0], q_indices=q_partial[1],
        full_q_num_blocks=q_full[0], full_q_indices=q_full[1],
        mask_mod=mask.mask_mod(seq_q, seq_k, q.device),
    )  # fmt: skip


def _block_states(mask: AttentionMask, seq_q: int, seq_k: int, device, size: int):
    """(partial, full): (rows or 1, 1, tiles of Sq, tiles of Sk) bool."""
    lo, hi = mask.bounds(seq_q, seq_k, device)  # (R, Sq)
    n_q, n_k = -(-seq_q // size), -(-seq_k // size)
    pad = (0, n_q * size - seq_q)
    # rows past Sq see no key, so a tile cut short is never full (as in create_block_mask)
    lo = F.pad(lo, pad)[..., None]
    hi = F.pad(hi, pad)[..., None]
    start = torch.arange(n_k, dtype=torch.int32, device=device) * size
    stop = start + size
    some = (lo < stop.clamp(max=seq_k)) & (hi > start) & (lo < hi)  # (R, n_q * size, n_k)
    every = (lo <= start) & (hi >= stop) & (stop <= seq_k)
    rows = lo.shape[0]
    some = some.view(rows, n_q, size, n_k).any(2)
    every = every.view(rows, n_q, size, n_k).all(2)
    return (some & ~every)[:, None], every[:, None]


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) per row of tiles, the kept ones first in order: BlockMask's format."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int32), dim=-1, descending=True, stable=True)
    return counts.contiguous(), order.to(torch.int32).contiguous()


# ---- the reference and the dense mask -----------------------------------------------------------
def masked_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, *, scale=None
) -> torch.Tensor:
    """Attention written out over the dense mask, the (B, H, Sq, Sk) scores in memory. A query
    that sees no key gets 0."""
    _check(q, k, v, mask, "default")
    return attention_reference(q, k, v, mask=dense_mask(mask, q, k), scale=scale)


def _run_dense(mask: AttentionMask, q, k, v, scale) -> torch.Tensor:
    """SDPA (PyTorch's pick) on the dense mask, made once per mask, shapes and dtype."""
    key = (mask.cache_key, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.dtype, q.device)
    dense = _kept(_DENSE_MASKS, key, partial(dense_mask, mask, q, k), _DENSE_MASKS_KEPT)
    return run("default", q, k, v, dense, False, scale)


# ---- FlexAttention: where it runs, compiled once -----------------------------------------------
def _compiles(device: torch.device) -> bool:
    return device.type != "cpu" or FLEX_COMPILE_ON_CPU


def _flex_function(device: torch.device) -> Callable[..., torch.Tensor]:
    """flex_attention as it runs on ``device``: compiled (for each shape on the CPU, where
    dynamic shapes fail to build), or uncompiled."""
    how = device.type if _compiles(device) else "uncompiled"
    if how not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        if how == "uncompiled":
            _FLEX[how] = _uncompiled
        else:  # None is torch.compile's default
            _FLEX[how] = torch.compile(flex_attention, dynamic=False if how == "cpu" else None)
    return _FLEX[how]


def _uncompiled(q, k, v, **kwargs) -> torch.Tensor:
    """FlexAttention uncompiled, after one warning of ours instead of PyTorch's."""
    from torch.nn.attention.flex_attention import flex_attention

    warn_once(
        "attention: uncompiled",
        f"accel.attention: FlexAttention runs uncompiled on {q.device.type}: correct, but it "
        "materializes the scores like the manual path (set "
        "accel.attention.flex.FLEX_COMPILE_ON_CPU = True to compile it, tens of seconds per "
        "shape)",
        RuntimeWarning,
        stacklevel=4,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, **kwargs)


def flex_unavailable(device: torch.device | str, grad: bool = False) -> str | None:
    """Why FlexAttention cannot run on ``device`` here (with a backward after it if ``grad``);
    None if it can."""
    try:
        import torch.nn.attention.flex_attention
    except ImportError:
        return f"torch {torch.__version__} has no FlexAttention (it came with torch 2.5)"
    device = torch.device(device)
    if device.type == "cpu" and grad and not FLEX_COMPILE_ON_CPU:
        return "FlexAttention has no backward on the CPU uncompiled (a limit of PyTorch's)"
    if not _compiles(device):
        return None
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile cannot run on this Python or platform; FlexAttention compiles with it"
    why = triton_support.unavailable(device) if device.type == "cuda" else None
    return f"{why}; FlexAttention builds its CUDA kernel with Triton" if why else None


def _default_unavailable(device: torch.device, grad: bool) -> str | None:
    """Why the default path does not take FlexAttention here, or None."""
    if _compiles(device):
        return flex_unavailable(device, grad)
    return ("on the CPU it would compile for tens of seconds per shape; set "
            "accel.attention.flex.FLEX_COMPILE_ON_CPU = True to take it")  # fmt: skip


def room_to_compile(room: int = RECOMPILE_ROOM) -> contextlib.AbstractContextManager:
    """torch.compile's limit of compiled variants per function raised to at least ``room``
    while the context lasts."""
    import torch._dynamo

    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{limit: max(getattr(config, limit), room)})


def _bound_flex(mask: AttentionMask, q, k) -> Callable[..., torch.Tensor]:
    """``(q, k, v, scale) -> out``: FlexAttention with its block mask (made once per mask,
    batch, lengths and device, and kept) and score_mod bound."""
    key = (mask.cache_key, q.shape[0], q.shape[2], k.shape[2], q.device)
    blocks = _kept(_BLOCK_MASKS, key, partial(block_mask, mask, q, k), _BLOCK_MASKS_KEPT)
    flex, score_mod = _flex_function(q.device), mask.score_mod(q.shape[1])
    if score_mod is None:
        return lambda q, k, v, scale: flex(q, k, v, block_mask=blocks, scale=scale)
    return lambda q, k, v, scale: flex(q, k, v, score_mod=score_mod, block_mask=blocks,
                                       scale=scale)  # fmt: skip


def _first_call(call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor | None, str]:
    """(out, "") of ``call`` run once, compiling, or (None, why it could not run)."""
    try:
        with room_to_compile():
            return call(), ""
    except (RuntimeError, ValueError, AssertionError, ImportError, NotImplementedError) as error:
        said = (str(error).strip().splitlines() or [""])[0][:300]
        return None, f"{type(error).__name__}: {said}"


# ---- the dispatcher --------------------------------------------------------------------------
def masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str = "default",
) -> torch.Tensor:
    """Attention under a mask kind, equal to :func:`masked_reference` within the dtype's
    rounding. q (B, H, Sq, D), k (B, H, Sk, D), v (B, H, Sk, Dv) -> (B, H, Sq, Dv).

    ``backend``: ``"default"``: ``torch.compile(flex_attention)`` on the mask's block mask,
    made once per (mask, shapes, device) and kept; ``Causal()`` alone runs SDPA's causal kernel;
    where FlexAttention cannot run, SDPA on the dense mask after one warning naming why.
    ``"flex"``: FlexAttention, or :class:`BackendUnavailableError` saying why it cannot run.
    ``"dense"``: SDPA (PyTorch's pick) on the dense mask, made once and kept.

    The first call of a key (the mask's ``cache_key``, shapes, dtype, device, grad mode) checks
    the inputs, builds the block mask and compiles; a later call looks the bound call up.
    """
    if causal:
        raise ValueError("pass either a mask or causal=True, not both (Causal() is a mask kind)")
    if torch.compiler.is_compiling():
        return _traced(q, k, v, mask, scale, backend)
    if backend == "default" and getattr(mask, "is_causal", False):
        return _causal_kernel(q, k, v, mask, scale)
    try:
        grad = (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()
        key = (backend, mask.cache_key, q.shape, k.shape, q.dtype, q.device, grad)
    except AttributeError:  # not tensors, or not a mask kind: the checks say so
        _check(q, k, v, mask, backend)
        raise
    ready = _READY.get(key)
    if ready is None:
        _check(q, k, v, mask, backend)
        ready, out = _ready(backend, q, k, v, mask, scale, grad)
        _kept(_READY, key, lambda: ready, _READY_KEPT)
        if out is not None:
            return out
    return ready(q, k, v, scale)


def _causal_kernel(q, k, v, mask: AttentionMask, scale) -> torch.Tensor:
    """``Causal()``: SDPA's causal kernel, as ``sdpa(q, k, v, causal=True)`` runs it."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    except (RuntimeError, TypeError, ValueError, AttributeError):
        _check(q, k, v, mask, "default")  # our words for what PyTorch refused
        raise


def _ready(backend: str, q, k, v, mask: AttentionMask, scale, grad: bool):
    """(the bound call of ``backend`` for inputs like these, the first call's output or None)."""
    dense = partial(_run_dense, mask)
    if backend == "dense":
        return dense, None
    flex_here = flex_unavailable if backend == "flex" else _default_unavailable
    why = flex_here(q.device, grad)
    if not why:
        flex = _bound_flex(mask, q, k)
        out, why = _first_call(partial(flex, q, k, v, scale))
        if not why:
            return flex, out
    if backend == "flex":
        raise BackendUnavailableError("flex", why)
    warn_once(
        f"attention: {why}",
        f"accel.attention: FlexAttention cannot run here ({why}); SDPA runs on the dense mask",
        RuntimeWarning,
        stacklevel=4,
    )
    return dense, None


def _check(q, k, v, mask: AttentionMask, backend: str) -> None:
    """Raise naming the problem unless ``mask`` and the inputs can be attended by ``backend``."""
    if backend not in MASKED_BACKENDS:
        raise ValueError(
            f"backend {backend!r} takes no mask kind; with one, expected one of "
            f"{', '.join(MASKED_BACKENDS)}"
        )
    if not isinstance(mask, AttentionMask):
        raise TypeError(
            "mask must be a tensor or a mask kind of accel.attention "
            f"(SlidingWindow(1024), Document(lengths), ...), got {type(mask).__name__}"
        )
    check_inputs(q, k, v)
    mask.check(q, k)


def _traced(q, k, v, mask: AttentionMask, scale, backend: str) -> torch.Tensor:
    """Inside torch.compile nothing is cached: the path is traced into the caller's graph."""
    _check(q, k, v, mask, backend)
    if backend == "dense":
        return run("default", q, k, v, dense_mask(mask, q, k), False, scale)
    if backend == "default" and mask.is_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    from torch.nn.attention.flex_attention import flex_attention

    blocks = block_mask(mask, q, k)
    return flex_attention(
        q, k, v, score_mod=mask.score_mod(q.shape[1]), block_mask=blocks, scale=scale
    )
