import math
import statistics
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accel.measure.timer import (
    CLOCKS,
    CandidateError,
    Timing,
    compare,
    interleaved,
    paired_ratio,
    round_order,
    time_fn,
)


def test_time_fn_gives_positive_median_with_spread(device, seed):
    x = torch.randn(256, 256, device=device)
    t = time_fn(lambda: x @ x, repeats=15, device=device)
    assert len(t.times_ms) == 15
    assert t.median_ms > 0
    assert t.q25_ms <= t.median_ms <= t.q75_ms
    assert t.iqr_ms >= 0 and t.min_ms <= t.median_ms


def test_time_fn_measures_what_runs():
    t = time_fn(lambda: time.sleep(0.002), repeats=5, warmup=1, device="cpu")
    assert 1.9 <= t.median_ms < 20


def test_compare_interleaves_rotating_and_reversing_the_order():
    log = []
    c = compare({k: (lambda k=k: log.append(k)) for k in "abc"}, warmup=0, repeats=6, device="cpu")
    # turned by one place every second round, reversed in odd rounds: all six orders of three
    assert log == list("abccbabcaacbcabbac")
    assert c.schedule == tuple(log)
    log.clear()
    compare({k: (lambda k=k: log.append(k)) for k in "ab"}, warmup=0, repeats=4, device="cpu")
    assert log == list("abbabaab")  # two candidates: each goes first half the time


@settings(deadline=None)
@given(st.integers(min_value=1, max_value=7))
def test_over_two_n_rounds_each_candidate_holds_every_place_twice_behind_both_neighbours(n):
    names = [str(i) for i in range(n)]
    orders = [round_order(names, r) for r in range(2 * n)]
    assert all(sorted(order) == names for order in orders)
    for name in names:
        assert sorted(order.index(name) for order in orders) == sorted(2 * list(range(n)))
        behind = {order[order.index(name) - 1] for order in orders if order.index(name) > 0}
        i = names.index(name)
        assert n < 3 or {names[i - 1], names[(i + 1) % n]} <= behind


def test_interleaved_gives_rounds_aligned_samples_and_medians():
    samples = interleaved({"a": lambda: None, "b": lambda: None}, "cpu", warmup=0, repeats=5)
    assert [len(t) for t in samples.samples.values()] == [5, 5]
    assert [t.calls_per_sample for t in samples.timings.values()] == [1, 1]
    assert set(samples.medians()) == {"a", "b"} and samples.baseline == "a"


def test_paired_ratio_is_taken_round_by_round_not_from_two_medians():
    slow, fast = (1.0, 10.0, 12.0), (0.5, 11.0, 6.0)  # per round: 2, 0.91, 2
    assert paired_ratio({"slow": slow, "fast": fast}, "slow", "fast") == 2.0
    assert statistics.median(slow) / statistics.median(fast) == pytest.approx(10 / 6)
    assert math.isnan(paired_ratio({"slow": slow}, "slow", "fast"))


@pytest.mark.parametrize("clock", CLOCKS)
def test_every_clock_times_what_runs_on_a_cpu(clock):
    samples = interleaved(
        {"sleep": lambda: time.sleep(0.002)}, "cpu", warmup=0, repeats=3, clock=clock
    )
    assert all(1.9 <= t < 20 for t in samples.samples["sleep"])


def test_an_unknown_clock_is_refused_naming_the_clocks():
    with pytest.raises(ValueError, match="clock must be one of device, latency, host, got 'wall'"):
        interleaved({"a": lambda: None}, "cpu", warmup=0, repeats=1, clock="wall")


def test_interleaved_raises_a_candidates_own_error_unless_asked_to_name_it():
    def boom():
        raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError):
        interleaved({"x": boom}, "cpu", warmup=1, repeats=1)
    with pytest.raises(CandidateError, match="candidate 'x' raised ZeroDivisionError"):
        interleaved({"x": boom}, "cpu", warmup=1, repeats=1, name_errors=True)


def test_compare_warms_up_each_candidate_before_timing():
    log = []
    compare({k: (lambda k=k: log.append(k)) for k in "ab"}, warmup=2, repeats=1, device="cpu")
    assert log == list("aabbab")


def test_speedup_is_baseline_over_candidate():
    slow, fast = (lambda: time.sleep(0.004)), (lambda: time.sleep(0.001))
    c = compare({"slow": slow, "fast": fast}, warmup=1, repeats=5, device="cpu")
    assert c.speedup("slow") == 1.0
    assert c.speedup("fast") > 2
    frame = c.to_frame()
    assert list(frame.index) == ["slow", "fast"]
    assert frame.loc["fast", "speedup"] == pytest.approx(c.speedup("fast"))


def test_calibration_batches_tiny_calls():
    x = torch.randn(8)
    t = time_fn(lambda: x.add(1), calls_per_sample=None, min_sample_ms=0.5, repeats=3, device="cpu")
    assert t.calls_per_sample > 1


def test_on_sample_reports_every_sample():
    seen = []
    compare(
        {"a": lambda: None, "b": lambda: None},
        repeats=4,
        warmup=0,
        device="cpu",
        on_sample=lambda label, r, ms: seen.append((label, r, ms)),
    )
    assert len(seen) == 8 and all(ms >= 0 for _, _, ms in seen)
    assert [r for _, r, _ in seen] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(repeats=0), "repeats must be an int >= 1, got 0"),
        (dict(warmup=-1), "warmup must be an int >= 0, got -1"),
        (dict(calls_per_sample=0), "calls_per_sample"),
        (dict(baseline="zzz"), "baseline 'zzz' is not a candidate"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compare({"a": lambda: None}, device="cpu", **kwargs)


def test_no_candidates_is_an_error():
    with pytest.raises(ValueError, match="at least one candidate"):
        compare({}, device="cpu")


# Generation speed depends on the machine's load; the property does not.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.floats(min_value=1e-6, max_value=1e6), min_size=1, max_size=50))
def test_timing_statistics_are_ordered(times):
    t = Timing("x", tuple(times))
    assert t.min_ms <= t.q25_ms <= t.median_ms <= t.q75_ms <= max(times)


def test_empty_timing_is_an_error():
    with pytest.raises(ValueError, match="at least one sample"):
        Timing("x", ())


def test_cuda_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda' but CUDA is not available.*'cpu'"):
        compare({"a": lambda: None}, device="cuda", repeats=1)


def test_a_candidate_that_is_not_callable_is_named():
    with pytest.raises(
        TypeError, match=r"compare: candidate 'a': expected a function to call, got 42 \(int\)"
    ):
        compare({"a": 42}, repeats=1, device="cpu")


@pytest.mark.parametrize("when", ["warm-up", "timing"])
def test_a_candidate_that_raises_is_named(when):
    calls = []

    def flaky():
        calls.append(1)
        if when == "warm-up" or len(calls) > 1:
            raise ZeroDivisionError("boom")

    with pytest.raises(
        RuntimeError, match=r"candidate 'flaky' raised ZeroDivisionError: boom"
    ) as e:
        compare(
            {"ok": lambda: None, "flaky": flaky},
            warmup=int(when == "warm-up"),
            repeats=2,
            device="cpu",
        )
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_a_mapping_is_expected():
    with pytest.raises(TypeError, match=r"a mapping of label to callable.*got a list"):
        compare([lambda: None], device="cpu")


def test_a_speedup_of_an_unknown_label_names_the_labels():
    result = compare({"before": lambda: None, "after": lambda: None}, repeats=2)
    with pytest.raises(KeyError, match=r"no candidate 'zz'.*'before', 'after'"):
        result.speedup("zz")


def test_ratio_band_is_the_spread_of_the_round_by_round_ratios():
    from accel.measure.timer import Comparison

    slow = Timing("slow", [2.0, 4.0, 6.0, 8.0, 10.0])
    fast = Timing("fast", [1.0, 1.0, 2.0, 2.0, 2.0])  # ratios 2, 4, 3, 4, 5
    c = Comparison({"slow": slow, "fast": fast}, baseline="slow", schedule=())
    assert c.ratio_band("slow", "fast", 0.0, 1.0) == (2.0, 5.0)
    low, high = c.ratio_band("slow", "fast")
    assert 2.0 < low < c.paired_ratio("slow", "fast") == 4.0 <= high < 5.0


def test_the_median_ratios_interval_is_between_order_statistics_that_cover_95_percent():
    """15 rounds: the 4th and 12th smallest ratios bound the median with 96.5% confidence (a
    binomial tail of 1.8% on each side); 5 rounds cannot reach 95%: the whole range."""
    from accel.measure.timer import Comparison

    fast = Timing("fast", [1.0] * 15)
    slow = Timing(
        "slow", [1.0 + r / 100 for r in (7, 0, 14, 3, 10, 1, 12, 5, 8, 2, 13, 6, 9, 4, 11)]
    )
    c = Comparison({"slow": slow, "fast": fast}, baseline="slow", schedule=())
    assert c.median_ratio_interval("slow", "fast") == pytest.approx((1.03, 1.11))
    few = Comparison(
        {"slow": Timing("slow", [3.0, 1.0, 2.0, 5.0, 4.0]), "fast": Timing("fast", [1.0] * 5)},
        baseline="slow",
        schedule=(),
    )
    assert few.median_ratio_interval("slow", "fast") == (1.0, 5.0)
