"""The field trainer's dynamics: one step of the field as pure functions of its tensors, so one
torch.compile of a step serves every :class:`accel.workloads.field_trainer.Step` (the LIoR pieces
live in :mod:`accel.fusion` beside their fused form)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from accel.fusion import lior_step, lior_step_fused, quad_form


def curvature(x: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """Scalar curvature per field point: softplus of the mean of ``x^T C x``, > 0."""
    return torch.nn.functional.softplus(((x @ C) * x).mean(-1))


def metric_cost(x: torch.Tensor, keys: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Cost of each bank entry for each point: ``g(x - k, x - k)`` per coordinate, (B, M)."""
    diff = x.unsqueeze(1) - keys  # (B, M, d)
    q = (diff @ g) * diff if g.ndim == 2 else diff * diff * g
    return q.mean(-1)


def retrieve(
    x: torch.Tensor, keys: torch.Tensor, g: torch.Tensor, values: torch.Tensor, beta: float
) -> torch.Tensor:
    """The bank's values mixed by ``softmax(-beta * cost)``, cost under the metric ``g``: (B, d),
    through the (B, M, d) products and their sum, as such code is usually written."""
    w = torch.softmax(-beta * metric_cost(x, keys, g), dim=-1)  # (B, M)
    return (values.unsqueeze(0) * w.unsqueeze(-1)).sum(1)


def field_step(
    x: torch.Tensor,
    v: torch.Tensor,
    nudge: float,
    C: torch.Tensor,
    keys: torch.Tensor,
    g0: torch.Tensor,
    values: torch.Tensor,
    theta: torch.Tensor,
    target: torch.Tensor,
    *,
    planes: Any,
    rotate_fn: Callable,
    fused_lior: bool,
    beta: float,
    eps: float,
    damping: float,
    dt: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the field (:meth:`Step.advance`) as a function of its tensors and settings
    only, so one compilation serves every Step: the new ``x``, ``v`` and the step's LIoR,
    curvature and speed per point."""
    R_sc = curvature(x, C)
    retrieved = retrieve(x, keys, g0, values, beta)
    if fused_lior:
        dlior, spd = lior_step_fused(R_sc, v, g0, eps)
    else:  # the quadratic form twice
        dlior = lior_step(R_sc, v, g0, eps)
        spd = quad_form(v, g0, eps)
    v_rot = rotate_fn(v, planes, theta)
    force = retrieved - x
    if nudge:
        force = force + nudge * (target - x)
    v = (1 - damping) * v_rot + dt * force
    x = x + dt * v
    return x, v, dlior, R_sc, spd


def accumulating_step(x, v, nudge, acc, vel_acc, *fixed, **options) -> tuple[torch.Tensor, ...]:
    """:func:`field_step`, then its LIoR, curvature and speed means added to ``acc`` and its
    velocity to ``vel_acc``, in place (``inplace_accumulate``), as one function for
    ``compiled_step`` to fuse."""
    x, v, dlior, R_sc, spd = field_step(x, v, nudge, *fixed, **options)
    acc.add_(torch.stack([dlior.mean(), R_sc.mean(), spd.mean()]))
    vel_acc.add_(v)
    return x, v
