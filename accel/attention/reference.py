"""Attention written out, the contract every fast path is held to: :func:`attention_reference`
(the manual "before", four passes over the scores), :func:`check_inputs` and :data:`TOLERANCES`
(how far a fused kernel may stray from the reference in float64)."""

from __future__ import annotations

import math

import torch

__all__ = ["TOLERANCES", "attention_reference", "check_inputs"]

# How far a backend may stray from attention computed in float64 from the same inputs: the
# output's own rounding plus the softmax weights rounded to the dtype before the product with v
# (bf16 keeps 8 mantissa bits: 4e-3 relative per rounding, outputs of order 1).
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: dict(rtol=1e-7, atol=1e-9),
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.float16: dict(rtol=4e-3, atol=4e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> None:
    """Raise a ValueError (TypeError for a non-tensor) naming the problem unless q, k, v (and
    mask) can be attended.

    q: (batch, heads, Sq, D), k: (batch, heads, Sk, D), v: (batch, heads, Sk, Dv), one floating
    dtype and device; mask: bool (True = attend) or q's dtype, broadcastable to (B, H, Sq, Sk).
    Sk may be 0: every query then has no key and gets 0.
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
    if mask is None:
        return
    if causal:
        raise ValueError("pass either a mask or causal=True, not both")
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or a mask kind, got {type(mask).__name__}")
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
    causal kernels and FlexAttention (SDPA's math path adds -inf, so a NaN there reaches it);
    its value is read with weight 0, so an inf there gives NaN (0 x inf) on every path.
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
