"""``Report.try_fixes``: each fix on its own copy of the step, then the ones that helped together,
each checked against an unchanged copy (same start, same batch, same seed) within the fix's
tolerance and timed against it interleaved, with the findings' prediction beside the
measurement."""

from __future__ import annotations

import math
import re
import time
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from accel.doctor.check_kernels import MATMUL_OPS
from accel.doctor.examine import CALLS
from accel.doctor.fixes import FIXES, GRAPH_WARMUP, FixNotApplicable, StepCopy
from accel.doctor.isolation import Session
from accel.doctor.parts import copy_step
from accel.doctor.untouched import Untouched
from accel.errors import UsageError
from accel.memory import peak_memory

__all__ = ["fix_names", "result_error", "tolerance", "try_fixes"]

EXCLUSIVE = ({"cuda_graph", "compile"}, {"fused_optimizer", "foreach_optimizer"})
NEEDS_NO_SYNC = ("cuda_graph", "compile")  # a capture fails and compile breaks at every sync
_SEED = 1234


def try_fixes(
    report, fixes: list[str] | None, *, steps: int, repeats: int | None, progress: bool = False
):
    import pandas as pd

    names = report.fixes() if fixes is None else fix_names(fixes)
    for what, value in (("steps", steps), ("repeats", 1 if repeats is None else repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"try_fixes needs {what} as an int >= 1, got {value!r}")
    if not report.parts.all:
        raise ValueError("try_fixes needs the step's model or optimizer, and none was found")
    if report.evidence.parts is report.parts:  # examine ran on the user's own objects
        raise UsageError("try_fixes needs copies of what the step trains, and they cannot be made")
    cuda = report.evidence.device.type == "cuda"
    repeats = repeats or (8 if cuda else 5)
    blocked = _blocked(report) if fixes is None else ""
    with Session() as session:  # the random generators put back (the trials seed them)
        session.watch(report.parts.reach.objects.values())
        untouched = Untouched(report.parts, report.batch)
        rows = _trials(report, names, blocked, steps, repeats, progress)
    _name_side_effects(report, session.effects() + untouched.report())
    return pd.DataFrame(rows, columns=TRIAL_COLUMNS)


def _trials(report, names: list[str], blocked: str, steps: int, repeats: int, progress: bool):
    """The rows of each fix alone, then of the ones that helped, together."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(names) + 1, desc="fixes", disable=not progress)
    rows = []
    for name in names:
        bar.set_description_str(f"trying {FIXES[name].label}")
        if blocked and name in NEEDS_NO_SYNC:
            rows.append(_not_tried(report, name, blocked))
        else:
            rows.append(_trial(report, [name], steps, repeats))
        bar.update()
    helped = sorted(
        (r for r in rows if r["status"] == "ok" and r["measured speedup"] > 1.0),
        key=lambda r: -r["measured speedup"],
    )
    chosen: list[str] = []
    for row in helped:
        name = row["fixes"]
        if not any(name in group and group.intersection(chosen) for group in EXCLUSIVE):
            chosen.append(name)
    if len(chosen) >= 2:
        bar.set_description_str("trying the helpful ones together")
        rows.append(_trial(report, chosen, steps, repeats))
    bar.update()
    bar.close()
    return rows


def fix_names(fixes: Any) -> list[str]:
    """``fixes`` as a list of known fix names (one name may come as a string)."""
    names = [fixes] if isinstance(fixes, str) else fixes
    try:
        names = list(names)
    except TypeError:
        raise UsageError(f"fixes must be a fix name or a list of them, got {fixes!r}") from None
    unknown = [n for n in names if not isinstance(n, str) or n not in FIXES]
    if unknown:
        raise UsageError(f"unknown fixes {unknown}; expected some of {', '.join(FIXES)}")
    return names


def _name_side_effects(report, found: list[str]) -> None:
    """What the trials changed that they could not keep from changing: warned now, and named
    first in the report's summary (once: examining may have named it already)."""
    if found:
        warnings.warn("accel.doctor's trials: " + "; ".join(found), RuntimeWarning, stacklevel=4)
    said = {_uncounted(what) for what in report.side_effects}
    report.side_effects += [what for what in found if _uncounted(what) not in said]


def _uncounted(what: str) -> str:
    return re.sub(r" \(\d+ times\)$", "", what)


def _blocked(report) -> str:
    """Why graphs and compile are not worth trying yet (the step syncs), or ""."""
    syncs = [f for f in report.findings if f.kind == "sync"]
    return f"{syncs[0].title}: remove them first" if syncs else ""


def _not_tried(report, name: str, why: str) -> dict[str, Any]:
    row = _trial_row(report, [name])
    return row | {"status": f"not tried: {why}"}


def _fresh(report) -> StepCopy:
    step, parts = copy_step(report.step, report.parts)
    return StepCopy(step, parts, report.batch, report.evidence.device)


def _predicted_us(report, names: list[str]) -> float:
    """The findings' predicted savings that these fixes address, each finding once."""
    saved = [
        f.saved_us for f in report.findings if f.saved_us is not None and set(f.fixes) & set(names)
    ]
    return min(sum(saved), 0.999 * report.evidence.step_us)  # a trial times the step alone


# A trial's row: every column, NaN until measured (an empty table keeps them too)
TRIAL_COLUMNS = ("fixes", "label", "mode", "status", "predicted ms", "predicted speedup",
                 "unchanged ms", "measured ms", "measured speedup", "error", "tolerance", "why",
                 "first call s", "unchanged peak MiB", "fixed peak MiB", "batch room")  # fmt: skip


def _trial_row(report, names: list[str]) -> dict[str, Any]:
    step_us = report.evidence.step_us
    predicted = step_us - _predicted_us(report, names)
    return dict.fromkeys(TRIAL_COLUMNS, math.nan) | {
        "fixes": "+".join(names),
        "label": " + ".join(FIXES[n].label for n in names),
        "mode": "alone" if len(names) == 1 else "together",
        "status": "ok",
        "predicted ms": predicted / 1e3,
        "predicted speedup": step_us / predicted,
        "tolerance": tolerance(report, names),
        "why": "; ".join(FIXES[n].why for n in names),
    }


def tolerance(report, names: list[str]) -> float:
    """The relative error the fixes ``names`` together may make on this step's results."""
    sixteen = any(
        op.op in MATMUL_OPS and op.inputs and op.inputs[0].dtype in (torch.bfloat16, torch.float16)
        for op in report.evidence.recording.ops
    )
    return sum(FIXES[n].tolerance(sixteen) for n in names)


def _trial(report, names: list[str], steps: int, repeats: int) -> dict[str, Any]:
    row = _trial_row(report, names)
    skipped = [n for n in names if FIXES[n].needs_cuda and report.evidence.device.type != "cuda"]
    if skipped:
        return row | {"status": f"not applicable: {', '.join(skipped)} needs a CUDA GPU"}
    try:
        return row | _measured(report, names, steps, repeats, row["tolerance"])
    except FixNotApplicable as error:
        return row | {"status": f"not applicable: {error}"}
    except Exception as error:  # a fix that breaks the user's step is a finding, not a crash
        said = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        return row | {"status": f"failed: {type(error).__name__}: {said}"}


def _measured(report, names: list[str], steps: int, repeats: int, tolerance: float) -> dict:
    from accel.lab.timing import compare

    base, fixed = _fresh(report), _fresh(report)
    for name in names:
        FIXES[name].apply(fixed)
    base_call, fixed_call = base.build(), fixed.build()
    checked = max(steps, GRAPH_WARMUP + 2) if fixed.graphed else steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error, first_s = result_error(base_call, fixed_call, base, fixed, checked)
        timing = compare(
            {"unchanged": base_call, "fixed": fixed_call},
            warmup=3,
            repeats=repeats,
            calls_per_sample=CALLS,
            device=report.evidence.device,
        )
    status = "ok" if error <= tolerance else "changes results beyond the tolerance"
    if fixed.graph is not None and fixed.graph.reason:
        status = f"ran eagerly: {fixed.graph.reason}"
    elif any("GraphCapture" in type(w.message).__name__ for w in caught):
        status = "ran eagerly: the capture failed"
    unchanged, measured = (timing.timings[k].median_ms for k in ("unchanged", "fixed"))
    device = report.evidence.device
    peaks = [peak_memory(call, device=device) / 2**20 for call in (base_call, fixed_call)]
    return {
        "status": status,
        "unchanged ms": unchanged,
        "measured ms": measured,
        "measured speedup": unchanged / measured,
        "error": error,
        "first call s": first_s,
        "unchanged peak MiB": peaks[0],
        "fixed peak MiB": peaks[1],
        # activations grow with the batch: how many times the batch fits where one did before
        "batch room": peaks[0] / peaks[1] if peaks[1] > 0 else math.nan,
    }


def result_error(base_call, fixed_call, base: StepCopy, fixed: StepCopy, steps: int):
    """(relative error, the fixed copy's first call in s): ``steps`` steps of each from the same
    start with the same seed; the outputs of every step and the parameters after the last,
    compared as one vector (norm of the difference over the norm of the unchanged)."""
    outputs = []
    first_s = math.nan
    for label, call in (("base", base_call), ("fixed", fixed_call)):
        torch.manual_seed(_SEED)
        got = []
        for i in range(steps):
            started = time.perf_counter()
            got.append([_clone(t) for t in tree_leaves(call())])
            if label == "fixed" and i == 0:
                if fixed.device.type == "cuda":
                    torch.cuda.synchronize(fixed.device)
                first_s = time.perf_counter() - started
        outputs.append(got)
    diff = norm = 0.0
    pairs = [
        (a, b) for s_a, s_b in zip(*outputs, strict=True) for a, b in zip(s_b, s_a, strict=True)
    ]
    pairs += list(zip(_parameters(fixed), _parameters(base), strict=True))
    for a, b in pairs:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
            a64, b64 = a.detach().double(), b.detach().double()
            diff += float((a64 - b64).square().sum())  # sync: once per tensor, outside timing
            norm += float(b64.square().sum())
    return (math.sqrt(diff / norm) if norm > 0 else math.sqrt(diff)), first_s


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _parameters(copy: StepCopy) -> list[torch.Tensor]:
    return [p for model in copy.parts.models for p in model.parameters()]
