"""The ladder's bench part on what it reads: the ground truth found by kind or at its line, and
the recorded rows as one row per script."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from accel.doctor.recorder import Site
from accel.lab.cases import doctor_ladder


def report_of(*findings):
    return SimpleNamespace(findings=list(findings))


def finding(kind, *lines):
    return SimpleNamespace(kind=kind, sites=[Site("s.py", n, "f") for n in lines], fixes=())


def test_a_change_a_line_names_is_found_only_at_that_line():
    assert doctor_ladder._found("sync", [12], report_of(finding("sync", 12)))
    assert not doctor_ladder._found("sync", [12], report_of(finding("sync", 40)))
    # about the whole model: found by its kind wherever the products ran
    assert doctor_ladder._found("precision", [5], report_of(finding("precision", 99)))
    assert not doctor_ladder._found("precision", [5], report_of(finding("sync", 5)))


def test_recorded_rows_become_one_row_per_script_with_the_gap_left():
    def row(case, baseline, optimized, met="", note=""):
        return {"device": "GPU", "case": f"ladder gpt2: {case}", "baseline": baseline,
                "optimized": optimized, "met": met, "note": note}  # fmt: skip

    rows = pd.DataFrame(
        [
            row("hand-optimized", 200.0, 25.0),
            row("doctor's best set", 200.0, 40.0, note="bf16 autocast + compile: 5.00x; ok"),
            row("share of the hand-optimized speedup", float("nan"), 0.625, met=False),
        ]
    )
    (shown,) = doctor_ladder.ladder_table(rows).to_dict("records")
    assert (shown["hand-optimized"], shown["doctor"], shown["share"]) == (8.0, 5.0, 0.625)
    assert shown["gap left"] == pytest.approx(1.6) and shown["best set"] == "bf16 autocast + compile"


def test_the_ladder_summary_is_the_geometric_mean_of_each_devices_shares():
    def share(device, script, value):
        return {"device": device, "case": f"ladder {script}: share of the hand-optimized speedup",
                "optimized": value}  # fmt: skip

    rows = pd.DataFrame([
        share("A", "gpt2", 0.64), share("A", "bert", 1.0), share("B", "gpt2", 0.95),
        {"device": "A", "case": "ladder gpt2: hand-optimized", "optimized": 0.01},
    ])  # fmt: skip
    summary = doctor_ladder.ladder_summary(rows).set_index("device")
    assert summary.loc["A", "geometric mean share"] == pytest.approx(0.8)
    assert summary.loc["A", "scripts"] == 2 and not summary.loc["A", "met"]
    assert summary.loc["B", "met"] and summary.loc["B", "scripts"] == 1


def test_a_fix_measured_slower_is_still_judged_against_its_prediction():
    """bf16 predicted 40% on a host-bound step and measured slower: a miss the rows must show;
    a fix no finding predicted (tried with the others, or a finding that measures by trying)
    gets no row of its own."""
    report = SimpleNamespace(
        findings=[SimpleNamespace(fixes=("bf16_autocast",), saved_us=4_000.0),
                  SimpleNamespace(fixes=("channels_last",), saved_us=None)],
        evidence=SimpleNamespace(step_us=10_000.0),
    )
    trials = pd.DataFrame([
        {"fixes": "bf16_autocast", "label": "bf16", "mode": "alone", "status": "slower here",
         "predicted ms": 6.0, "predicted from": "the findings' cost models",
         "measured ms": 10.5, "unchanged ms": 10.0},
        {"fixes": "fused_optimizer", "label": "fused", "mode": "alone", "status": "ok",
         "predicted ms": 10.0, "predicted from": "the findings' cost models",
         "measured ms": 9.9, "unchanged ms": 10.0},
        {"fixes": "channels_last", "label": "channels last", "mode": "alone", "status": "ok",
         "predicted ms": 10.0, "predicted from": "the findings' cost models",
         "measured ms": 8.7, "unchanged ms": 10.0},
    ])  # fmt: skip
    ctx = SimpleNamespace(judged=True)
    (row,) = doctor_ladder._prediction_rows("vit", report, trials, ctx)
    assert row.case == "ladder vit: prediction bf16_autocast" and row.met is False
    assert (row.optimized, row.baseline) == pytest.approx((40.0, -5.0))


def test_a_prediction_inside_the_measured_interval_is_not_judged_a_miss():
    """A host-bound step moves 10% between readings: a prediction 40% off the median but inside
    the measured speedup's 95% interval is not refuted by it; one outside it is a miss."""
    report = SimpleNamespace(
        findings=[SimpleNamespace(fixes=("tf32",), saved_us=500.0),
                  SimpleNamespace(fixes=("compile",), saved_us=500.0)],
        evidence=SimpleNamespace(step_us=10_000.0),
    )
    trial = {"mode": "alone", "status": "ok", "predicted from": "the findings' cost models",
             "unchanged ms": 10.0}  # fmt: skip
    trials = pd.DataFrame([
        trial | {"fixes": "tf32", "label": "TF32", "predicted ms": 9.5, "predicted speedup": 1.053,
                 "measured ms": 9.2, "speedup interval": "0.98-1.19"},
        trial | {"fixes": "compile", "label": "compile", "predicted ms": 9.5,
                 "predicted speedup": 1.053, "measured ms": 8.0, "speedup interval": "1.20-1.30"},
    ])  # fmt: skip
    tf32, compiled = doctor_ladder._prediction_rows("gpt2", report, trials, SimpleNamespace(judged=True))
    assert tf32.met is None and "inside the measured speedup's 95% interval 0.98-1.19x" in tf32.note
    assert compiled.met is False and "interval 1.20-1.30x" in compiled.note


def test_the_share_comes_from_one_run_of_the_script_its_twin_and_the_best_set(monkeypatch):
    """The twin's time drifts between runs by more than the share's margin: the share is the
    twin's time over the best set's, paired round by round in one interleaved run."""
    timed = {}

    class Timing:
        def paired_ratio(self, slow, fast):
            return {("hand-optimized", "doctor"): 0.85, ("as written", "doctor"): 8.5,
                    ("as written", "hand-optimized"): 10.0}[(slow, fast)]  # fmt: skip

        def median_ratio_interval(self, slow, fast):
            return (0.8, 0.9)

    def compare(calls, **kwargs):
        timed.update(calls)
        return Timing()

    monkeypatch.setattr(doctor_ladder, "compare", compare)
    monkeypatch.setattr(doctor_ladder, "fixed_step", lambda report, names: ("built", tuple(names)))
    script = SimpleNamespace(step=lambda batch: None, batch=None)
    trials = pd.DataFrame([{"fixes": "bf16_autocast+compile", "label": "bf16 + compile",
                            "best set": True, "status": "ok", "mode": "together",
                            "measured speedup": 9.0, "measured ms": 1.0, "unchanged ms": 9.0}])  # fmt: skip
    final = doctor_ladder._final_round(script, script, None, trials,
                                      SimpleNamespace(device=torch.device("cpu")))
    assert timed["doctor"] == ("built", ("bf16_autocast", "compile"))
    hand = {"speedup": 9.5, "hand ms": 1.0, "written ms": 9.5}
    rows = doctor_ladder._speedup_rows("gpt2", hand, trials, final, SimpleNamespace(judged=True))
    share = rows[-1]
    assert share.optimized == 0.85 and share.met is True and "0.80-0.90" in share.note
