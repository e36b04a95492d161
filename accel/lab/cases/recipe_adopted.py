"""Bench phase ``recipe``, part ``adopted``: each workbook workload with every flag its phases
adopted against none, timed in one run (paired rounds). The phases' own rows each judge one lever
against the flags before it; this is the gain a user takes home, the number the guides' totals
can be checked against. The neural operator's is the ``cumulative`` part."""

from __future__ import annotations

import dataclasses
import importlib

from accel.lab.bench import BenchContext, Row
from accel.measure.timer import compare
from accel.phases import WORKBOOK
from accel.workloads.flags import label, through_phase, unavailable

PHASE = "recipe"
WORKLOADS = ("tiny_mlp", "field_trainer", "nested_optimizer", "polychromic", "vit")
REPEATS = 20


def rows(ctx: BenchContext, *, repeats: int = REPEATS) -> list[Row]:
    return [_row(name, ctx, repeats) for name in WORKLOADS]


def _row(name: str, ctx: BenchContext, repeats: int) -> Row:
    workload = importlib.import_module(f"accel.workloads.{name}")
    adopted = through_phase(workload.Flags, WORKBOOK[-1])
    left_out = {k: why for k, why in unavailable(workload.Flags, ctx.device).items()
                if getattr(adopted, k) is True}  # fmt: skip
    adopted = dataclasses.replace(adopted, **dict.fromkeys(left_out, False))
    sizes = workload.Sizes.preset(ctx.preset)
    steps = {
        "none": workload.build(workload.Flags(), sizes, device=ctx.device, seed=0),
        "adopted": workload.build(adopted, sizes, device=ctx.device, seed=0),
    }
    timing = compare(steps, warmup=3, repeats=repeats, device=ctx.device)  # compiles in warm-up
    low, high = timing.median_ratio_interval("none", "adopted")
    note = (f"{label(adopted)}; paired ratio {timing.paired_ratio('none', 'adopted'):.2f}x "
            f"(95% interval {low:.2f}-{high:.2f})")  # fmt: skip
    if left_out:
        note += "; left out here: " + "; ".join(f"{k} ({why})" for k, why in left_out.items())
    return Row(PHASE, f"adopted {name}: every adopted flag against none",
               "time per training step, every flag the workbook adopted vs none", "ms",
               timing.timings["adopted"].median_ms, baseline=timing.timings["none"].median_ms,
               note=note)  # fmt: skip
