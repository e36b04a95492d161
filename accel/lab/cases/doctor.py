"""Bench phase ``doctor``: the doctor on every zoo model (``accel.doctor.zoo``): the planted
problems found, the clean twin's findings (false alarms), the top finding's predicted saving
beside the saving measured by removing that one problem (a launch-bound step's: its blockers
removed, then a CUDA graph), as shares of the step, and the best set ``try_fixes`` measured.
Targets: every planted problem found, no finding on a clean twin, the top finding within 30% of
its measured share on every model, the planted GPT's safe fixes together at least 3x.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accel.doctor import examine, zoo
from accel.doctor.timeline import CALLS
from accel.lab.bench import BenchContext, Row
from accel.lab.cases import doctor_ladder
from accel.measure.costs import measure_costs
from accel.measure.timer import compare

PHASE = "doctor"
TARGET_TOP_WITHIN = 0.30  # |predicted / measured - 1| of each model's top finding
TARGET_GPT_FIXES = 3.0  # the planted GPT's step over the step with every safe fix
# planted kinds whose removal is exactly the change the finding proposes (a stepwise loop's
# finding, launch-bound, proposes a graph: graph_saving measures that)
MEASURABLE = frozenset({"sync", "attention", "optimizer_loop", "clip_loop", "precision",
                        "tensor_loop", "input", "zero_grad"})  # fmt: skip


def feeder(case: zoo.ZooCase) -> Callable[[], Any]:
    """The step as the user runs it: on the loader's next batch if any, else the batch."""
    if case.loader is None:
        return lambda: case.step(case.batch)
    # the loader gone through again and again (its iterator starts on first use)
    batches = itertools.chain.from_iterable(itertools.repeat(case.loader))
    return lambda: case.step(next(batches))


CAPTURE_BLOCKERS = frozenset({"sync"})  # planted kinds that stop a CUDA graph capturing a step


@dataclass(frozen=True)
class Saving:
    """A change's saving, timed interleaved against the planted model's step."""

    ms: float  # per step: the median over rounds of the difference within a round
    step_ms: float  # the planted model's step in the same rounds
    how: str = ""

    @property
    def share(self) -> float:
        return self.ms / self.step_ms


def saving(
    name: str, planted: frozenset[str], changed: Callable[[], Any], ctx: BenchContext, how=""
) -> Saving:
    """The planted model's step against ``changed``, interleaved round by round (a host-bound
    step drifts with the host's speed; within a round both see the same host)."""
    with_it = zoo.build(name, planted, device=ctx.device, preset=ctx.preset)
    repeats = 8 if ctx.device.type == "cuda" else 3
    timing = compare({"with": feeder(with_it), "changed": changed}, warmup=3, repeats=repeats,
                     calls_per_sample=CALLS, device=ctx.device)
    mine, theirs = timing.timings["with"].times_ms, timing.timings["changed"].times_ms
    diff = statistics.median(a - b for a, b in zip(mine, theirs, strict=True))
    return Saving(diff, statistics.median(mine), how)


def graph_saving(name: str, planted: frozenset[str], ctx: BenchContext, costs) -> Saving:
    """A launch-bound finding's change: the planted kinds that stop a capture removed, then
    ``GraphedStep`` on what is left (checked by ``try_fixes`` first: NaN if it did not run)."""
    blockers = planted & CAPTURE_BLOCKERS
    free = zoo.build(name, planted - blockers, device=ctx.device, preset=ctx.preset)
    report = examine(free.step, free.batch, loader=free.loader, ceilings=ctx.ceilings, costs=costs)
    trial = report.try_fixes(["cuda_graph"]).iloc[0]
    if trial["status"] != "ok":
        return Saving(math.nan, math.nan, f"the graph did not run: {trial['status']}")
    graphed = report.fixed_step(report.fix_flags()(cuda_graph=True))
    how = f"measured with {sorted(blockers)} removed and the rest replayed by GraphedStep"
    return saving(name, planted, graphed, ctx, how)


def parts() -> list[str]:
    """The zoo, then each ladder script (``bench --phase doctor --only ladder``)."""
    return ["zoo", *doctor_ladder.parts()]


def run(ctx: BenchContext) -> list[Row]:
    costs = measure_costs(ctx.device)
    rows: list[Row] = []
    if ctx.selected("zoo"):
        for name in zoo.MODELS:
            rows += model_rows(name, ctx, costs)
    for part in doctor_ladder.parts():
        if ctx.selected(part):
            rows += doctor_ladder.run_script(part.removeprefix("ladder "), ctx, costs)
    return ctx.judge(rows)


def model_rows(name: str, ctx: BenchContext, costs) -> list[Row]:
    judged = ctx.judged
    build = dict(device=ctx.device, preset=ctx.preset)
    planted = zoo.build(name, True, **build)
    rates = dict(ceilings=ctx.ceilings, costs=costs)
    report = examine(planted.step, planted.batch, loader=planted.loader, **rates)
    clean = zoo.build(name, False, **build)
    clean_report = examine(clean.step, clean.batch, loader=clean.loader, **rates)
    return [_found_row(name, planted, report, judged), _false_alarm_row(name, clean_report, judged),
            *_prediction_rows(name, planted, report, ctx, costs), *_fix_rows(name, report, judged)]


def _found_row(name: str, case: zoo.ZooCase, report, judged: bool) -> Row:
    found = report.kinds()
    missing, extra = case.expected - found, found - case.expected
    return Row(PHASE, f"{name}: planted problems found", "planted problems found by examine (those "
               "visible on this device)", "count", len(case.expected & found),
               baseline=len(case.expected), higher_is_better=True, target="all",
               met=not missing if judged else None,
               note=f"planted {sorted(case.expected)}; missing {sorted(missing) or 'none'}; also "
               f"found {sorted(extra) or 'nothing else'}; step {report.step_ms:.3f} ms")  # fmt: skip


def _false_alarm_row(name: str, report, judged: bool) -> Row:
    return Row(PHASE, f"{name}: clean twin's findings", "findings on the same model without its "
               "planted problems (false alarms)", "count", len(report.findings), target="0",
               met=not report.findings if judged else None,
               note="; ".join(f.title for f in report.findings) or "none")  # fmt: skip


def _measured_saving(name: str, case: zoo.ZooCase, kind: str, ctx, costs) -> Saving | None:
    """The saving measured for the finding ``kind`` on this model, or None where it cannot be."""
    if kind == zoo.FINDING_OF["stepwise"] and "stepwise" in case.planted:
        return graph_saving(name, case.planted, ctx, costs)
    if kind in MEASURABLE & case.planted:  # removed alone from the planted model
        without = zoo.build(name, case.planted - {kind}, device=ctx.device, preset=ctx.preset)
        return saving(name, case.planted, feeder(without), ctx)
    return None


def _prediction_rows(name: str, case: zoo.ZooCase, report, ctx: BenchContext, costs) -> list[Row]:
    """The top finding (the first with a prediction whose change can be measured on its own),
    judged, as shares of the step (the prediction's of the step examine measured, the
    measurement's of the step in its own rounds: a host-bound step's speed moves between the
    two); the findings below it are not measured, as no row reads them."""
    for finding in report.findings:
        if finding.saved_us is None:
            continue
        measured = _measured_saving(name, case, finding.kind, ctx, costs)
        if measured is None:
            continue
        step_us = report.evidence.iteration_us  # with the wait for data, as the loop runs it
        predicted = finding.saved_us / step_us
        off = abs(predicted / measured.share - 1) if measured.share > 0 else math.inf
        return [Row(
            PHASE, f"{name}: {finding.kind} saving (top finding)",
            "saving as a share of the step: measured (the problem removed alone or its change "
            "applied) vs predicted", "%", 100 * predicted, baseline=100 * measured.share,
            target=f"within {TARGET_TOP_WITHIN:.0%}",
            met=(off <= TARGET_TOP_WITHIN) if ctx.judged else None,
            note=f"baseline = measured, optimized = predicted ({off:.0%} apart): predicted "
            f"{finding.saved_us / 1e3:.3f} ms of a {step_us / 1e3:.3f} ms step, measured "
            f"{measured.ms:.3f} ms of a {measured.step_ms:.3f} ms step; {finding.cost_model}"
            + (f"; {measured.how}" if measured.how else ""),
        )]  # fmt: skip
    return []


def _fix_rows(name: str, report, judged: bool) -> list[Row]:
    """The best set of ``try_fixes`` (the planted GPT's judged), or for the GPT a row saying none
    made the step faster."""
    trials = report.try_fixes()
    best = trials[trials["best set"].astype(bool)].to_dict("records")
    gpt_target = f">= {TARGET_GPT_FIXES}x" if name == "gpt" else ""
    if not best:
        return [Row(PHASE, f"{name}: fix (best set)", "time per step, unchanged vs with the best "
                    "set of fixes", "ms", math.nan, target=gpt_target,
                    met=False if judged and gpt_target else None,
                    note="no fix made the step faster within its allowance")] if gpt_target else []
    trial = best[0]
    return [Row(
        PHASE, f"{name}: fix {trial['fixes']} (best set)",
        "time per step, unchanged vs with the fix (predicted speedup in the note)", "ms",
        trial["measured ms"], baseline=trial["unchanged ms"], target=gpt_target,
        met=(trial["status"] == "ok" and trial["measured speedup"] >= TARGET_GPT_FIXES)
        if gpt_target and judged else None,
        note=f"{trial['status']}; predicted {trial['predicted speedup']:.2f}x; error "
        f"{trial['error']:.2g} (allowed {trial['allowance']:.0e}: {trial['allowed by']}); "
        f"first call {trial['first call s']:.2f} s",
    )]  # fmt: skip
