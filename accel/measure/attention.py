"""SDPA's kernels measured against each other at a user's own shape.

``accel.attention.sdpa`` calls PyTorch's pick: its priority order and each kernel's limits, no
measurement. Whether another kernel is faster at a given shape is a measurement, made here, by
hand, once: PyTorch's pick (``default``) and every kernel forced, timed interleaved
(``lab.compare``) with a second copy of the default whose ratio to the first is the measurement's
own spread. A kernel that wins by more than that spread can then be forced by name
(``sdpa(..., backend="cudnn")``).

    rows = lab.sdpa_backends(q, k, v, causal=True)            # forward
    rows = lab.sdpa_backends(q, k, v, causal=True, backward=True)
"""

from __future__ import annotations

import pandas as pd
import torch

from accel.attention import (
    FORCED,
    TOLERANCES,
    check_inputs,
    picked_kernel,
    sdpa,
    unavailable_reason,
)
from accel.measure.timer import compare

__all__ = ["AGAIN", "COLUMNS", "MATH_BYTES", "sdpa_backends"]

AGAIN = "default again"  # the default timed twice: its ratio to itself is the spread
MATH_BYTES = 2 << 30  # math materializes float32 scores (and their gradient): left out above this
COLUMNS = ["backend", "kernel", "ms", "speedup", "spread", "reason"]


def sdpa_backends(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    backward: bool = False,
    repeats: int = 10,
    warmup: int = 2,
) -> pd.DataFrame:
    """One row per SDPA kernel on these inputs: ``default`` (PyTorch's pick, which runs
    ``kernel``), its second copy ``default again``, and each kernel forced.

    ``ms``: the median time per call (forward, or forward and backward with ``backward``) on the
    inputs' device; ``speedup``: the default's time over this kernel's, taken round by round;
    ``spread``: how far ``default again`` sits from 1, the same kernel timed twice, so a speedup
    within ``1 ± spread`` is no gain; ``reason``: why a kernel was not timed (PyTorch's reason
    it cannot run, math's scores too large, or an output that differs from the default's beyond
    the dtype's tolerance). The inputs are not changed (a backward runs on detached copies) and
    no random generator is drawn from.
    """
    check_inputs(q, k, v, mask, causal)
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    with torch.no_grad():
        expected = sdpa(q, k, v, mask=mask, causal=causal)
    calls = {"default": _timed("default", q, k, v, mask, causal, backward)}
    calls[AGAIN] = calls["default"]
    reasons = {}
    for backend in FORCED:
        reasons[backend] = _reason_not_timed(backend, q, k, v, mask, causal, backward, expected)
        if not reasons[backend]:
            calls[backend] = _timed(backend, q, k, v, mask, causal, backward)
    timing = compare(calls, warmup=warmup, repeats=repeats, device=q.device)
    spread = abs(timing.paired_ratio("default", AGAIN) - 1)
    picked = picked_kernel(q, k, v, mask, causal)
    rows = []
    for backend in ("default", AGAIN, *FORCED):
        timed = backend in timing.timings
        rows.append({
            "backend": backend, "kernel": picked if backend in ("default", AGAIN) else backend,
            "ms": timing.timings[backend].median_ms if timed else float("nan"),
            "speedup": timing.paired_ratio("default", backend) if timed else float("nan"),
            "spread": spread, "reason": reasons.get(backend, ""),
        })  # fmt: skip
    return pd.DataFrame(rows, columns=COLUMNS)


def _timed(backend: str, q, k, v, mask, causal: bool, backward: bool):
    """One call of ``backend``: a forward without autograd, or forward and backward, the output
    itself as the incoming gradient (no random numbers drawn)."""

    def forward():
        return sdpa(q, k, v, mask=mask, causal=causal, backend=backend)

    if backward:
        return lambda: torch.autograd.grad((out := forward()), (q, k, v), out.detach())

    def no_grad_forward():
        with torch.no_grad():
            return forward()

    return no_grad_forward


def _reason_not_timed(backend: str, q, k, v, mask, causal, backward, expected) -> str:
    """Why forced ``backend`` is not timed on these inputs, or ""."""
    if backend == "math":
        scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * 4 * (3 if backward else 2)
        if scores > MATH_BYTES:
            return f"would materialize {scores / 2**30:.1f} GiB of float32 scores"
    reason = unavailable_reason(backend, q, k, v, mask=mask, causal=causal)
    if reason:
        return reason
    with torch.no_grad():
        out = sdpa(q, k, v, mask=mask, causal=causal, backend=backend)
    if not torch.allclose(out, expected, **TOLERANCES.get(out.dtype, {})):
        worst = (out.float() - expected.float()).abs().max().item()  # sync: once per kernel
        return f"output differs from the default's by up to {worst:.3g}"
    if backward:
        try:
            _timed(backend, q, k, v, mask, causal, backward)()
        except RuntimeError as error:
            return f"its backward cannot run: {str(error).strip().splitlines()[0][:200]}"
    return ""
