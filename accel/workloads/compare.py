"""Comparing a workload's results with the baseline's: the check every flag must pass."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

# Elementwise ``{"atol": ..., "rtol": ...}`` (``torch.testing.assert_close``), or normwise
# ``{"rel_norm": ...}``: ``|result - reference| / |reference|`` over the whole entry, for results
# whose rounding error scales with the entry's size rather than with each element.
Tolerance = Mapping[str, float]

BF16_UNIT_ROUNDOFF = 2.0**-8  # 8 significant bits


def adamw_drift_bound(steps: int, lr: float, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The most two AdamW runs from the same weights can move one weight apart in ``steps`` steps,
    whatever their gradients: ``2 lr sum_t rho_t``, where ``rho_t`` bounds ``|m_hat / sqrt(v_hat)|``
    at step t (Cauchy-Schwarz over the moment weights). A weight whose gradient is at rounding
    level can take either sign at each step, so two valid implementations may differ this much."""
    beta1, beta2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1**t) for i in range(1, t + 1)]
        b = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2**t) for i in range(1, t + 1)]
        total += math.sqrt(sum(x * x / y for x, y in zip(a, b, strict=True)))
    return 2 * lr * total


def compare_results(result, reference, tolerances, *, relative: bool = True) -> dict[str, float]:
    """Check each entry of ``result`` against ``reference`` at its tolerance (an AssertionError
    names the entry; an entry whose tolerance is None is not comparable and is skipped) and
    return, per entry, the largest difference: relative to the entry's largest value, or absolute
    with ``relative=False``."""
    errors = {}
    for key, ref in reference.items():
        tol = tolerances[key]
        if tol is None:
            continue
        got = result[key].to(ref.device)
        if "rel_norm" in tol:
            _assert_close_normwise(got, ref, tol["rel_norm"], key)
        else:
            torch.testing.assert_close(got, ref, **tol, msg=lambda m, k=key: f"{k}: {m}")
        scale = ref.abs().max().clamp_min(1e-30) if relative and ref.numel() else 1.0
        errors[key] = float((got - ref).abs().max() / scale) if ref.numel() else 0.0
    return errors


def make_compare_results(tolerance: Callable, *, relative: bool = True) -> Callable:
    """A workload's ``compare_results`` (the contract in :mod:`accel.workloads`) from its
    ``tolerance(flags, sizes, steps)``: :func:`compare_results` at that tolerance."""

    def compare_results_(result, reference, flags, *, sizes, steps: int) -> dict[str, float]:
        """An AssertionError naming the first entry of ``result`` (of ``flags``) beyond the
        workload's ``tolerance`` of the baseline's ``reference``; else each one's largest
        difference (relative to its largest value, or absolute where the workload says so)."""
        return compare_results(result, reference, tolerance(flags, sizes, steps), relative=relative)

    compare_results_.__name__ = compare_results_.__qualname__ = "compare_results"
    return compare_results_


def _assert_close_normwise(got: torch.Tensor, ref: torch.Tensor, bound: float, key: str) -> None:
    if got.shape != ref.shape:
        raise AssertionError(f"{key}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    if not torch.isfinite(got).all():
        raise AssertionError(f"{key}: not finite where the reference is")
    diff, scale = (got - ref).double().norm(), ref.double().norm()
    error = float(diff / scale) if scale > 0 else float(diff)
    if not error <= bound:
        raise AssertionError(
            f"{key}: |result - reference| / |reference| = {error:.3g}, expected <= {bound:.3g}"
        )
