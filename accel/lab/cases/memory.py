"""Bench phase ``memory`` (notebook 03): steady-state allocations, activation checkpointing
(judged at ``JUDGED_BATCH``, where the GPU bounds the step; the preset's own batch gets a row
without a target); gradient accumulation's rows are ``memory_accumulate``'s, the CPU-offload
optimizer's ``memory_offload``'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from accel import memory
from accel.lab.bench import BenchContext, Row
from accel.lab.cases import memory_accumulate, memory_offload
from accel.measure.timer import Comparison, compare
from accel.workloads import nested_optimizer as no
from accel.workloads.flags import through_phase

FUSION_FLAGS = through_phase(no.Flags, "fusion")  # the nested optimizer as 02_fusion leaves it
MEMORY_FLAGS = through_phase(no.Flags, "memory")
CHECKPOINT_ALL = dataclasses.replace(FUSION_FLAGS, activation_checkpointing="all")
# The budget the largest-batch search works against: far below the device's memory, so the
# search is quick and its answer does not depend on which GPU ran it.
BUDGET_BYTES = {"gpu": 4 * memory.GiB, "cpu": 12 * memory.MiB}
TARGETS = {"peak": 0.5, "time": 1.35, "batch": 2.0}


def allocations(flags: no.Flags, sizes: no.Sizes, device, *, steps: int = 10):
    """Allocator activity per steady-state training step (after 3 warm-up steps)."""
    step = no.build(flags, sizes, device=device)
    return memory.count_allocations(step, steps=steps, warmup=3, device=device)


# Sequences per batch at which checkpointing's price is judged: where the step is bound by the
# GPU, the regime checkpointing is for. None: the preset's batch.
JUDGED_BATCH: dict[str, int | None] = {"gpu": 32, "cpu": None}


@dataclass
class CheckpointCosts:
    """What checkpointing every block (``"all"``) costs and buys against ``"none"``, at one batch
    size and within a budget."""

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

    def meets(self) -> dict[str, bool]:
        r = self.ratios()
        return {key: r[key] >= goal if key == "batch" else r[key] <= goal
                for key, goal in TARGETS.items()}  # fmt: skip


def checkpoint_costs(
    sizes: no.Sizes, device, *, budget_bytes: int, repeats: int = 20, limit: int = 4096
) -> CheckpointCosts:
    """Peak activation memory, step time (interleaved) and the largest batch within
    ``budget_bytes``, without and with every block checkpointed (the fusion flags on in both,
    so the optimizer does not hide the recompute)."""
    built = _checkpointed(sizes, device)
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
    return ["allocations", "checkpointing", "accumulate", "offload"]


def _checkpointed(sizes: no.Sizes, device) -> dict[str, no.Step]:
    """The nested optimizer with the fusion flags, without and with every block checkpointed."""
    return {
        choice: no.build(dataclasses.replace(FUSION_FLAGS, activation_checkpointing=choice),
                         sizes, device=device)
        for choice in ("none", "all")
    }  # fmt: skip


def run(ctx: BenchContext) -> list[Row]:
    sizes = no.Sizes.preset(ctx.preset)
    rows = allocation_rows(ctx, sizes) if ctx.selected("allocations") else []
    if ctx.selected("checkpointing"):
        rows += checkpointing_rows(ctx, sizes)
    if ctx.selected("accumulate"):
        rows += memory_accumulate.rows(ctx, sizes)
    if ctx.selected("offload"):
        rows += memory_offload.rows(ctx)
    return rows


def allocation_rows(ctx: BenchContext, sizes: no.Sizes) -> list[Row]:
    """cudaMalloc and allocator requests per step."""
    dev, where, rows = ctx.device, ctx.where, []
    before, after = allocations(no.Flags(), sizes, dev), allocations(MEMORY_FLAGS, sizes, dev)
    if after.device_allocs is not None:
        fast_allocs = after.device_allocs + after.retries
        rows.append(Row(
            "memory", "device_allocs_per_step",
            "cudaMalloc calls + allocator retries per steady-state training step", "count",
            fast_allocs, baseline=before.device_allocs + before.retries, target="0",
            met=(fast_allocs == 0) if ctx.judged else None,
            note=f"{where}; flags {', '.join(_on(MEMORY_FLAGS))}; from "
            "torch.cuda.memory_stats deltas over 10 steps after 3 warm-up steps",
        ))  # fmt: skip
    rows.append(Row(
        "memory", "allocator_requests_per_step",
        "tensors allocated per training step (from the cache or not)", "count", after.requests,
        baseline=before.requests,
        note=f"{where}; no target: the caching allocator serves these without cudaMalloc"
        + ("" if after.device_allocs is not None else "; CPU: profiler memory events"),
    ))  # fmt: skip
    return rows


def checkpointing_rows(ctx: BenchContext, sizes: no.Sizes) -> list[Row]:
    """Activation checkpointing's peak, price and largest batch with every block checkpointed
    against none, at the batch where the GPU bounds the step; the price at the preset's batch
    too, where the host bounds it."""
    judged_sizes = dataclasses.replace(sizes, batch=JUDGED_BATCH[ctx.preset] or sizes.batch)
    costs = checkpoint_costs(judged_sizes, ctx.device, budget_bytes=BUDGET_BYTES[ctx.preset])
    extra = [] if judged_sizes.batch == sizes.batch else [preset_batch_row(sizes, ctx)]
    met = costs.meets() if ctx.judged else {}
    note = f"{ctx.where}; every block checkpointed, use_reentrant=False, fusion flags on"
    setting = ", activation_checkpointing=all"
    budget = f"largest batch within {costs.budget_bytes / memory.GiB:.3g} GiB"
    probes = f"; probes: none {len(costs.searches['none'].probes)}, "
    probes += f"all {len(costs.searches['all'].probes)}"
    mib = {c: b / memory.MiB for c, b in costs.peak_bytes.items()}
    ms = {c: t.median_ms for c, t in costs.timing.timings.items()}
    batch = {c: search.batch for c, search in costs.searches.items()}
    specs = [  # (case, key of targets and met, description, unit, values by choice, target text)
        ("checkpoint_peak", "peak", f"peak activation memory of forward + backward, batch "
         f"{judged_sizes.batch} x {judged_sizes.context}{setting}", "MiB", mib,
         f"<= {TARGETS['peak']}x (speedup >= {1 / TARGETS['peak']:.0f})"),
        ("checkpoint_step_time", "time", f"time per training step{setting} (the price)", "ms", ms,
         f"<= {TARGETS['time']}x time (speedup >= {1 / TARGETS['time']:.2f})"),
        ("checkpoint_largest_batch", "batch", f"{budget} (resident weights, gradients and AdamW "
         f"state included){setting}", "sequences", batch, f">= {TARGETS['batch']}x"),
    ]  # fmt: skip
    return [
        Row("memory", case, what, unit, values["all"], baseline=values["none"],
            higher_is_better=key == "batch", target=target, met=met.get(key),
            note=note + probes if key == "batch" else note)
        for case, key, what, unit, values, target in specs
    ] + extra  # fmt: skip


def preset_batch_row(sizes: no.Sizes, ctx: BenchContext, *, repeats: int = 20) -> Row:
    """Step time with every block checkpointed at the preset's own batch, against none."""
    built = _checkpointed(sizes, ctx.device)
    timing = compare(built, baseline="none", repeats=repeats, device=ctx.device)
    return Row(
        "memory", f"checkpoint_step_time all, batch {sizes.batch}",
        f"time per training step at the preset's batch {sizes.batch} x {sizes.context}, "
        "every block checkpointed (the price where the host bounds the step)", "ms",
        timing.timings["all"].median_ms, baseline=timing.timings["none"].median_ms,
        note=f"{ctx.where}; no target: the price is judged at batch {JUDGED_BATCH['gpu']}, "
        "where the GPU bounds the step",
    )  # fmt: skip


def _on(flags) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(flags)
        if getattr(flags, f.name) not in (False, f.default)
    ]
