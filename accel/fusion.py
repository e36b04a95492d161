"""Fusion: fewer, larger kernels for work done over many tensors or in many small steps.

A Python loop over ~150 parameter tensors launches a kernel or two per tensor per statistic;
``torch._foreach_*`` ops take the whole list in a handful of launches. Each fast version sits
beside its plain reference: ``foreach=`` picks between them in :func:`group_stats` (no host
read); :func:`lior_step_fused` beside :func:`lior_step`. Norms accumulate in float32 (float64
for float64 tensors). Clipping is torch's own
``torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)``.
"""

from __future__ import annotations

import functools
import reprlib
from collections.abc import Iterable, Sequence

import torch

from accel.sync import to_device_without_sync

Tensors = torch.Tensor | Iterable[torch.Tensor]


def _as_list(tensors: Tensors, what: str) -> list[torch.Tensor]:
    """``tensors`` as a non-empty list of floating-point tensors, or an error naming ``what``."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    try:
        out = list(tensors)
    except TypeError:
        raise TypeError(
            f"{what}: expected a tensor or an iterable of tensors, got "
            f"{reprlib.repr(tensors)} ({type(tensors).__name__})"
        ) from None
    if not out:
        raise ValueError(
            f"{what}: got no tensors (an empty list, or a generator such as "
            "model.parameters() that was already consumed)"
        )
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: item {i} is a {type(t).__name__}, not a tensor")
        if not t.is_floating_point():
            raise TypeError(f"{what}: item {i} has dtype {t.dtype}; norms need floating point")
    return out


def _one_device(tensors: Sequence[torch.Tensor], what: str) -> torch.device:
    try:
        devices = {t.device for t in tensors}
    except AttributeError:  # checked only on the way to the error: the common call pays nothing
        i, bad = next((i, t) for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor))
        raise TypeError(f"{what}: item {i} is a {type(bad).__name__}, not a tensor") from None
    if len(devices) > 1:
        raise ValueError(
            f"{what}: tensors are on several devices ({', '.join(sorted(map(str, devices)))}); "
            "call once per device (a total across devices would need a copy between them)"
        )
    return devices.pop()


def group_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """Indices of ``tensors`` (on one device) per dtype: a foreach op takes one dtype at a time."""
    buckets: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault(t.dtype, []).append(i)
    return buckets


def _one_dtype(tensors: Sequence[torch.Tensor]) -> bool:  # cheaper than group_by_dtype
    return len({t.dtype for t in tensors}) == 1


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a norm is summed in: float32 for 16-bit tensors (their own dtype loses ~3 digits),
    float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def _foreach_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor L2 norms (:func:`_norm_dtype`) in input order, the tensors on one device: one
    ``_foreach_norm`` per dtype (an empty tensor's norm is 0)."""
    if _one_dtype(tensors):
        return list(torch._foreach_norm(list(tensors), 2.0, dtype=_norm_dtype(tensors[0].dtype)))
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    for indices in group_by_dtype(tensors).values():
        bucket = [tensors[i] for i in indices]
        bucket_norms = torch._foreach_norm(bucket, 2.0, dtype=_norm_dtype(bucket[0].dtype))
        for i, n in zip(indices, bucket_norms, strict=True):
            norms[i] = n
    return norms  # type: ignore[return-value]


def group_stats(
    groups: Sequence[Sequence[torch.Tensor]],
    *,
    foreach: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per group of parameters: the L2 norms of its gradients (a missing ``.grad`` counts as
    zero) and of its values, float32 (G, 2), without autograd (a controller fed with it trains on
    its own). ``out``, (G, 2) float32 on the parameters' device, receives it without an
    allocation. ``foreach=False`` is the per-tensor reference.
    """
    if isinstance(groups, (torch.Tensor, str, bytes)) or not isinstance(groups, Iterable):
        got = "a tensor" if isinstance(groups, torch.Tensor) else reprlib.repr(groups)
        raise TypeError(
            "group_stats: expected a sequence of groups (each a list of tensors), got "
            f"{got} ({type(groups).__name__})"
        )
    groups = [_as_list(g, f"group_stats: group {i}") for i, g in enumerate(groups)]
    if not groups:
        raise ValueError("group_stats: got no groups")
    device = _one_device([t for g in groups for t in g], "group_stats")
    if out is not None and (
        out.shape != (len(groups), 2) or out.dtype != torch.float32 or out.device != device
    ):
        raise ValueError(
            f"group_stats: out must be float32 of shape ({len(groups)}, 2) on {device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    impl = _group_stats_foreach if foreach else _group_stats_loop
    with torch.no_grad():
        return impl(groups, device, out)


def _group_stats_loop(
    groups: list[list[torch.Tensor]], device: torch.device, out: torch.Tensor | None
) -> torch.Tensor:
    """The plain version: pow and sum per tensor (4 kernels per parameter), then per group a
    stack, a sum and a sqrt per statistic."""
    stats = torch.zeros(len(groups), 2, device=device) if out is None else out.zero_()
    for i, params in enumerate(groups):
        grad_sq = [p.grad.float().pow(2).sum() for p in params if p.grad is not None]
        param_sq = [p.float().pow(2).sum() for p in params]
        if grad_sq:
            stats[i, 0] = torch.stack(grad_sq).sum().sqrt()
        stats[i, 1] = torch.stack(param_sq).sum().sqrt()
    return stats


def _group_stats_foreach(
    groups: list[list[torch.Tensor]], device: torch.device, out: torch.Tensor | None
) -> torch.Tensor:
    """One ``_foreach_norm`` over every gradient and parameter (per dtype), one stack, one
    gather into a zero-padded (2, G, longest group) block and a sum: about ten launches for any
    number of tensors. The gather's indices are built once per layout (:func:`_group_index`);
    the padding keeps the per-group sums deterministic (no atomic ``index_add``)."""
    flat = [p for g in groups for p in g]
    has_grad = tuple(p.grad is not None for p in flat)
    grads = [p.grad for p, h in zip(flat, has_grad, strict=True) if h]
    norms = _foreach_norms(grads + flat)
    zero = torch.zeros((), device=device)  # the norm of a missing gradient, and the padding
    squares = torch.stack([*norms, zero]).float().square_()  # float64 norms: stats are float32
    index = _group_index(device, tuple(len(g) for g in groups), has_grad)
    sums = squares[index].sum(-1)  # (stat, group)
    if out is None:
        return sums.sqrt_().T.contiguous()  # (G, 2)
    torch.sqrt(sums, out=out.T)  # written through the transposed view: no copy
    return out


@functools.lru_cache(maxsize=64)
def _group_index(
    device: torch.device, sizes: tuple[int, ...], has_grad: tuple[bool, ...]
) -> torch.Tensor:
    """(2, G, longest group) positions in ``[grad norms..., param norms..., 0]`` of each group's
    gradient norms (row 0) and parameter norms (row 1); a missing gradient and the padding point
    at the trailing zero."""
    has = torch.tensor(has_grad, dtype=torch.bool)
    grads = int(has.sum())
    zero = grads + len(has_grad)
    grad_at = torch.where(has, has.long().cumsum(0) - 1, zero)
    param_at = grads + torch.arange(len(has_grad))
    rows = torch.stack(
        [
            torch.nn.utils.rnn.pad_sequence(at.split(sizes), batch_first=True, padding_value=zero)
            for at in (grad_at, param_at)
        ]
    )
    return to_device_without_sync(rows, device)


# ---- the field trainer's fused LIoR step --------------------------------------------------------
def quad_form(v: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(g(v, v) + eps)`` per row of ``v`` (..., d); ``g`` is (d, d) or its diagonal (d,)."""
    q = ((v @ g) * v).sum(-1) if g.ndim == 2 else (v * v * g).sum(-1)
    return torch.sqrt(q + eps)


def lior_step(R_sc: torch.Tensor, v: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """The "before": the LIoR loss ``R_sc * sqrt(g(v, v) + eps)`` computes its own quadratic form,
    and the caller computes the same form again for the speed (5 kernels each, full metric)."""
    return R_sc * quad_form(v, g, eps)


def lior_step_fused(
    R_sc: torch.Tensor, v: torch.Tensor, g: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """LIoR and the speed from one quadratic form: ``(R_sc * spd, spd)``."""
    spd = quad_form(v, g, eps)
    return R_sc * spd, spd
