"""Comparing a workload's results with the baseline's: the check every flag must pass."""

from __future__ import annotations

from collections.abc import Mapping

import torch

Tolerance = Mapping[str, float]


def compare_results(
    result: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    tolerances: Mapping[str, Tolerance | None],
    *,
    relative: bool = True,
) -> dict[str, float]:
    """Check each entry of ``result`` against ``reference`` with ``torch.testing.assert_close``
    at its tolerance (an AssertionError names the entry; an entry whose tolerance is None is not
    comparable and is skipped) and return, per entry, the largest difference: relative to the
    entry's largest value, or absolute with ``relative=False``."""
    errors = {}
    for key, ref in reference.items():
        tol = tolerances[key]
        if tol is None:
            continue
        got = result[key].to(ref.device)
        torch.testing.assert_close(got, ref, **tol, msg=lambda m, k=key: f"{k}: {m}")
        if not ref.numel():
            errors[key] = 0.0
            continue
        largest = (got - ref).abs().max()
        if relative:
            largest = largest / ref.abs().max().clamp_min(1e-30)
        errors[key] = float(largest)
    return errors
