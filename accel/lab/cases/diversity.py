"""Bench phase ``diversity``: the Triton diversity kernels against PyTorch, and the polychromic step.

Cases (targets for an H100 or H200):

- groups B=8192, N=4, D=384, float32, ``mean`` and ``nearest``: bytes read over time at
  >= 80% of the measured copy bandwidth, >= 5x the naive PyTorch reference, >= 3x
  ``torch.compile`` of the best PyTorch formulation (the closed form for ``mean``);
- one large set N=32768, D=384, bfloat16, ``nearest``: within 1.5x of the cuBLAS product
  ``X @ X.T`` alone, with <= 64 MB of extra device memory (no N x N buffer);
- the polychromic step with every flag on: >= 3x its baseline.

Every candidate is timed over several input buffers that together exceed the L2 cache, taken in
turn, so each call reads from device memory. On CUDA the kernels' times are CUDA-graph replays
of each candidate over those buffers: device time without Python's launch overhead, the same
for every candidate; one row per grouped case gives the host-launched call beside it. On a CPU
the sizes are tiny, the kernels run in Triton's interpreter or fall back to the reference, and
nothing is compiled: the rows only show that the bench runs (``met`` is None).

Shapes the kernels were not tuned on, and host time per call, are the ``overhead`` phase's
(``overhead_diversity``).
"""

from __future__ import annotations

import math

from accel import diversity as dv
from accel.lab.bench import BenchContext, Row, speedup_row
from accel.lab.cases.diversity_measure import (
    BANDWIDTH_TARGET,
    CASES,
    COMPILED_TARGET,
    MATMUL_SLOWDOWN_LIMIT,
    MEMORY_LIMIT_MB,
    NAIVE_TARGET,
    PHASE,
    STEP_TARGET,
    GroupCase,
    LargeCase,
    extra_memory_mb,
    group_candidates,
    group_sweep,
    large_sweep,
    rotating_inputs,
    time_per_call,
)
from accel.measure.timer import compare
from accel.workloads import polychromic
from accel.workloads.flags import all_on, label

__all__ = [  # the phase as the notebook and the bench reach it
    "CASES",
    "MEMORY_LIMIT_MB",
    "PHASE",
    "GroupCase",
    "LargeCase",
    "extra_memory_mb",
    "group_rows",
    "group_sweep",
    "large_rows",
    "large_sweep",
    "polychromic",
    "run",
    "step_rows",
]


def group_rows(case: GroupCase, reduction: str, ctx: BenchContext) -> list[Row]:
    device, ceilings = ctx.device, ctx.ceilings
    buffers = rotating_inputs(case.shape, case.dtype, device)
    candidates = group_candidates(reduction, device)
    path, why = dv.backend(buffers[0])
    ms = time_per_call(candidates, buffers, device)
    host = time_per_call(
        {"triton": candidates["triton"], "naive eager": candidates["naive eager"]},
        buffers,
        device,
        graphs=False,
    )
    fraction = ceilings.bandwidth_fraction(case.bytes_read, ms["triton"])
    gb_s = case.bytes_read / (ms["triton"] * 1e-3) / 1e9
    note = f"{ctx.where}; {path}: {why}; {len(buffers)} rotating input buffers"
    if device.type == "cuda":
        note += "; times are CUDA-graph replays (device time)"
    label = case.label(reduction)
    compiled = "closed form compiled" if reduction == "mean" else "naive compiled"

    def met(ok: bool) -> bool | None:
        return ok if ctx.judged else None

    def timed(metric: str, base: str, target: str = "", goal: float = math.nan) -> Row:
        base_ms = ms.get(base, math.nan)
        return Row(
            PHASE, label, metric, "ms", ms["triton"], baseline=base_ms,
            fraction_of_ceiling=fraction, target=target,
            met=met(base_ms / ms["triton"] >= goal) if target and base in ms else None,
            note=note if base in ms else f"{note}; {base} skipped (compiled on CUDA only)",
        )  # fmt: skip

    rows = [
        Row(PHASE, label, "bandwidth (bytes read)", "GB/s", gb_s, higher_is_better=True,
            fraction_of_ceiling=fraction, target=f">= {BANDWIDTH_TARGET:.0%} of copy",
            met=met(fraction >= BANDWIDTH_TARGET), note=note),
        timed("time vs naive eager", "naive eager", f">= {NAIVE_TARGET:g}x", NAIVE_TARGET),
        timed(f"time vs {compiled}", compiled, f">= {COMPILED_TARGET:g}x", COMPILED_TARGET),
    ]  # fmt: skip
    if reduction == "mean":
        rows.append(timed("time vs closed form eager", "closed form eager"))
    rows.append(Row(
        PHASE, label, "host-launched call vs naive eager", "ms", host["triton"],
        baseline=host["naive eager"],
        fraction_of_ceiling=ceilings.bandwidth_fraction(case.bytes_read, host["triton"]),
        note=f"{note}; eager calls one after another, Python launch overhead included",
    ))  # fmt: skip
    return rows


def large_rows(case: LargeCase, ctx: BenchContext) -> list[Row]:
    device, judged = ctx.device, ctx.judged
    buffers = rotating_inputs((case.n, case.dim), case.dtype, device)
    path, why = dv.backend(buffers[0])
    candidates = {
        "triton": dv.nearest_diversity,
        "X @ X.T": lambda x: x @ x.T,
        "naive eager": dv.nearest_diversity_reference,
    }
    ms = time_per_call(candidates, buffers, device, repeats=10)
    fraction = ctx.ceilings.compute_fraction(case.flops, ms["triton"])
    x = buffers[0]
    fused_mb = extra_memory_mb(lambda: dv.nearest_diversity(x), device)
    naive_mb = extra_memory_mb(lambda: dv.nearest_diversity_reference(x), device)
    note = f"{ctx.where}; {path}: {why}; fraction_of_ceiling: 2 N^2 D FLOPs over the matmul rate"
    ratio, name = ms["X @ X.T"] / ms["triton"], case.label()
    return [
        Row(PHASE, name, "time vs X @ X.T (cuBLAS)", "ms", ms["triton"], baseline=ms["X @ X.T"],
            fraction_of_ceiling=fraction, note=note,
            target=f">= {1 / MATMUL_SLOWDOWN_LIMIT:.2f}x (within {MATMUL_SLOWDOWN_LIMIT:g}x)",
            met=ratio >= 1 / MATMUL_SLOWDOWN_LIMIT if judged else None),
        Row(PHASE, name, "time vs naive eager", "ms", ms["triton"], baseline=ms["naive eager"],
            fraction_of_ceiling=fraction, note=note),
        Row(PHASE, name, "extra device memory", "MB", fused_mb, baseline=naive_mb,
            target=f"<= {MEMORY_LIMIT_MB:g} MB", met=fused_mb <= MEMORY_LIMIT_MB if judged else None,
            note=note if device.type == "cuda" else f"{note}; memory measured on CUDA only"),
    ]  # fmt: skip


def step_rows(ctx: BenchContext) -> list[Row]:
    device = ctx.device
    sizes = polychromic.Sizes.preset(ctx.preset)
    flags = all_on(polychromic.Flags, device)
    steps = {
        "baseline": polychromic.build(polychromic.Flags(), sizes, device=device),
        "all flags": polychromic.build(flags, sizes, device=device),
    }
    timing = compare(steps, warmup=1, repeats=5, device=device)
    note = f"flags: {label(flags)}"
    return [
        speedup_row(
            ctx, PHASE, "polychromic step", "step time", timing, "all flags", STEP_TARGET, note
        )
    ]


def run(ctx: BenchContext) -> list[Row]:
    """Every case of the phase at the context's preset (tiny on a CPU)."""
    group, large = CASES[ctx.preset]
    rows: list[Row] = []
    for reduction in ("mean", "nearest"):
        rows += group_rows(group, reduction, ctx)
    rows += large_rows(large, ctx)
    return rows + step_rows(ctx)
