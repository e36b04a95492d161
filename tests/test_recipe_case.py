"""Bench phase ``recipe`` on the CPU: which configurations are trained and validated, and how the
target row is judged. Tiny sizes: a step takes milliseconds."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from accel.lab.cases import recipe
from accel.workloads import advection as op

TINY = op.Sizes(grid=12, queries=16, modes=2, dim=16, heads=2, depth=1, batch=4, epoch_batches=2)
CONFIGS = {
    "baseline": op.Flags(),
    "bf16": op.Flags(precision="bf16"),
    "every 2nd": op.Flags(aux_loss_every=2),
}

pytestmark = pytest.mark.usefixtures("one_thread")


def test_only_the_named_configurations_are_trained_and_validated():
    frame = recipe.measure(
        CONFIGS,
        TINY,
        "cpu",
        repeats=1,
        train_steps=12,
        reads=2,
        read_every=3,
        validate=("baseline", "every 2nd"),
    ).set_index("config")
    timed_steps = 2 + TINY.epoch_batches * 2  # 2 for memory, warm-up and one timed sample
    assert frame.loc["baseline", "train_steps"] == 12 == frame.loc["every 2nd", "train_steps"]
    assert frame.loc["bf16", "train_steps"] == timed_steps
    assert math.isnan(frame.loc["bf16", "val_error"])
    assert math.isnan(frame.loc["bf16", "val_vs_baseline"])
    errors = frame.loc[["baseline", "every 2nd"], "val_error"]
    assert ((errors > 0) & (errors < 10)).all()
    assert frame.loc["baseline", "val_vs_baseline"] == 1.0
    assert frame.loc["every 2nd", "aux_calls"] == 6  # steps 2, 4, ..., 12
    assert (frame["samples_per_s"] > 0).all() and frame.loc["baseline", "speedup"] == 1.0


def test_the_validation_error_is_the_mean_of_the_reads(monkeypatch):
    reads = []

    def read(step):
        reads.append(step.count)
        return float(step.count)  # the error "is" the step count: the mean is checkable

    monkeypatch.setattr(op.Step, "validation_error", read)
    frame = recipe.measure(
        {"baseline": op.Flags()}, TINY, "cpu", repeats=1, train_steps=12, reads=3, read_every=2
    )
    assert reads == [8, 10, 12]
    assert frame["val_error"].iloc[0] == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(validate=("bf16",)), "must name the baseline 'baseline'"),
        (dict(validate=("baseline", "nope")), "must name the baseline"),
        (dict(train_steps=8, reads=3, read_every=2), "first validation read, at step 4"),
    ],
)
def test_bad_measure_arguments_are_refused_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        recipe.measure(CONFIGS, TINY, "cpu", **{"repeats": 1, "train_steps": 12, **kwargs})


def test_compile_comes_last_in_the_progression_and_everything_is_cumulative():
    configs = recipe.progression("cuda")  # names only: nothing is built
    names = list(configs)
    assert names[0] == "baseline" and names[-1].startswith("+ 1 compile")
    flags = list(configs.values())
    assert all(f.compile == "none" for f in flags[:-1]) and flags[-1].compile == "reduce-overhead"
    # each row keeps every change of the rows before it
    assert flags[-1].precision == "bf16" and flags[-1].fused_adamw and flags[-1].aux_loss_every == 4
    assert "+ 1 compile" not in " ".join(recipe.progression("cpu"))  # compile needs CUDA


def frame_of(speedup: float, val_vs_baseline: float) -> pd.DataFrame:
    rows = [("baseline", 100.0, 0.1), ("recipe", 100.0 * speedup, 0.1 * val_vs_baseline)]
    return pd.DataFrame(
        [
            {
                "config": name,
                "flags": name,
                "batch": 8,
                "step_ms": 80.0 / rate,
                "samples_per_s": rate,
                "peak_mib": 1.0,
                "compile_s": 0.0,
                "val_error": error,
                "train_steps": 10,
                "speedup": rate / 100.0,
                "val_vs_baseline": error / 0.1,
            }
            for name, rate, error in rows
        ]
    )


@pytest.mark.parametrize(
    ("speedup", "quality", "met"),
    [(2.6, 1.02, True), (2.4, 1.0, False), (3.0, 1.05, False), (2.5, 0.5, True)],
)
def test_the_target_row_needs_both_speed_and_quality(speedup, quality, met):
    rows = recipe.rows(frame_of(speedup, quality), "cumulative", judged=True, target="recipe")
    target = {r.case: r for r in rows}["cumulative: recipe"]
    assert target.met is met and target.speedup == pytest.approx(speedup)
    assert all(r.met is None for r in rows if r is not target)
    unjudged = recipe.rows(frame_of(speedup, quality), "cumulative", judged=False, target="recipe")
    assert all(r.met is None for r in unjudged)


@pytest.mark.parametrize(
    ("only", "groups"),
    [((), ["cumulative", "alone"]), (("alone",), ["alone"]), (("cumulative",), ["cumulative"])],
)
def test_the_phase_runs_in_parts_each_with_its_own_rows(monkeypatch, only, groups):
    from accel.lab.bench import BenchContext, check_parts

    check_parts(["recipe"], only)
    measured = []

    def fake_measure(configs, sizes, device, *, validate, **kwargs):
        measured.append((list(configs)[1], tuple(validate)))
        return frame_of(2.6, 1.0)

    monkeypatch.setattr(recipe, "measure", fake_measure)
    monkeypatch.setattr(recipe.recipe_adopted, "rows", lambda ctx: [])
    monkeypatch.setattr(recipe.recipe_float8, "rows", lambda ctx: [])
    ctx = BenchContext(device=torch.device("cpu"), preset="cpu", only=only)
    rows = recipe.run(ctx)
    ran = [g for g in ("cumulative", "alone") if any(r.case.startswith(f"{g}: ") for r in rows)]
    assert ran == groups and len(measured) == len(groups)
    validation = [r for r in rows if r.case == recipe.VALIDATION_CASE]
    assert len(validation) == ("cumulative" in groups)
    for first_changed, validated in measured:  # the progression validates its last, alone not
        assert validated[0] == "baseline" and len(validated) == (
            2 if first_changed.startswith("+") else 1
        )


def test_step_flops_count_every_sample_of_a_step():
    """An accumulated step does the matrix products of the batch it stands for, per sample as
    much as one piece."""
    one, k = recipe.step_flops(TINY), 4
    for flags in (op.Flags(batch_multiplier=k), op.Flags(grad_accumulation=k)):
        flops = recipe.step_flops(TINY, flags)
        assert flops["total"] == k * one["total"]
        assert flops["per_sample"] == one["per_sample"]
