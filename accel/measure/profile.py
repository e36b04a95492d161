"""The profiler as data: a step run under ``accel.profiling.profile_steps``, as DataFrames.

What the events mean (a CUDA device's kernels, launches and syncs; a CPU's "kernels", the ATen
operators that did arithmetic) is ``accel.profiling``'s. On a CPU "idle" is the share of the step
spent outside those operators, in Python and dispatch, and syncs are reported as NaN.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import profile

from accel.errors import checked_callable, checked_count
from accel.files import check_writable, write_text_atomic
from accel.measure.device import default_device

# HOST_READ_OP: notebooks read it as lab.profile.HOST_READ_OP
from accel.profiling import HOST_READ_OP, profile_steps, union_length  # noqa: F401

CPU_NOTE = (
    "CPU: kernels are the ATen ops that did arithmetic themselves; "
    "host-device syncs do not apply (NaN)."
)


@dataclass
class ProfileReport:
    """What one profiled run of ``steps`` steps did. Times in microseconds."""

    steps: int
    device: str
    kernels: pd.DataFrame  # name, kind, count, total_us, mean_us, share, per_step
    ops: pd.DataFrame  # ATen operators as the host saw them: name, count, self_us
    timeline: pd.DataFrame  # name, kind, start_us, end_us (from the window's start)
    memory: pd.DataFrame  # t_us, bytes: allocated bytes over time, from the window's start
    launches_per_step: float
    syncs_per_step: float  # NaN on a CPU: there is no separate device to wait for
    window_us: float
    busy_us: float
    peak_memory_bytes: int  # peak allocated during the window, above the level at its start
    trace_path: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def idle_fraction(self) -> float:
        """Share of the profiled window in which the device ran no kernel."""
        return 1.0 - self.busy_us / self.window_us if self.window_us > 0 else math.nan

    @property
    def step_us(self) -> float:
        return self.window_us / self.steps

    def summary(self) -> dict[str, float | int | str]:
        """Per step: kernels, launches, syncs, idle share, peak memory; one flat dict."""
        return {"device": self.device, "steps": self.steps, "step_us": self.step_us,
                "kernels_per_step": float(self.kernels["count"].sum()) / self.steps,
                "launches_per_step": self.launches_per_step, "syncs_per_step": self.syncs_per_step,
                "idle_fraction": self.idle_fraction,
                "peak_memory_bytes": self.peak_memory_bytes}  # fmt: skip


def profile_step(
    fn: Callable[[], object],
    *,
    steps: int = 5,
    warmup: int = 2,
    device: torch.device | str | None = None,
    trace_path: str | Path | None = None,
) -> ProfileReport:
    """Profile ``steps`` calls of ``fn`` (after ``warmup`` unprofiled ones) and tabulate them.

    ``trace_path`` also writes the Chrome/Perfetto trace JSON there (open it in ui.perfetto.dev):
    a file's name (its folders are made); a folder or a read-only file is refused before the step
    runs.
    """
    checked_callable(fn, "profile_step(fn)")
    steps = checked_count(steps, "steps", at_least=1)
    warmup = checked_count(warmup, "warmup")
    if trace_path is not None:
        trace_path = Path(trace_path)
        check_writable(trace_path, "trace_path")
    dev = torch.device(device) if device is not None else default_device()
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        fn()
    start_bytes = 0
    if cuda:  # the peak is measured from here
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start_bytes = torch.cuda.memory_allocated(dev)
    run = profile_steps(fn, dev, steps, profile_memory=True)
    if trace_path is not None:
        _write_trace(run.profile, trace_path)
    t0 = run.start_us
    spans = [(e.name, _kind(e.name, cuda), e.time_range.start - t0, e.time_range.end - t0)
             for e in run.work]  # fmt: skip
    timeline = pd.DataFrame(spans, columns=["name", "kind", "start_us", "end_us"])
    memory = _memory_over_time(run.profile, t0, cuda)
    if cuda:  # the allocator's own peak is exact; the profiler's records are the CPU's only view
        peak = torch.cuda.max_memory_allocated(dev) - start_bytes
    else:
        peak = max(0, int(memory["bytes"].max())) if len(memory) else 0
    return ProfileReport(
        steps, str(dev), _kernel_table(timeline, steps), _op_table(run.host), timeline, memory,
        launches_per_step=len(run.launches) / steps,
        syncs_per_step=len(run.syncs) / steps if cuda else math.nan, window_us=run.end_us - t0,
        busy_us=union_length(timeline[["start_us", "end_us"]].to_numpy().tolist()),
        peak_memory_bytes=int(peak), trace_path=trace_path, notes=[] if cuda else [CPU_NOTE],
    )  # fmt: skip


def _write_trace(prof: profile, path: Path) -> None:
    """The Chrome trace, written whole as every file accel writes (the profiler writes in place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        exported = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(exported))
        write_text_atomic(path, exported.read_text(encoding="utf-8"))


def _kind(name: str, cuda: bool) -> str:
    if not cuda:
        return "op"
    return next((k for k in ("memcpy", "memset") if name.lower().startswith(k)), "kernel")


def _kernel_table(timeline: pd.DataFrame, steps: int) -> pd.DataFrame:
    columns = ["name", "kind", "count", "total_us", "mean_us", "share", "per_step"]
    if timeline.empty:
        return pd.DataFrame(columns=columns)
    t = timeline.assign(us=timeline["end_us"] - timeline["start_us"])
    table = t.groupby(["name", "kind"], as_index=False).agg(
        count=("us", "size"), total_us=("us", "sum")
    )
    table["mean_us"] = table["total_us"] / table["count"]
    table["share"] = table["total_us"] / table["total_us"].sum()
    table["per_step"] = table["count"] / steps
    return table.sort_values("total_us", ascending=False, ignore_index=True)[columns]


def _op_table(host) -> pd.DataFrame:
    rows: dict[str, list[float]] = {}
    for e in host:
        if e.name.startswith("aten::"):
            row = rows.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += e.self_cpu_time_total
    table = pd.DataFrame(
        [(k, n, us) for k, (n, us) in rows.items()], columns=["name", "count", "self_us"]
    )
    return table.sort_values("self_us", ascending=False, ignore_index=True)


def _memory_over_time(prof, t0: float, cuda: bool) -> pd.DataFrame:
    """Allocated bytes after every allocation and free in the window, relative to its start.

    Read from the raw profiler records: torch's FunctionEvents fold allocations into the ops
    around them, and a free outside any op lands on the enclosing step mark's start time.
    """
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    results = prof.profiler.kineto_results
    origin = results.trace_start_ns()
    deltas = [
        ((e.start_ns() - origin) / 1e3 - t0, e.nbytes())
        for e in results.events()
        if e.name() == "[memory]" and e.device_type() == kind
    ]
    frame = pd.DataFrame([d for d in deltas if d[0] >= 0], columns=["t_us", "delta"])
    frame = frame.sort_values("t_us", ignore_index=True)
    frame["bytes"] = frame["delta"].cumsum()
    return frame[["t_us", "bytes"]]
