"""Timing: medians, spreads and speedups of candidates timed interleaved by ``accel.timer``.

Why not ``torch.utils.benchmark.Timer``: it times with the host clock on every device and runs
one candidate's repeats back to back, so a clock or thermal drift between candidates lands in
their ratio. Here every sample of every candidate is taken in turn, the order rotated and
reversed round by round (A B C, C B A, B C A, ...), and, on CUDA, is bracketed by device events,
so host overhead that does not delay the GPU is not counted as step time, while GPU idle time
waiting for launches is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from accel.errors import checked_callable
from accel.lab.device import default_device
from accel.timer import (
    CandidateError,
    Clock,
    SampleCallback,
    interleaved,
    paired_ratio,
    round_differences,
    round_ratios,
)

__all__ = ["CandidateError", "Comparison", "SampleCallback", "Timing", "compare", "time_fn"]


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
        return _quantile(self.times_ms, 0.25)

    @property
    def q75_ms(self) -> float:
        return _quantile(self.times_ms, 0.75)

    @property
    def iqr_ms(self) -> float:
        """Spread: the interquartile range, robust to the odd slow sample."""
        return self.q75_ms - self.q25_ms

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    def summary(self) -> dict[str, float | int | str]:
        return {
            "label": self.label,
            "median_ms": self.median_ms,
            "q25_ms": self.q25_ms,
            "q75_ms": self.q75_ms,
            "iqr_ms": self.iqr_ms,
            "min_ms": self.min_ms,
            "samples": len(self.times_ms),
            "calls_per_sample": self.calls_per_sample,
            "device": self.device,
        }

    def __str__(self) -> str:
        return (
            f"{self.label}: median {self.median_ms:.4g} ms "
            f"(IQR {self.q25_ms:.4g}-{self.q75_ms:.4g}, n={len(self.times_ms)})"
        )


@dataclass(frozen=True)
class Comparison:
    """Interleaved timings of several candidates; ratios are against ``baseline``."""

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

    def paired_ratio(self, slow: str, fast: str) -> float:
        """``slow``'s time over ``fast``'s, round by round (:func:`accel.timer.paired_ratio`)."""
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
        return _quantile(ratios, low), _quantile(ratios, high)

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


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile, clamped so rounding never leaves [min, max]."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    i = int(pos)
    if i + 1 >= len(ordered):
        return ordered[-1]
    lo, hi = ordered[i], ordered[i + 1]
    return min(max(lo + (hi - lo) * (pos - i), lo), hi)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r} but CUDA is not available here; time on device='cpu' "
            "(or leave device unset to pick the default)"
        )
    return dev


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
    """Time several candidates interleaved, so that drift cancels in their ratios.

    Each candidate is warmed up ``warmup`` times, then ``repeats`` rounds run one sample of every
    candidate, the order rotated and reversed round by round (:func:`accel.timer.round_order`).
    ``calls_per_sample=None`` picks, per candidate, enough calls for a sample to last
    ``min_sample_ms`` (for functions of microseconds). ``on_sample(label, round, ms)`` is called
    as each sample completes (this waits for the GPU after every sample, which a live plot needs).
    ``clock``: what a sample measures on a GPU, its time there back to back (``"device"``), one
    call's latency from an idle GPU (``"latency"``) or the host time of the call (``"host"``).
    """
    if not isinstance(candidates, Mapping):
        raise TypeError(
            f"compare() takes a mapping of label to callable, e.g. {{'before': f, 'after': g}}; "
            f"got a {type(candidates).__name__}"
        )
    if not candidates:
        raise ValueError("compare() needs at least one candidate, got none")
    for label, fn in candidates.items():
        checked_callable(fn, f"compare: candidate {label!r}")
    labels = list(candidates)
    baseline = labels[0] if baseline is None else baseline
    if baseline not in candidates:
        raise ValueError(f"baseline {baseline!r} is not a candidate; candidates are {labels}")
    dev = _resolve_device(device)
    samples = interleaved(
        candidates,
        dev,
        warmup=warmup,
        repeats=repeats,
        calls_per_sample=calls_per_sample,
        min_sample_ms=min_sample_ms,
        on_sample=on_sample,
        name_errors=True,
        clock=clock,
    )
    timings = {
        k: Timing(k, samples.times_ms[k], samples.calls_per_sample[k], dev.type) for k in labels
    }
    return Comparison(timings, baseline, samples.schedule)


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
    comparison = compare(
        {label: fn},
        warmup=warmup,
        repeats=repeats,
        calls_per_sample=calls_per_sample,
        min_sample_ms=min_sample_ms,
        device=device,
    )
    return comparison.timings[label]
