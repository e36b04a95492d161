"""Bench phase ``memory``: steady-state allocations, cache cleanup, activation checkpointing.
Shared with ``notebooks/03_memory.ipynb``.

Rows (targets for an H100/H200 at the gpu preset): ``cudaMalloc`` calls and allocator retries per
steady-state step = 0 with the memory flags on; activation checkpointing of every block: peak
activation memory <= 0.5x, step time <= 1.35x, and the largest batch within a memory budget
>= 2x. Also, without a target: allocator requests per step, and the field trainer's window with
``empty_cache()`` every 10 windows against the adaptive cleaner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from accel import memory
from accel.lab.bench import BenchContext, Row
from accel.lab.cases.fusion import FUSION_FLAGS
from accel.lab.cases.sync import PHASE1
from accel.lab.timing import Comparison, compare
from accel.workloads import field_trainer as ft
from accel.workloads import nested_optimizer as no

MEMORY_FLAGS = dataclasses.replace(FUSION_FLAGS, preallocated_buffers=True, set_to_none_grads=True)
CHECKPOINT_ALL = dataclasses.replace(FUSION_FLAGS, activation_checkpointing="all")
# no compiled_retrieval: the cleanup comparison should not wait for (or depend on) inductor
CLEANUP_BASE = dataclasses.replace(PHASE1, fused_lior=True, inplace_accumulate=True)
CLEANUP_FAST = dataclasses.replace(CLEANUP_BASE, adaptive_cleanup=True)
# The budget the largest-batch search works against: far below the device's memory, so the
# search is quick and its answer does not depend on which GPU ran it.
BUDGET_BYTES = {"gpu": 4 * memory.GiB, "cpu": 12 * memory.MiB}
TARGETS = {"peak": 0.5, "time": 1.35, "batch": 2.0}


def allocations(flags: no.Flags, sizes: no.Sizes, device, *, steps: int = 10):
    """Allocator activity per steady-state training step (after 3 warm-up steps)."""
    step = no.build(flags, sizes, device=device)
    return memory.count_allocations(step, steps=steps, warmup=3, device=device)


def cleanup_timing(
    sizes: ft.Sizes, device, *, repeats: int = 8, expandable_segments: bool = False
) -> tuple[Comparison, dict]:
    """Field-trainer windows with ``empty_cache()`` every 10 windows against the adaptive
    cleaner; each sample is 10 windows, so each baseline sample holds one ``empty_cache``.

    ``expandable_segments=True`` runs both with the allocator's expandable segments (set at
    runtime with ``torch.cuda.memory._set_allocator_settings`` and switched off after): segments
    grow by mapping pages instead of new ``cudaMalloc`` calls. CUDA only.
    """
    if expandable_segments:
        torch.cuda.empty_cache()  # so that the steps below get new, expandable segments
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")  # private API
    try:
        base = ft.build(CLEANUP_BASE, sizes, device=device)
        fast = ft.build(CLEANUP_FAST, sizes, device=device)
        every = ft.CLEANUP_EVERY

        def windows(step):
            return lambda: [step() for _ in range(every)]

        timing = compare(
            {"every 10 windows": windows(base), "adaptive": windows(fast)},
            warmup=1,
            repeats=repeats,
            device=device,
        )
        counts = {
            label: memory.count_allocations(windows(s), steps=2, warmup=0, device=device)
            for label, s in (("every 10 windows", base), ("adaptive", fast))
        }
    finally:
        if expandable_segments:
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    return timing, {"counts": counts, "cleaner": fast.cleaner}


@dataclass
class CheckpointCosts:
    """What checkpointing every block costs and buys, at one batch size and within a budget."""

    peak_bytes: dict[str, int]  # activation peak of forward + backward, above the resident bytes
    timing: Comparison  # whole training steps
    searches: dict[str, memory.BatchSearch]
    budget_bytes: int

    def ratios(self) -> dict[str, float]:
        return {
            "peak": self.peak_bytes["all"] / self.peak_bytes["none"],
            "time": 1 / self.timing.speedup("all"),
            "batch": self.searches["all"].batch / max(self.searches["none"].batch, 1),
        }


def checkpoint_costs(
    sizes: no.Sizes,
    device,
    *,
    budget_bytes: int,
    repeats: int = 20,
    limit: int = 4096,
) -> CheckpointCosts:
    """Peak activation memory, step time and the largest batch within ``budget_bytes``, with
    no block and with every block checkpointed (the fusion flags on in both, so the optimizer
    does not hide the recompute)."""
    steps = {"none": FUSION_FLAGS, "all": CHECKPOINT_ALL}
    built = {k: no.build(f, sizes, device=device) for k, f in steps.items()}
    for step in built.values():
        step(), step()  # gradients and AdamW state exist: the peak below is activations
    peaks = {k: memory.peak_memory(s.forward_backward, device=device) for k, s in built.items()}
    timing = compare(built, baseline="none", repeats=repeats, device=device)

    def probe(step: no.Step):
        def run(batch: int) -> None:
            step.optimizer_step(step.forward_backward(step.random_batch(batch)))

        return run

    searches = {
        k: memory.largest_batch(
            probe(s), budget_bytes, resident_bytes=s.resident_bytes(), limit=limit, device=device
        )
        for k, s in built.items()
    }
    return CheckpointCosts(peaks, timing, searches, budget_bytes)


def run(ctx: BenchContext) -> list[Row]:
    sizes = no.Sizes.preset(ctx.preset)
    dev = ctx.device
    judged = dev.type == "cuda" and ctx.preset == "gpu"
    where = (
        f"{dev.type}, preset {ctx.preset}"
        if judged
        else f"not judged: the targets are for a CUDA GPU with the gpu preset, this is "
        f"{dev.type} with preset {ctx.preset} (tiny sizes)"
    )
    rows = []
    before, after = allocations(no.Flags(), sizes, dev), allocations(MEMORY_FLAGS, sizes, dev)
    if after.device_allocs is not None:
        base_allocs = before.device_allocs + before.retries
        fast_allocs = after.device_allocs + after.retries
        rows.append(
            Row(
                "memory",
                "device_allocs_per_step",
                "cudaMalloc calls + allocator retries per steady-state training step",
                "count",
                fast_allocs,
                baseline=base_allocs,
                target="0",
                met=(fast_allocs == 0) if judged else None,
                note=f"{where}; flags {', '.join(_on(MEMORY_FLAGS))}; from "
                "torch.cuda.memory_stats deltas over 10 steps after 3 warm-up steps",
            )
        )
    rows.append(
        Row(
            "memory",
            "allocator_requests_per_step",
            "tensors allocated per training step (from the cache or not)",
            "count",
            after.requests,
            baseline=before.requests,
            note=f"{where}; no target: the caching allocator serves these without cudaMalloc"
            + ("" if after.device_allocs is not None else "; CPU: profiler memory events"),
        )
    )

    if dev.type == "cuda":  # a CPU has no cache to empty: the two would run the same code
        rows.append(cleanup_row(ctx, where))
    costs = checkpoint_costs(sizes, dev, budget_bytes=BUDGET_BYTES[ctx.preset])
    r = costs.ratios()
    ckpt_note = f"{where}; every block checkpointed (use_reentrant=False), fusion flags on"
    rows += [
        Row(
            "memory",
            "checkpoint_peak",
            f"peak activation memory of forward + backward, batch {sizes.batch} x {sizes.context}",
            "MiB",
            costs.peak_bytes["all"] / memory.MiB,
            baseline=costs.peak_bytes["none"] / memory.MiB,
            target=f"<= {TARGETS['peak']}x (speedup >= {1 / TARGETS['peak']:.0f})",
            met=(r["peak"] <= TARGETS["peak"]) if judged else None,
            note=ckpt_note,
        ),
        Row(
            "memory",
            "checkpoint_step_time",
            "time per training step with every block checkpointed (the price)",
            "ms",
            costs.timing.timings["all"].median_ms,
            baseline=costs.timing.timings["none"].median_ms,
            target=f"<= {TARGETS['time']}x time (speedup >= {1 / TARGETS['time']:.2f})",
            met=(r["time"] <= TARGETS["time"]) if judged else None,
            note=ckpt_note,
        ),
        Row(
            "memory",
            "checkpoint_largest_batch",
            f"largest batch within {costs.budget_bytes / memory.GiB:.3g} GiB "
            "(resident weights, gradients and AdamW state included)",
            "sequences",
            costs.searches["all"].batch,
            baseline=costs.searches["none"].batch,
            higher_is_better=True,
            target=f">= {TARGETS['batch']}x",
            met=(r["batch"] >= TARGETS["batch"]) if judged else None,
            note=f"{ckpt_note}; probes: none {len(costs.searches['none'].probes)}, "
            f"all {len(costs.searches['all'].probes)}",
        ),
    ]
    return rows


def cleanup_row(ctx: BenchContext, where: str) -> Row:
    timing, info = cleanup_timing(ft.Sizes.preset(ctx.preset), ctx.device)
    mallocs = {k: c.device_allocs for k, c in info["counts"].items()}
    return Row(
        "memory",
        "field_trainer_cleanup",
        "time per window: empty_cache every 10 windows vs the adaptive cleaner",
        "ms",
        timing.timings["adaptive"].median_ms / ft.CLEANUP_EVERY,
        baseline=timing.timings["every 10 windows"].median_ms / ft.CLEANUP_EVERY,
        note=f"{where}; no target; cudaMalloc per 10 windows {mallocs}; {info['cleaner']!r}",
    )


def _on(flags) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(flags)
        if getattr(flags, f.name) not in (False, f.default)
    ]
