"""The ``overhead`` phase's ground, shared by its parts: host time per call and single-call
latency of candidates timed interleaved, their rows, and a sweep summary's count of misses."""

from __future__ import annotations

import statistics

import torch

from accel.lab.bench import BenchContext, Row
from accel.measure.timer import Comparison, compare, round_differences

PHASE = "overhead"
HOST_CALLS = 50  # calls per host-clock sample
HOST_ROUNDS = 41  # a host's pace drifts: the median of many rounds outlasts a slow spell


def host_times(fns: dict, device: torch.device, repeats: int = HOST_ROUNDS) -> Comparison:
    """Host time per call of each of ``fns`` (the first is the baseline), interleaved."""
    return compare(fns, repeats=repeats, warmup=10, calls_per_sample=HOST_CALLS, device=device,
                   clock="host")  # fmt: skip


def latencies(fns: dict, device: torch.device, repeats: int = 25) -> Comparison:
    """One call's latency from an idle GPU, of each of ``fns`` (the first is the baseline)."""
    return compare(fns, repeats=repeats, warmup=3, device=device, clock="latency")


def host_rows(ctx: BenchContext, case: str, timing: Comparison, ours: str, *, added_us=None,
              most_us=None, note: str = "") -> list[Row]:  # fmt: skip
    """Host µs per call of ``ours`` beside the baseline's, judged on its own µs against
    ``most_us``; with ``added_us``, a second row of the µs it adds, taken within each round (the
    host's pace drifts between rounds) and judged against ``added_us``: its note gives the middle
    half of the rounds."""
    mine = timing.timings[ours].median_ms * 1e3
    plain = timing.timings[timing.baseline].median_ms * 1e3
    sampled = f"{HOST_CALLS} calls a sample from an idle GPU"
    rows = [Row(
        PHASE, case, "host time per call", "us", mine, baseline=plain,
        target=f"<= {most_us:g} us" if most_us is not None else "",
        met=mine <= most_us if ctx.judged and most_us is not None else None,
        note=f"{ctx.where}; {sampled}{note}",
    )]  # fmt: skip
    if added_us is None:
        return rows
    added = [ms * 1e3 for ms in round_differences(timing.samples, ours, timing.baseline)]
    typical = statistics.median(added)
    low, _, high = statistics.quantiles(added, n=4) if len(added) > 1 else (typical,) * 3
    rows.append(Row(
        PHASE, case, "host time added per call", "us", typical,
        target=f"<= {added_us:g} us over {timing.baseline}",
        met=typical <= added_us if ctx.judged else None,
        note=f"{ctx.where}; {ours} over {timing.baseline}'s {plain:.1f} us "
        f"({typical / plain:.0%} of it), round by round (middle half of rounds {low:+.1f} to "
        f"{high:+.1f} us); {sampled}{note}",
    ))  # fmt: skip
    return rows


def latency_row(ctx: BenchContext, case: str, timing: Comparison, ours: str, *,
                at_least: float | None = None, note: str = "") -> Row:  # fmt: skip
    """One call's latency of ``ours`` beside the baseline's; the speedup judged round by round
    against ``at_least`` where given."""
    paired = timing.paired_ratio(timing.baseline, ours)
    return Row(
        PHASE, case, "single-call latency", "us", timing.timings[ours].median_ms * 1e3,
        baseline=timing.timings[timing.baseline].median_ms * 1e3,
        target=f">= {at_least:g}x" if at_least is not None else "",
        met=paired >= at_least if ctx.judged and at_least is not None else None,
        note=f"{ctx.where}; {timing.baseline} / {ours} round by round {paired:.3f}x{note}",
    )  # fmt: skip
