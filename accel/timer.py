"""The one timer of accel: callables timed interleaved, round by round, so drift cancels in ratios.

Each candidate is warmed up, then every round takes one sample of each. The order turns by one
place every second round and runs backwards in odd rounds (A B C, C B A, B C A, A C B, C A B,
B A C): rotation alone keeps each candidate behind the same neighbour every round, and a kernel
that runs right after a slow, cool one gets more of the GPU's power budget. With the reversal each
candidate follows both of its neighbours, and over 2 n rounds each of n candidates holds every
place exactly twice.

What a sample measures is its ``clock``. On CUDA: ``"device"`` brackets the calls with CUDA
events and lets samples queue back to back (the GPU's time per call; host overhead that does not
delay the GPU is not counted); ``"latency"`` waits for an idle GPU before each sample, then
brackets it with events (one call as a user makes it, host launch time included); ``"host"`` also
starts each sample from an idle GPU and reads the host clock around the calls without waiting for
them (the Python call to its return, with a launch queue that is never full). A CPU has one clock:
all three read the host's.

    samples = interleaved({"a": f, "b": g}, device, warmup=2, repeats=12)
    samples.medians()                                  # {"a": ms per call, "b": ...}

Torch only: the lab's ``accel.lab.timing.compare`` builds its timings and comparisons on it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from accel.errors import checked_callable, checked_count

SampleCallback = Callable[[str, int, float], None]
Clock = Literal["device", "latency", "host"]
CLOCKS: tuple[str, ...] = get_args(Clock)


class CandidateError(RuntimeError):
    """A timed candidate raised; the message names it, the cause is the original exception."""


@dataclass(frozen=True)
class Samples:
    """Per-call times (ms) of each candidate, one per round: sample ``r`` of every candidate
    comes from round ``r``, so ratios can be taken round by round."""

    times_ms: dict[str, tuple[float, ...]]
    calls_per_sample: dict[str, int]
    schedule: tuple[str, ...]  # labels in the order their samples ran

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(times) for name, times in self.times_ms.items()}

    def paired_ratio(self, slow: str, fast: str) -> float:
        """:func:`paired_ratio` of two candidates' samples."""
        return paired_ratio(self.times_ms, slow, fast)


def paired_ratio(samples: Mapping[str, Sequence[float]], slow: str, fast: str) -> float:
    """Median over rounds of ``slow``'s time over ``fast``'s in the same round: how many times
    faster ``fast`` ran than its neighbour in time. Slow drift (clocks falling as the GPU warms
    over a long measurement) moves both samples of a round alike and cancels here, while a ratio
    of two medians keeps it; NaN if either was not timed."""
    if slow not in samples or fast not in samples:
        return math.nan
    return statistics.median(round_ratios(samples, slow, fast))


def round_ratios(samples: Mapping[str, Sequence[float]], slow: str, fast: str) -> list[float]:
    """``slow``'s time over ``fast``'s in each round."""
    return [a / b for a, b in zip(samples[slow], samples[fast], strict=True)]


def round_differences(samples: Mapping[str, Sequence[float]], slow: str, fast: str) -> list[float]:
    """``slow``'s time minus ``fast``'s in each round: what ``slow`` adds, free of the drift
    that moves both samples of a round alike."""
    return [a - b for a, b in zip(samples[slow], samples[fast], strict=True)]


def round_order(names: Sequence[str], r: int) -> list[str]:
    """The order of round ``r``: ``names`` turned by ``r // 2`` places, reversed when ``r`` is
    odd."""
    names = list(names)
    turn = (r // 2) % len(names) if names else 0
    order = names[turn:] + names[:turn]
    return order[::-1] if r % 2 else order


def take_sample(
    fn: Callable[[], object], calls: int, cuda: bool, *, idle_first: bool = False
) -> Callable[[], float]:
    """Call ``fn`` ``calls`` times as one sample; returns the reader of its ms per call.

    ``cuda``: CUDA events time it, and reading waits for the GPU, so defer it and samples queue
    back to back. Otherwise the host clock times it. ``idle_first`` waits for the GPU before the
    sample starts."""
    if idle_first:
        torch.cuda.synchronize()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        return lambda: (end.synchronize(), start.elapsed_time(end))[1] / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - t0) * 1e3 / calls
    return lambda: elapsed


def calls_for(fn: Callable[[], object], min_sample_ms: float, cuda: bool) -> int:
    """Calls per sample so that one sample of ``fn`` lasts at least ``min_sample_ms``."""
    once = take_sample(fn, 1, cuda)()
    if once <= 0:
        return 1000
    return max(1, min(10_000, math.ceil(min_sample_ms / once)))


def interleaved(
    fns: Mapping[str, Callable[[], object]],
    device: torch.device | str,
    *,
    warmup: int,
    repeats: int,
    calls_per_sample: int | None = 1,
    min_sample_ms: float = 1.0,
    on_sample: SampleCallback | None = None,
    name_errors: bool = False,
    clock: Clock = "device",
) -> Samples:
    """Time ``fns`` on ``device`` interleaved: ``warmup`` calls of each, then ``repeats`` rounds
    in :func:`round_order`, one sample of each candidate per round.

    ``calls_per_sample=None`` picks, per candidate, enough calls for a sample to last
    ``min_sample_ms`` (for functions of microseconds). ``on_sample(name, round, ms)`` is called
    as each sample completes (on CUDA this waits for the GPU after every sample). With
    ``name_errors`` an exception of a candidate is raised as :class:`CandidateError` naming it.
    ``clock`` says what a sample measures (the module's docstring). Without ``on_sample`` and
    with the ``"device"`` clock this waits for the GPU once, at the end.
    """
    repeats = checked_count(repeats, "repeats", at_least=1)
    warmup = checked_count(warmup, "warmup")
    if calls_per_sample is not None:
        calls_per_sample = checked_count(calls_per_sample, "calls_per_sample", at_least=1)
    for name, fn in fns.items():
        checked_callable(fn, f"interleaved(fns[{name!r}])")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    names = list(fns)
    dev = torch.device(device)
    cuda = dev.type == "cuda" and clock != "host"
    idle_first = dev.type == "cuda" and clock != "device"

    def blamed(name: str, thunk: Callable[[], object]) -> object:
        try:
            return thunk()
        except Exception as e:
            if not name_errors:
                raise
            raise CandidateError(f"candidate {name!r} raised {type(e).__name__}: {e}") from e

    for name in names:
        for _ in range(warmup):
            blamed(name, fns[name])
    if calls_per_sample is None:
        calls = {n: blamed(n, lambda n=n: calls_for(fns[n], min_sample_ms, cuda)) for n in names}
    else:
        calls = dict.fromkeys(names, calls_per_sample)

    pending: dict[str, list[Callable[[], float]]] = {n: [] for n in names}
    schedule: list[str] = []
    for r in range(repeats):
        for name in round_order(names, r):
            read = blamed(
                name,
                lambda name=name: take_sample(fns[name], calls[name], cuda, idle_first=idle_first),
            )
            pending[name].append(read)
            schedule.append(name)
            if on_sample is not None:
                on_sample(name, r, read())
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    times = {n: tuple(read() for read in pending[n]) for n in names}
    return Samples(times, calls, tuple(schedule))
