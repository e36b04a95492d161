"""The sdpa bench phase and its helpers: cost model, profiler read-out, sweep rows round trip."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from accel import attention as A
from accel.lab import plots
from accel.lab.bench import BenchContext
from accel.lab.cases import sdpa, sdpa_measure
from accel.lab.ceilings import Ceilings
from accel.workloads import vit

CPU = torch.device("cpu")
FAKE_CEILINGS = Ceilings("cpu", 10.0, 0.5, "float32", 1 << 20, 256)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_cost_model_counts():
    # the shape: 4 * 4 * 16 * 4096^2 * 128 = 0.55 TFLOP per forward
    assert sdpa.attention_flops(4, 16, 4096, 4096, 128) == pytest.approx(5.4976e11, rel=1e-4)
    assert sdpa.attention_flops(1, 1, 8, 8, 4, causal=True) == 4 * 64 * 4 / 2
    assert sdpa.attention_flops(1, 1, 8, 8, 4, backward=True) == 3.5 * 4 * 64 * 4
    fused = sdpa.attention_bytes(1, 2, 8, 8, 4, elem_bytes=2)
    assert fused == 2 * (16 + 16) * 4 * 2
    manual = sdpa.attention_bytes(1, 2, 8, 8, 4, elem_bytes=2, manual=True)
    assert manual - fused == 6 * 2 * 64 * 2


@pytest.mark.parametrize(
    ("variant", "expected"),
    [("flash", "flash"), ("math", "math"), ("manual", "none (manual)")],
)
def test_profiler_names_the_backend_that_ran(variant, expected):
    case = sdpa.AttnCase(1, 2, 33, 16, dtype=torch.float32)
    q, k, v, grad = sdpa.make_inputs(case, CPU)
    ran = sdpa.which_backend(sdpa.variant_fn(variant, case, q, k, v, grad), CPU)
    assert ran["backend"] == expected


def test_manual_path_needs_the_scores_in_memory_and_sdpa_does_not():
    case = sdpa.AttnCase(1, 4, 255, 16, dtype=torch.float32)
    q, k, v, grad = sdpa.make_inputs(case, CPU)
    scores = 4 * 255 * 255 * 4
    manual = sdpa.peak_memory_bytes(sdpa.variant_fn("manual", case, q, k, v, grad), CPU)
    fused = sdpa.peak_memory_bytes(sdpa.variant_fn("flash", case, q, k, v, grad), CPU)
    assert manual >= 2 * scores > 4 * fused


def test_check_backends_table(seed):
    q, k, v = (torch.randn(1, 2, 17, 16) for _ in range(3))
    table = sdpa.check_backends(q, k, v, causal=True).set_index("backend")
    assert set(table.index) == {"manual", *A.BACKENDS}
    ran = table[table["ran"]]
    assert ran["within_tolerance"].all() and (ran["max_abs_error"] < 1e-5).all()
    assert not table.loc["cudnn", "ran"] and "CPU" in table.loc["cudnn", "reason"]


def test_measure_point_skips_with_reasons():
    case = sdpa.AttnCase(2, 2, 31, 16, causal=True, backward=True, dtype=torch.float32)
    point = sdpa.measure_point(case, CPU, ("manual", "auto", "cudnn", "math"), repeats=2)
    assert set(point.times) >= {"manual", "auto", "math"} and "cudnn" not in point.times
    assert all(t > 0 for t in point.times.values())
    assert "CPU" in point.skipped["cudnn"]
    point = sdpa.measure_point(case, CPU, ("math",), repeats=1, math_bytes=0)
    assert "GiB" in point.skipped["math"]


def test_sweep_rows_round_trip_through_recorded_results():
    sizes = sdpa.SweepSizes((15,), (8,), heads=2, tokens=30, dtype=torch.float32, repeats=2)
    frame = sdpa.sweep(CPU, sizes, variants=("default", "auto", "flash", "cudnn"))
    assert (
        len(frame) == 4 * 4 and frame["skipped"][frame["backend"] == "cudnn"].str.len().gt(0).all()
    )
    ctx = BenchContext(CPU, "cpu", FAKE_CEILINGS)
    rows = sdpa.sweep_rows(frame, ctx, judged=False)
    assert len(rows) == 4 and all(r.met is None for r in rows)
    recorded = pd.DataFrame([r.as_dict() | {"device": "cpu"} for r in rows])
    back = sdpa.sweep_frame(recorded)
    ran = frame[frame["skipped"] == ""]
    merged = ran.merge(back, on=["S", "D", "causal", "direction", "backend"], suffixes=("", "_rec"))
    assert len(merged) == len(ran)
    assert ((merged["tflop_s"] - merged["tflop_s_rec"]).abs() <= 1e-3 * merged["tflop_s"]).all()
    fig = plots.sdpa_sweep(back, ceiling_tflop_s=0.5)
    assert len(fig.data) == 3 * 4  # 3 backends that ran x (2 directions x 2 masks) panels


def test_run_on_cpu_gives_unjudged_sdpa_rows(monkeypatch):
    tiny = sdpa.BenchSizes(
        headline=sdpa.AttnCase(1, 2, 17, 8, dtype=torch.float32),
        sweep=sdpa.SweepSizes((9,), (8,), heads=2, tokens=18, dtype=torch.float32, repeats=1),
        repeats=1,
        vit_repeats=1,
    )
    monkeypatch.setitem(sdpa.BENCH_SIZES, "cpu", tiny)
    small = vit.Sizes(image=8, patch=4, dim=8, heads=2, depth=1, classes=2, batch=2, batches=1)
    monkeypatch.setitem(vit.Sizes.PRESETS, "cpu", small)
    flex = sdpa.FlexSizes(1, 2, 8, torch.float32, 5, (17,), (17,), 2, 17, 17, repeats=1)
    monkeypatch.setitem(sdpa.FLEX_SIZES, "cpu", flex)
    rows = sdpa.run(BenchContext(CPU, "cpu", FAKE_CEILINGS))
    assert {r.phase for r in rows} == {"sdpa"}
    assert all(r.met is None and r.note.startswith("not judged") for r in rows)
    cases = [r.case for r in rows]
    assert "vit step: all but compile" in cases and "sweep fwd causal D=8 S=9" in cases
    assert "flex sliding window 5 B=1 H=2 S=17 D=8 fwd" in cases
    auto = next(r for r in rows if r.case == "B=1 H=2 S=17 D=8 full fwd auto")
    assert auto.optimized > 0 and not math.isnan(auto.fraction_of_ceiling)
    assert "profiler: " in auto.note
    equal = [r for r in rows if r.case.startswith("vit step")]
    assert all("result equal" in r.note for r in equal), [r.note for r in equal]


def test_sweep_records_auto_pick_and_a_second_copy_of_it():
    sizes = sdpa.SweepSizes((15,), (8,), heads=2, tokens=30, dtype=torch.float32, repeats=3)
    frame = sdpa.sweep(CPU, sizes, variants=("default", "auto", "flash", "math"))
    point = frame[(frame["direction"] == "fwd") & ~frame["causal"]]
    assert point["picked"].iloc[0] in ("default", "math")
    assert (point["picked_ms"] > 0).all() and "ms" in point["decision"].iloc[0]
    # what the pick was held to: the larger of auto's margin and the default's own spread
    assert "kept unless beaten by" in point["decision"].iloc[0]
    rows = sdpa.sweep_rows(frame, BenchContext(CPU, "cpu", FAKE_CEILINGS), judged=False)
    assert all("auto picked" in r.note and "forced again" in r.note for r in rows)
    back = sdpa.sweep_frame(pd.DataFrame([r.as_dict() | {"device": "cpu"} for r in rows]))
    assert set(back["backend"]) == {"default", "auto", "flash", "math"}  # the copy is no line
    summary = {r.case: r for r in sdpa.sweep_summary_rows(frame, judged=False)}
    assert {
        "sweep: worst auto / the same backend forced",
        "sweep: worst the pick forced again / forced",
        "sweep: worst auto / default",
    } <= set(summary)
    assert summary["sweep: worst auto / the same backend forced"].optimized > 0


def test_measure_point_times_variants_in_the_timers_rotated_and_reversed_rounds(monkeypatch):
    taken = []
    real = sdpa_measure.interleaved
    monkeypatch.setattr(
        sdpa_measure, "interleaved", lambda *a, **kw: taken.append(real(*a, **kw)) or taken[-1]
    )
    case = sdpa.AttnCase(1, 2, 15, 8, dtype=torch.float32)
    point = sdpa.measure_point(case, CPU, ("default", "auto", "flash", "math"), repeats=4)
    (samples,) = taken
    names = list(samples.times_ms)
    assert names == ["default", "auto", "flash", "math", sdpa.PICKED]
    # round r: turned by r // 2 places, reversed when r is odd
    turned = names[1:] + names[:1]
    rounds = [names, names[::-1], turned, turned[::-1]]
    assert list(samples.schedule) == [name for order in rounds for name in order]
    assert all(len(t) == 4 for t in samples.times_ms.values())  # one sample per round, aligned
    assert point.times == samples.medians() and point.picked in ("default", "math")


def test_paired_ratio_is_the_median_of_round_ratios():
    # the clock falls over the point: medians of each would say b is 1.25x slower than a
    samples = {"a": [1.0, 2.0, 4.0, 8.0], "b": [1.01, 2.02, 4.04, 8.08]}
    assert sdpa.paired_ratio(samples, "b", "a") == pytest.approx(1.01)
    assert math.isnan(sdpa.paired_ratio(samples, "b", "missing"))


def _point_frame(
    versus_auto: dict[str, float], ms: dict[str, float], control: float = 1.0
) -> pd.DataFrame:
    rows = [
        {
            "S": 64, "D": 16, "B": 1, "H": 2, "causal": False, "direction": "fwd",
            "backend": b, "ms": t, "flops": 1e9, "tflop_s": 1e9 / (t * 1e-3) / 1e12,
            "skipped": "", "picked": "cudnn", "picked_ms": ms["cudnn"], "decision": "cudnn=1ms",
            "versus_auto": versus_auto[b], "control": control,
        }
        for b, t in ms.items()
    ]  # fmt: skip
    return pd.DataFrame(rows)


def test_sweep_is_judged_on_round_by_round_ratios():
    # by medians auto is 0.95x default; round by round it is 0.99x default and 1.0x cudnn
    ms = {"default": 0.95, "auto": 1.0, "cudnn": 1.0, "flash": 2.0}
    frame = _point_frame({"default": 0.99, "auto": 1.0, "cudnn": 1.0, "flash": 2.0}, ms)
    ctx = BenchContext(CPU, "cpu", FAKE_CEILINGS)
    (row,) = sdpa.sweep_rows(frame, ctx, judged=True)
    assert row.met is True and "auto / default = 0.990" in row.note
    assert "auto / best forced (cudnn) = 1.000" in row.note
    summary = {r.case: r for r in sdpa.sweep_summary_rows(frame, judged=True)}
    assert summary["sweep: worst auto / default"].optimized == pytest.approx(0.99)
    assert summary["sweep: worst auto / best forced backend"].met is True
    # a point where auto is really 3% behind the best forced backend fails
    frame = _point_frame({"default": 1.0, "auto": 1.0, "cudnn": 0.97, "flash": 2.0}, ms)
    (row,) = sdpa.sweep_rows(frame, ctx, judged=True)
    assert row.met is False
    assert summary["sweep: worst auto / default"].met is True


def test_a_point_whose_own_spread_is_wider_than_the_margin_says_so():
    ms = {"default": 1.0, "auto": 1.0, "cudnn": 0.97, "flash": 2.0}
    versus = {"default": 1.0, "auto": 1.0, "cudnn": 0.97, "flash": 2.0}
    ctx = BenchContext(CPU, "cpu", FAKE_CEILINGS)
    (steady,) = sdpa.sweep_rows(_point_frame(versus, ms, control=0.995), ctx, judged=True)
    (noisy,) = sdpa.sweep_rows(_point_frame(versus, ms, control=0.962), ctx, judged=True)
    assert steady.met is noisy.met is False  # the verdict stays what was measured
    assert "margin" not in steady.note
    assert "the same kernel twice differs by 3.8%, more than the target's 2% margin" in noisy.note


def test_an_attention_sweep_point_says_when_its_own_noise_hides_the_target():
    """F.sdpa against its copy: a median within 3% but rounds so spread that the median's 95%
    interval passes 3% is named as noise, as a median off by more than 3% is; a tight one is
    not."""
    from accel.lab.cases import overhead_attention as sweep

    assert sweep.noise_note(1.0, (0.99, 1.01)) == ""
    for ratio, interval in ((1.0, (0.95, 1.02)), (1.0, (0.99, 1.04)), (1.04, (1.035, 1.05))):
        note = sweep.noise_note(ratio, interval)
        assert "inside this point's noise" in note and f"{interval[0]:.3f}" in note, note


def test_a_missed_attention_sweep_point_says_what_bounds_it():
    """A miss is put on the host where F.sdpa's host time is most of its time on the GPU back to
    back and the host time auto adds to a call is itself past the 3% of it the target allows; on
    the point's noise where F.sdpa against its copy moves past 3%; on both; on the pairing of
    rounds where auto's median call is not the slower; or else on the microseconds auto adds. A
    met point has none."""
    from accel.lab.cases import overhead_attention as sweep
    from accel.lab.cases.overhead import misses_summary

    def cause(ratio, share, noisy, added=3.5, host_added=3.0, call=30.0):
        return sweep.miss_cause(ratio, host_share=share, noisy=noisy, added_us=added,
                                host_added_us=host_added, call_us=call)  # fmt: skip

    assert cause(0.98, 0.9, True) is None
    assert cause(0.90, 0.9, False) == "host"
    assert cause(0.90, 0.9, True) == "host and noise"
    assert cause(0.90, 0.4, True) == "noise"
    assert cause(0.96, 0.4, False) == "added"
    # a host-bound call whose added host time fits the 3% it allows: the host does not explain it
    assert cause(0.96, 0.95, True, added=17.0, host_added=2.0, call=400.0) == "noise"
    assert cause(0.96, 0.95, False, added=17.0, host_added=2.0, call=400.0) == "added"
    assert cause(0.96, 0.95, False, added=17.0, host_added=12.5, call=400.0) == "host"
    assert cause(0.90, 0.9, False, added=3.5, host_added=0.8, call=30.0) == "added"
    # past its 3%, the host time lands whole, whatever the latency's own spread adds to it
    assert cause(0.88, 0.9, False, added=5.0, host_added=2.0, call=30.0) == "host"
    # auto's median call not the slower: the rounds' pairing, not auto's time, missed
    assert cause(0.96, 0.85, True, added=-4.7) == "not slower"
    assert cause(0.96, 0.4, False, added=0.0) == "not slower"
    assert set(sweep.MISS_CAUSES) == set(sweep.MISS_COUNTED)
    for name, words in sweep.MISS_CAUSES.items():  # every note's words fill in
        assert words.startswith("; ") and "{" not in words.format(
            share=0.9, added=4.0, host_added=3.0, plain=30.0
        ), name
    causes = ["host", "host", "host and noise", "noise", None, "added", "not slower"]
    summary = misses_summary(causes, sweep.MISS_COUNTED)
    assert summary == (
        "6 point(s) missed: 2 bound by the host, 1 by the host and inside their noise, "
        "1 inside their noise, 1 by auto's added time, 1 by the pairing of rounds "
        "(auto's median not the slower)"
    )
