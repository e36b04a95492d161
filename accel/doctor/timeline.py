"""Where a step's time goes on the device: kernels, launches, syncs, and the device's idle time
split by cause, as Holistic Trace Analysis splits it (computed from the profiler's events in
memory). Each gap between kernels is **sync** (a blocking host call returned during it: the
host waited, then restarted the queue), **host** (a launch started during it: the device waited
for the host), or **other** (the next kernel was already queued). On a CPU the "kernels" are
the ATen operators that did arithmetic, and the rest of the step is host time.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from accel.measure.costs import launch_queue_depth
from accel.profiling import profile_steps, union_length

__all__ = ["CALLS", "Timeline", "kernel_category", "profile_timeline"]

# steps per timed sample: a sync at a step's end idles the device until the next step starts,
# between two calls, which a sample of one call would leave out
CALLS = 3
_SYNC_GRACE_US = 5.0  # a sync that returned just before the gap opened still caused it
_CATEGORIES = (  # (category, substrings of a kernel or operator name), first match wins
    ("communication", ("nccl", "gloo:", "c10d::", "allreduce", "all_gather", "reduce_scatter")),
    ("compiled (Triton)", ("triton_",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "_efficient_attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "cublas", "xmma", "wgmma", "mm", "conv", "linear")),
    ("optimizer", ("multi_tensor_apply", "adam", "sgd", "_foreach")),
    ("copy", ("memcpy", "copy_", "_to_copy")),
    ("memset", ("memset", "fill_", "zero_")),
    ("normalization", ("norm", "softmax")),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, needles in _CATEGORIES:
        if any(n in lowered for n in needles):
            return category
    return "elementwise and other"


@dataclass
class Timeline:
    """Per-step averages over ``steps`` profiled steps (microseconds)."""

    device: str
    steps: int
    step_us: float
    kernel_us: float  # the kernels' durations summed (what a graph replay could not go under)
    busy_us: float  # time in which at least one kernel ran
    kernels: int  # per step
    launches: float
    syncs: float  # NaN on a CPU
    sync_wait_us: float = 0.0  # host time blocked inside the syncs' runtime calls
    idle_us: dict[str, float] = field(default_factory=dict)  # host, sync, other
    by_category: dict[str, float] = field(default_factory=dict)  # kernel time per category
    comm_us: float = 0.0
    comm_overlap_us: float = 0.0  # communication time during which compute also ran
    # the profiled window itself, for :meth:`step_saving_us`: each kernel's (start, end, category,
    # the start of the runtime call that queued it, or NaN) in start order, the host's blocking
    # calls, the start of every event the host recorded, the window's ends and the host's end
    spans: tuple[tuple[float, float, str, float], ...] = field(default=(), repr=False)
    sync_spans: tuple[tuple[float, float], ...] = field(default=(), repr=False)
    host_events: tuple[float, ...] = field(default=(), repr=False)
    window: tuple[float, float] = (0.0, 0.0)
    host_end: float = math.nan  # the last step's end on the host (NaN: its last call)
    host_event_us: float = 0.0  # what the profiler added to the host's time per recorded event
    queue_depth: int = 0  # launches the device's queue holds before a launch waits (0: no limit)

    def step_saving_us(self, saved_by_category: dict[str, float]) -> float:
        """The step's time saved per step when each category's kernels take
        ``saved_by_category[c]`` µs a step less (in proportion to their time), replayed on the
        profiled window. The host runs as profiled, less the profiler's own cost per event it
        recorded (:attr:`host_event_us`). A kernel starts once the one before it has ended and
        the host has queued it (plus the launch's own latency where the device waited for it); a
        launch finding the device's queue full (:attr:`queue_depth`) waits until a kernel
        starts; a blocking call returns once the host reached it and the device finished what
        was queued before it. A kernel made faster while the host holds the device back saves
        nothing. Without profiled kernels (a CPU), the kernels' own saving."""
        if not self.spans or not self.steps:
            return sum(saved_by_category.values())
        factor = {c: min(1.0, max(0.0, 1 - saved / self.by_category[c]))
                  for c, saved in saved_by_category.items() if self.by_category.get(c, 0) > 0}  # fmt: skip
        return max(0.0, self._replayed_us({}) - self._replayed_us(factor)) / self.steps

    def spread_saving_us(self, saved_us: float, categories) -> float:
        """:meth:`step_saving_us` of ``saved_us`` taken off ``categories`` in proportion to their
        kernels' time (``saved_us`` itself where they ran none)."""
        parts = {c: self.by_category.get(c, 0.0) for c in categories}
        total = sum(parts.values())
        if total <= 0:
            return saved_us
        return self.step_saving_us({c: saved_us * t / total for c, t in parts.items() if t > 0})

    def _replayed_us(self, factor: dict[str, float]) -> float:
        """The window's length replayed with each category's kernels ``factor`` as long."""
        events, cost = self.host_events, self.host_event_us
        anchor = at = done = host_at = seen = self.window[0]  # seen: the profiled device's end
        counted = 0  # events recorded before the anchor

        def host(t: float) -> float:  # when the replayed host reaches profiled time t
            return at + max(0.0, t - anchor - cost * (bisect.bisect_left(events, t) - counted))

        syncs, returned = self.sync_spans, 0
        started: list[float] = []  # the replayed start of each launched kernel
        for start, end, category, queued in self.spans:
            ready = start if math.isnan(queued) else queued
            for called, back in syncs[returned:]:  # the blocking calls the host came back from
                if back > ready:
                    break
                at = max(host(called), done)  # returns once the device drained the queue
                anchor, counted, returned = back, bisect.bisect_left(events, back), returned + 1
            if not math.isnan(queued):  # no call seen: taken as queued behind the one before
                launched = host(queued)
                if self.queue_depth and len(started) >= self.queue_depth:
                    room = started[-self.queue_depth]  # a full queue: the launch waits for room
                    if room > launched:
                        at, anchor, counted = room, queued, bisect.bisect_left(events, queued)
                        launched = room
                host_at = max(host_at, launched + max(0.0, start - max(queued, seen)))
            begun = max(done, host_at)
            if not math.isnan(queued):
                started.append(begun)
            done = begun + (end - start) * factor.get(category, 1.0)
            seen = max(seen, end)
        for called, back in syncs[returned:]:
            at = max(host(called), done)
            anchor, counted = back, bisect.bisect_left(events, back)
        host_end = host(self.host_end) if not math.isnan(self.host_end) else self.window[0]
        return max(host_end, done) - self.window[0]

    @property
    def idle_fraction(self) -> float:
        return 1 - self.busy_us / self.step_us if self.step_us > 0 else math.nan

    def at_step_time(self, step_us: float) -> Timeline:
        """This timeline with the step's time measured without the profiler: the profiler adds
        host time to every operator, so a profiled step idles more than the real one. Kernel
        times stand; the idle time shrinks to what the real step leaves, split as profiled, and
        the replay's host is at least as fast as the real step shows (:meth:`_event_us_at`)."""
        busy = self.busy_us
        work = 1.0  # on a CPU the profiler slows the operators themselves: their share stands
        if not self.device.startswith("cuda") and busy > 0:
            work = step_us / self.step_us
            busy *= work
        idle = max(0.0, step_us - busy)
        profiled = sum(self.idle_us.values())
        scale = idle / profiled if profiled > 0 else 0.0
        return dataclasses.replace(
            self,
            step_us=step_us,
            kernel_us=self.kernel_us * work,
            busy_us=busy,
            comm_us=self.comm_us * work,
            comm_overlap_us=self.comm_overlap_us * work,
            by_category={k: v * work for k, v in self.by_category.items()},
            idle_us={k: v * scale for k, v in self.idle_us.items()},
            host_event_us=self._event_us_at(step_us) if self.spans else self.host_event_us,
        )

    def _event_us_at(self, step_us: float) -> float:
        """The profiler's cost per host event as measured, or more where the replay at that cost
        is longer than the real step: the least cost at which it is not (or, where the kernels
        alone take longer, at which the replay reaches their time)."""

        def replayed(cost: float) -> float:
            return dataclasses.replace(self, host_event_us=cost)._replayed_us({})

        low, high = self.host_event_us, max(self.window[1] - self.window[0], self.host_event_us)
        target = max(step_us * self.steps, replayed(high) * (1 + 1e-3))
        if replayed(low) <= target:
            return low
        for _ in range(40):  # the replay shortens as the cost grows
            middle = (low + high) / 2
            low, high = (low, middle) if replayed(middle) <= target else (middle, high)
        return high


def profile_timeline(
    call: Callable[[], object], device: torch.device, *, steps: int = 5
) -> Timeline:
    """Profile ``steps`` calls of ``call`` (already warmed up) and account for their time."""
    run = profile_steps(call, device, steps, probe=device.type == "cuda")
    cuda, t0, t1 = run.cuda, run.start_us, run.end_us
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in run.work]
    launches = sorted(e.time_range.start for e in run.launches)
    blocking = sorted((e.time_range for e in run.syncs), key=lambda r: r.end)
    sync_ends = [r.end for r in blocking]
    busy = union_length([[a, b] for a, b, _ in spans])
    if cuda:
        idle = _idle_breakdown(spans, t0, t1, launches, sync_ends)
    else:
        idle = {"host": max(0.0, (t1 - t0) - busy)}
    comm, overlap = _communication(spans)
    by_category: dict[str, float] = {}
    for a, b, name in spans:
        category = kernel_category(name)
        by_category[category] = by_category.get(category, 0.0) + (b - a)
    per = 1.0 / steps
    return Timeline(
        device=str(device),
        steps=steps,
        step_us=(t1 - t0) * per,
        kernel_us=sum(b - a for a, b, _ in spans) * per,
        busy_us=busy * per,
        kernels=round(len(spans) * per),
        launches=len(launches) * per,
        syncs=len(sync_ends) * per if cuda else math.nan,
        sync_wait_us=sum(r.end - r.start for r in blocking) * per,
        idle_us={k: v * per for k, v in idle.items()},
        by_category={k: v * per for k, v in by_category.items()},
        comm_us=comm * per,
        comm_overlap_us=overlap * per,
        spans=_replayable(run) if cuda else (),
        sync_spans=tuple((r.start, r.end) for r in blocking),
        host_events=tuple(sorted(e.time_range.start for e in run.host)),
        window=(t0, t1),
        host_end=max((e.time_range.end for e in run.host), default=t1),
        host_event_us=run.event_us,
        queue_depth=launch_queue_depth(device) if cuda else 0,
    )


def _replayable(run) -> tuple[tuple[float, float, str, float], ...]:
    """Each kernel's (start, end, category, queued): the start of the runtime call whose
    correlation id is the kernel's (NaN where none was seen, or it started after the kernel)."""
    launched = {e.id: e.time_range.start for e in run.enqueues}
    out = []
    for e in run.work:
        a, b = e.time_range.start, e.time_range.end
        at = launched.get(e.id, math.nan)
        out.append((a, b, kernel_category(e.name), at if at <= a else math.nan))
    return tuple(sorted(out))


def _idle_breakdown(spans, t0, t1, launches, sync_ends) -> dict[str, float]:
    """Each gap in the kernels' coverage, by cause (see the module doc)."""
    out = {"host": 0.0, "sync": 0.0, "other": 0.0}
    covered_to = t0
    gaps = []
    for start, end, _ in spans:
        if start > covered_to:
            gaps.append((covered_to, start))
        covered_to = max(covered_to, end)
    if t1 > covered_to:
        gaps.append((covered_to, t1))
    for a, b in gaps:
        if _any_in(sync_ends, a - _SYNC_GRACE_US, b):
            out["sync"] += b - a
        elif _any_in(launches, a, b):
            out["host"] += b - a
        else:
            out["other"] += b - a
    return out


def _any_in(sorted_times: list[float], a: float, b: float) -> bool:
    i = bisect.bisect_left(sorted_times, a)
    return i < len(sorted_times) and sorted_times[i] < b


def _communication(spans) -> tuple[float, float]:
    """Communication kernels' covered time, and how much of it compute kernels overlapped."""
    comm = [[a, b] for a, b, n in spans if kernel_category(n) == "communication"]
    if not comm:
        return 0.0, 0.0
    compute = [[a, b] for a, b, n in spans if kernel_category(n) != "communication"]
    total = union_length(comm)
    both = total + union_length(compute) - union_length(comm + compute)
    return total, both
