"""SDPA backends forced and measured: the engine behind ``accel.attention.sdpa``'s backends.

Forcing one kernel flips PyTorch's SDPA enable switches around the call (lean private switches
in eager mode, the public ``sdpa_kernel`` while tracing); a backend that cannot run says why, in
PyTorch's own words (:class:`BackendUnavailableError`). ``auto`` times PyTorch's own pick
(``"default"``) against every kernel that can run an input :func:`signature` forced (its own
pick among them: forcing can change a kernel's speed), interleaved with ``accel.timer``, both
back to back and one call at a time from an idle GPU, and keeps the default unless a forced
kernel beats it in both by more than the measurement's own spread
(:class:`AutoChoice`, :func:`auto_choices`, :func:`clear_auto_cache`).

After its measurement a signature costs one flat key and one dictionary lookup per call, and a
choice of ``"default"`` then calls ``F.scaled_dot_product_attention`` itself: no switch is
flipped (:func:`cached_runner`). Without a mask or autocast, shapes whose every measured layout
kept PyTorch's pick cost less still: a shorter key (:func:`default_key`, no strides) in one set,
so another layout of those shapes runs PyTorch's pick without being measured; and while no
unmasked signature took a forced kernel, ``sdpa`` launches PyTorch's pick before it reads that
key, so the key's host time runs beside the kernel.

``accel.attention`` re-exports every public name here. Importing this module costs torch only.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from accel.attention_auto_rules import (
    AUTO_MARGIN,
    DEFAULT_AGAIN,
    kept_without_comparing,
    winner,
)
from accel.timer import Samples, interleaved

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
# SDPBackend values as torch._fused_sdp_choice returns them
_KERNEL_NAMES = {int(b): name for name, b in FORCED.items()}


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
    grad = (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()
    autocast = _autocast_dtype(q.device.type)
    return SignatureKey(
        _sig(q), _sig(k), _sig(v), None if mask is None else _sig(mask), causal, grad, autocast
    )


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` measured for one signature.

    ``backend`` is ``"default"`` (PyTorch's own pick, which runs ``default_kernel``) or the
    forced kernel that beat it. Per candidate: ``times_ms``, the median ms back to back (forward,
    or forward + backward when the key's ``grad``), and ``latency_ms``, one call from an idle GPU
    with its host time (on a CPU the two are one measurement); ``skipped`` gives the reason of
    each kernel left out. ``spread`` is the default against its own second copy, round by round:
    how far the measurement moves for the same kernel. On a GPU, a default shorter than
    ``SHORT_CALL_MS``, or one whose host time is most of its time there (``HOST_BOUND_SHARE``,
    ``accel.attention_auto_rules``), is kept without the comparison alone (``note`` says why)."""

    backend: str
    times_ms: dict[str, float]
    skipped: dict[str, str] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    default_kernel: str = ""
    spread: float = 0.0
    note: str = ""  # why the default was kept without comparing, if it was

    @property
    def kernel(self) -> str:
        """The kernel the choice runs: ``default_kernel`` for ``"default"``."""
        return self.default_kernel if self.backend == "default" else self.backend


_AUTO_CACHE: dict[SignatureKey, AutoChoice] = {}
# flat_key -> (what auto measured, its runner): a repeated call is one key and one lookup
_AUTO_FAST: dict[tuple, tuple[AutoChoice, Callable[..., torch.Tensor]]] = {}
_UNAVAILABLE: dict[tuple[str, tuple], str] = {}  # "" when the backend ran
# default_key of shapes whose every measured signature kept PyTorch's pick (unmasked, no
# autocast): the dispatcher's cheapest path. _FORCED_SHAPES: those where one did not.
_KEPT_DEFAULT: set[tuple] = set()
_FORCED_SHAPES: set[tuple] = set()
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def flat_key(q, k, v, mask, causal) -> tuple:
    """What :func:`signature` holds, as one flat tuple built at the least host cost: the cache
    key of the dispatcher's hot path. k's and v's dtype and device are q's once the inputs were
    checked (PyTorch raises otherwise); the mask and the autocast dtype are looked at only when
    there is a mask or autocast is on somewhere."""
    grad = (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()
    if mask is None and not _any_autocast():
        return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
                causal, grad)  # fmt: skip
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
            causal, grad, None if mask is None else (mask.shape, mask.stride(), mask.dtype),
            _autocast_dtype(q.device.type))  # fmt: skip


def default_key(q, k, v, causal) -> tuple:
    """The key of :data:`_KEPT_DEFAULT`: shapes, dtype, device, causal and whether a backward
    follows (the inputs asked first: without gradients, the common call, grad mode is not read),
    without the strides, whose reading is a third of :func:`flat_key`'s cost. Only a
    choice of PyTorch's own pick is shared across layouts: it runs any layout, as it would
    without ``auto``."""
    return (q.shape, k.shape, v.shape, q.dtype, q.device, causal,
            (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled())  # fmt: skip


def _keep_shapes(choice: AutoChoice, q, k, v, causal) -> None:
    """Note an unmasked choice made without autocast under its :func:`default_key`."""
    shapes = default_key(q, k, v, causal)
    if choice.backend != "default":  # this layout wants a forced kernel: key by layout again
        _KEPT_DEFAULT.discard(shapes)
        _FORCED_SHAPES.add(shapes)
    elif shapes not in _FORCED_SHAPES:
        _KEPT_DEFAULT.add(shapes)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def auto_choices() -> dict[SignatureKey, AutoChoice]:
    """A copy of ``auto``'s cache: one entry per input signature measured so far."""
    return dict(_AUTO_CACHE)


def clear_auto_cache() -> None:
    """Forget every measurement (``auto`` measures again on the next call of each signature)."""
    _AUTO_CACHE.clear()
    _AUTO_FAST.clear()
    _KEPT_DEFAULT.clear()
    _FORCED_SHAPES.clear()
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
if _SWITCHES is not None:
    _GETTERS = tuple(get for _, get, _ in _SWITCHES)
    _SETTERS = tuple(set_ for _, _, set_ in _SWITCHES)
    # per forced backend: each switch's state while it runs alone
    _ALONE = {name: tuple(b == sdp for b, _, _ in _SWITCHES) for name, sdp in FORCED.items()}


def _plain(q, k, v, mask, causal, scale) -> torch.Tensor:
    """PyTorch's own pick: nothing flipped, nothing added."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def _alone(backend: str, q, k, v, mask, causal, scale) -> torch.Tensor:
    """SDPA with only ``backend`` enabled: ``sdpa_kernel([backend])`` without its Python cost
    (the switches set directly, no context-manager generator or backend list per call); the
    public context manager while tracing, which dynamo understands."""
    if _SWITCHES is None or torch.compiler.is_compiling():
        with sdpa_kernel([FORCED[backend]]):
            return _plain(q, k, v, mask, causal, scale)
    saved = [get() for get in _GETTERS]
    for set_, on in zip(_SETTERS, _ALONE[backend], strict=True):
        set_(on)
    try:
        return _plain(q, k, v, mask, causal, scale)
    finally:
        for set_, was in zip(_SETTERS, saved, strict=True):
            set_(was)


def _run(backend: str, q, k, v, mask, causal, scale) -> torch.Tensor:
    """SDPA with ``backend`` forced (or PyTorch's pick for "default"); a query that the mask
    leaves without keys gets 0 (:func:`_mask_plan`)."""
    run = partial(_alone, backend) if backend in FORCED else _plain
    if mask is None:
        return run(q, k, v, mask, causal, scale)
    return _with_mask_plan(run, *_mask_plan(backend, q, k, v, mask, causal, scale))(
        q, k, v, mask, causal, scale
    )


def _mask_plan(backend: str, q, k, v, mask, causal, scale) -> tuple[bool, bool]:
    """(pass the bool mask as an additive one, zero the rows without keys afterwards): what
    makes a query that the mask leaves without keys come back 0 on the kernel that runs. The
    kernel may give 0 itself; cuDNN does for an additive mask but not for a bool one, which
    costs one conversion of the mask (kept while the mask lives) instead of a pass over the
    output. While tracing nothing can be asked or probed: the rows are zeroed (the compiler
    fuses that into the graph)."""
    if torch.compiler.is_compiling():
        return False, True
    if _zero_without_keys(_kernel_of(backend, q, k, v, mask, causal, scale), q, mask):
        return False, False
    if mask.dtype == torch.bool:
        additive = _additive_mask(mask, q.dtype)
        if _zero_without_keys(_kernel_of(backend, q, k, v, additive, causal, scale), q, additive):
            return True, False
    return False, True


def _with_mask_plan(run, additive: bool, zero_rows: bool):
    """``run`` that passes an additive mask, or zeroes the rows without keys, as planned."""
    if additive:
        return lambda q, k, v, m, c, s: run(q, k, v, _additive_mask(m, q.dtype), c, s)
    if zero_rows:
        return lambda q, k, v, m, c, s: _zero_rows_without_keys(run(q, k, v, m, c, s), m)
    return run


# id(bool mask) -> (a weak reference to it, its version, dtype, the additive mask); up to this size
_ADDITIVE: dict[int, tuple] = {}
ADDITIVE_CACHE_BYTES = 64 << 20


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as 0 / -inf of ``dtype``: made once per mask tensor and
    version while the mask lives (a model passes one mask to every layer), or at each call for
    a mask whose additive form is larger than :data:`ADDITIVE_CACHE_BYTES`."""
    key = id(mask)
    hit = _ADDITIVE.get(key)
    if hit is not None and hit[0]() is mask and hit[1] == mask._version and hit[2] == dtype:
        return hit[3]
    additive = torch.full(mask.shape, -math.inf, dtype=dtype, device=mask.device)
    additive.masked_fill_(mask, 0.0)
    if additive.numel() * additive.element_size() <= ADDITIVE_CACHE_BYTES:
        gone = weakref.ref(mask, lambda _, key=key: _ADDITIVE.pop(key, None))
        _ADDITIVE[key] = (gone, mask._version, dtype, additive)
    return additive


def _kernel_of(backend: str, q, k, v, mask, causal, scale) -> str:
    """The kernel ``backend`` runs on these inputs: PyTorch's pick for "default"."""
    if backend in FORCED:
        return backend
    return _KERNEL_NAMES.get(
        int(torch._fused_sdp_choice(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)), ""
    )


def _zero_rows_without_keys(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A query whose mask leaves it no key gets 0, as in the reference. Two small kernels on the
    device, no host read."""
    keys = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
    return out.masked_fill(~keys.any(dim=-1, keepdim=True), 0.0)


_GIVES_ZERO: dict[tuple, bool] = {}  # (kernel, device, dtype, bool mask) -> probed


def _zero_without_keys(kernel: str, q: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``kernel`` itself returns 0 for a query whose mask leaves it no key. The CPU's
    kernels do; on CUDA some fused kernels return other values there (seen: cuDNN with a bool
    mask), which would pass silently into the model, so each (kernel, device, dtype, mask kind)
    is probed once on a small input (one host read). While a CUDA graph is being captured
    nothing is probed: the answer is False, and the rows are zeroed."""
    if q.device.type == "cpu":
        return True
    key = (kernel, q.device, q.dtype, mask.dtype == torch.bool)
    known = _GIVES_ZERO.get(key)
    if known is None:
        if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        known = _GIVES_ZERO[key] = _probe_zero_without_keys(*key)
    return known


def _probe_zero_without_keys(kernel, device, dtype, bool_mask: bool) -> bool:
    """Run ``kernel`` on an input whose fourth query has no key; True if its row came back 0.
    The values come from no random generator (auto must not move the user's)."""
    if kernel not in FORCED:
        return False
    n = 3 * 2 * 80 * 64
    q, k, v = torch.linspace(-2, 2, n, device=device).sin().to(dtype).view(3, 1, 2, 80, 64)
    keep = torch.ones(80, 80, dtype=torch.bool, device=device)
    keep[3] = False
    mask = keep if bool_mask else torch.zeros(80, 80, dtype=dtype, device=device)
    if not bool_mask:
        mask.masked_fill_(~keep, -math.inf)
    try:
        with torch.no_grad():
            out = _alone(kernel, q, k, v, mask, False, None)
    except RuntimeError:
        return False
    return not bool(out[:, :, 3].any())  # sync: once per kernel, device, dtype and mask kind


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


# ---- auto: PyTorch's pick against every other kernel, kept unless beaten -------------------------
def _auto(key: SignatureKey, fast: tuple, q, k, v, mask, causal, scale) -> AutoChoice:
    """What ``auto`` uses for these inputs: measured on the first call of a signature,
    then read from the cache (and ``fast``, the signature's :func:`flat_key`, is filled for the
    dispatcher's hot path). Nothing can be timed while a CUDA graph is captured (or, in the
    dispatcher, while compiling): there ``auto`` means ``"default"``, so pin a model before
    compiling it (one eager forward, then ``SelfAttention.pin_backend``)."""
    choice = _AUTO_CACHE.get(key)
    if choice is None:
        if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            kernel = _kernel_of("default", q, k, v, mask, causal, scale)
            return AutoChoice("default", {}, default_kernel=kernel)
        choice = _AUTO_CACHE[key] = _measure(key, q, k, v, mask, causal, scale)
    _AUTO_FAST[fast] = (choice, cached_runner(choice, q, k, v, mask, causal, scale))
    if key.mask is None and key.autocast is None:
        _keep_shapes(choice, q, k, v, causal)
    return choice


def cached_runner(choice: AutoChoice, q, k, v, mask, causal, scale):
    """What a call of a measured signature runs, ``(q, k, v, mask, causal, scale) -> out``:
    ``F.scaled_dot_product_attention`` itself for ``"default"``, the forced kernel otherwise,
    and with a mask what makes queries without keys 0 where the kernel needs it."""
    run = _plain if choice.backend == "default" else partial(_alone, choice.backend)
    if mask is None:
        return run
    return _with_mask_plan(run, *_mask_plan(choice.backend, q, k, v, mask, causal, scale))


def _measure(key: SignatureKey, q, k, v, mask, causal, scale) -> AutoChoice:
    """PyTorch's own pick and every kernel that can run these inputs forced, timed interleaved
    back to back and (on CUDA) one call at a time from an idle GPU; a forced kernel wins only if
    it beats the default in both by more than :data:`AUTO_MARGIN` or the default's spread
    against its own second copy, whichever is wider.

    A kernel whose output differs from the default's beyond the dtype's tolerance is skipped
    (a kernel bug must not win on speed)."""
    if key.grad:  # time what training runs: forward and backward, on detached copies
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    default_kernel = _kernel_of("default", q, k, v, mask, causal, scale)
    candidates, skipped = _candidates(key, default_kernel, q, k, v, mask, causal, scale)
    if len(candidates) == 1:
        return AutoChoice("default", {}, skipped, default_kernel=default_kernel)
    # the default twice, at two places in each round's order: its spread against itself
    fns = {"default": candidates["default"], DEFAULT_AGAIN: candidates["default"], **candidates}
    back_to_back = interleaved(fns, q.device, warmup=2, repeats=10)
    spread = abs(back_to_back.paired_ratio(DEFAULT_AGAIN, "default") - 1)
    kept = kept_without_comparing(back_to_back, candidates["default"], q.device)
    if kept:
        return AutoChoice("default", _medians(back_to_back), skipped, {}, default_kernel, spread,
                          note=kept)  # fmt: skip
    alone = back_to_back
    if q.device.type == "cuda":
        alone = interleaved(fns, q.device, warmup=0, repeats=10, clock="latency")
        spread = max(spread, abs(alone.paired_ratio(DEFAULT_AGAIN, "default") - 1))
    return AutoChoice(
        winner(back_to_back, alone, max(AUTO_MARGIN, spread)),
        _medians(back_to_back),
        skipped,
        _medians(alone),
        default_kernel,
        spread,
    )


def _candidates(key: SignatureKey, default_kernel: str, q, k, v, mask, causal, scale):
    """``{"default": its call, forced kernel: its call, ...}`` of every kernel that ran these
    inputs, and the reason of each one that did not (or was left out)."""
    runs = {}
    for backend in ("default", *FORCED):
        call = partial(_run, backend, q, k, v, mask, causal, scale)
        runs[backend] = _with_backward(call, (q, k, v)) if key.grad else call
    skipped: dict[str, str] = {}
    out, reason = _try("default", runs["default"], q, mask)
    if reason:  # PyTorch's own pick cannot run: nothing can
        raise BackendUnavailableError("auto", reason)
    with torch.no_grad():
        first = _run("default", q, k, v, mask, causal, scale)
    candidates = {"default": runs["default"]}
    for backend in FORCED:
        # PyTorch's pick is a candidate forced too, judged like the rest (forced and picked,
        # cuDNN ran the same kernels in the same time: results/sdpa-auto-host-cost-*.txt)
        if backend == "math" and _math_bytes(key) > MATH_CANDIDATE_BYTES:
            skipped[backend] = (
                f"would materialize {_math_bytes(key) / 2**30:.1f} GiB of float32 scores; "
                "a fused backend can run"
            )
            continue
        reason = _try(backend, runs[backend], q, mask)[1]
        if not reason:
            with torch.no_grad():
                out = _run(backend, q, k, v, mask, causal, scale)
            if not torch.allclose(out, first, **TOLERANCES.get(out.dtype, {})):
                worst = (out.float() - first.float()).abs().max().item()  # sync: once
                reason = (
                    f"output differs from the default's ({default_kernel}) by up to {worst:.3g}"
                )
        if reason:
            skipped[backend] = reason
        else:
            candidates[backend] = runs[backend]
    return candidates, skipped


def _medians(samples: Samples) -> dict[str, float]:
    return {k: t for k, t in samples.medians().items() if k != DEFAULT_AGAIN}


def _math_bytes(key: SignatureKey) -> int:
    (b, h, sq, _), (_, _, sk, _), _ = key.shapes
    return b * h * sq * sk * 4 * (3 if key.grad else 2)


def _with_backward(call: Callable[[], torch.Tensor], inputs) -> Callable[[], object]:
    def forward_backward():
        out = call()
        # the output itself as the incoming gradient: no random numbers drawn from any generator
        return torch.autograd.grad(out, inputs, out.detach())

    return forward_backward
