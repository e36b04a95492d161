"""``Report.try_fixes``: each fix on its own copy of the step, then the best set of those that
helped, each checked against an unchanged copy (same start, batch and seed) and timed against it
interleaved. A fix may differ from the unchanged step by its argued tolerance or
:data:`SPREAD_MULTIPLE` times the unchanged step's own spread (:func:`own_spread`), the larger,
in what the steps return and in the trained state alike (:mod:`accel.doctor.agreement`); one
slower beyond the timing's spread is "slower here" and stays out of the combined trial.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accel.doctor.agreement import SEED, Errors, dropout_off, result_error
from accel.doctor.check_compute import FUSED_KERNELS
from accel.doctor.check_host import GRAPH_REPLAY_OVER_KERNELS
from accel.doctor.check_kernels import MATMUL_OPS
from accel.doctor.fixes import FIXES, GRAPH_WARMUP, FixNotApplicable, StepCopy, left_as_written
from accel.doctor.isolation import Session
from accel.doctor.parts import copy_step, loader_copies_ended
from accel.doctor.reach import where_raised
from accel.doctor.timeline import CALLS
from accel.doctor.untouched import Untouched
from accel.errors import UsageError
from accel.memory import peak_memory

__all__ = ["ACTS_ON", "combined_prediction_us", "fix_names", "fixed_step", "replay_device_savings",
           "tolerance", "try_fixes"]  # fmt: skip

EXCLUSIVE = ({"cuda_graph", "compile", "compile_graphs"}, {"fused_optimizer", "foreach_optimizer"},
             {"batched_clip", "foreach_clip"})  # fmt: skip
# a fix swapped for its next rung on the best set: once the other fixes have shortened the
# device's work, launching the compiled kernels can hold the step back, which CUDA graphs remove
NEXT_RUNG = {"compile": "compile_graphs"}
GRAPHED = {"compile_graphs", "cuda_graph"}  # fixes whose step is replayed, launched by no host
SPREAD_MULTIPLE = 4.0  # a fix's allowance: at least this many times the unchanged step's own spread
COMBINED_TRIES = 3  # combined trials at most, each without the least helpful fix of the last
NEUTRAL = 0.98  # a fix measured at least this fast alone may still help beside the others
RETRY_SHARE = 0.03  # a fix predicted to save this share of the step is retried on the best set
RETRIES = 3  # fixes left out of the best set tried on it, one at a time, at most
JUDGED_ROUNDS = 6  # fewer rounds give no 95% interval of the median ratio: then ...
EVERY_ROUND = 5  # ... a fix slower in each of at least this many (1 in 32 by chance) is slower
_KERNELS = ("matmul", "attention", "normalization", "elementwise and other", "compiled (Triton)")
_FUSED = (*FUSED_KERNELS, "idle host", "idle other")  # what compile merges
# the parts of a step's time (the timeline's kernel categories, "idle <cause>") each fix acts on
ACTS_ON: dict[str, tuple[str, ...]] = {
    "tf32": ("matmul",),
    "bf16_autocast": _KERNELS,
    "sdpa_attention": _KERNELS,
    "mha_without_weights": _KERNELS,
    "compile": _FUSED,
    "compile_graphs": _FUSED,
    "cuda_graph": ("idle host", "idle sync", "idle other"),
    "deferred_reads": ("idle sync",),
    "pinned_batch": ("copy", "idle sync"),
    "fused_optimizer": ("optimizer", "idle host"),
    "foreach_optimizer": ("optimizer", "idle host"),
    "foreach_clip": ("elementwise and other", "idle host"),
    "batched_clip": ("elementwise and other", "idle host"),
    "foreach_loop": ("elementwise and other", "idle host"),
    "set_to_none": ("memset", "idle host"),
    "channels_last": ("matmul", "elementwise and other"),
    "cudnn_benchmark": ("matmul",),
    "padded_products": ("matmul",),
    "checkpointing": (),
}
# fixes that take launches off the host, so that a saving of the kernels the host hid may show
# beside them; compile's own kernels are launched by Python wrappers, and on a BatchNorm CNN
# its host took as long as the eager step's (results/doctor-notes.md)
FREES_HOST = frozenset(n for n, parts in ACTS_ON.items() if "idle host" in parts) - {"compile"}
_MAX_SHARE = 0.95  # no fix removes all of a part of the step
# the parts a fix's saving comes off first (the rest, if any, off the other parts it acts on):
# bf16 runs the products several times faster, the elementwise work between them less so
SAVES_FIRST = {"bf16_autocast": ("matmul", "attention")}
# fixes that do the same work another way: under autocast the products run in bf16, where TF32
# has no say, so together they save what the better of them saves alone
ALTERNATIVES = (frozenset({"tf32", "bf16_autocast"}),)


def replay_device_savings(findings: list, timeline) -> None:
    """Each predicted saving that only the device's kernels make (every fix of the finding acts
    on kernels alone) as the step keeps it where the device waits for the host: spread over the
    kernels its fixes act on and replayed on the profiled timeline
    (:meth:`~accel.doctor.timeline.Timeline.step_saving_us`)."""
    for f in findings:
        acts = {p for n in f.fixes for p in ACTS_ON.get(n, ("not a kernel",))}
        if f.saved_us is None or not f.fixes or not acts <= set(_KERNELS):
            continue
        kept = timeline.spread_saving_us(f.saved_us, sorted(acts))
        f.kernels_us = f.saved_us
        if kept < 0.9 * f.saved_us:
            f.cost_model += (f"; replayed on the step's timeline, where the device waits for the "
                             f"host: {kept / 1e3:.3f} ms of it shortens the step")  # fmt: skip
        f.saved_by_fix = {n: timeline.spread_saving_us(saved, ACTS_ON[n])
                          for n, saved in f.saved_by_fix.items()}  # fmt: skip
        f.saved_us = kept


def try_fixes(report, fixes: list[str] | None, *, steps: int, repeats: int | None, progress=False):
    import pandas as pd

    names = report.fixes() if fixes is None else fix_names(fixes)
    for what, value in (("steps", steps), ("repeats", 1 if repeats is None else repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"try_fixes needs {what} as an int >= 1, got {value!r}")
    if not report.parts.all:
        raise ValueError("try_fixes needs the step's model or optimizer, and none was found")
    if report.evidence.parts is report.parts:  # examine ran on the user's own objects
        raise UsageError("try_fixes needs copies of what the step trains, and examine ran on your "
                         "own objects (allow_training=True; the report's first line says why)")
    cuda = report.evidence.device.type == "cuda"
    repeats = repeats or (8 if cuda else 5)
    with isolated(report) as session:
        rows = _trials(report, names, steps, repeats, progress, session.tidy_compiled,
                       compile_last=fixes is None)
    _record_measured(report, rows)
    return pd.DataFrame(rows, columns=TRIAL_COLUMNS)


@contextlib.contextmanager
def isolated(report) -> Iterator[Session]:
    """Where the copies of the report's step run: on leaving, what their code changed is put
    back (the random generators, which the trials seed, the process's switches, files and
    folders, the loader copies' workers ended), and what could not be kept from changing is
    warned and named in the report."""
    with Session() as session, loader_copies_ended():
        session.watch(report.parts.reach.objects.values())
        untouched = Untouched(report.parts, report.batch)
        yield session
    _name_side_effects(report, session.effects(), untouched.report())


def _trials(report, names: list[str], steps: int, repeats: int, progress: bool, tidy, *,
            compile_last: bool = False):
    """The unchanged step's own spread, each fix alone, then the best set of them; ``tidy`` runs
    after each trial (what its copy compiled freed)."""
    from tqdm.auto import tqdm

    if not names:  # nothing to try: the step is not run again
        return []

    with tqdm(total=len(names) + 2, desc="fixes", disable=not progress) as bar:
        bar.set_description_str("running the unchanged step twice")
        try:
            spread = own_spread(report, steps)
        except Exception:  # a step that fails run twice: its fixes' own tolerances, and each
            spread = Errors(0.0, 0.0)  # trial says how the step fails
        rows = []
        for name in names:
            bar.update()
            bar.set_description_str(f"trying {FIXES[name].label}")
            rows.append(_trial(report, [name], steps, repeats, spread))
            tidy()
        bar.update()
        bar.set_description_str("trying the helpful ones together")
        rows += _together(report, rows, steps, repeats, spread, tidy, compile_last=compile_last)
        bar.update()
    return rows


def fix_names(fixes: Any) -> list[str]:
    """``fixes`` as a list of known fix names, each once (one name may come as a string)."""
    names = [fixes] if isinstance(fixes, str) else fixes
    try:
        names = list(names)
    except TypeError:
        raise UsageError(f"fixes must be a fix name or a list of them, got {fixes!r}") from None
    unknown = [n for n in names if not isinstance(n, str) or n not in FIXES]
    if unknown:
        raise UsageError(f"unknown fixes {unknown}; expected some of {', '.join(FIXES)}")
    return list(dict.fromkeys(names))  # each once, in the order given


def _name_side_effects(report, effects, changed: list[str]) -> None:
    """What the trials changed that they could not keep from changing: warned now, and named
    first in the report's summary (added to what examining named, each once)."""
    found = effects.said() + changed
    if found:
        warnings.warn("accel.doctor's trials: " + "; ".join(found), RuntimeWarning, stacklevel=4)
    report.effects += effects
    said = {_uncounted(what) for what in report.changed}
    report.changed += [what for what in changed if _uncounted(what) not in said]


def _uncounted(what: str) -> str:
    return re.sub(r" \(\d+ times\)", "", what)


def own_spread(report, steps: int) -> Errors:
    """The relative differences between two runs of the unchanged step from the same start, one
    with its parameters moved by a rounding step (as summing in another order moves them): what
    the step makes of rounding (Adam turns a bias's noise before a BatchNorm into full updates),
    with what a device that does not compute the same twice adds."""
    first, second = _fresh(report), _fresh(report)
    signs: dict[torch.device, torch.Generator] = {}  # made where each parameter lives
    with torch.no_grad():
        for p in (p for m in second.parts.models for p in m.parameters()
                  if p.is_floating_point() and not p.is_meta):
            gen = signs.setdefault(p.device, torch.Generator(p.device).manual_seed(SEED))
            flip = torch.randint(0, 2, p.shape, generator=gen, device=p.device, dtype=p.dtype)
            p.mul_(flip.mul_(2 * torch.finfo(p.dtype).eps).add_(1 - torch.finfo(p.dtype).eps))
    error, _ = result_error(first.build(), second.build(), first, second, steps)
    return error


def _together(report, rows: list[dict], steps: int, repeats: int, spread: Errors,
              tidy: Callable[[], None] = lambda: None, *, compile_last: bool = False) -> list[dict]:  # fmt: skip
    """Combined trials of the fixes that helped, then the best of them with the fixes predicted
    to help that it left out; the best row (a combined one, or the best fix alone where no
    combination beat it) is marked ``best set``. ``tidy`` runs after each trial.
    ``compile_last``: compile's rung is tried on the best set where no fix of its kind ran."""

    def attempt(names: list[str], predicted_us: float | None = None) -> dict:
        row = _trial(report, names, steps, repeats, spread, predicted_us=predicted_us)
        tidy()
        return row

    # not only the fixes that helped alone: one sync removed while another stays (a pageable copy
    # and a read) gains nothing alone, both together do
    kept = sorted(
        (r for r in rows if r["status"] == "ok" and r["measured speedup"] >= NEUTRAL),
        key=lambda r: -r["measured speedup"],
    )
    helped = [r for r in kept if r["measured speedup"] > 1.0]
    if not helped:
        return []
    chosen: list[str] = []
    for row in kept:
        name = row["fixes"]
        if not any(name in group and group.intersection(chosen) for group in EXCLUSIVE):
            chosen.append(name)
    out: list[dict] = []
    while len(chosen) >= 2 and len(out) < COMBINED_TRIES:
        predicted = combined_prediction_us(report, rows, chosen)
        out.append(attempt(chosen, predicted))
        last = out[-1]
        if last["status"] == "ok" and last["measured speedup"] >= helped[0]["measured speedup"]:
            break
        chosen = chosen[:-1]
    candidates = [r for r in (*out, *helped[:1]) if r["status"] == "ok"]
    if not candidates:
        return out
    best = max(candidates, key=lambda r: r["measured speedup"])
    in_best = best["fixes"].split("+")
    for name in _left_out(report, rows, best)[:RETRIES]:  # each kept only where it pays
        out.append(attempt([*in_best, name]))
        if out[-1]["status"] == "ok" and out[-1]["measured speedup"] > best["measured speedup"]:
            best, in_best = out[-1], [*in_best, name]
    # a rung's base in the set is swapped for it; a base that ran alone but joined no set (compile
    # slower alone, its launches left on the host) has its rung added to the set
    bases = [n for n in in_best if n in NEXT_RUNG] + [
        r["fixes"] for r in rows if r["fixes"] in NEXT_RUNG and _may_join(r, in_best)]  # fmt: skip
    # compile, which an expert adds last: float32 products can hide the kernels it fuses from
    # every finding, and once the set has shortened them they are what is left
    compiled = EXCLUSIVE[0]
    if compile_last and not compiled & ({r["fixes"] for r in rows} | set(in_best)):
        bases.append("compile")
    for name in [n for n in bases if _can_run(report, NEXT_RUNG[n])]:
        rung = NEXT_RUNG[name]
        swapped = [rung if n == name else n for n in in_best] if name in in_best else [*in_best, rung]
        predicted = combined_prediction_us(report, rows, swapped)
        out.append(attempt(swapped, predicted))
        if out[-1]["status"] != "ok" or out[-1]["measured speedup"] <= best["measured speedup"]:
            continue
        best, in_best = out[-1], swapped
        # a replay leaves the step to its kernels: a fix of theirs the host hid alone may pay now
        for extra in _kernel_fixes_left_out(report, rows, in_best)[:RETRIES]:
            wider = [*in_best, extra]
            predicted = combined_prediction_us(report, rows, wider)
            out.append(attempt(wider, predicted))
            if out[-1]["status"] == "ok" and out[-1]["measured speedup"] > best["measured speedup"]:
                best, in_best = out[-1], wider
    best["best set"] = True
    return out


def _kernel_fixes_left_out(report, rows: list[dict], in_best: list[str]) -> list[str]:
    """Fixes outside ``in_best`` that act on the device's kernels alone and ran alone (faster or
    not), most predicted first."""
    left = [
        r["fixes"] for r in rows
        if _may_join(r, in_best) and set(ACTS_ON.get(r["fixes"]) or ("not a kernel",)) <= set(_KERNELS)
    ]  # fmt: skip
    return sorted(left, key=lambda n: -_predicted_us(report, [n], unbound=True))


def _may_join(row: dict, chosen: list[str]) -> bool:
    """Whether ``row``, a fix that ran alone (faster or not), is outside ``chosen`` and excludes
    none of it."""
    name = row["fixes"]
    return (
        row["mode"] == "alone"
        and row["status"] in ("ok", "slower here")
        and name not in chosen
        and not any(name in g and g.intersection(chosen) for g in EXCLUSIVE)
    )


def _can_run(report, name: str) -> bool:
    return not FIXES[name].needs_cuda or report.evidence.device.type == "cuda"


def _left_out(report, rows: list[dict], best: dict) -> list[str]:
    """Fixes outside the ``best`` set (its row) that may pay on it though they did not alone,
    most predicted first: one predicted to save :data:`RETRY_SHARE` of the step the best set
    leaves (a fix of the device's time, bf16, gains nothing while the host holds the step back),
    and one that removes a sync (it costs what the device has queued, which grows as the other
    fixes free the host)."""
    in_best = best["fixes"].split("+")
    left_us = report.evidence.step_us * best["measured ms"] / best["unchanged ms"]
    left = {}
    for r in rows:
        name = r["fixes"]
        if not _may_join(r, in_best + list(left)):
            continue
        predicted = _predicted_us(report, [name], unbound=True)
        if predicted >= RETRY_SHARE * left_us or "idle sync" in ACTS_ON[name]:
            left[name] = predicted
    return sorted(left, key=lambda n: -left[n])


def combined_prediction_us(report, rows: list[dict], names: list[str]) -> float:
    """The step's time with ``names`` together, predicted from their rows measured alone: each
    fix's saving is spread over the parts of the step it acts on (in proportion to their time;
    :data:`SAVES_FIRST` over its own parts first), and a part's time left is what every fix
    acting on it leaves of it in turn. Beside a fix that frees the host, a fix of the device's
    kernels that the host held back alone counts its kernels' own saving
    (:func:`_kernels_saving_us`). A set replayed as a CUDA
    graph takes the kernels' time it leaves, with the gaps a replay keeps between them, and no
    more than the same set launched from the host."""
    t = report.evidence.timeline
    unbound = bool(FREES_HOST & set(names))
    parts = dict(t.by_category) | {f"idle {cause}": us for cause, us in t.idle_us.items()}
    left = dict(parts)
    unexplained = 0.0
    alone = {r["fixes"]: r for r in rows if r["mode"] == "alone"}
    # the CUDA-graph rung is tried on the best set only: its fusion is compile's, measured alone
    alone.setdefault("compile_graphs", alone.get("compile"))
    saving = {n: max(_saved_us(t.step_us, alone[n]) if alone.get(n) else 0.0,
                     _kernels_saving_us(report, n) if unbound else 0.0) for n in names}  # fmt: skip
    for group in ALTERNATIVES:
        present = [n for n in names if n in group]
        if len(present) > 1:
            best = max(present, key=saving.get)
            names = [n for n in names if n not in group or n == best]
    for name in names:
        acts = [p for p in ACTS_ON.get(name, ()) if parts.get(p, 0.0) > 0]
        first = [p for p in SAVES_FIRST.get(name, ()) if p in acts]
        saved = saving[name]
        if not acts:
            unexplained += saved
        for group in (first, [p for p in acts if p not in first]):
            total = sum(parts[p] for p in group)
            if total <= 0 or saved <= 0:
                continue
            share = min(_MAX_SHARE, saved / total)  # the same share of each part of the group
            for p in group:
                left[p] *= 1 - share
            saved -= share * total
    launched = max(t.step_us - sum(parts.values()) + sum(left.values()) - unexplained, 0.0)
    if GRAPHED & set(names):
        kernels = sum(left[p] for p in t.by_category) - unexplained
        launched = min(launched, max(kernels, 0.0) * GRAPH_REPLAY_OVER_KERNELS)
    return launched or math.nan


def _kernels_saving_us(report, name: str) -> float:
    """What the device's kernels alone would save with fix ``name``, before the timeline's
    replay kept only what a step held back by the host shows (0 where no finding says)."""
    return max((f.kernels_us for f in report.findings
                if f.kernels_us is not None and name in f.fixes), default=0.0)  # fmt: skip


def _saved_us(step_us: float, row: dict) -> float:
    """A trial's measured saving on a step of ``step_us`` (its ratio: the trial timed its own)."""
    return step_us * (1 - row["measured ms"] / row["unchanged ms"])


def _record_measured(report, rows: list[dict]) -> None:
    """Each finding's measured saving (its best fix alone), measured ones ranked first."""
    step_us = report.evidence.step_us
    alone = [r for r in rows if r["mode"] == "alone" and r["status"] in ("ok", "slower here")]
    saved = {r["fixes"]: _saved_us(step_us, r) for r in alone}
    edits = {r["fixes"]: r["edit"] for r in alone}
    for finding in report.findings:  # not one the fix left as written (an attention it cannot read)
        tried = [saved[n] for n in finding.fixes if n in saved and not any(
            left_as_written(s) in edits[n] for s in finding.sites)]
        finding.measured_us = max(tried) if tried else None
    report.findings.sort(key=lambda f: (f.measured_us is None, -(
        f.measured_us if f.measured_us is not None else (f.saved_us or -1.0))))  # fmt: skip


def fixed_step(report, names: list[str]) -> Callable[[], Any]:
    """One step of a fresh copy of the report's step with the fixes ``names`` applied, as the
    trials call it (to time it beside other steps). What the step's own code changes (files, the
    random state) is put back only where it runs inside :func:`isolated`."""
    return _fixed(report, fix_names(names)).build()


def _fixed(report, names: list[str]) -> StepCopy:
    fixed = _fresh(report)
    for name in names:
        FIXES[name].apply(fixed)
    return fixed


def _fresh(report) -> StepCopy:
    step, parts = copy_step(report.step, report.parts)
    return StepCopy(step, parts, report.batch, report.evidence.device, findings=report.findings)


def _predicted_us(report, names: list[str], *, unbound: bool = False) -> float:
    """The findings' predicted savings that these fixes address, each finding once; ``unbound``
    (or a fix among them that frees the host): the kernels' own where the host held the step
    back, as they may save once it does not."""
    unbound = unbound or bool(FREES_HOST & set(names))
    saved = [
        f.kernels_us if unbound and f.kernels_us is not None
        else max(f.saved_by_fix.get(n, f.saved_us) for n in set(f.fixes) & set(names))
        for f in _predicting(report, names)
    ]  # fmt: skip
    return min(sum(saved), 0.999 * report.evidence.step_us)  # a trial times the step alone


def _addressed(report, names: list[str]) -> list:
    """The findings these fixes address."""
    return [f for f in report.findings if set(f.fixes) & set(names)]


def _predicting(report, names: list[str]) -> list:
    """The findings these fixes address that predict a saving."""
    return [f for f in _addressed(report, names) if f.saved_us is not None]


# A trial's row: every column, NaN until measured (an empty table keeps them too)
TRIAL_COLUMNS = ("fixes", "label", "mode", "best set", "status", "predicted ms",
                 "predicted speedup", "predicted from", "unchanged ms", "measured ms",
                 "measured speedup", "speedup interval", "error", "allowance", "allowed by",
                 "tolerance", "why", "edit", "first call s", "unchanged peak MiB",
                 "fixed peak MiB", "batch room")  # fmt: skip


def _trial_row(report, names: list[str], predicted_us: float | None) -> dict:
    step_us = report.evidence.step_us
    if predicted_us is None and not _predicting(report, names):
        source = (f"nothing: not predicted on {report.evidence.device.type}"
                  if _addressed(report, names)
                  else "nothing: no finding names these fixes")  # fmt: skip
        predicted = math.nan
    elif predicted_us is None:
        predicted, source = step_us - _predicted_us(report, names), "the findings' cost models"
    elif math.isnan(predicted_us):
        predicted, source = predicted_us, "nothing: the fixes measured alone leave no time"
    else:
        predicted = predicted_us
        source = "the fixes measured alone, overlapping where they share time" + (
            "; replayed as a CUDA graph: the kernels' time left" if GRAPHED & set(names) else ""
        )
    argued = tolerance(report, names)
    return dict.fromkeys(TRIAL_COLUMNS, math.nan) | {
        "fixes": "+".join(names),
        "label": " + ".join(FIXES[n].label for n in names),
        "mode": "alone" if len(names) == 1 else "together",
        "best set": False,
        "status": "ok",
        "predicted ms": predicted / 1e3,
        "predicted speedup": step_us / predicted if predicted > 0 else math.nan,
        "predicted from": source,
        "allowance": argued,
        "allowed by": "the fixes' tolerance",
        "tolerance": argued,
        "why": "; ".join(FIXES[n].why for n in names),
        "edit": "",
    }


def tolerance(report, names: list[str]) -> float:
    """The relative error the fixes ``names`` together may make on this step's results."""
    sixteen = any(
        op.op in MATMUL_OPS and op.inputs and op.inputs[0].dtype in (torch.bfloat16, torch.float16)
        for op in report.evidence.recording.ops
    )
    return sum(FIXES[n].tolerance(sixteen) for n in names)


def _trial(
    report, names: list[str], steps: int, repeats: int, spread: Errors, predicted_us=None
) -> dict[str, Any]:
    row = _trial_row(report, names, predicted_us)
    skipped = [n for n in names if not _can_run(report, n)]
    if skipped:
        return row | {"status": f"not applicable: {', '.join(skipped)} needs a CUDA GPU"}
    try:
        return row | _measured(report, names, steps, repeats, row["tolerance"], spread)
    except FixNotApplicable as error:
        return row | {"status": f"not applicable: {error}"}
    except Exception as error:  # a fix that breaks the user's step is a finding, not a crash
        return row | {"status": f"failed {where_raised(error).splitlines()[0][:300]}"}


def _measured(report, names: list[str], steps: int, repeats: int, argued: float,
              spread: Errors) -> dict:  # fmt: skip
    from accel.measure.timer import compare, round_ratios

    base, fixed = _fresh(report), _fixed(report, names)
    base_call, fixed_call = base.build(), fixed.build()
    checked = max(steps, GRAPH_WARMUP + 2) if fixed.graphed else steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        redrawn = any(FIXES[n].redraws_dropout for n in names) and any(
            word in op.op for op in report.evidence.recording.ops for word in _DROPOUT_OPS)
        with dropout_off() if redrawn else contextlib.nullcontext():
            errors, first_s = result_error(base_call, fixed_call, base, fixed, checked)
        if redrawn:  # timed as they train: captured and compiled anew, with dropout
            base_call, fixed_call = base.build(), fixed.build()
        # alone only: a set is built of fixes that acted alone
        if len(names) == 1 and (idle := [why for probe in fixed.idle if (why := probe())]):
            raise FixNotApplicable(f"nothing to change: {'; '.join(idle)}")
        timing = compare({"unchanged": base_call, "fixed": fixed_call}, warmup=3, repeats=repeats,
                         calls_per_sample=CALLS, device=report.evidence.device)
    unchanged, measured = (timing.timings[k].median_ms for k in ("unchanged", "fixed"))
    judged = repeats >= JUDGED_ROUNDS
    low, high = timing.median_ratio_interval("unchanged", "fixed") if judged else (math.nan,) * 2
    if not judged and repeats >= EVERY_ROUND:
        high = max(round_ratios(timing.samples, "unchanged", "fixed"))  # the fix's best round
    allowed = Errors(*(max(argued, SPREAD_MULTIPLE * s) for s in spread))
    part = _nearest(errors, allowed)  # the part of the results the row shows
    error, allowance = errors[part], allowed[part]
    status = _status(error, allowance, high, fixed, caught)
    device = report.evidence.device
    peaks = [peak_memory(call, device=device) / 2**20 for call in (base_call, fixed_call)]
    return {
        "status": status,
        "unchanged ms": unchanged,
        "measured ms": measured,
        "measured speedup": unchanged / measured,
        "speedup interval": f"{low:.2f}-{high:.2f}" if math.isfinite(low) else "",
        "error": error,
        "allowance": allowance,
        "allowed by": ("the fixes' tolerance" if allowance == argued else
                       f"{SPREAD_MULTIPLE:g}x the unchanged step's own spread in its "
                       f"{Errors._fields[part].replace('_', ' ')} ({spread[part]:.1e})")
        + ("; both compared with dropout off (SDPA draws its own masks)" if redrawn else ""),
        "edit": "".join(edit if edit.endswith("\n") else edit + "\n" for edit in fixed.edits),
        "first call s": first_s,
        "unchanged peak MiB": peaks[0],
        "fixed peak MiB": peaks[1],
        # activations grow with the batch: how many times the batch fits where one did before
        "batch room": peaks[0] / peaks[1] if peaks[1] > 0 else math.nan,
    }


_DROPOUT_OPS = ("dropout", "bernoulli")  # CUDA's native_dropout; on a CPU, a bernoulli_ mask


def _nearest(errors: Errors, allowed: Errors) -> int:
    """Which part of the results is nearest its allowance, or past it (a NaN error is past it)."""

    def ratio(part: int) -> float:
        error, allowance = errors[part], allowed[part]
        if not error <= allowance:
            return math.inf
        return error / allowance if allowance > 0 else 0.0

    return max(range(len(errors)), key=ratio)


def _status(error: float, allowance: float, high: float, fixed: StepCopy, caught) -> str:
    if fixed.graph is not None and fixed.graph.reason:
        return f"ran eagerly: {fixed.graph.reason}"
    if any("GraphCapture" in type(w.message).__name__ for w in caught):
        return "ran eagerly: the capture failed"
    if not error <= allowance:  # NaN too
        return "changes results beyond the allowance"
    if high < 1.0:  # the whole 95% interval of the ratio below 1
        return "slower here"
    return "ok"
