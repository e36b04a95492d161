"""The one registry of phases: what the flags, the bench and the command line read."""

import importlib
from pathlib import Path

import pytest

from accel import phases
from accel.__main__ import parser
from accel.workloads.flags import flag, through_phase

ROOT = Path(__file__).resolve().parents[1]


def test_every_bench_phase_has_its_case_and_every_named_notebook_exists():
    for phase in phases.PHASES:
        if phase.bench:
            assert callable(importlib.import_module(phase.case).run), phase.name
        if phase.notebook:
            assert (ROOT / "notebooks" / f"{phase.notebook}.ipynb").is_file(), phase.notebook
    cases = {p.stem for p in (ROOT / "accel" / "lab" / "cases").glob("*.py")}
    unregistered = {
        c for c in cases if c.partition("_")[0] not in phases.BY_NAME and c != "__init__"
    }
    assert not unregistered, f"case modules of no registered phase: {sorted(unregistered)}"


def test_a_flag_of_a_phase_that_is_not_registered_is_refused_when_declared():
    with pytest.raises(ValueError, match="unknown phase 'fuse'; expected one of ceilings, sync"):
        flag("go fast", "fuse")
    with pytest.raises(ValueError, match="unknown phase 'recipe'; expected one of sync, fusion"):
        through_phase(object, "recipe")  # a phase, but not one of the workbook's


def test_the_bench_command_offers_the_bench_phases_in_the_registrys_order():
    bench = parser()._subparsers._group_actions[0].choices["bench"]
    (phase,) = [a for a in bench._actions if a.dest == "phase"]
    assert list(phase.choices) == [p.name for p in phases.PHASES if p.bench]
    assert phases.WORKBOOK == ("sync", "fusion", "memory", "graphs", "sdpa", "diversity")
