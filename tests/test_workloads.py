"""Every workload keeps the one contract of ``accel/workloads/__init__.py``: its names, and each
flag that runs on a CPU, alone and all together, within the workload's own tolerance of the
all-flags-off baseline (same seed, same steps, the cpu preset).

A flag alone is a boolean flag on, or an option at its first setting after the default, with
what it needs to be accepted (:data:`NEEDS`); all together is every boolean flag that runs here
on (:func:`accel.workloads.flags.all_on`) with what those need. The workloads' own tests go
further (more settings, seeds, sizes, the GPU); this one keeps them all to one shape.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil

import pytest

import accel.workloads
from accel.workloads import WORKLOADS
from accel.workloads.flags import describe, label, unavailable

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 1
STEPS = 2
CONTRACT = ("Flags", "Sizes", "build", "tolerance", "compare_results")
# What a flag needs beside it to be accepted or to do anything: a prerequisite's setting.
NEEDS = {
    ("advection", "persistent_workers"): {"loader_workers": 2},
    ("vit", "backend"): {"sdpa": True},
}
# It runs on a CPU, but inductor compiles C++ there for seconds: tests/test_field_trainer.py
# runs it (and checks the fallback where compile cannot run).
SLOW_ON_CPU = {("field_trainer", "compiled_step")}


def workload(name: str):
    return importlib.import_module(f"accel.workloads.{name}")


def runnable(name: str) -> list:
    """The flags of workload ``name`` that run on a CPU here, quickly."""
    off = unavailable(workload(name).Flags, "cpu")
    return [
        info
        for info in describe(workload(name).Flags)
        if info.name not in off and (name, info.name) not in SLOW_ON_CPU
    ]


def flag_sets(name: str) -> list:
    """Each runnable flag alone, then all runnable boolean flags together."""
    Flags = workload(name).Flags
    alone, together = [], {}
    for info in runnable(name):
        value = True if info.is_bool else next(c for c in info.choices if c != info.default)
        alone.append(Flags(**{**NEEDS.get((name, info.name), {}), info.name: value}))
        if info.is_bool:
            together.update({**NEEDS.get((name, info.name), {}), info.name: True})
    return [*alone, Flags(**together)]


def needs_triton(flags) -> list:
    """The ``triton`` mark where a flag that runs a Triton kernel is on (its path here depends
    on whether Triton is installed)."""
    on = [i for i in describe(type(flags)) if getattr(flags, i.name) != i.default]
    return [pytest.mark.triton] if any(i.requires == "triton" for i in on) else []


CASES = [
    pytest.param(name, flags, id=f"{name}-{label(flags)}", marks=needs_triton(flags))
    for name in WORKLOADS
    for flags in dict.fromkeys(flag_sets(name))  # all together may be one flag alone
]


def trained(name: str, flags) -> dict:
    w = workload(name)
    step = w.build(flags, w.Sizes.preset("cpu"), device="cpu", seed=SEED)
    for _ in range(STEPS):
        step()
    result = step.result()
    getattr(step, "close", lambda: None)()  # loader workers, where there are any
    return result


@functools.cache
def baseline(name: str) -> dict:
    return trained(name, workload(name).Flags())


@pytest.mark.parametrize(("name", "flags"), CASES)
def test_each_flag_and_all_together_keep_the_baseline(name, flags):
    w = workload(name)
    errors = w.compare_results(
        trained(name, flags), baseline(name), flags, sizes=w.Sizes.preset("cpu"), steps=STEPS
    )
    assert isinstance(errors, dict)


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_workload_has_the_contracts_names(name):
    w = workload(name)
    assert [n for n in CONTRACT if not hasattr(w, n)] == []
    assert w.Flags.__dataclass_params__.frozen and describe(w.Flags)  # flag()/option() fields
    assert w.Sizes.preset("cpu") != w.Sizes.preset("gpu")
    assert list(inspect.signature(w.build).parameters)[:4] == ["flags", "sizes", "device", "seed"]
    assert list(inspect.signature(w.tolerance).parameters) == ["flags", "sizes", "steps"]
    compare = inspect.signature(w.compare_results).parameters
    assert list(compare) == ["result", "reference", "flags", "sizes", "steps"]
    assert [compare[k].kind for k in ("sizes", "steps")] == [inspect.Parameter.KEYWORD_ONLY] * 2


def test_every_module_with_flags_is_a_listed_workload():
    modules = [m.name for m in pkgutil.iter_modules(accel.workloads.__path__)]
    with_flags = {m for m in modules if dataclasses.is_dataclass(getattr(workload(m), "Flags", 0))}
    assert with_flags == set(WORKLOADS)
