"""Attention: the manual "before" beside fused scaled_dot_product_attention (SDPA).

The manual path is four steps, each a full pass over a (batch, heads, S, S) score matrix in
memory: matrix product, scale, softmax, matrix product. SDPA computes the same numbers in one
fused kernel that keeps each block of scores on chip, so memory grows with S, not S^2, and the
matrix units stay busy. Which fused kernel runs is PyTorch's static priority order, which has
changed between releases and differs by GPU; ``backend="auto"`` measures the candidates once per
input signature and keeps the fastest.

    out = sdpa(q, k, v, causal=True)                   # (B, H, S, D) in, (B, H, S, D) out
    ref = attention_reference(q, k, v, causal=True)    # the same numbers, S x S in memory
    auto_choices()                                     # what ``auto`` measured and picked

Also here, each beside its "before": rotary position embeddings with cos/sin cached as buffers
(:class:`RotaryEmbedding`, ``cached=False`` recomputes them every forward), and one fused
projection for q, k and v (:class:`QKVProjection`). :class:`SelfAttention` puts them together.

Importing this module costs torch only. Which kernel really ran is read from the profiler by the
lab (``accel.lab.cases.sdpa``), never in this hot path.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

Backend = Literal["auto", "default", "flash", "efficient", "cudnn", "math"]
BACKENDS: tuple[str, ...] = get_args(Backend)
# The kernels SDPA can be forced to; "default" is PyTorch's own pick, "auto" ours.
FORCED: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
# How far a backend may stray from attention computed in float64 from the same inputs: the
# output's own rounding plus the softmax weights rounded to the dtype before the product with v
# (bf16 keeps 8 mantissa bits: 4e-3 relative per rounding, outputs of order 1).
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: dict(rtol=1e-7, atol=1e-9),
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.float16: dict(rtol=4e-3, atol=4e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}
# math materializes the scores in float32 (and their gradient when training): above this it is
# left out of ``auto``'s candidates when a fused backend can run.
MATH_CANDIDATE_BYTES = 2 << 30


class BackendUnavailableError(RuntimeError):
    """A forced SDPA backend cannot run these inputs; ``reason`` says why (from PyTorch)."""

    def __init__(self, backend: str, reason: str):
        self.backend, self.reason = backend, reason
        super().__init__(f"SDPA backend {backend!r} cannot run these inputs: {reason}")


# ---- input checks ------------------------------------------------------------------------------
def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> None:
    """Raise a ValueError naming the problem unless q, k, v (and mask) can be attended.

    q: (batch, heads, Sq, D), k: (batch, heads, Sk, D), v: (batch, heads, Sk, Dv), one floating
    dtype and device; mask: bool (True = attend) or q's dtype, broadcastable to (B, H, Sq, Sk).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape (batch, heads, seq, head_dim), got {tuple(t.shape)}"
            )
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k and v must be floating point, got {q.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if not q.device == k.device == v.device:
        raise ValueError(
            f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
        raise ValueError(
            "mismatched shapes: expected q (B, H, Sq, D), k (B, H, Sk, D), v (B, H, Sk, Dv); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[2] == 0:
        raise ValueError("k and v have sequence length 0: there is nothing to attend to")
    if mask is None:
        return
    if causal:
        raise ValueError("pass either a mask or causal=True, not both")
    if mask.dtype not in (torch.bool, q.dtype):
        raise ValueError(f"mask must be bool or q's dtype {q.dtype}, got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device}, q on {q.device}")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        if torch.broadcast_shapes(mask.shape, target) != target:
            raise RuntimeError
    except RuntimeError:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Sk) = {target}"
        ) from None


# ---- the "before": matmul, scale, softmax, matmul ------------------------------------------------
def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention written out: softmax(q k^T * scale + mask) v, materializing the S x S scores.

    Same semantics as SDPA: ``causal`` keeps key j <= query i (top-left aligned when Sq != Sk);
    a bool mask keeps True; a float mask is added; rows with no key left give 0.
    """
    check_inputs(q, k, v, mask, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # each line below reads and writes a (B, H, Sq, Sk) tensor: 2 bytes x S^2 per head in bf16
    scores = q @ k.transpose(-2, -1)
    scores = scores * scale
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    elif mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -math.inf)
    elif mask is not None:
        scores = scores + mask
    weights = scores.softmax(dim=-1)
    if mask is not None:
        weights = weights.nan_to_num(0.0)  # a fully masked row: SDPA returns 0, softmax NaN
    return weights @ v


# ---- the "after": SDPA with a chosen or measured backend ----------------------------------------
TensorSig = tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device]


class SignatureKey(NamedTuple):
    """What decides which SDPA kernel can run and which is fastest: per tensor its shape,
    strides (fused kernels need a unit last stride), dtype and device; the mask's, if any;
    causal; whether a backward will follow (``auto`` then times forward + backward); the
    autocast dtype, if autocast is on."""

    q: TensorSig
    k: TensorSig
    v: TensorSig
    mask: TensorSig | None
    causal: bool
    grad: bool
    autocast: torch.dtype | None

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.q[0]), tuple(self.k[0]), tuple(self.v[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.q[2]

    @property
    def device(self) -> torch.device:
        return self.q[3]


def _sig(t: torch.Tensor) -> TensorSig:
    return t.shape, t.stride(), t.dtype, t.device


def signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> SignatureKey:
    """The cache key of these inputs, for ``auto`` and for forced-backend availability."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    device_type = q.device.type
    autocast = (
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    )
    return SignatureKey(
        _sig(q), _sig(k), _sig(v), None if mask is None else _sig(mask), causal, grad, autocast
    )


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` measured for one signature: the winner, each candidate's median time (ms,
    forward, or forward + backward when the key's ``grad``) and the backends skipped with the
    reason."""

    backend: str
    times_ms: dict[str, float]
    skipped: dict[str, str] = field(default_factory=dict)


_AUTO_CACHE: dict[SignatureKey, AutoChoice] = {}
# key -> auto's backend, once measured: a repeated call is one signature and one lookup
_AUTO_FAST: dict[SignatureKey, str] = {}
_UNAVAILABLE: dict[tuple[str, SignatureKey], str] = {}  # "" when the backend ran
_CHECKED: set[SignatureKey] = set()  # signatures that passed check_inputs


def auto_choices() -> dict[SignatureKey, AutoChoice]:
    """A copy of ``auto``'s cache: one entry per input signature measured so far."""
    return dict(_AUTO_CACHE)


def clear_auto_cache() -> None:
    """Forget every measurement (``auto`` measures again on the next call of each signature)."""
    _AUTO_CACHE.clear()
    _AUTO_FAST.clear()
    _UNAVAILABLE.clear()


def _lean_switches():
    """(backend, getter, setter) of each SDPA enable flag; None if this torch lacks them."""
    try:
        from torch.nn.attention import _backend_names

        return tuple(
            (
                getattr(SDPBackend, attr),
                getattr(torch._C, f"_get_{name}_sdp_enabled"),
                getattr(torch._C, f"_set_sdp_use_{name}"),
            )
            for name, attr in _backend_names.items()
        )
    except (ImportError, AttributeError):
        return None


_SWITCHES = _lean_switches()


class _Only:
    """``sdpa_kernel([backend])`` for eager calls without its Python cost (15 µs -> 2 µs per
    call, measured on this project's CPU machine in 2026-11)."""

    __slots__ = ("backend", "saved")

    def __init__(self, backend: SDPBackend):
        self.backend = backend

    def __enter__(self) -> None:
        self.saved = [get() for _, get, _ in _SWITCHES]
        for backend, _, set_ in _SWITCHES:
            set_(backend == self.backend)

    def __exit__(self, *exc) -> None:
        for (_, _, set_), was in zip(_SWITCHES, self.saved, strict=True):
            set_(was)


def _run(backend: str, q, k, v, mask, causal, scale) -> torch.Tensor:
    """SDPA with ``backend`` forced (or PyTorch's pick for "default")."""
    if backend not in FORCED:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    elif _SWITCHES is None or torch.compiler.is_compiling():
        with sdpa_kernel([FORCED[backend]]):  # the public one: dynamo traces it
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale
            )
    else:
        with _Only(FORCED[backend]):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale
            )
    return out if mask is None or q.device.type == "cpu" else _zero_rows_without_keys(out, mask)


def _zero_rows_without_keys(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A query whose mask leaves it no key gets 0, as on the CPU and in the reference: CUDA's
    fused kernels return other values there (seen: a mean of the values), which would pass
    silently into the model. Two small kernels on the device, no host read."""
    keys = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
    return out.masked_fill(~keys.any(dim=-1, keepdim=True), 0.0)


# TORCH_WARN headers before each backend's reasons when no forced kernel can run (CUDA)
_REASON_HEADERS = {
    "flash attention": "flash",
    "memory efficient attention": "efficient",
    "cudnn attention": "cudnn",
}


def _documented_limits(backend: str, q: torch.Tensor, mask: torch.Tensor | None) -> list[str]:
    """Input limits of the fused CUDA kernels, from PyTorch's documentation: the reason to give
    when PyTorch's own warnings are not there (it may have shown them once already)."""
    limits = []
    if backend in ("flash", "cudnn") and q.dtype not in (torch.float16, torch.bfloat16):
        limits.append(f"{backend} takes float16 or bfloat16 inputs, got dtype {q.dtype}")
    if backend == "flash" and mask is not None:
        limits.append("flash takes no explicit attention mask (causal only)")
    if backend in ("flash", "efficient") and (q.shape[-1] > 256 or q.shape[-1] % 8):
        limits.append(f"head dimension must be a multiple of 8 up to 256, got {q.shape[-1]}")
    return limits


def _reason(
    backend: str, q: torch.Tensor, mask: torch.Tensor | None, error: Exception, messages: list[str]
) -> str:
    """PyTorch's own reasons for ``backend``, picked out of the warnings it emits."""
    mine, current = [], None
    for message in messages:
        lowered = message.strip().lower()
        if lowered.endswith("kernel not used because:"):
            header = lowered.removesuffix("kernel not used because:").strip()
            current = _REASON_HEADERS.get(header, header)
        elif current == backend:
            mine.append(message.strip())
    if mine:
        return "; ".join(mine)
    if q.device.type == "cpu" and backend in ("efficient", "cudnn"):
        return f"PyTorch has no {backend} attention kernel for CPU tensors (CUDA only)"
    said = str(error).strip() or type(error).__name__
    known = _documented_limits(backend, q, mask) if q.device.type == "cuda" else []
    return f"{said} ({'; '.join(known)})" if known else said


def _try(
    backend: str, call: Callable[[], object], q: torch.Tensor, mask: torch.Tensor | None
) -> tuple[object, str]:
    """Run ``call`` once; return (result, "") or (None, why it could not run)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = call()
        except RuntimeError as error:
            return None, _reason(backend, q, mask, error, [str(w.message) for w in caught])
    for w in caught:  # it ran: pass on any unrelated warning
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out, ""


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}; expected one of {', '.join(BACKENDS)}")


def _checked_signature(q, k, v, mask, causal) -> SignatureKey:
    """The signature, after check_inputs the first time it is seen (later calls skip the
    checks: everything they look at is in the key)."""
    try:
        key = signature(q, k, v, mask, causal)
    except AttributeError:  # not tensors: let check_inputs say so
        check_inputs(q, k, v, mask, causal)
        raise
    if key not in _CHECKED:
        check_inputs(q, k, v, mask, causal)
        _CHECKED.add(key)
    return key


def unavailable_reason(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> str | None:
    """Why a forced ``backend`` cannot run these inputs, or None if it can. Cached per
    signature; the first query runs the backend once (forward only, without gradients)."""
    _check_backend(backend)
    if backend not in FORCED:
        return None
    with torch.no_grad():
        key = (backend, _checked_signature(q, k, v, mask, causal))
        if key not in _UNAVAILABLE:
            call = partial(_run, backend, q, k, v, mask, causal, None)
            _UNAVAILABLE[key] = _try(backend, call, q, mask)[1]
    return _UNAVAILABLE[key] or None


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Fused attention, equal to :func:`attention_reference` within the dtype's rounding.

    q (B, H, Sq, D), k (B, H, Sk, D), v (B, H, Sk, Dv) -> (B, H, Sq, Dv). ``backend``:
    ``"auto"`` (measure the backends once per :func:`signature`, keep the fastest),
    ``"default"`` (PyTorch's own priority order), or one forced kernel: ``"flash"``,
    ``"efficient"``, ``"cudnn"``, ``"math"``. A forced backend that cannot run the inputs raises
    :class:`BackendUnavailableError` with PyTorch's reason; ``auto`` skips it, keeping the reason.
    """
    return _sdpa(q, k, v, mask, causal, scale, backend)[0]


def _sdpa(q, k, v, mask, causal, scale, backend: str) -> tuple[torch.Tensor, str]:
    """:func:`sdpa` and the backend it resolved to."""
    if backend == "auto" and isinstance(q, torch.Tensor) and not torch.compiler.is_compiling():
        try:
            known = _AUTO_FAST.get(signature(q, k, v, mask, causal))
        except AttributeError:  # k, v or mask not tensors: the checks below say so
            known = None
        if known is not None:  # checked and measured before: straight to the kernel
            return _run(known, q, k, v, mask, causal, scale), known
    _check_backend(backend)
    if torch.compiler.is_compiling():  # nothing to time or cache while tracing
        check_inputs(q, k, v, mask, causal)
        backend = "default" if backend == "auto" else backend
        return _run(backend, q, k, v, mask, causal, scale), backend
    key = _checked_signature(q, k, v, mask, causal)
    if backend == "auto":
        backend = _auto(key, q, k, v, mask, causal, scale)  # it ran while being measured
    elif backend in FORCED:
        known = _UNAVAILABLE.get((backend, key))
        if known is None:  # first call of this signature: run it, keeping PyTorch's reasons
            call = partial(_run, backend, q, k, v, mask, causal, scale)
            out, known = _try(backend, call, q, mask)
            _UNAVAILABLE[(backend, key)] = known
            if not known:
                return out, backend  # type: ignore[return-value]
        if known:
            raise BackendUnavailableError(backend, known)
    return _run(backend, q, k, v, mask, causal, scale), backend


def choose_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> str:
    """The backend ``auto`` uses for these inputs: measured on the first call of a signature,
    then read from the cache. Nothing can be timed while compiling or capturing a CUDA graph:
    there ``auto`` means ``"default"``, so pin a model before compiling it (run it once eagerly,
    then :meth:`SelfAttention.pin_backend`)."""
    if torch.compiler.is_compiling():
        return "default"
    return _auto(_checked_signature(q, k, v, mask, causal), q, k, v, mask, causal, scale)


def _auto(key: SignatureKey, q, k, v, mask, causal, scale) -> str:
    choice = _AUTO_CACHE.get(key)
    if choice is not None:
        return choice.backend
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "default"
    choice = _measure(key, q, k, v, mask, causal, scale)
    _AUTO_CACHE[key] = choice
    _AUTO_FAST[key] = choice.backend
    return choice.backend


def _measure(key: SignatureKey, q, k, v, mask, causal, scale) -> AutoChoice:
    """Time every backend that can run these inputs, interleaved; the fastest median wins.

    A backend whose output differs from the first runnable one's beyond the dtype's tolerance is
    skipped too (a kernel bug must not win on speed)."""
    device = q.device
    if key.grad:  # time what training runs: forward and backward, on detached copies
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    runnable: dict[str, Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    first: tuple[str, torch.Tensor] | None = None
    for backend in FORCED:
        if backend == "math" and runnable and _math_bytes(key) > MATH_CANDIDATE_BYTES:
            skipped[backend] = (
                f"would materialize {_math_bytes(key) / 2**30:.1f} GiB of float32 scores; "
                "a fused backend can run"
            )
            continue
        call = partial(_run, backend, q, k, v, mask, causal, scale)
        fn = _with_backward(call, (q, k, v)) if key.grad else call
        reason = _try(backend, fn, q, mask)[1]
        if not reason:
            with torch.no_grad():
                out = call()
            if first is None:
                first = (backend, out)
            elif not torch.allclose(out, first[1], **TOLERANCES.get(out.dtype, {})):
                worst = (out.float() - first[1].float()).abs().max().item()  # sync: once
                reason = f"output differs from {first[0]}'s by up to {worst:.3g}"
        if reason:
            skipped[backend] = reason
        else:
            runnable[backend] = fn
    if not runnable:
        raise BackendUnavailableError("auto", "; ".join(f"{b}: {r}" for b, r in skipped.items()))
    times = _median_times(runnable, device) if len(runnable) > 1 else dict.fromkeys(runnable, 0.0)
    return AutoChoice(min(times, key=times.__getitem__), times, skipped)


def _math_bytes(key: SignatureKey) -> int:
    (b, h, sq, _), (_, _, sk, _), _ = key.shapes
    return b * h * sq * sk * 4 * (3 if key.grad else 2)


def _with_backward(call: Callable[[], torch.Tensor], inputs) -> Callable[[], object]:
    def forward_backward():
        out = call()
        # the output itself as the incoming gradient: no random numbers drawn from any generator
        return torch.autograd.grad(out, inputs, out.detach())

    return forward_backward


def _median_times(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int = 2,
    repeats: int = 12,
) -> dict[str, float]:
    """Median ms per call of each function, one sample of each in turn (drift cancels).

    Half the rounds rotate the candidates in one order, half in the reverse order: rotation
    alone keeps each candidate behind the same neighbour every round, and a kernel that runs
    right after a slow, cool one gets more of the GPU's power budget (a bias of several % on an
    H200 at 700 TFLOP/s). CUDA events time the device; the host clock times a CPU. This waits
    for the GPU once at the end: ``auto`` pays it once per signature.
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    cuda = device.type == "cuda"
    samples: dict[str, list] = {name: [] for name in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order[r % len(order) :] + order[: r % len(order)]:
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                samples[name].append((start, end))
            else:
                t0 = time.perf_counter()
                fns[name]()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        return {n: statistics.median(s.elapsed_time(e) for s, e in samples[n]) for n in names}
    return {n: statistics.median(samples[n]) for n in names}


# ---- rotary position embeddings ----------------------------------------------------------------
def rope_cos_sin(
    seq_len: int, head_dim: int, *, base: float = 10_000.0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (seq_len, head_dim), float32.

    Pair i of the head dimension turns by position * base^(-2i / head_dim); the halves layout
    (dims i and i + head_dim/2 form a pair) matches :func:`apply_rope`.
    """
    inv_freq = 1.0 / base ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) of x (..., S, D) by the angles whose cos/sin are (S, D)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # keep bf16 activations bf16 under autocast
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of queries and keys (B, H, S, head_dim).

    ``cached=True`` (the "after") computes cos/sin once for ``max_seq_len`` positions and keeps
    them as buffers, which follow the module to its device; ``cached=False`` (the "before")
    recomputes them on every forward: six small kernels per call, every layer, every step.
    """

    def __init__(
        self, head_dim: int, max_seq_len: int, *, base: float = 10_000.0, cached: bool = True
    ):
        super().__init__()
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim > 0, got {head_dim}")
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        self.head_dim, self.max_seq_len, self.base, self.cached = (
            head_dim,
            max_seq_len,
            base,
            cached,
        )
        if cached:
            cos, sin = rope_cos_sin(max_seq_len, head_dim, base=base)
            self.register_buffer("cos_cached", cos, persistent=False)
            self.register_buffer("sin_cached", sin, persistent=False)

    def cos_sin(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.max_seq_len}")
        if self.cached:
            return self.cos_cached[:seq_len], self.sin_cached[:seq_len]
        return rope_cos_sin(seq_len, self.head_dim, base=self.base, device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"expected head_dim {self.head_dim}, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        cos, sin = self.cos_sin(max(q.shape[-2], k.shape[-2]), q.device)
        return (
            apply_rope(q, cos[: q.shape[-2]], sin[: q.shape[-2]]),
            apply_rope(k, cos[: k.shape[-2]], sin[: k.shape[-2]]),
        )


# ---- q, k, v projections -------------------------------------------------------------------------
class QKVProjection(nn.Module):
    """q, k, v = proj(x) for x (..., dim): one (dim -> 3 dim) matrix product when ``fused``,
    three (dim -> dim) products when not (the "before": three launches, x read three times).

    Both forms start from the same weights for the same random state, so switching ``fused``
    changes speed, not results.
    """

    def __init__(self, dim: int, *, fused: bool = True, bias: bool = True):
        super().__init__()
        self.dim, self.fused = dim, fused
        separate = [nn.Linear(dim, dim, bias=bias) for _ in range(3)]  # same draws either way
        if not fused:
            self.q, self.k, self.v = separate
            return
        # skip_init: the fused layer draws nothing, so later layers' weights do not shift
        self.qkv = nn.utils.skip_init(nn.Linear, dim, 3 * dim, bias=bias)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([layer.weight for layer in separate]))
            if bias:
                self.qkv.bias.copy_(torch.cat([layer.bias for layer in separate]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if x.shape[-1] != self.dim:
            raise ValueError(f"expected inputs (..., {self.dim}), got {tuple(x.shape)}")
        if self.fused:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return q, k, v
        return self.q(x), self.k(x), self.v(x)

    def separate_parameters(self) -> dict[str, torch.Tensor]:
        """Parameters named as in the separate form (``q.weight``, ``k.bias`` ...), either form."""
        if not self.fused:
            return dict(self.named_parameters())
        out = {}
        for kind, tensor in (("weight", self.qkv.weight), ("bias", self.qkv.bias)):
            if tensor is not None:
                for name, part in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                    out[f"{name}.{kind}"] = part
        return out


# ---- the module ------------------------------------------------------------------------------------
class SelfAttention(nn.Module):
    """Multi-head self-attention over x (B, S, dim), with optional rotary embeddings.

    ``use_sdpa=False`` is the manual "before" (:func:`attention_reference`); ``True`` calls
    :func:`sdpa` with ``backend``. ``last_backend`` records the backend the last eager forward
    resolved to (``auto``'s pick), so a compiled model can be pinned to it.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        use_sdpa: bool = True,
        backend: Backend = "auto",
        fused_qkv: bool = True,
        rope: RotaryEmbedding | None = None,
        bias: bool = True,
    ):
        super().__init__()
        if heads <= 0 or dim % heads:
            raise ValueError(f"dim {dim} is not divisible into {heads} heads")
        _check_backend(backend)
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.use_sdpa, self.backend = use_sdpa, backend
        self.qkv = QKVProjection(dim, fused=fused_qkv, bias=bias)
        self.out = nn.Linear(dim, dim, bias=bias)
        self.rope = rope
        self.last_backend: str | None = None

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (B, S, dim) -> (B, H, S, head_dim) each
        q, k, v = (
            t.view(batch, seq, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x)
        )
        if self.rope is not None:
            q, k = self.rope(q, k)
        if not self.use_sdpa:
            out = attention_reference(q, k, v, mask=mask, causal=causal)
        else:
            out, backend = _sdpa(q, k, v, mask, causal, None, self.backend)
            if not torch.compiler.is_compiling():
                self.last_backend = backend
        return self.out(out.transpose(1, 2).reshape(batch, seq, self.dim))

    def pin_backend(self) -> str:
        """Replace ``auto`` by the backend it picked in the last eager forward (before
        ``torch.compile``, which cannot time anything while it traces)."""
        if self.use_sdpa and self.backend == "auto":
            if self.last_backend is None:
                raise RuntimeError("pin_backend() needs one eager forward first: nothing measured")
            self.backend = self.last_backend
        return self.backend
