"""Bench phase ``sync`` (notebook 01): the field trainer's window before and after phase 1, and
its syncs; the gain predicted by ``accel.measure.costs``."""

from __future__ import annotations

from dataclasses import dataclass

from accel.lab.bench import BenchContext, Row
from accel.measure.costs import measure_costs
from accel.measure.profile import HOST_READ_OP, ProfileReport, profile_step
from accel.measure.timer import compare
from accel.sync import count_syncs
from accel.workloads import field_trainer as ft
from accel.workloads.flags import through_phase

PHASE1 = through_phase(ft.Flags, "sync")
TARGET_SPEEDUP = 1.2


@dataclass
class WindowStats:
    """Counts per window of one configuration, after warm-up (steady state)."""

    label: str
    syncs: float | None  # device syncs (accel.sync.count_syncs); None without CUDA
    host_reads: float  # .item()-style reads seen by the profiler: syncs on a GPU
    launches: float  # kernel launches on CUDA; compute ops on a CPU
    idle_fraction: float
    report: ProfileReport

    def as_dict(self) -> dict[str, float | str | None]:
        return {"label": self.label, "syncs_per_window": self.syncs,
                "host_reads_per_window": self.host_reads, "launches_per_window": self.launches,
                "idle_fraction": self.idle_fraction,
                "ms_per_window_profiled": self.report.step_us / 1e3}  # fmt: skip


def window_stats(step: ft.Step, label: str) -> WindowStats:
    """Count the syncs of ``step``'s windows and profile them, over one rotor-update cycle of
    windows, so every kind of window is counted in its share."""
    windows = step.sizes.nudge_every_windows
    for _ in range(2):  # warm-up
        step()

    def run_windows() -> None:
        for _ in range(windows):
            step()

    syncs = count_syncs(run_windows)
    report = profile_step(run_windows, steps=1, warmup=0, device=step.device)
    ops = report.ops.set_index("name")["count"]
    syncs = None if syncs is None else syncs / windows
    host_reads = float(ops.get(HOST_READ_OP, 0)) / windows
    launches = report.launches_per_step / windows
    return WindowStats(label, syncs, host_reads, launches, report.idle_fraction, report)


def run(ctx: BenchContext) -> list[Row]:
    sizes = ft.Sizes.preset(ctx.preset)
    base = ft.build(ft.Flags(), sizes, device=ctx.device, seed=0)
    fast = ft.build(PHASE1, sizes, device=ctx.device, seed=0)
    for _ in range(2):  # correctness before timing
        base()
        fast()
    ft.compare_results(fast.result(), base.result(), PHASE1, sizes=sizes, steps=fast.windows)

    timing = compare({"baseline": base, "optimized": fast}, warmup=3, repeats=30, device=ctx.device)
    before, after = window_stats(base, "baseline"), window_stats(fast, "optimized")
    model = measure_costs(ctx.device)
    base_ms = timing.timings["baseline"].median_ms
    counted = before.syncs is not None  # device syncs on CUDA; else the reads that are syncs there
    removed = (before.syncs - after.syncs) if counted else before.host_reads - after.host_reads
    launches = before.launches - after.launches
    predicted = model.predict_speedup(base_ms, removed, launches)
    time_row = Row(
        "sync", "field_trainer_window", "time per window", "ms",
        timing.timings["optimized"].median_ms, baseline=base_ms, target=f">= {TARGET_SPEEDUP}x",
        met=(timing.speedup("optimized") >= TARGET_SPEEDUP) if ctx.judged else None,
        note=f"{ctx.where}; {sizes.steps_per_window} steps/window; flags batched_progress + "
        f"vectorized_rotor; cost model predicted {predicted:.2f}x from {removed:.0f} host reads x "
        f"{model.sync_us:.1f} us + {launches:.0f} launches x {model.launch_us:.1f} us",
    )  # fmt: skip
    if counted:
        return [time_row, Row(
            "sync", "syncs_per_window", "host-device syncs per window (steady state)", "count",
            after.syncs, baseline=before.syncs, target="0", met=after.syncs == 0,
            note=f"{ctx.device.type}, preset {ctx.preset}; counted with "
            "torch.cuda.set_sync_debug_mode('warn')",
        )]  # fmt: skip
    return [time_row, Row(
        "sync", "syncs_per_window", "host reads (.item()) per window, steady state", "count",
        after.host_reads, baseline=before.host_reads, target="0",
        note="no CUDA: device syncs cannot be counted; counted the host reads that "
        f"are syncs on a GPU ({HOST_READ_OP} in the profiler)",
    )]  # fmt: skip
