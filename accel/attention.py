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

This module holds the contract (input checks, the reference), the dispatcher (:func:`sdpa`) and
:class:`SelfAttention`; forcing and measuring backends (``auto``'s cache, :func:`signature`,
:class:`AutoChoice`) is ``accel.attention_auto``, and the q/k/v projection and rotary embeddings
(:class:`QKVProjection`, :class:`RotaryEmbedding`) are ``accel.attention_qkv``. Every public name
of both is re-exported here.

Importing this module costs torch only. Which kernel really ran is read from the profiler by the
lab (``accel.lab.cases.sdpa``), never in this hot path.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from accel.attention_auto import (
    _AUTO_FAST,
    _FORCED_SHAPES,
    _KEPT_DEFAULT,
    _UNAVAILABLE,
    AUTO_MARGIN,
    FORCED,
    MATH_CANDIDATE_BYTES,
    TOLERANCES,
    AutoChoice,
    BackendUnavailableError,
    SignatureKey,
    TensorSig,
    _any_autocast,
    _auto,
    _plain,
    _run,
    _try,
    auto_choices,
    clear_auto_cache,
    default_key,
    flat_key,
    signature,
)
from accel.attention_flex import (
    MASKED_BACKENDS,
    MaskedChoice,
    block_mask,
    clear_masked_cache,
    flex_unavailable,
    masked_choices,
    masked_reference,
    masked_sdpa,
)
from accel.attention_masks import ALiBi, AttentionMask, Causal, Document, PrefixLM, SlidingWindow
from accel.attention_qkv import QKVProjection, RotaryEmbedding, apply_rope, rope_cos_sin

__all__ = [
    "AUTO_MARGIN",
    "BACKENDS",
    "FORCED",
    "MATH_CANDIDATE_BYTES",
    "TOLERANCES",
    "AutoChoice",
    "Backend",
    "BackendUnavailableError",
    "QKVProjection",
    "RotaryEmbedding",
    "SelfAttention",
    "SignatureKey",
    "TensorSig",
    "apply_rope",
    "attention_reference",
    "auto_choices",
    "check_inputs",
    "clear_auto_cache",
    "rope_cos_sin",
    "sdpa",
    "signature",
    "unavailable_reason",
]
__all__ += [  # masked attention (accel.attention_masks, accel.attention_flex)
    "MASKED_BACKENDS",
    "ALiBi",
    "AttentionMask",
    "Causal",
    "Document",
    "MaskedChoice",
    "PrefixLM",
    "SlidingWindow",
    "block_mask",
    "clear_masked_cache",
    "flex_unavailable",
    "masked_choices",
    "masked_reference",
    "masked_sdpa",
]

Backend = Literal["auto", "default", "flash", "efficient", "cudnn", "math"]
BACKENDS: tuple[str, ...] = get_args(Backend)
_CHECKED: set[tuple] = set()  # flat keys of inputs that passed check_inputs
_is_compiling = torch.compiler.is_compiling  # looked up once: sdpa's hot path calls it


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
    a bool mask keeps True; a float mask is added. A query whose every score is -inf (the mask
    left it no key) gives 0, as in SDPA; NaN and inf reach the output of every other query that
    sees them. A key the mask hides (False, or -inf in a float mask) is never read, as in SDPA's
    causal kernels and FlexAttention (SDPA's math path adds -inf, so a NaN there reaches it).
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
        scores = (scores + mask).masked_fill(torch.isneginf(mask), -math.inf)
    weights = scores.softmax(dim=-1)
    no_key = torch.isneginf(scores).all(dim=-1, keepdim=True)  # softmax gives NaN there, SDPA 0
    return weights.masked_fill(no_key, 0.0) @ v


# ---- the "after": SDPA with a chosen or measured backend -----------------------------------------
def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}; expected one of {', '.join(BACKENDS)}")


def _checked_key(q, k, v, mask, causal) -> tuple:
    """The inputs' :func:`flat_key`, after check_inputs the first time it is seen (later calls
    skip the checks: what they look at is in the key, or PyTorch checks it itself)."""
    try:
        key = flat_key(q, k, v, mask, causal)
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
        key = (backend, _checked_key(q, k, v, mask, causal))
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
    ``"auto"`` (measure once per :func:`signature`, keep PyTorch's own pick unless another kernel
    is clearly faster), ``"default"`` (PyTorch's own pick), or one forced kernel: ``"flash"``,
    ``"efficient"``, ``"cudnn"``, ``"math"``. A forced backend that cannot run the inputs raises
    :class:`BackendUnavailableError` with PyTorch's reason; ``auto`` skips it, keeping the reason.
    ``mask`` may also be a mask kind (``SlidingWindow(1024)``, ``Document(lengths)``, ...): then
    :func:`masked_sdpa` runs it, with its own backends (``auto``, ``flex``, ``dense``, ``causal``).

    Host cost: where ``auto`` kept PyTorch's pick for every layout of these shapes measured,
    without a mask or autocast, a call adds one short key (shapes, dtype, device, causal, grad)
    and one set lookup to ``F.scaled_dot_product_attention``, which ``sdpa`` calls itself (a new
    layout of such shapes is not measured again: PyTorch's pick runs it). While no unmasked
    signature measured took a forced kernel, that kernel is launched before the key is read:
    a single call then pays the key only where the kernel is shorter than it. Other measured
    signatures add a longer key (strides, the mask's) and a lookup. Measured beside ``F.sdpa`` in
    ``results/`` (rows ``phase=overhead``, ``sdpa auto``): 9-14% of ``F.sdpa``'s own host time,
    so it follows the host's pace: 1.3-2.7 µs a call where ``F.sdpa`` takes 13-22 µs, 2.8-4.6 µs
    where it takes 26-32 µs (H100 and H200 hosts, 2026-11-26). One call from an idle GPU pays
    it in full where the kernel ends before the host returns: 3-5 µs, 0.88-0.92 of ``F.sdpa``'s
    latency at calls of 30-50 µs, within 3% from about 70 µs
    (``results/sdpa-auto-latency-parts-nvidia-h200.txt``). A call whose
    host time is most of its time on the GPU keeps PyTorch's pick (a short forward and backward,
    whose autograd host work outlasts the kernels). Under ``torch.compile`` auto traces to
    PyTorch's pick and adds nothing. A forced kernel adds the switching of PyTorch's backend
    flags. The first call of a signature with ``auto`` measures every candidate (milliseconds to
    seconds, once).
    """
    if mask is not None and not isinstance(mask, torch.Tensor):  # a mask kind: masked_sdpa
        return masked_sdpa(q, k, v, mask, causal=causal, scale=scale, backend=backend)
    if backend == "auto" and not _is_compiling():
        if mask is None and not _FORCED_SHAPES and not _any_autocast():
            # every unmasked signature measured kept PyTorch's pick: launch it, then read the
            # key while the kernel runs (a new signature is measured after it)
            try:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            except (RuntimeError, TypeError, ValueError, AttributeError):
                return _sdpa(q, k, v, mask, causal, scale, backend)[0]  # our checks say why
            if default_key(q, k, v, causal) in _KEPT_DEFAULT:
                return out
            return _measured_after_launch(out, q, k, v, causal, scale)
        try:  # kept: shapes that kept PyTorch's pick in every layout measured
            kept = (
                mask is None
                and not _any_autocast()
                and default_key(q, k, v, causal) in _KEPT_DEFAULT
            )
            hit = None if kept else _AUTO_FAST.get(flat_key(q, k, v, mask, causal))
        except AttributeError:  # not tensors: the checks below say so
            kept, hit = False, None
        if kept:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        if hit is not None:  # checked and measured before: straight to the kernel
            if hit[1] is _plain:  # PyTorch's own pick, called here: no frame in between
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal, scale=scale
                )
            return hit[1](q, k, v, mask, causal, scale)
    return _sdpa(q, k, v, mask, causal, scale, backend)[0]


def _measured_after_launch(out: torch.Tensor, q, k, v, causal, scale) -> torch.Tensor:
    """A new unmasked signature whose PyTorch pick ``out`` already ran: checked and measured
    now; the chosen kernel's output if a forced kernel won (every call of a signature returns
    its choice's), else ``out``."""
    key = _checked_key(q, k, v, None, causal)
    hit = _AUTO_FAST.get(key)
    choice = hit[0] if hit else _auto(signature(q, k, v, None, causal), key, q, k, v, None,
                                      causal, scale)  # fmt: skip
    return out if choice.backend == "default" else _run(choice.backend, q, k, v, None, causal,
                                                         scale)  # fmt: skip


def _sdpa(q, k, v, mask, causal, scale, backend: str) -> tuple[torch.Tensor, str, str]:
    """:func:`sdpa`, the backend it resolved to and the kernel that runs (the module's path,
    where a few more host calls per forward do not show)."""
    _check_backend(backend)
    if torch.compiler.is_compiling():  # nothing to time or cache while tracing
        check_inputs(q, k, v, mask, causal)
        backend = "default" if backend == "auto" else backend
        return _run(backend, q, k, v, mask, causal, scale), backend, ""
    key = _checked_key(q, k, v, mask, causal)
    if backend == "auto":
        hit = _AUTO_FAST.get(key)
        if hit is None:  # measured now (it runs while being measured), or "default" in a capture
            choice = _auto(signature(q, k, v, mask, causal), key, q, k, v, mask, causal, scale)
            out = _run(choice.backend, q, k, v, mask, causal, scale)
            return out, choice.backend, choice.kernel
        return hit[1](q, k, v, mask, causal, scale), hit[0].backend, hit[0].kernel
    if backend in FORCED:
        known = _UNAVAILABLE.get((backend, key))
        if known is None:  # first call of this signature: run it, keeping PyTorch's reasons
            call = partial(_run, backend, q, k, v, mask, causal, scale)
            out, known = _try(backend, call, q, mask)
            _UNAVAILABLE[(backend, key)] = known
            if not known:
                return out, backend, backend  # type: ignore[return-value]
        if known:
            raise BackendUnavailableError(backend, known)
        return _run(backend, q, k, v, mask, causal, scale), backend, backend
    return _run(backend, q, k, v, mask, causal, scale), backend, ""  # PyTorch picks per call


# ---- the module ----------------------------------------------------------------------------------
class SelfAttention(nn.Module):
    """Multi-head self-attention over x (B, S, dim), with optional rotary embeddings.

    ``use_sdpa=False`` is the manual "before" (:func:`attention_reference`); ``True`` calls
    :func:`sdpa` with ``backend``. ``last_backend`` records the backend the last eager forward
    resolved to (``auto``'s pick: ``"default"`` or a forced kernel), so a compiled model can be
    pinned to it, and ``last_kernel`` the kernel that ran ("" where PyTorch picked per call).
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
        self.last_kernel: str | None = None

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(
                f"SelfAttention takes x of shape (batch, seq, {self.dim}), got {tuple(x.shape)}"
            )
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
            out, backend, kernel = _sdpa(q, k, v, mask, causal, None, self.backend)
            if not torch.compiler.is_compiling():
                self.last_backend, self.last_kernel = backend, kernel
        return self.out(out.transpose(1, 2).reshape(batch, seq, self.dim))

    def pin_backend(self) -> str:
        """Replace ``auto`` by the backend it picked in the last eager forward (before
        ``torch.compile``, which cannot time anything while it traces)."""
        if self.use_sdpa and self.backend == "auto":
            if self.last_backend is None:
                raise RuntimeError("pin_backend() needs one eager forward first: nothing measured")
            self.backend = self.last_backend
        return self.backend
