"""SDPA on a tensor mask, a query the mask leaves without keys given 0 as in the reference.

The CPU's kernels give 0 there; on CUDA some fused kernels do not (cuDNN with a bool mask), which
would pass silently into the model. So each (kernel, device, dtype, mask kind) is probed once,
and where it does not give 0 the mask goes in as an additive one (if that gives 0) or the rows
are zeroed after the call.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from accel.attention.backends import FORCED, picked_kernel, run_forced

__all__ = ["ADDITIVE_CACHE_BYTES", "run"]

# id(bool mask) -> (a weak reference to it, its version, dtype, the additive mask); up to this size
_ADDITIVE: dict[int, tuple] = {}
ADDITIVE_CACHE_BYTES = 64 << 20
_GIVES_ZERO: dict[tuple, bool] = {}  # (kernel, device, dtype, bool mask) -> probed


def run(backend: str, q, k, v, mask, causal, scale) -> torch.Tensor:
    """SDPA with ``backend`` forced, or PyTorch's pick for ``"default"``; a query that the mask
    leaves without keys gets 0."""
    if mask is None:
        return _call(backend, q, k, v, mask, causal, scale)
    additive, zero_rows = _mask_plan(backend, q, k, v, mask, causal, scale)
    if additive:
        return _call(backend, q, k, v, _additive_mask(mask, q.dtype), causal, scale)
    out = _call(backend, q, k, v, mask, causal, scale)
    return _zero_rows_without_keys(out, mask) if zero_rows else out


def _call(backend: str, q, k, v, mask, causal, scale) -> torch.Tensor:
    if backend in FORCED:
        return run_forced(backend, q, k, v, mask, causal, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def _kernel(backend: str, q, k, v, mask, causal, scale) -> str:
    return backend if backend in FORCED else picked_kernel(q, k, v, mask, causal, scale)


def _mask_plan(backend: str, q, k, v, mask, causal, scale) -> tuple[bool, bool]:
    """(pass the bool mask as an additive one, zero the rows without keys afterwards): what
    gives a query without keys 0 on the kernel that runs. An additive mask costs one conversion
    (kept while the mask lives), zeroing a pass over the output. While tracing nothing can be
    probed: the rows are zeroed (fused into the graph)."""
    if torch.compiler.is_compiling():
        return False, True
    if _zero_without_keys(_kernel(backend, q, k, v, mask, causal, scale), q, mask):
        return False, False
    if mask.dtype == torch.bool:
        additive = _additive_mask(mask, q.dtype)
        if _zero_without_keys(_kernel(backend, q, k, v, additive, causal, scale), q, additive):
            return True, False
    return False, True


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as 0 / -inf of ``dtype``, kept per mask tensor and version while the mask
    lives (a model passes one mask to every layer) unless larger than the cache's limit."""
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


def _zero_rows_without_keys(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A query whose mask leaves it no key gets 0: two small kernels, no host read."""
    keys = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
    return out.masked_fill(~keys.any(dim=-1, keepdim=True), 0.0)


def _zero_without_keys(kernel: str, q: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``kernel`` itself returns 0 for a query without keys: yes on the CPU; elsewhere
    probed once per key (not while a CUDA graph is captured: False, so the rows are zeroed)."""
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
    """True if ``kernel`` gives 0 to a query without keys (no random generator drawn from)."""
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
            out = run_forced(kernel, q, k, v, mask, False, None)
    except RuntimeError:
        return False
    return not bool(out[:, :, 3].any())  # sync: once per kernel, device, dtype and mask kind
