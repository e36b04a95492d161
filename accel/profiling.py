"""torch.profiler without its own log lines (:func:`quiet_profile`: Kineto writes its start and
stop lines straight to stderr, a red box under every notebook cell), what its events mean, and
one pipeline for profiling a step (:func:`profile_steps`, :func:`device_profile`).

On CUDA a step's "kernels" are the device's own activities, launches the runtime's launch calls
and syncs its blocking calls (which ``.item()``, ``.cpu()`` and ``print(tensor)`` end in). On a
CPU the "kernels" are the ATen operators that did the arithmetic themselves.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

# Kineto's start and stop lines, and c10's note that a block allocated before the profile was freed
# inside it (the profile's own bookkeeping: nothing the profiled code can act on)
_PROFILER_LINE = re.compile(
    rb"^((USDT|STAGE):\S* \S+ \d+:\d+ \S+\.cpp:\d+\] "
    rb"|\[W\S* \S+ CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before)"
)


@contextlib.contextmanager
def quiet_profile(**kwargs: Any) -> Iterator[profile]:
    """``torch.profiler.profile(**kwargs)`` with Kineto's lines kept off stderr; every other
    line written to stderr meanwhile (a warning from the profiled code) is passed on after; and
    CUDA's profiling interface detached when a profile of the device stops
    (:func:`_cupti_detached_after`)."""
    device = _profiles_device(kwargs.get("activities"))
    with _without_kineto_lines(), _cupti_detached_after(device), profile(**kwargs) as prof:
        yield prof


TEARDOWN = "TEARDOWN_CUPTI"  # Kineto's switch, read when a profile stops


def _profiles_device(activities: Any) -> bool:
    """Whether a profile of these activities attaches CUPTI (no list: torch's default, the
    device's too where there is one)."""
    if activities is None:
        return torch.cuda.is_available()
    return ProfilerActivity.CUDA in activities


@contextlib.contextmanager
def _cupti_detached_after(device: bool) -> Iterator[None]:
    # Kineto keeps CUPTI attached after a profile of the device unless TEARDOWN_CUPTI is "1" when
    # it stops, and an attached CUPTI slows every later kernel launch of the process. A value
    # the user set is theirs; one torch sets meanwhile ("0": CUDA graphs with an old CUDA) is
    # kept. A profile of the host alone attaches nothing, so it asks for nothing.
    if not device:
        yield
        return
    ours = TEARDOWN not in os.environ
    if ours:
        os.environ[TEARDOWN] = "1"
    try:
        yield
    finally:
        # Kineto ends a teardown (ours or one the user asked for) inside the next CUDA runtime
        # call: a process that makes none after the profile would wait for it at exit
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        if ours and os.environ.get(TEARDOWN) == "1":
            del os.environ[TEARDOWN]


@contextlib.contextmanager
def device_profile(device: torch.device, **kwargs: Any) -> Iterator[profile]:
    """:func:`quiet_profile` of the host and, on CUDA, the device, from an idle GPU to one that
    has finished what the block queued."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with quiet_profile(activities=activities, **kwargs) as prof:
        yield prof
        if cuda:
            torch.cuda.synchronize(device)


STEP_MARK = "accel.step"


@dataclass
class ProfiledSteps:
    """``steps`` calls of a step under the profiler, each inside a :data:`STEP_MARK` range.
    Times in microseconds on the profiler's clock; the window runs from the first step's start
    to the last step's or the last kernel's end."""

    profile: profile
    cuda: bool
    steps: int
    start_us: float
    end_us: float
    work: list  # kernels (CUDA) or ATen ops that did arithmetic (CPU) in the window, by start
    host: list  # the host's events inside the steps (runtime calls, ATen ops as it saw them)
    event_us: float = 0.0  # the profiler's own host time per recorded event, where probed

    @property
    def launches(self) -> list:
        """The runtime's launch calls; on a CPU every operator that did arithmetic."""
        return [e for e in self.host if e.name in LAUNCH_CALLS] if self.cuda else self.work

    @property
    def enqueues(self) -> list:
        """The runtime calls that queued the device's work (:data:`ENQUEUE_CALLS`); none on a CPU."""
        return [e for e in self.host if e.name in ENQUEUE_CALLS] if self.cuda else []

    @property
    def syncs(self) -> list:
        """The host's blocking calls (none on a CPU: there is no separate device to wait for)."""
        return [e for e in self.host if e.name in SYNC_CALLS] if self.cuda else []


def profile_steps(
    call: Callable[[], object], device: torch.device, steps: int, *, probe: bool = False,
    **kwargs: Any,
) -> ProfiledSteps:  # fmt: skip
    """Profile ``steps`` calls of ``call`` (warmed up already), each inside a step mark; ``kwargs``
    go to the profiler (``profile_memory=True``). On CUDA, a profile whose steps launched kernels
    and recorded none (CUPTI not attached: the teardown of the profile before can still be under
    way) is taken again, once. ``probe``: also measure the profiler's own host time per event it
    records (:attr:`ProfiledSteps.event_us`)."""
    for _ in range(2):
        run = _profiled(call, device, steps, probe, **kwargs)
        # a graph's replay is left out: whether its kernels are traced depends on the CUDA version
        launched = [e for e in run.launches if e.name != "cudaGraphLaunch"]
        if not run.cuda or run.work or not launched:
            return run
    raise RuntimeError(
        f"the profiler recorded no kernel of the {len(launched)} launched in {steps} steps, "
        "twice: CUDA's profiling interface (CUPTI) did not attach"
    )


def _profiled(
    call: Callable[[], object], device: torch.device, steps: int, probe: bool, **kwargs: Any
) -> ProfiledSteps:
    host_probe = _HostProbe(device) if probe else None
    with device_profile(device, **kwargs) as prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                call()
        if host_probe:
            host_probe.run_profiled()
    events = list(prof.events())
    marks = [e for e in events if e.name == STEP_MARK and e.device_type == DeviceType.CPU]
    if not marks:
        raise RuntimeError("profiler recorded no step marks; was the step run under the profiler?")
    cuda = device.type == "cuda"
    probed = [e for e in events if e.name == _PROBE_MARK and e.device_type == DeviceType.CPU]
    stop = min((e.time_range.start for e in probed), default=math.inf)
    start = min(e.time_range.start for e in marks)
    work = device_work(events, frozenset({STEP_MARK, _PROBE_MARK})) if cuda else cpu_kernels(events)
    work = sorted(
        (e for e in work if start <= e.time_range.start < stop), key=lambda e: e.time_range.start
    )
    end = max(e.time_range.end for e in [*marks, *work])
    inside = _inside(marks)
    host = [e for e in events if e.device_type == DeviceType.CPU and inside(e)]
    event_us = host_probe.event_us(events, probed) if host_probe else 0.0
    return ProfiledSteps(prof, cuda, steps, start, end, work, host, event_us)


class _HostProbe:
    """The profiler's own host time per event it records: tiny in-place adds timed on the host
    bare (before the profile) and inside it (after the steps, the device drained first), their
    difference per recorded event."""

    CALLS, REPEATS = 400, 5

    def __init__(self, device: torch.device) -> None:
        self.device, self.x = device, torch.ones((), device=device)
        self.timed()  # warm-up
        self.bare = statistics.median(self.timed() for _ in range(self.REPEATS))
        self.profiled = math.nan

    def timed(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for _ in range(self.CALLS):
            self.x.add_(1.0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def run_profiled(self) -> None:
        times = []
        for _ in range(self.REPEATS):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the steps' kernels end before the mark
            with record_function(_PROBE_MARK):
                times.append(self.timed())
        self.profiled = statistics.median(times)

    def event_us(self, events: list, probed: list) -> float:
        inside = _inside(probed)
        recorded = sum(1 for e in events if e.device_type == DeviceType.CPU and inside(e)
                       and e.name != _PROBE_MARK)  # fmt: skip
        per_call = recorded / (self.CALLS * len(probed)) if probed else 0.0
        added_us = (self.profiled - self.bare) / self.CALLS * 1e6
        return max(0.0, added_us / per_call) if per_call else 0.0


_PROBE_MARK = "accel.profiler_probe"


def _inside(marks) -> Callable[[object], bool]:
    """Whether an event starts inside one of the (non-overlapping) step marks."""
    spans = sorted((m.time_range.start, m.time_range.end) for m in marks)
    starts = [a for a, _ in spans]

    def inside(e) -> bool:
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        return i >= 0 and e.time_range.start <= spans[i][1]

    return inside


@contextlib.contextmanager
def _without_kineto_lines() -> Iterator[None]:
    # Kineto is C++ and writes to file descriptor 2: only swapping the descriptor catches it.
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [
                line for line in caught.read().splitlines(True) if not _PROFILER_LINE.match(line)
            ]
            if kept:
                sys.stderr.write(b"".join(kept).decode(errors="replace"))
                sys.stderr.flush()


LAUNCH_CALLS = frozenset(
    {"cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cudaGraphLaunch"}
    | {"cuLaunchKernel", "cuLaunchKernelEx"}
)
# Calls that queue work on the device without a kernel: copies and fills
ENQUEUE_CALLS = LAUNCH_CALLS | {"cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy2DAsync"}
# Calls after which the host waits for the device. cudaMemcpy (not Async) blocks too.
SYNC_CALLS = frozenset(
    ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
)
HOST_READ_OP = "aten::_local_scalar_dense"  # what .item(), float(t) and int(t) end in
CPU_COLLECTIVE = "gloo:"  # a CPU process group's collective, as its thread runs it
# ops that only choose another op to do their arithmetic: never a kernel when they called one
DISPATCHING_OPS = frozenset(
    {"aten::matmul", "aten::linear", "aten::conv2d", "aten::convolution", "aten::_convolution"}
)
# ATen ops that move no data through arithmetic: views, metadata and allocation.
NO_WORK_OPS = frozenset(
    f"aten::{name}"
    for names in (
        ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "new_zeros"),
        ("zeros", "ones", "ones_like", "zeros_like", "full", "scalar_tensor", "lift_fresh"),
        ("as_strided", "view", "reshape", "_reshape_alias", "_unsafe_view", "view_as", "alias"),
        ("t", "transpose", "permute", "expand", "expand_as", "unsqueeze", "squeeze", "flatten"),
        ("select", "slice", "unbind", "split", "chunk", "narrow", "set_", "resize_"),
        ("detach", "detach_", "resolve_conj", "resolve_neg", "result_type", "to", "_to_copy"),
        ("contiguous",),
    )
    for name in names
)


def device_work(events, marks: frozenset[str] = frozenset()):
    """The device's activities, without the device-side copies of ranges: the user's (the
    optimizer's ``Optimizer.step#AdamW.step`` spans its kernels) and those named ``marks``."""
    return [e for e in events if e.device_type == DeviceType.CUDA and e.name not in marks
            and not getattr(e, "is_user_annotation", False)]  # fmt: skip


def cpu_kernels(events):
    """ATen ops that do arithmetic themselves: the CPU's analogue of a kernel launch; and the
    collectives of a CPU process group, run on gloo's own threads (its analogue of NCCL's kernels).

    An op counts when it spends at least as long in its own code as in arithmetic ops it calls
    (``aten::sum`` counts although it first calls ``fill_`` on its output), unless it only
    chooses the op that does the arithmetic (``aten::matmul`` calling ``aten::mm``).
    """
    return [
        e
        for e in events
        if e.device_type == DeviceType.CPU
        and (e.name.startswith(CPU_COLLECTIVE) or _does_arithmetic(e))
    ]


def _does_arithmetic(e) -> bool:
    if not _is_compute(e):
        return False
    called = [c for c in e.cpu_children if _is_compute(c)]
    if called and e.name in DISPATCHING_OPS:  # its own time is dispatch, however long it took
        return False
    return e.self_cpu_time_total >= sum(c.cpu_time_total for c in called)


def _is_compute(e) -> bool:
    return e.name.startswith("aten::") and e.name not in NO_WORK_OPS


def union_length(intervals: list[list[float]]) -> float:
    """Total length covered by possibly overlapping intervals (kernels on several streams)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
