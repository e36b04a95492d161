"""Bench phase ``doctor``, part ``ladder <script>``: the doctor on training scripts as people first
write them (``accel.doctor.ladder``), against each script's hand-optimized twin: the twin's
speedup (the headroom), the best set of ``try_fixes()`` as a share of it, each ground-truth change
found (at its line where a line names it) and tried, each fix's predicted saving beside its
measured one, examine's time, and the findings on the twin whose fix does not pay. The targets
are the constants below.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

from accel.doctor import examine, ladder
from accel.doctor.timeline import CALLS
from accel.doctor.trial import fixed_step
from accel.lab.bench import BenchContext, Row
from accel.measure.timer import compare

PHASE = "doctor"
TARGET_SHARE = 0.8  # the best set's speedup over the twin's, each script
TARGET_GEOMEAN = 0.9  # ... as the geometric mean over the ladder
TARGET_WITHIN = 0.30  # |predicted / measured - 1| of a fix's saving
TARGET_EXAMINE_S = 30.0
TARGET_TWIN_PAYS = 1.05  # a finding on a twin is a false alarm unless its fix pays this much
LINE_KINDS = frozenset({"attention", "sync", "input", "clip_loop", "optimizer_loop", "tensor_loop"})
JUDGED_SHARE = 0.03  # a saving under this share of the step is inside the timing's spread
REPEATS = 6  # rounds of each timing (the fewest that give a 95% interval of the median ratio)


def parts() -> list[str]:
    return [f"ladder {name}" for name in ladder.SCRIPTS]


def run_script(name: str, ctx: BenchContext, costs) -> list[Row]:
    first = ladder.build(name, device=ctx.device, preset=ctx.preset)
    twin = ladder.build(name, optimized=True, device=ctx.device, preset=ctx.preset)
    hand = _hand_speedup(first, twin, ctx)
    started = time.perf_counter()
    report = examine(first.step, first.batch, ceilings=ctx.ceilings, costs=costs)
    examine_s = time.perf_counter() - started
    trials = report.try_fixes(repeats=REPEATS, steps=2)
    final = _final_round(first, twin, report, trials, ctx)
    rows = [*_speedup_rows(name, hand, trials, final, ctx), *_truth_rows(name, report, trials, ctx),
            *_prediction_rows(name, report, trials, ctx), _examine_row(name, examine_s, ctx),
            _twin_row(name, twin, ctx, costs)]  # fmt: skip
    torch._dynamo.reset()  # what the twin and the trials compiled, freed before the next script
    return rows


def _hand_speedup(first, twin, ctx: BenchContext) -> dict:
    timing = compare(
        {"as written": lambda: first.step(first.batch), "hand-optimized": lambda: twin.step(twin.batch)},
        warmup=3,  # the twin compiles in its first calls
        repeats=REPEATS,
        calls_per_sample=CALLS,
        device=ctx.device,
    )  # fmt: skip
    t = timing.timings
    return {
        "written ms": t["as written"].median_ms,
        "hand ms": t["hand-optimized"].median_ms,
        "speedup": timing.paired_ratio("as written", "hand-optimized"),
    }


def _final_round(first, twin, report, trials, ctx: BenchContext) -> dict | None:
    """The script as written, its twin and the doctor's best set timed in one interleaved run:
    the share from paired rounds (the twin's time drifts between runs by more than the share's
    margin), with the 95% interval of its median."""
    best = _best(trials)
    if best is None:
        return None
    gc.collect()  # the trials' copies, so that the three run on a heap and allocator none holds
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    timing = compare(
        {"as written": lambda: first.step(first.batch), "hand-optimized": lambda: twin.step(twin.batch),
         "doctor": fixed_step(report, best["fixes"].split("+"))},
        warmup=3, repeats=REPEATS, calls_per_sample=CALLS, device=ctx.device,
    )  # fmt: skip
    return {
        "share": timing.paired_ratio("hand-optimized", "doctor"),
        "interval": timing.median_ratio_interval("hand-optimized", "doctor"),
        "doctor": timing.paired_ratio("as written", "doctor"),
        "hand": timing.paired_ratio("as written", "hand-optimized"),
    }


def _best(trials):
    best = trials[trials["best set"].eq(True)]
    return best.iloc[0] if len(best) else None


def _speedup_rows(name: str, hand: dict, trials, final: dict | None, ctx: BenchContext) -> list[Row]:
    best = _best(trials)
    doctor = best["measured speedup"] if best is not None else 1.0
    label = best["label"] if best is not None else "no fix helped"
    share = doctor / hand["speedup"]
    said = f"doctor {doctor:.2f}x, hand-optimized {hand['speedup']:.2f}x"
    if final is not None:
        low, high = final["interval"]
        share = final["share"]
        said = (f"the three timed in one run: doctor {final['doctor']:.2f}x, hand-optimized "
                f"{final['hand']:.2f}x; share's 95% interval {low:.2f}-{high:.2f}")  # fmt: skip
    return [
        Row(PHASE, f"ladder {name}: hand-optimized", "time per step, as written vs the "
            "hand-optimized twin", "ms", hand["hand ms"], baseline=hand["written ms"],
            note=f"the headroom there was: {hand['speedup']:.2f}x (paired rounds)"),
        Row(PHASE, f"ladder {name}: doctor's best set", "time per step, unchanged copy vs the "
            "best set of try_fixes()", "ms", best["measured ms"] if best is not None else math.nan,
            baseline=best["unchanged ms"] if best is not None else math.nan,
            note=f"{label}: {doctor:.2f}x; {best['status'] if best is not None else ''}"),
        Row(PHASE, f"ladder {name}: share of the hand-optimized speedup", "the best set's "
            "speedup over the twin's", "ratio", share, higher_is_better=True,
            target=f">= {TARGET_SHARE}", met=share >= TARGET_SHARE if ctx.judged else None,
            note=said),
    ]  # fmt: skip


def _found(kind: str, lines: list[int], report) -> bool:
    findings = [f for f in report.findings if f.kind == kind]
    if kind not in LINE_KINDS:
        return bool(findings)
    return any(s.line in lines for f in findings for s in f.sites)


def _truth_rows(name: str, report, trials, ctx: BenchContext) -> list[Row]:
    truth = ladder.ground_truth(name)
    measured = set(trials.loc[trials["status"].isin(["ok", "slower here"]), "fixes"])
    found, tried, missing, untried = [], [], [], []
    for kind, lines in truth.items():
        (found if _found(kind, lines, report) else missing).append(kind)
        fixes = {n for f in report.findings if f.kind == kind for n in f.fixes}
        (tried if fixes & measured else untried).append(kind)
    n = len(truth)
    return [
        Row(PHASE, f"ladder {name}: ground truth found", "changes of the hand-optimization "
            "found (at their line where a line names them)", "count", len(found), baseline=n,
            higher_is_better=True, target="all", met=not missing if ctx.judged else None,
            note=f"found {sorted(found)}; missing {sorted(missing) or 'none'}"),
        Row(PHASE, f"ladder {name}: ground truth tried", "changes of the hand-optimization "
            "tried on the copy and measured", "count", len(tried), baseline=n,
            higher_is_better=True, target="all", met=not untried if ctx.judged else None,
            note=f"not tried: {sorted(untried) or 'none'}"),
    ]  # fmt: skip


def _prediction_rows(name: str, report, trials, ctx: BenchContext) -> list[Row]:
    rows = []
    for trial in trials.to_dict("records"):
        measured_ok = trial["status"] in ("ok", "slower here")  # a loss is a measurement too
        if not measured_ok or not math.isfinite(trial["predicted ms"]):
            continue
        predicted = 1 - trial["predicted ms"] / (report.evidence.step_us / 1e3)
        measured = 1 - trial["measured ms"] / trial["unchanged ms"]
        predicted_by = [f for f in report.findings if trial["fixes"] in f.fixes]
        if trial["mode"] == "alone" and all(f.saved_us is None for f in predicted_by):
            continue  # no finding predicted this fix's saving (or its finding measures by trying)
        off = abs(predicted / measured - 1) if measured > 0 else math.inf
        low, high = _interval(trial)
        small = max(predicted, measured) < JUDGED_SHARE
        covered = off > TARGET_WITHIN and low <= trial.get("predicted speedup", math.nan) <= high
        if small:
            why = f"; under {JUDGED_SHARE:.0%} of the step either way: inside the spread, not judged"
        elif covered:
            why = f"; inside the measured speedup's 95% interval {low:.2f}-{high:.2f}x: not judged"
        else:
            why = f"; measured speedup's 95% interval {low:.2f}-{high:.2f}x" * math.isfinite(low)
        judged = ctx.judged and not small and not covered
        rows.append(
            Row(PHASE, f"ladder {name}: prediction {trial['fixes']}", "saving as a share of the "
                f"step, measured vs predicted (from {trial['predicted from']})", "%",
                100 * predicted, baseline=100 * measured, target=f"within {TARGET_WITHIN:.0%}",
                met=off <= TARGET_WITHIN if judged else None,
                note=f"{off:.0%} apart; {trial['label']}{why}")
        )  # fmt: skip
    return rows


def _interval(trial: dict) -> tuple[float, float]:
    """The interval of the measured speedup the trial gives (nan where it timed too few rounds)."""
    low, _, high = str(trial.get("speedup interval", "nan-nan")).partition("-")
    try:
        return float(low), float(high)
    except ValueError:
        return math.nan, math.nan


def _examine_row(name: str, seconds: float, ctx: BenchContext) -> Row:
    return Row(PHASE, f"ladder {name}: examine time", "seconds examine took (no compiling)", "s",
               seconds, target=f"<= {TARGET_EXAMINE_S:g} s",
               met=seconds <= TARGET_EXAMINE_S if ctx.judged else None)  # fmt: skip


def _twin_row(name: str, twin, ctx: BenchContext, costs) -> Row:
    """The twin examined and its fixes tried: a finding whose fix pays under 5% is false."""
    report = examine(twin.step, twin.batch, ceilings=ctx.ceilings, costs=costs)
    fixes = report.fixes()
    trials = report.try_fixes(fixes, repeats=REPEATS, steps=2) if fixes else None
    alarms = []
    for finding in report.findings:
        tried = trials[trials["fixes"].isin(finding.fixes)] if trials is not None else None
        pays = tried is not None and (tried["measured speedup"] >= TARGET_TWIN_PAYS).any()
        if not pays:
            alarms.append(finding.title)
    return Row(PHASE, f"ladder {name}: twin's findings that do not pay", "findings on the "
               "hand-optimized twin whose fix does not pay 5%", "count", len(alarms), target="0",
               met=not alarms if ctx.judged else None,
               note="; ".join(alarms) or "none")  # fmt: skip


def ladder_table(rows):
    """Recorded ladder rows (a DataFrame of ``results/``) as one row per script and device: the
    twin's speedup, the doctor's best set, the share and the gap it leaves."""
    import pandas as pd

    out = []
    scripts = rows["case"].str.extract(r"^ladder (\w+):")[0]
    for (device, script), group in rows.groupby([rows["device"], scripts]):
        by = {c.split(": ", 1)[1]: r
              for c, r in zip(group["case"], group.to_dict("records"), strict=True)}  # fmt: skip
        names = ("hand-optimized", "doctor's best set", "share of the hand-optimized speedup")
        hand, best, share = (by.get(k) for k in names)
        if not (hand and best and share):
            continue
        hand_x = float(hand["baseline"]) / float(hand["optimized"])
        doctor_x = float(best["baseline"]) / float(best["optimized"])
        out.append({
            "device": device, "script": script, "hand-optimized": round(hand_x, 2),
            "doctor": round(doctor_x, 2), "share": round(float(share["optimized"]), 3),
            "target met": share["met"], "gap left": round(hand_x / doctor_x, 2),
            "best set": str(best["note"]).split(":")[0],
        })  # fmt: skip
    return pd.DataFrame(out)


def ladder_summary(rows):
    """Recorded ladder rows as one row per device: the geometric mean of the scripts' shares
    against its target, computed from the share rows each time (a stored mean would go stale
    when one script is rerun)."""
    import pandas as pd

    shares = rows[rows["case"].str.match(r"^ladder \w+: share of the hand-optimized speedup$")]
    out = []
    for device, group in shares.groupby("device"):
        values = [float(v) for v in group["optimized"] if float(v) > 0 and math.isfinite(float(v))]
        if not values:
            continue
        mean = statistics.geometric_mean(values)
        out.append({"device": device, "scripts": len(values), "geometric mean share": round(mean, 3),
                    "target": f">= {TARGET_GEOMEAN}", "met": mean >= TARGET_GEOMEAN})  # fmt: skip
    return pd.DataFrame(out)
