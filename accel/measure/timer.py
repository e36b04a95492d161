"""The one timer of accel: callables timed interleaved, round by round, so drift cancels in ratios.

Each candidate is warmed up, then every round takes one sample of each. The order turns by one
place every second round and runs backwards in odd rounds (A B C, C B A, B C A, A C B, C A B,
B A C): rotation alone keeps each candidate behind the same neighbour every round, and a kernel
that runs right after a slow, cool one gets more of the GPU's power budget. With the reversal each
candidate follows both of its neighbours, and over 2 n rounds each of n candidates holds every
place exactly twice. (``torch.utils.benchmark.Timer`` runs one candidate's repeats back to back
with the host clock, so a drift between candidates lands in their ratio.)

What a sample measures is its ``clock``. On CUDA: ``"device"`` brackets the calls with CUDA
events and lets samples queue back to back (the GPU's time per call; host overhead that does not
delay the GPU is not counted, GPU idle time waiting for launches is); ``"latency"`` waits for an
idle GPU before each sample, then brackets it with events (one call as a user makes it, host
launch time included); ``"host"`` also starts each sample from an idle GPU and reads the host
clock around the calls without waiting for them (the Python call to its return, with a launch
queue that is never full). A CPU has one clock: all three read the host's.

    c = compare({"before": f, "after": g})
    c.speedup("after"), c.paired_ratio("before", "after"), c.to_frame()
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from accel.errors import checked_callable, checked_count
from accel.measure.device import default_device

__all__ = [
    "CLOCKS",
    "CandidateError",
    "Comparison",
    "SampleCallback",
    "Timing",
    "compare",
    "interleaved",
    "time_fn",
]

SampleCallback = Callable[[str, int, float], None]
Clock = Literal["device", "latency", "host"]
CLOCKS: tuple[str, ...] = get_args(Clock)


class CandidateError(RuntimeError):
    """A timed candidate raised; the message names it, the cause is the original exception."""


@dataclass(frozen=True)
class Timing:
    """Per-call times of one candidate, in milliseconds, in the order they were taken."""

    label: str
    times_ms: tuple[float, ...]
    calls_per_sample: int = 1
    device: str = "cpu"

    def __post_init__(self):
        if not self.times_ms:
            raise ValueError(f"Timing {self.label!r} needs at least one sample, got none")

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def q25_ms(self) -> float:
        return quantile(self.times_ms, 0.25)

    @property
    def q75_ms(self) -> float:
        return quantile(self.times_ms, 0.75)

    @property
    def iqr_ms(self) -> float:
        """Spread: the interquartile range, robust to the odd slow sample."""
        return self.q75_ms - self.q25_ms

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    def summary(self) -> dict[str, float | int | str]:
        return {"label": self.label, "median_ms": self.median_ms, "q25_ms": self.q25_ms,
                "q75_ms": self.q75_ms, "iqr_ms": self.iqr_ms, "min_ms": self.min_ms,
                "samples": len(self.times_ms), "calls_per_sample": self.calls_per_sample,
                "device": self.device}  # fmt: skip

    def __str__(self) -> str:
        return (
            f"{self.label}: median {self.median_ms:.4g} ms "
            f"(IQR {self.q25_ms:.4g}-{self.q75_ms:.4g}, n={len(self.times_ms)})"
        )


@dataclass(frozen=True)
class Comparison:
    """Interleaved timings of several candidates, sample ``r`` of each from round ``r``; ratios
    are against ``baseline``."""

    timings: dict[str, Timing]
    baseline: str
    schedule: tuple[str, ...] = field(repr=False)  # labels in the order their samples ran

    def speedup(self, label: str) -> float:
        """Baseline median over ``label``'s median: above 1 means ``label`` is faster."""
        if label not in self.timings:
            raise KeyError(
                f"no candidate {label!r}; the candidates: {', '.join(map(repr, self.timings))}"
            )
        return self.timings[self.baseline].median_ms / self.timings[label].median_ms

    @property
    def samples(self) -> dict[str, tuple[float, ...]]:
        """Each candidate's per-call times (ms), sample ``r`` of each from round ``r``."""
        return {k: t.times_ms for k, t in self.timings.items()}

    def medians(self) -> dict[str, float]:
        """Each candidate's median ms per call."""
        return {k: t.median_ms for k, t in self.timings.items()}

    def paired_ratio(self, slow: str, fast: str) -> float:
        """:func:`paired_ratio` of two candidates' samples."""
        return paired_ratio(self.samples, slow, fast)

    def paired_difference(self, slow: str, fast: str) -> float:
        """Median over rounds of ``slow``'s time minus ``fast``'s in the same round, in ms: what
        ``slow`` adds, free of the drift that moves both samples of a round alike."""
        return statistics.median(round_differences(self.samples, slow, fast))

    def ratio_band(
        self, slow: str, fast: str, low: float = 0.1, high: float = 0.9
    ) -> tuple[float, float]:
        """The ``low`` and ``high`` quantiles of ``slow``'s time over ``fast``'s, round by round:
        the spread around :meth:`paired_ratio`."""
        ratios = round_ratios(self.samples, slow, fast)
        return quantile(ratios, low), quantile(ratios, high)

    def median_ratio_interval(
        self, slow: str, fast: str, confidence: float = 0.95
    ) -> tuple[float, float]:
        """Where the median of ``slow``'s time over ``fast``'s, round by round, lies with at least
        ``confidence`` (:func:`median_interval`): how far :meth:`paired_ratio` can be trusted."""
        return median_interval(round_ratios(self.samples, slow, fast), confidence)

    def rows(self) -> list[dict[str, float | int | str]]:
        """One summary per candidate (label, median, IQR, ...) with its speedup."""
        return [t.summary() | {"speedup": self.speedup(k)} for k, t in self.timings.items()]

    def to_frame(self):
        """:meth:`rows` as a DataFrame indexed by label."""
        import pandas as pd

        return pd.DataFrame(self.rows()).set_index("label")


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
    """``slow``'s time minus ``fast``'s in each round."""
    return [a - b for a, b in zip(samples[slow], samples[fast], strict=True)]


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval holding the median of what ``values`` sample with at least
    ``confidence``: the k-th smallest and k-th largest value, k the largest whose binomial tail
    P(Bin(n, 1/2) < k) stays within (1 - confidence) / 2; the whole range when none does."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median_interval needs at least one value, got none")
    tail, k = 0.0, 0
    while k < n // 2:
        tail += math.comb(n, k) / 2**n  # P(Bin(n, 1/2) = k), added: P(... <= k)
        if tail > (1 - confidence) / 2:
            break
        k += 1
    k = max(k, 1)  # 1-based: the smallest value at least
    return ordered[k - 1], ordered[n - k]


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile, clamped so rounding never leaves [min, max]."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    i = int(pos)
    if i + 1 >= len(ordered):
        return ordered[-1]
    lo, hi = ordered[i], ordered[i + 1]
    return min(max(lo + (hi - lo) * (pos - i), lo), hi)


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
    """Call ``fn`` ``calls`` times as one sample; returns the reader of its ms per call (with
    ``cuda``, CUDA events time it, and reading waits for the GPU: defer it, and samples queue
    back to back). ``idle_first`` waits for the GPU before the sample starts."""
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
    baseline: str | None = None,
    caller: str = "interleaved",
) -> Comparison:
    """Time ``fns`` on ``device`` interleaved: ``warmup`` calls of each, then ``repeats`` rounds
    in :func:`round_order`, one sample of each candidate per round.

    ``calls_per_sample=None`` picks, per candidate, enough calls for a sample to last
    ``min_sample_ms`` (for functions of microseconds). ``on_sample(name, round, ms)`` is called
    as each sample completes (on CUDA this waits for the GPU after every sample, which a live plot
    needs). With ``name_errors`` an exception of a candidate is raised as
    :class:`CandidateError` naming it. ``clock`` says what a sample measures (the module's
    docstring). ``baseline``: the candidate ratios are taken against (the first by default).
    Without ``on_sample`` and with the ``"device"`` clock this waits for the GPU once, at the end.
    """
    names = _checked_candidates(fns, caller)
    baseline = names[0] if baseline is None else baseline
    if baseline not in fns:
        raise ValueError(f"baseline {baseline!r} is not a candidate; candidates are {names}")
    repeats = checked_count(repeats, "repeats", at_least=1)
    warmup = checked_count(warmup, "warmup")
    if calls_per_sample is not None:
        calls_per_sample = checked_count(calls_per_sample, "calls_per_sample", at_least=1)
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
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
    timings = {
        n: Timing(n, tuple(read() for read in pending[n]), calls[n], dev.type) for n in names
    }
    return Comparison(timings, baseline, tuple(schedule))


def _checked_candidates(fns: Mapping[str, Callable[[], object]], caller: str) -> list[str]:
    if not isinstance(fns, Mapping):
        raise TypeError(
            f"{caller}() takes a mapping of label to callable, e.g. {{'before': f, 'after': g}}; "
            f"got a {type(fns).__name__}"
        )
    if not fns:
        raise ValueError(f"{caller}() needs at least one candidate, got none")
    for name, fn in fns.items():
        checked_callable(fn, f"{caller}: candidate {name!r}")
    return list(fns)


def compare(
    candidates: Mapping[str, Callable[[], object]],
    *,
    baseline: str | None = None,
    warmup: int = 3,
    repeats: int = 30,
    calls_per_sample: int | None = 1,
    min_sample_ms: float = 1.0,
    device: torch.device | str | None = None,
    on_sample: SampleCallback | None = None,
    clock: Clock = "device",
) -> Comparison:
    """:func:`interleaved` on this machine's device (or ``device``), with a candidate's error
    raised naming it: ``compare({"before": f, "after": g})``."""
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r} but CUDA is not available here; time on device='cpu' "
            "(or leave device unset to pick the default)"
        )
    return interleaved(
        candidates, dev, warmup=warmup, repeats=repeats, calls_per_sample=calls_per_sample,
        min_sample_ms=min_sample_ms, on_sample=on_sample, name_errors=True, clock=clock,
        baseline=baseline, caller="compare",
    )  # fmt: skip


def time_fn(
    fn: Callable[[], object],
    *,
    label: str = "fn",
    warmup: int = 3,
    repeats: int = 30,
    calls_per_sample: int | None = 1,
    min_sample_ms: float = 1.0,
    device: torch.device | str | None = None,
) -> Timing:
    """Median and spread of one callable: :func:`compare` with a single candidate."""
    comparison = compare({label: fn}, warmup=warmup, repeats=repeats, device=device,
                         calls_per_sample=calls_per_sample,
                         min_sample_ms=min_sample_ms)  # fmt: skip
    return comparison.timings[label]
