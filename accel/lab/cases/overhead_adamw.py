"""The AdamW sweep of the ``overhead`` phase: ``MultiTensorAdamW`` beside
``torch.optim.AdamW(fused=True)`` from a few hundred small tensors to over a billion parameters
in tensors of odd sizes, back to back and one call alone, and against the step's bytes over the
copy bandwidth."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from accel.lab.bench import BenchContext, Row
from accel.lab.cases.overhead import SMALL_TENSORS
from accel.lab.cases.overhead_timing import PHASE, latencies
from accel.lab.cases.sdpa_measure import release_memory
from accel.measure.timer import compare
from accel.optim import MultiTensorAdamW

BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v (float32)
TARGET_LARGE = 1.1
TARGET_FLOOR = 0.9
LARGE_PARAMS = 10**9


@dataclass(frozen=True)
class Point:
    name: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


POINTS = (
    Point("a few hundred small tensors", tuple(SMALL_TENSORS)),
    Point("50 mid-size tensors", ((1021, 997), (997,)) * 25),
    Point("a GPT-like mix", ((4099, 1027), (1027, 4099), (1027, 3081), (1027,), (1027,)) * 12),
    Point("over 1B parameters", ((3301, 3307), (3307,)) * 92),
)


def _copies(point: Point, device: torch.device):
    """Two identical sets of parameters with gradients (random, never zeros)."""
    gen = torch.Generator(device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen) for s in point.shapes]
    grads = [torch.randn(s, device=device, generator=gen) for s in point.shapes]
    sets = []
    for _ in range(2):
        ps = [p.clone().requires_grad_() for p in params]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        sets.append(ps)
    return sets


def measure(point: Point, device: torch.device):
    """(back to back, alone) comparisons of fused AdamW and MultiTensorAdamW, after one step
    each from the same values has given the same parameters."""
    theirs, ours = _copies(point, device)
    fused = torch.optim.AdamW(theirs, lr=1e-3, fused=True)
    mine = MultiTensorAdamW(ours, lr=1e-3)
    fused.step()
    mine.step()
    for a, b in zip(theirs, ours, strict=True):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=2e-5)
    fns = {"AdamW(fused=True)": fused.step, "MultiTensorAdamW": mine.step}
    queued = compare(fns, repeats=10, warmup=2, device=device)
    alone = latencies(fns, device, repeats=10)
    return queued, alone


def rows(ctx: BenchContext) -> list[Row]:
    if ctx.device.type != "cuda":
        return [Row(PHASE, "adamw sweep", "step", "ms", math.nan,
                    note=f"{ctx.where}; fused AdamW and the one-launch kernel need CUDA")]  # fmt: skip
    out = []
    for point in POINTS:
        queued, alone = measure(point, ctx.device)
        release_memory(ctx.device)
        large = point.params >= LARGE_PARAMS
        floor_ms = ctx.ceilings.floor_ms(bytes_moved=BYTES_PER_PARAM * point.params)
        case = f"adamw {point.name} ({len(point.shapes)} tensors, {point.params / 1e6:.0f}M)"
        for metric, timing in (("step back to back", queued), ("single-call latency", alone)):
            ratio = timing.paired_ratio("AdamW(fused=True)", "MultiTensorAdamW")
            target = TARGET_LARGE if large and metric == "step back to back" else 1.0
            out.append(Row(
                PHASE, case, metric, "ms", timing.timings["MultiTensorAdamW"].median_ms,
                baseline=timing.timings["AdamW(fused=True)"].median_ms, target=f">= {target}x",
                met=ratio >= target if ctx.judged else None,
                note=f"{ctx.where}; fused / ours round by round {ratio:.3f}x; the bytes floor "
                f"{floor_ms:.3f} ms",
            ))  # fmt: skip
        if large:
            fraction = floor_ms / queued.timings["MultiTensorAdamW"].median_ms
            out.append(Row(
                PHASE, case, "bandwidth", "fraction of the floor", fraction,
                target=f">= {TARGET_FLOOR}", higher_is_better=True,
                met=fraction >= TARGET_FLOOR if ctx.judged else None,
                note=f"{ctx.where}; {BYTES_PER_PARAM} bytes a parameter over "
                f"{ctx.ceilings.copy_gb_s:.0f} GB/s; fused AdamW at "
                f"{floor_ms / queued.timings['AdamW(fused=True)'].median_ms:.2f}",
            ))  # fmt: skip
    return out
