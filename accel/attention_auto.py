"""SDPA backends forced and measured: the engine behind ``accel.attention.sdpa``'s backends.

Forcing one kernel flips PyTorch's SDPA enable switches around the call (lean private switches
in eager mode, the public ``sdpa_kernel`` while tracing); a backend that cannot run says why, in
PyTorch's own words (:class:`BackendUnavailableError`). ``auto`` times every backend that can run
an input :func:`signature`, interleaved with ``accel.timer``, and caches the fastest
(:class:`AutoChoice`, :func:`auto_choices`, :func:`clear_auto_cache`).

``accel.attention`` re-exports every public name here. Importing this module costs torch only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from accel.timer import interleaved

__all__ = [
    "FORCED",
    "MATH_CANDIDATE_BYTES",
    "TOLERANCES",
    "AutoChoice",
    "BackendUnavailableError",
    "SignatureKey",
    "TensorSig",
    "auto_choices",
    "clear_auto_cache",
    "signature",
]

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


# ---- the signature, auto's choices and caches ----------------------------------------------------
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


def auto_choices() -> dict[SignatureKey, AutoChoice]:
    """A copy of ``auto``'s cache: one entry per input signature measured so far."""
    return dict(_AUTO_CACHE)


def clear_auto_cache() -> None:
    """Forget every measurement (``auto`` measures again on the next call of each signature)."""
    _AUTO_CACHE.clear()
    _AUTO_FAST.clear()
    _UNAVAILABLE.clear()


# ---- forcing one backend, and why it cannot run --------------------------------------------------
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
    """``sdpa_kernel([backend])`` for eager calls without its Python cost: the switches flipped
    directly, no context-manager generator or backend list built per call."""

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


# ---- auto: measure every backend that can run, keep the fastest ----------------------------------
def _auto(key: SignatureKey, q, k, v, mask, causal, scale) -> str:
    """The backend ``auto`` uses for these inputs: measured on the first call of a signature,
    then read from the cache. Nothing can be timed while a CUDA graph is captured (or, in the
    dispatcher, while compiling): there ``auto`` means ``"default"``, so pin a model before
    compiling it (one eager forward, then ``SelfAttention.pin_backend``)."""
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
    if len(runnable) > 1:  # warm-up and rounds in accel.timer's order; one GPU wait at the end
        times = interleaved(runnable, device, warmup=2, repeats=12).medians()
    else:
        times = dict.fromkeys(runnable, 0.0)
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
