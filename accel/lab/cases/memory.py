"""Bench phase ``memory``: steady-state allocations, cache cleanup, activation checkpointing.
Shared with ``notebooks/03_memory.ipynb``.

Rows (targets for an H100/H200 at the gpu preset): ``cudaMalloc`` calls and allocator retries per
steady-state step = 0 with the memory flags on; every block checkpointed: peak activation memory
<= 0.5x, step time <= 1.35x, and the largest batch within a memory budget >= 2x, at
``JUDGED_BATCH`` (32 sequences on a GPU, where the GPU bounds the step; the preset's own batch
gets a row without a target). Also, without a target: allocator requests per step, and the field
trainer's window with ``empty_cache()`` every 10 windows against the adaptive cleaner.
Gradient accumulation's rows (``accumulate_*``) are ``memory_accumulate``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from accel import memory
from accel.lab.bench import BenchContext, Row
from accel.lab.cases import memory_accumulate
from accel.measure.profile import profile_step
from accel.measure.timer import Comparison, compare
from accel.workloads import field_trainer as ft
from accel.workloads import nested_optimizer as no
from accel.workloads.flags import through_phase

FUSION_FLAGS = through_phase(no.Flags, "fusion")  # the nested optimizer as 02_fusion leaves it
MEMORY_FLAGS = through_phase(no.Flags, "memory")
CHECKPOINT_ALL = dataclasses.replace(FUSION_FLAGS, activation_checkpointing="all")
# no compiled_retrieval: the cleanup comparison should not wait for (or depend on) inductor
CLEANUP_BASE = dataclasses.replace(
    through_phase(ft.Flags, "sync"), fused_lior=True, inplace_accumulate=True
)
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


# The activation_checkpointing choices the bench measures: none (the baseline) and every block.
CHECKPOINT_CHOICES = ("none", "all")
# Sequences per batch at which checkpointing's price is judged: where the step is bound by the
# GPU, the regime checkpointing is for. None: the preset's batch.
JUDGED_BATCH: dict[str, int | None] = {"gpu": 32, "cpu": None}


@dataclass
class CheckpointCosts:
    """What checkpointing costs and buys per choice of blocks, at one batch size and within a
    budget; ``"none"`` is the baseline."""

    peak_bytes: dict[str, int]  # activation peak of forward + backward, above the resident bytes
    timing: Comparison  # whole training steps
    searches: dict[str, memory.BatchSearch]
    budget_bytes: int

    def ratios(self, choice: str = "all") -> dict[str, float]:
        return {
            "peak": self.peak_bytes[choice] / self.peak_bytes["none"],
            "time": 1 / self.timing.speedup(choice),
            "batch": self.searches[choice].batch / max(self.searches["none"].batch, 1),
        }

    def meets(self, choice: str) -> dict[str, bool]:
        r = self.ratios(choice)
        return {
            "peak": r["peak"] <= TARGETS["peak"],
            "time": r["time"] <= TARGETS["time"],
            "batch": r["batch"] >= TARGETS["batch"],
        }


def checkpoint_costs(
    sizes: no.Sizes,
    device,
    *,
    budget_bytes: int,
    repeats: int = 20,
    limit: int = 4096,
    choices: tuple[str, ...] = CHECKPOINT_CHOICES,
) -> CheckpointCosts:
    """Peak activation memory, step time (all choices interleaved) and the largest batch within
    ``budget_bytes``, per ``activation_checkpointing`` choice, "none" first (the fusion flags on
    in all, so the optimizer does not hide the recompute)."""
    steps = {c: dataclasses.replace(FUSION_FLAGS, activation_checkpointing=c) for c in choices}
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


def parts() -> list[str]:
    """The parts ``bench --phase memory --only`` can pick."""
    return ["allocations", "checkpointing", "accumulate"]


def run(ctx: BenchContext) -> list[Row]:
    sizes = no.Sizes.preset(ctx.preset)
    rows = allocation_rows(ctx, sizes) if ctx.selected("allocations") else []
    if ctx.selected("checkpointing"):
        rows += checkpointing_rows(ctx, sizes)
    if ctx.selected("accumulate"):
        rows += memory_accumulate.rows(ctx, sizes)
    return rows


def allocation_rows(ctx: BenchContext, sizes: no.Sizes) -> list[Row]:
    """cudaMalloc and allocator requests per step; on a GPU the cache cleanup's timing."""
    dev = ctx.device
    judged, where = ctx.judged, ctx.where
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
    return rows


def checkpointing_rows(ctx: BenchContext, sizes: no.Sizes) -> list[Row]:
    """Activation checkpointing's peak, price and largest batch, per choice of blocks."""
    dev, where = ctx.device, ctx.where
    judged_sizes = dataclasses.replace(sizes, batch=JUDGED_BATCH[ctx.preset] or sizes.batch)
    idle = {
        b: idle_fraction(b, sizes, dev) for b in dict.fromkeys((judged_sizes.batch, sizes.batch))
    }
    costs = checkpoint_costs(
        judged_sizes, dev, budget_bytes=BUDGET_BYTES[ctx.preset], choices=CHECKPOINT_CHOICES
    )
    at = f"{where}; batch {judged_sizes.batch}: GPU idle {idle[judged_sizes.batch]:.0%} of a step"
    rows = checkpoint_rows(costs, judged_sizes, at, ctx.judged)
    if judged_sizes.batch != sizes.batch:
        rows.append(preset_batch_row(sizes, dev, f"{where}; GPU idle {idle[sizes.batch]:.0%}"))
    return rows


def idle_fraction(batch: int, sizes: no.Sizes, device) -> float:
    """Share of a training step (fusion flags, no checkpointing) in which the GPU ran nothing:
    near 0 when the step is bound by the device, large when Python's launches bound it."""
    step = no.build(FUSION_FLAGS, dataclasses.replace(sizes, batch=batch), device=device)
    return profile_step(step, steps=3, warmup=2, device=device).idle_fraction


def preset_batch_row(sizes: no.Sizes, device, where: str, *, repeats: int = 20) -> Row:
    """Step time with every block checkpointed at the preset's own batch, against none."""
    built = {
        c: no.build(
            dataclasses.replace(FUSION_FLAGS, activation_checkpointing=c), sizes, device=device
        )
        for c in ("none", "all")
    }
    timing = compare(built, baseline="none", repeats=repeats, device=device)
    return Row(
        "memory",
        f"checkpoint_step_time all, batch {sizes.batch}",
        f"time per training step at the preset's batch {sizes.batch} x {sizes.context}, "
        "every block checkpointed (the price where the host bounds the step)",
        "ms",
        timing.timings["all"].median_ms,
        baseline=timing.timings["none"].median_ms,
        note=f"{where} without checkpointing; no target: the price is judged at batch "
        f"{JUDGED_BATCH['gpu']}, where the GPU bounds the step",
    )


def checkpoint_rows(costs: CheckpointCosts, sizes: no.Sizes, where: str, judged: bool) -> list[Row]:
    """Peak, step time and largest batch with every block checkpointed against none: the rows
    named ``... all`` (what notebook 03 reads back), then the same judged, without a suffix."""
    note = f"{where}; every block checkpointed, use_reentrant=False, fusion flags on"
    rows = _checkpoint_triple(
        costs, "all", sizes, f"{note}; no target (judged in the rows without a suffix)"
    )
    return rows + _checkpoint_triple(
        costs, "all", sizes, note, met=costs.meets("all") if judged else {}
    )


def _checkpoint_triple(
    costs: CheckpointCosts, choice: str, sizes: no.Sizes, note: str, met: dict | None = None
) -> list[Row]:
    """Peak, step time and largest batch of one choice against no checkpointing; with ``met``
    (judged or not: an empty dict), the target rows, which carry no suffix."""
    targeted = met is not None
    setting = f", activation_checkpointing={choice}" if targeted else ""
    budget = f"largest batch within {costs.budget_bytes / memory.GiB:.3g} GiB"
    probes = f"; probes: none {len(costs.searches['none'].probes)}, "
    probes += f"{choice} {len(costs.searches[choice].probes)}"
    mib = {c: b / memory.MiB for c, b in costs.peak_bytes.items()}
    ms = {c: t.median_ms for c, t in costs.timing.timings.items()}
    batch = {c: search.batch for c, search in costs.searches.items()}
    # (case, key of targets and met, description, unit, values by choice, target text)
    specs = [
        (
            "checkpoint_peak",
            "peak",
            f"peak activation memory of forward + backward, batch {sizes.batch} x "
            f"{sizes.context}{setting}",
            "MiB",
            mib,
            f"<= {TARGETS['peak']}x (speedup >= {1 / TARGETS['peak']:.0f})",
        ),
        (
            "checkpoint_step_time",
            "time",
            f"time per training step{setting} (the price)",
            "ms",
            ms,
            f"<= {TARGETS['time']}x time (speedup >= {1 / TARGETS['time']:.2f})",
        ),
        (
            "checkpoint_largest_batch",
            "batch",
            f"{budget} (resident weights, gradients and AdamW state included){setting}"
            if targeted
            else budget,
            "sequences",
            batch,
            f">= {TARGETS['batch']}x",
        ),
    ]
    return [
        Row(
            "memory",
            case if targeted else f"{case} {choice}",
            what,
            unit,
            values[choice],
            baseline=values["none"],
            higher_is_better=key == "batch",
            target=target if targeted else "",
            met=(met or {}).get(key),
            note=note + probes if targeted and key == "batch" else note,
        )
        for case, key, what, unit, values, target in specs
    ]


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
