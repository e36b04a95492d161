"""``sdpa``: fused attention as PyTorch picks its kernel, or one kernel forced (after measuring it
at your shape with ``accel.lab.sdpa_backends``).

    out = sdpa(q, k, v, causal=True)                    # (B, H, S, D) in, (B, H, S, D) out
    out = sdpa(q, k, v, mask=SlidingWindow(1024))       # a mask kind: FlexAttention
    out = sdpa(q, k, v, backend="cudnn")                # one kernel, or PyTorch's reason why not
"""

from __future__ import annotations

from functools import partial
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from accel.attention.backends import FORCED, BackendUnavailableError, run, try_once
from accel.attention.flex import MASKED_BACKENDS, masked_sdpa
from accel.attention.reference import check_inputs

__all__ = ["BACKENDS", "Backend", "sdpa", "unavailable_reason"]

Backend = Literal["default", "flash", "efficient", "cudnn", "math"]
BACKENDS: tuple[str, ...] = get_args(Backend)
# (backend, the inputs' key) -> "" once checked and run, else why the forced kernel cannot run
_SEEN: dict[tuple, str] = {}
_SEEN_KEPT = 256
_RAISED = (RuntimeError, TypeError, ValueError, AttributeError, IndexError)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    backend: str = "default",
) -> torch.Tensor:
    """Fused attention, equal to :func:`accel.attention.attention_reference` within the dtype's
    rounding. q (B, H, Sq, D), k (B, H, Sk, D), v (B, H, Sk, Dv) -> (B, H, Sq, Dv).

    ``backend``: ``"default"``, PyTorch's own pick (without a mask,
    ``F.scaled_dot_product_attention`` called as it is, nothing measured or cached); or one
    forced kernel, ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``, which raises
    :class:`BackendUnavailableError` with PyTorch's reason where it cannot run the inputs.
    ``accel.lab.sdpa_backends(q, k, v)`` measures which is fastest at a shape.

    ``mask``: a tensor (bool, True = attend, or additive of q's dtype) or a mask kind
    (``SlidingWindow(1024)``, ``Document(lengths)``, ``PrefixLM(n)``, ``Causal()``, ``ALiBi()``),
    which :func:`accel.attention.masked_sdpa` runs (``backend`` then one of ``"default"``,
    ``"flex"``, ``"dense"``). A query that a tensor mask leaves without keys gets 0, as in the
    reference, on every kernel.

    Checks: without a mask the inputs go to PyTorch as they come (a batch of 1 broadcast, 3-D
    inputs work as there), and what it refuses gets our message naming the argument
    (:func:`accel.attention.check_inputs`). With a tensor mask or a forced kernel, the first
    call of each input key is checked before it runs.
    """
    if backend == "default" and mask is None:
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        except _RAISED:
            check_inputs(q, k, v, None, causal)  # our words for what PyTorch refused
            raise
    if mask is not None and not isinstance(mask, torch.Tensor):
        return masked_sdpa(q, k, v, mask, causal=causal, scale=scale, backend=backend)
    check_backend(backend)
    return _checked_run(backend, q, k, v, mask, causal, scale)


def check_backend(backend: object) -> None:
    """A ValueError unless ``backend`` is one of :data:`BACKENDS`."""
    if backend in BACKENDS:
        return
    raise ValueError(
        f"unknown SDPA backend {backend!r}; expected one of {', '.join(BACKENDS)} (with a mask "
        f"kind: {', '.join(MASKED_BACKENDS)})"
    )


def _key(q, k, v, mask, causal) -> tuple:
    """What decides whether a forced kernel can run."""
    grad = (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()
    masked = None if mask is None else (mask.shape, mask.stride(), mask.dtype)
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
            masked, causal, grad)  # fmt: skip


def _checked_run(backend: str, q, k, v, mask, causal, scale) -> torch.Tensor:
    """``backend`` on inputs checked once per key: the first call of a key checks them and, for
    a forced kernel, keeps PyTorch's reason if it fails; later calls run it or raise that
    reason. While tracing nothing is kept: the checks are traced with the call."""
    if torch.compiler.is_compiling():
        check_inputs(q, k, v, mask, causal)
        return run(backend, q, k, v, mask, causal, scale)
    try:
        key = (backend, _key(q, k, v, mask, causal))
    except AttributeError:  # not tensors: the checks say so
        check_inputs(q, k, v, mask, causal)
        raise
    known = _SEEN.get(key)
    if known is None:
        check_inputs(q, k, v, mask, causal)
        out, known = None, ""
        if backend in FORCED:  # run it now, keeping PyTorch's reasons if it cannot
            call = partial(run, backend, q, k, v, mask, causal, scale)
            out, known = try_once(backend, call, q, mask)
        if len(_SEEN) >= _SEEN_KEPT:
            del _SEEN[next(iter(_SEEN))]
        _SEEN[key] = known
        if out is not None:
            return out  # type: ignore[return-value]
    if known:
        raise BackendUnavailableError(backend, known)
    return run(backend, q, k, v, mask, causal, scale)


def unavailable_reason(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask=None, causal=False
) -> str | None:
    """Why a forced ``backend`` cannot run these inputs, or None if it can (``"default"``
    always can). The first query of a key runs the backend once, forward only."""
    check_backend(backend)
    if backend not in FORCED:
        return None
    with torch.no_grad():
        try:
            _checked_run(backend, q, k, v, mask, causal, None)
        except BackendUnavailableError as error:
            return error.reason
    return None
