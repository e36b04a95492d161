"""The fixes a report names, as a ``Flags`` dataclass for ``lab.FeaturePanel``: one checkbox per
fix, grouped by the phase whose notebook teaches it, and a build function that applies the
checked ones to a fresh copy of the step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from accel.doctor.fixes import FIXES, StepCopy
from accel.doctor.parts import copy_step
from accel.workloads.flags import flag

__all__ = ["fix_flags", "fixed_step"]


def fix_flags(report) -> type:
    """A frozen dataclass with a boolean flag per fix the findings name (off: the step as you
    wrote it)."""
    fields = []
    for name in report.fixes():
        finding = next(f for f in report.findings if name in f.fixes)
        fix = FIXES[name]
        help_text = f"{fix.label}: for '{finding.title}'"
        requires = "cuda" if fix.needs_cuda else None
        phase = finding.notebook.partition("_")[2] or finding.notebook  # "02_fusion": fusion
        fields.append((name, bool, flag(help_text, phase, requires=requires)))
    return dataclasses.make_dataclass("DoctorFixes", fields, frozen=True)


def fixed_step(report, flags: Any) -> Callable[[], Any]:
    """One call of the step on a fresh copy with the fixes whose flag is on."""
    step, parts = copy_step(report.step, report.parts)
    copy = StepCopy(step, parts, report.batch, report.evidence.device)
    for f in dataclasses.fields(flags):
        if getattr(flags, f.name):
            FIXES[f.name].apply(copy)
    return copy.build()
