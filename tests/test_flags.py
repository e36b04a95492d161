from dataclasses import dataclass, field

import pytest

from accel.workloads import WORKLOADS
from accel.workloads.flags import all_on, describe, flag, label, option, unavailable


@dataclass(frozen=True)
class Demo:
    fast: bool = flag("go fast", "fusion")
    graph: bool = flag("capture a graph", "graphs", requires="cuda")
    every: int = option("update every k steps", "fusion", default=1, choices=(1, 4, 16))


def test_describe_reads_phase_help_and_choices():
    infos = {i.name: i for i in describe(Demo)}
    assert infos["fast"].phase == "fusion" and infos["fast"].help == "go fast"
    assert infos["fast"].is_bool and not infos["every"].is_bool
    assert infos["every"].choices == (1, 4, 16)


def test_a_plain_field_is_rejected_with_its_name():
    @dataclass(frozen=True)
    class Bad:
        ok: bool = flag("fine", "sync")
        plain: bool = field(default=False)

    with pytest.raises(TypeError, match=r"Bad.plain was not declared with flag\(\)"):
        describe(Bad)


def test_describe_needs_a_dataclass_type():
    with pytest.raises(TypeError, match="expected a Flags dataclass type"):
        describe(Demo())


def test_a_flags_class_must_be_frozen():
    """A panel keeps one built step per flag set, keyed by the flags: they must be hashable."""

    @dataclass
    class Loose:
        fast: bool = flag("go fast", "fusion")

    with pytest.raises(TypeError, match=r"Loose must be a frozen dataclass.*frozen=True"):
        describe(Loose)


def test_option_default_must_be_a_choice():
    with pytest.raises(ValueError, match="not among the choices"):
        option("x", "p", default=3, choices=(1, 2))


def test_label_names_what_changed():
    assert label(Demo()) == "baseline"
    assert label(Demo(fast=True, every=4)) == "fast+every=4"


def test_cuda_flags_are_unavailable_on_cpu_with_a_reason():
    assert unavailable(Demo, "cpu") == {"graph": "needs a CUDA GPU; this run is on cpu"}
    assert unavailable(Demo, "cuda") == {}


def test_all_on_skips_what_cannot_run():
    assert all_on(Demo, "cpu") == Demo(fast=True)
    assert all_on(Demo) == Demo(fast=True, graph=True)


@pytest.mark.parametrize("module", WORKLOADS)
def test_every_workload_names_its_presets_on_a_wrong_one(module):
    import importlib

    workload = importlib.import_module(f"accel.workloads.{module}")
    assert workload.Sizes.preset("cpu") != workload.Sizes.preset("gpu")
    with pytest.raises(ValueError, match="unknown preset 'huge'; expected one of cpu, gpu"):
        workload.Sizes.preset("huge")


def test_through_phase_turns_on_the_adopted_flags_of_that_phase_and_the_ones_before():
    from accel.workloads import field_trainer as ft
    from accel.workloads import nested_optimizer as no
    from accel.workloads.flags import through_phase

    assert through_phase(ft.Flags, "sync") == ft.Flags(batched_progress=True, vectorized_rotor=True)
    assert through_phase(ft.Flags, "fusion") == ft.Flags(
        batched_progress=True, vectorized_rotor=True, fused_lior=True
    )
    assert through_phase(no.Flags, "sync") == no.Flags()  # it has no flag of phase 1
    assert through_phase(no.Flags, "memory") == no.Flags(
        foreach_stats=True,
        fused_clip=True,
        fused_adamw=True,
        preallocated_buffers=True,
        set_to_none_grads=True,
    )
    with pytest.raises(ValueError, match="unknown phase 'fuse'; expected one of sync, fusion"):
        through_phase(no.Flags, "fuse")
