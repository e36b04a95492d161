"""Masked attention from a mask kind: FlexAttention on a block mask, SDPA on the dense mask, or
plain SDPA's causal kernel, with the manual reference beside them and ``auto`` measuring which
is fastest per input signature.

A dense mask costs ``Sq x Sk`` memory, takes SDPA off its fastest kernel (flash takes no mask)
and still computes every tile of scores, kept or not. FlexAttention takes the mask as a function
and a *block mask*: which 128 x 128 tiles of the scores keep any key, and which keep every key.
It skips the empty tiles and evaluates the mask on the partial ones only, so its time follows the
fraction of tiles kept.

    out = masked_sdpa(q, k, v, SlidingWindow(1024))            # auto: measured once per signature
    out = masked_sdpa(q, k, v, Document(lengths), backend="flex")
    ref = masked_reference(q, k, v, SlidingWindow(1024))        # the S x S scores written out
    masked_choices()                                            # what auto measured and kept

``accel.attention.sdpa(q, k, v, mask=<mask kind>)`` lands here. Block masks are built on the
device from the mask's key ranges (:func:`block_mask`: no S x S tensor, no host read) and cached
per (mask, shapes, device). On a GPU FlexAttention runs compiled: its first call per signature
compiles for seconds (``auto`` reports it in ``first_call_s``). On the CPU it runs uncompiled
unless ``FLEX_COMPILE_ON_CPU`` (compiling takes tens of seconds per shape there): correct, but it
materializes the scores like the manual path. Importing this module costs torch only;
FlexAttention is imported on first use.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, get_args

import torch

from accel import triton_support
from accel.attention_auto import (
    TOLERANCES,
    AutoChoice,
    BackendUnavailableError,
    SignatureKey,
    flat_key,
    signature,
)
from accel.attention_masks import AttentionMask, dense_mask
from accel.errors import checked_count
from accel.timer import interleaved

__all__ = [
    "BLOCK_SIZE",
    "DENSE_MASK_CANDIDATE_BYTES",
    "MASKED_BACKENDS",
    "MaskedBackend",
    "MaskedChoice",
    "block_mask",
    "clear_masked_cache",
    "flex_unavailable",
    "masked_choices",
    "masked_reference",
    "masked_sdpa",
]

# "flex": FlexAttention; "dense": accel's SDPA (its own auto) on the dense mask; "causal": plain
# SDPA's causal kernel, for Causal() only.
MaskedBackend = Literal["auto", "flex", "dense", "causal"]
MASKED_BACKENDS: tuple[str, ...] = get_args(MaskedBackend)
BLOCK_SIZE = 128  # the block mask's tile, FlexAttention's default
# auto leaves the dense path out when its mask would be larger than this and FlexAttention runs
DENSE_MASK_CANDIDATE_BYTES = 1 << 30
FLEX_COMPILE_ON_CPU = False
# torch.compile keeps `recompile_limit` (8) variants of a function, then runs it uncompiled;
# masked attention compiles one per mask kind, dtype, head size and grad mode, so a signature's
# first call compiles with room for this many
RECOMPILE_ROOM = 64
_BLOCK_MASKS_KEPT = 64  # KiB each (a document's: its ids too, 4 bytes a token)
_DENSE_MASKS_KEPT = 4  # Sq x Sk each

MaskedKey = tuple[Hashable, SignatureKey]  # (mask.signature, the inputs' signature)


@dataclass(frozen=True)
class MaskedChoice(AutoChoice):
    """What ``auto`` measured for one masked signature; ``first_call_s``: each candidate's first
    call in seconds, FlexAttention's compile included (never inside ``times_ms``)."""

    first_call_s: dict[str, float] = field(default_factory=dict)


_CHOICES: dict[MaskedKey, MaskedChoice] = {}
_FAST: dict[MaskedKey, str] = {}  # key -> auto's backend once measured
_FLEX_REASONS: dict[MaskedKey, str] = {}  # forced flex: "" once it ran, else why it cannot
_CHECKED: set[tuple[str, bool, MaskedKey]] = set()  # (backend, causal, key) that passed
_BLOCK_MASKS: dict[Hashable, Any] = {}
_DENSE_MASKS: dict[Hashable, torch.Tensor] = {}
_FLEX: dict[str, Callable[..., torch.Tensor]] = {}  # "cuda", "cpu", "uncompiled" -> the call
# (backend, mask.cache_key, the inputs' flat_key) -> (q, k, v, scale) -> out: a repeated call's
# path with its block mask bound, so it costs one key and one lookup
_READY: dict[tuple, Callable[..., torch.Tensor]] = {}
_READY_KEPT = 32
_warned: set[str] = set()


def masked_choices() -> dict[MaskedKey, MaskedChoice]:
    """A copy of ``auto``'s masked cache: one entry per signature measured so far."""
    return dict(_CHOICES)


def clear_masked_cache() -> None:
    """Forget every measurement, block mask and dense mask kept."""
    for cache in (_CHOICES, _FAST, _FLEX_REASONS, _BLOCK_MASKS, _DENSE_MASKS, _READY):
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


def _warn_once(why: str, message: str) -> None:
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"accel.attention_flex: {message}", RuntimeWarning, stacklevel=4)


# ---- the block mask, from each query's key range ----------------------------------------------
def block_mask(mask: AttentionMask, q: torch.Tensor, k: torch.Tensor, *, block_size=BLOCK_SIZE):
    """FlexAttention's ``BlockMask`` of ``mask`` for q (B, H, Sq, D) and k (B, H, Sk, D).

    Built from the key range of each query: work and memory of Sq x Sk / block_size booleans,
    never Sq x Sk, and no host read. Equal to ``create_block_mask(mask_mod, ...)`` (which
    evaluates the mask at every one of the S x S positions)."""
    from torch.nn.attention.flex_attention import BlockMask

    block_size = checked_count(block_size, "block_size", at_least=1)
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    partial, full = _block_states(mask, seq_q, seq_k, q.device, block_size)
    kv_partial, kv_full = _ordered(partial), _ordered(full)
    # the backward walks the tiles by key block: the same states transposed (from_kv_blocks
    # would derive them from the ordered lists, at a millisecond of host time per mask)
    q_partial, q_full = _ordered(partial.transpose(-2, -1)), _ordered(full.transpose(-2, -1))
    return BlockMask(
        seq_lengths=(seq_q, seq_k),
        kv_num_blocks=kv_partial[0],
        kv_indices=kv_partial[1],
        full_kv_num_blocks=kv_full[0],
        full_kv_indices=kv_full[1],
        q_num_blocks=q_partial[0],
        q_indices=q_partial[1],
        full_q_num_blocks=q_full[0],
        full_q_indices=q_full[1],
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=mask.mask_mod(seq_q, seq_k, q.device),
    )


def _block_states(mask: AttentionMask, seq_q: int, seq_k: int, device, size: int):
    """(partial, full): (rows or 1, 1, tiles of Sq, tiles of Sk) bool. A tile is full when
    every query of it sees every key of it, partial when some query sees some key."""
    lo, hi = mask.bounds(seq_q, seq_k, device)  # (R, Sq)
    n_q, n_k = -(-seq_q // size), -(-seq_k // size)
    pad = (0, n_q * size - seq_q)
    # rows past Sq see no key, so a tile cut short is never full (as in create_block_mask)
    lo = torch.nn.functional.pad(lo, pad)[..., None]
    hi = torch.nn.functional.pad(hi, pad)[..., None]
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


# ---- the three paths: reference, dense mask, FlexAttention -------------------------------------
def masked_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention written out over the dense mask: softmax(q k^T * scale + bias, masked) v, the
    (B, H, Sq, Sk) scores in memory. A query that sees no key gets 0."""
    from accel.attention import attention_reference, check_inputs

    check_inputs(q, k, v)
    _check_kind(mask)
    mask.check(q, k)
    return attention_reference(q, k, v, mask=dense_mask(mask, q, k), scale=scale)


def _dense_key(mask: AttentionMask, q: torch.Tensor, k: torch.Tensor) -> Hashable:
    return (mask.cache_key, q.shape[1], q.shape[2], k.shape[2], q.dtype, q.device)


def _run_dense(q, k, v, mask, scale) -> torch.Tensor:
    from accel.attention import sdpa

    dense = _kept(
        _DENSE_MASKS, _dense_key(mask, q, k), partial(dense_mask, mask, q, k), _DENSE_MASKS_KEPT
    )
    return sdpa(q, k, v, mask=dense, scale=scale)


def _run_causal(q, k, v, mask, scale) -> torch.Tensor:
    from accel.attention import sdpa

    return sdpa(q, k, v, causal=True, scale=scale)


def _kept_block_mask(mask: AttentionMask, q: torch.Tensor, k: torch.Tensor):
    """``mask``'s block mask for these query and key lengths, made once and kept."""
    key = (mask.cache_key, q.shape[2], k.shape[2], q.device)
    return _kept(_BLOCK_MASKS, key, partial(block_mask, mask, q, k), _BLOCK_MASKS_KEPT)


def _run_flex(q, k, v, mask, scale) -> torch.Tensor:
    blocks = _kept_block_mask(mask, q, k)
    flex = _flex_function(q.device)
    return flex(q, k, v, score_mod=mask.score_mod(q.shape[1]), block_mask=blocks, scale=scale)


_RUNNERS: dict[str, Callable[..., torch.Tensor]] = {
    "flex": _run_flex,
    "dense": _run_dense,
    "causal": _run_causal,
}


def _compiles(device: torch.device) -> bool:
    return device.type != "cpu" or FLEX_COMPILE_ON_CPU


def _flex_function(device: torch.device) -> Callable[..., torch.Tensor]:
    """flex_attention as it runs on ``device``: compiled (shapes made dynamic once a second
    length is seen, as torch.compile does), compiled for each shape on the CPU (its kernels
    with a dynamic length and a document's ids fail to build there), or uncompiled."""
    how = device.type if _compiles(device) else "uncompiled"
    if how not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        if how == "uncompiled":
            _FLEX[how] = _uncompiled
        else:
            _FLEX[how] = torch.compile(flex_attention, dynamic=False if how == "cpu" else None)
    return _FLEX[how]


def _uncompiled(q, k, v, **kwargs) -> torch.Tensor:
    """FlexAttention's own uncompiled path (the CPU's), after one warning of ours instead of
    PyTorch's."""
    from torch.nn.attention.flex_attention import flex_attention

    _warn_once(
        "uncompiled",
        f"FlexAttention runs uncompiled on {q.device.type}: correct, but it materializes the "
        "scores like the manual path (set accel.attention_flex.FLEX_COMPILE_ON_CPU = True to "
        "compile it, tens of seconds per shape)",
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
    if device.type == "cpu" and grad:
        return "FlexAttention has no backward on the CPU (a limit of PyTorch's)"
    if not _compiles(device):
        return None
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile cannot run on this Python or platform; FlexAttention compiles with it"
    why = triton_support.unavailable(device) if device.type == "cuda" else None
    return f"{why}; FlexAttention builds its CUDA kernel with Triton" if why else None


def _first_call(name: str, call: Callable[[], Any]) -> tuple[Any, str]:
    """Run ``call`` once (for flex: compiling, with room for one more compiled variant);
    (result, "") or (None, why it could not run)."""
    room = _room_to_compile() if name == "flex" else contextlib.nullcontext()
    try:
        with room:
            return call(), ""
    except (RuntimeError, ValueError, AssertionError, ImportError) as error:
        said = (str(error).strip().splitlines() or [""])[0][:300]
        return None, f"{type(error).__name__}: {said}"


def _room_to_compile() -> contextlib.AbstractContextManager:
    import torch._dynamo

    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{limit: max(getattr(config, limit), RECOMPILE_ROOM)})


# ---- the dispatcher --------------------------------------------------------------------------
def masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: MaskedBackend = "auto",
) -> torch.Tensor:
    """Attention under a mask kind, equal to :func:`masked_reference` within the dtype's
    rounding. q (B, H, Sq, D), k (B, H, Sk, D), v (B, H, Sk, Dv) -> (B, H, Sq, Dv).

    ``backend``: ``"auto"`` (measure the paths once per signature, keep the fastest; where
    FlexAttention cannot run, one warning says why), ``"flex"`` (FlexAttention;
    :class:`BackendUnavailableError` with the reason where it cannot run), ``"dense"`` (SDPA on
    the dense mask, accel's own SDPA ``auto`` picking its kernel), ``"causal"`` (plain SDPA's
    causal kernel, for ``Causal()``).

    Host cost: after the first call of a signature (checks, ``auto``'s measurement, compiles),
    a call costs the mask's cache key, the inputs' key (shapes, strides, dtype, device, grad)
    and one lookup, then its path with what it needs bound (FlexAttention's block mask and
    compiled call; the dense mask's own cache; :func:`accel.attention.sdpa`'s for causal).
    Beside ``torch.compile(flex_attention)`` with a block mask made once, forced ``"flex"``
    added 8-14 µs of host time a call on an H100's host (``results/masked-sdpa-host-*.txt``;
    rows ``phase=overhead``, ``sdpa SlidingWindow``)."""
    if torch.compiler.is_compiling():
        return _traced(q, k, v, mask, causal, scale, backend)
    try:
        ready_key = (backend, mask.cache_key, flat_key(q, k, v, None, causal))
    except AttributeError:  # not tensors, or not a mask kind: the checks say so
        ready_key = None
    ready = _READY.get(ready_key)
    if ready is not None:
        return ready(q, k, v, scale)
    key = _checked_key(q, k, v, mask, causal, backend)
    path, keep, out = backend, True, None
    if backend == "auto":
        path = _FAST.get(key) or _auto(key, q, k, v, mask, scale)
        keep = key in _FAST  # not while a CUDA graph is captured: nothing was measured
    elif backend == "flex":
        known = _FLEX_REASONS.get(key)
        if known is None:  # first call of this signature: run it, keeping the reason it failed
            known = flex_unavailable(q.device, key[1].grad) or ""
            if not known:
                out, known = _first_call("flex", partial(_run_flex, q, k, v, mask, scale))
            _FLEX_REASONS[key] = known
        if known:
            raise BackendUnavailableError("flex", known)
    if keep:
        _kept(_READY, ready_key, partial(_bound, path, q, k, v, mask), _READY_KEPT)
    return _RUNNERS[path](q, k, v, mask, scale) if out is None else out


def _bound(path: str, q, k, v, mask: AttentionMask) -> Callable[..., torch.Tensor]:
    """``path`` for inputs of this signature and ``mask``, ``(q, k, v, scale) -> out``: flex
    with its block mask and score_mod bound; dense and causal as they run (a dense mask is too
    large to keep beyond its own cache)."""
    if path != "flex":
        return partial(_with_bound_mask, _RUNNERS[path], mask)
    blocks = _kept_block_mask(mask, q, k)
    flex, score_mod = _flex_function(q.device), mask.score_mod(q.shape[1])
    return lambda q, k, v, scale: flex(q, k, v, score_mod=score_mod, block_mask=blocks,
                                       scale=scale)  # fmt: skip


def _with_bound_mask(run, mask, q, k, v, scale) -> torch.Tensor:
    return run(q, k, v, mask, scale)


def _check_kind(mask: object) -> None:
    if not isinstance(mask, AttentionMask):
        raise TypeError(
            "mask must be a tensor or a mask kind of accel.attention_masks "
            f"(SlidingWindow(1024), Document(lengths), ...), got {type(mask).__name__}"
        )


def _checked_key(q, k, v, mask, causal, backend) -> MaskedKey:
    """The signature, after the checks the first time it is seen with ``backend``; a mask made
    from data is checked against q and k with each new mask (its values may not fit)."""
    _check_kind(mask)
    try:
        key = (mask.signature, signature(q, k, v))
    except AttributeError:  # not tensors: the checks say so
        key = None
    if key is None or (backend, causal, key) not in _CHECKED:
        _check(q, k, v, mask, causal, backend)
        _CHECKED.add((backend, causal, key))
    elif mask.data() is not None:
        mask.check(q, k)
    return key  # type: ignore[return-value]


def _check(q, k, v, mask: AttentionMask, causal: bool, backend: str) -> None:
    from accel.attention import check_inputs

    if backend not in MASKED_BACKENDS:
        raise ValueError(
            f"backend {backend!r} takes no mask kind; with one, expected one of "
            f"{', '.join(MASKED_BACKENDS)}"
        )
    check_inputs(q, k, v)
    if causal:
        raise ValueError("pass either a mask or causal=True, not both (Causal() is a mask kind)")
    mask.check(q, k)
    if backend == "causal" and not mask.is_causal:
        raise ValueError(
            f"backend 'causal' is plain SDPA's causal kernel: it runs Causal() only, got "
            f"{type(mask).__name__}"
        )


def _traced(q, k, v, mask, causal, scale, backend) -> torch.Tensor:
    """Inside torch.compile nothing is timed or cached: ``auto`` takes plain SDPA's causal
    kernel for ``Causal()``, else FlexAttention, compiled with the caller's graph."""
    _check_kind(mask)
    _check(q, k, v, mask, causal, backend)
    if backend == "auto":
        backend = "causal" if mask.is_causal else "flex"
    if backend != "flex":
        return _RUNNERS[backend](q, k, v, mask, scale)
    from torch.nn.attention.flex_attention import flex_attention

    blocks = block_mask(mask, q, k)
    return flex_attention(
        q, k, v, score_mod=mask.score_mod(q.shape[1]), block_mask=blocks, scale=scale
    )


# ---- auto: measure the paths that can run, keep the fastest -----------------------------------
def _auto(key: MaskedKey, q, k, v, mask: AttentionMask, scale) -> str:
    """The path ``auto`` takes for these inputs: measured on the first call of a signature.
    While a CUDA graph is captured nothing can be timed or compiled: the dense mask (plain SDPA
    for ``Causal()``) until a call outside the capture measured."""
    choice = _CHOICES.get(key)
    if choice is not None:
        return choice.backend
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "causal" if mask.is_causal else "dense"
    choice = _measure(key, q, k, v, mask, scale)
    _CHOICES[key] = choice
    _FAST[key] = choice.backend
    if choice.backend != "dense":  # keep no Sq x Sk tensor for a path not taken
        _DENSE_MASKS.pop(_dense_key(mask, q, k), None)
    if "flex" in choice.skipped:
        why = choice.skipped["flex"]
        _warn_once(why, f"FlexAttention cannot run these inputs ({why}); using {choice.backend}")
    return choice.backend


def _measure(key: MaskedKey, q, k, v, mask: AttentionMask, scale) -> MaskedChoice:
    """Every path that can run, its first call timed apart (compiles), its output checked
    against the first path's, then all timed interleaved by ``accel.timer``."""
    grad = key[1].grad
    if grad:  # time what training runs: forward and backward, on detached copies
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    tried: dict[str, tuple[Callable[[], object] | None, str]] = {}
    first_s: dict[str, float] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name in ("flex", "dense", "causal") if mask.is_causal else ("flex", "dense"):
        call = partial(_RUNNERS[name], q, k, v, mask, scale)
        fn = _forward_backward(call, (q, k, v)) if grad else call
        reason = _left_out(name, q, k, mask, grad, ran=[n for n, t in tried.items() if t[0]])
        if not reason:
            reason, first_s[name] = _first_timed(name, fn, q.device)
        if not reason:
            outputs[name] = call().detach()  # in the grad mode timed: no other compiled variant
            reason = _disagrees(outputs)
        tried[name] = (None if reason else fn, reason)
    runnable = {name: fn for name, (fn, _) in tried.items() if fn is not None}
    skipped = {name: reason for name, (_, reason) in tried.items() if reason}
    if not runnable:
        raise BackendUnavailableError("auto", "; ".join(f"{b}: {r}" for b, r in skipped.items()))
    times = dict.fromkeys(runnable, 0.0)
    if len(runnable) > 1:
        times = interleaved(runnable, q.device, warmup=2, repeats=12).medians()
    best = min(times, key=times.__getitem__)
    return MaskedChoice(best, times, skipped, first_call_s=first_s)


def _forward_backward(call: Callable[[], torch.Tensor], inputs) -> Callable[[], object]:
    # the output itself as the incoming gradient: no random numbers drawn
    return lambda: torch.autograd.grad((out := call()), inputs, out.detach())


def _first_timed(name: str, fn: Callable[[], object], device: torch.device) -> tuple[str, float]:
    """Why ``fn`` cannot run (or ""), and its first call's seconds, the device's work included."""
    started = time.perf_counter()
    reason = _first_call(name, fn)[1]
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # once per path and signature
    return reason, time.perf_counter() - started


def _disagrees(outputs: dict[str, torch.Tensor]) -> str:
    """Why the last path's output is not the first's within the dtype's tolerance, or "": a
    kernel bug must not win on speed."""
    if len(outputs) < 2:
        return ""
    (first, expected), *_, (_, out) = outputs.items()
    if torch.allclose(out, expected, **TOLERANCES.get(out.dtype, {})):
        return ""
    worst = (out.float() - expected.float()).abs().max().item()  # sync: once
    return f"output differs from {first}'s by up to {worst:.3g}"


def _left_out(name: str, q, k, mask: AttentionMask, grad: bool, ran) -> str | None:
    """Why ``auto`` does not try ``name`` on these inputs (``ran``: the paths that ran), or None."""
    if name == "flex":
        return flex_unavailable(q.device, grad)
    if name == "dense" and "flex" in ran:
        biased = mask.score_mod(q.shape[1]) is not None  # a float bias per head, else bool
        per_element, heads = (q.element_size(), q.shape[1]) if biased else (1, 1)
        size = (mask.rows or 1) * heads * q.shape[2] * k.shape[2] * per_element
        if size > DENSE_MASK_CANDIDATE_BYTES:
            return f"its mask would take {size / 2**30:.1f} GiB; FlexAttention can run"
    return None
