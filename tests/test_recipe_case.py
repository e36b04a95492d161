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
    [(2.6, 1.02, True), (2.4, 1.0, False), (3.0, 1.05, True), (2.5, 0.5, True)],
)
def test_the_target_row_judges_speed_and_leaves_one_seeds_quality_to_the_seed_rows(
    speedup, quality, met
):
    rows = recipe.rows(frame_of(speedup, quality), "cumulative", judged=True, target="recipe")
    target = {r.case: r for r in rows}["cumulative: recipe"]
    assert target.met is met and target.speedup == pytest.approx(speedup)
    assert "validation" not in target.target and "over seeds" in target.note
    assert all(r.met is None for r in rows if r is not target)
    unjudged = recipe.rows(frame_of(speedup, quality), "cumulative", judged=False, target="recipe")
    assert all(r.met is None for r in unjudged)


@pytest.mark.parametrize(
    ("only", "groups"),
    [((), ["cumulative", "alone"]), (("alone",), ["alone"]), (("cumulative",), ["cumulative"]),
     (("quality",), [])],
)
def test_the_phase_runs_in_parts_each_with_its_own_rows(monkeypatch, only, groups):
    from accel.lab.bench import BenchContext, check_parts

    check_parts(["recipe"], only)
    measured = []

    def fake_measure(configs, sizes, device, *, validate, **kwargs):
        measured.append((list(configs)[1], tuple(validate)))
        return frame_of(2.6, 1.0)

    def fake_seed_errors(configs, sizes, device, *, seeds, **kwargs):
        return pd.DataFrame([{"seed": s, "config": c, "val_error": 0.1}
                             for s in seeds for c in configs])  # fmt: skip

    monkeypatch.setattr(recipe, "measure", fake_measure)
    monkeypatch.setattr(recipe, "seed_errors", fake_seed_errors)
    monkeypatch.setattr(recipe.recipe_adopted, "rows", lambda ctx: [])
    monkeypatch.setattr(recipe.recipe_float8, "rows", lambda ctx: [])
    ctx = BenchContext(device=torch.device("cpu"), preset="cpu", only=only)
    rows = recipe.run(ctx)
    quality = [r for r in rows if r.case.startswith("quality seed ")]
    assert len(quality) == (recipe.SEEDS if not only or "quality" in only else 0)
    for row in quality:
        assert row.optimized == pytest.approx(1.0)  # the last configuration over the first
    ran = [g for g in ("cumulative", "alone") if any(r.case.startswith(f"{g}: ") for r in rows)]
    assert ran == groups and len(measured) == len(groups)
    validation = [r for r in rows if r.case == recipe.VALIDATION_CASE]
    assert len(validation) == ("cumulative" in groups)
    assert all(r.met is None and "judged over seeds" in r.target for r in validation)
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


def quality_rows(ratios, device="NVIDIA H100 80GB HBM3", first_seed=1):
    configs = {"baseline": op.Flags(), "recipe": op.Flags(precision="bf16")}
    errors = pd.DataFrame([{"seed": s, "config": c, "val_error": 0.1 * (r if c == "recipe" else 1.0)}
                           for s, r in enumerate(ratios, first_seed) for c in configs])  # fmt: skip
    rows = recipe.quality_rows(errors, configs, train_steps=10)
    return pd.DataFrame([r.as_dict() | {"phase": "recipe", "device": device} for r in rows])


def test_quality_over_seeds_is_judged_on_the_interval_of_the_mean_ratio():
    tight = quality_rows([0.97, 0.98, 0.99, 0.98, 0.97])
    assert list(tight["case"].str.extract(r"quality seed (\d+):")[0]) == ["1", "2", "3", "4", "5"]
    assert "precision=bf16" in tight["note"].iloc[0]
    (summary,) = recipe.quality_summary(tight).to_dict("records")
    assert summary["seeds"] == 5 and summary["mean ratio"] == pytest.approx(0.978)
    assert summary["met"] is True
    # the same mean over seeds that disagree: the interval reaches past the target
    (wide,) = recipe.quality_summary(quality_rows([0.74, 1.47, 0.8, 0.9, 0.98])).to_dict("records")
    assert wide["met"] is False and wide["95% interval"][1] > recipe.TARGET_QUALITY


def test_quality_is_judged_over_seeds_recorded_in_separate_runs_per_device():
    """A GPU call too short for five trainings of each takes the seeds in pieces: each seed's row
    replaces its own, and the summary reads every recorded seed of each device."""
    runs = pd.concat([quality_rows([0.97, 0.98]), quality_rows([0.99, 0.98, 0.97], first_seed=3),
                      quality_rows([1.2], device="NVIDIA H200")])  # fmt: skip
    summary = recipe.quality_summary(runs).set_index("device")
    assert summary.loc["NVIDIA H100 80GB HBM3", "seeds"] == 5
    assert summary.loc["NVIDIA H100 80GB HBM3", "met"] is True
    assert summary.loc["NVIDIA H200", "seeds"] == 1
    assert summary.loc["NVIDIA H200", "met"] is None  # too few seeds to judge


def test_seed_errors_train_each_configuration_from_each_seed_in_processes_too():
    configs = {"baseline": op.Flags(), "every 2nd": op.Flags(aux_loss_every=2)}
    kwargs = dict(seeds=(1, 2), train_steps=2, reads=1, read_every=1)
    here = recipe.seed_errors(configs, TINY, "cpu", **kwargs)
    assert list(here["seed"]) == [1, 1, 2, 2] and list(here["config"]) == list(configs) * 2
    # another seed, another start: the errors differ between seeds
    assert here["val_error"].iloc[0] != here["val_error"].iloc[2]
    apart = recipe.seed_errors(configs, TINY, "cpu", processes=2, **kwargs)
    torch.testing.assert_close(torch.tensor(apart["val_error"].values),
                               torch.tensor(here["val_error"].values))  # fmt: skip


def test_seed_errors_deal_the_trainings_to_the_devices_in_turn(monkeypatch):
    configs = {"baseline": op.Flags(), "every 2nd": op.Flags(aux_loss_every=2)}
    where = []
    monkeypatch.setattr(recipe, "_trained_error", lambda job: where.append(job[2]) or 0.5)
    recipe.seed_errors(configs, TINY, "cuda", devices=["cuda:0", "cuda:1", "cuda:2"],
                       seeds=(1, 2, 3), train_steps=2)  # fmt: skip
    assert where == ["cuda:0", "cuda:1", "cuda:2"] * 2
    where.clear()
    recipe.seed_errors(configs, TINY, "cpu", seeds=(1,), train_steps=2)
    assert where == ["cpu", "cpu"]
    # the slow configuration's trainings spread over the devices, not stacked on every other one
    dealt = []
    monkeypatch.setattr(recipe, "_trained_error", lambda job: dealt.append(job[::2]) or 0.5)
    recipe.seed_errors(configs, TINY, "cuda", devices=["cuda:0", "cuda:1"], seeds=(1, 2),
                       train_steps=2)  # fmt: skip
    assert {device for flags, device, _ in dealt if flags == op.Flags()} == {"cuda:0", "cuda:1"}


def test_autotune_compares_the_recipes_two_graph_modes_where_compile_runs():
    assert recipe.autotune("cpu") == {}  # compile needs a CUDA GPU
    if torch.cuda.is_available():
        modes = [f.compile for f in recipe.autotune("cuda").values()]
        assert modes == ["reduce-overhead", "max-autotune"]


def test_seed_errors_give_each_training_at_once_its_share_of_the_cores(monkeypatch):
    configs = {"baseline": op.Flags(), "every 2nd": op.Flags(aux_loss_every=2)}
    threads = []
    monkeypatch.setattr(recipe, "_trained_error", lambda job: threads.append(job[5]) or 0.5)
    monkeypatch.setattr(recipe.os, "cpu_count", lambda: 32)
    recipe.seed_errors(configs, TINY, "cpu", seeds=(1, 2), train_steps=2)
    assert threads == [None] * 4  # one at a time, in this process: its setting left alone
    threads.clear()
    monkeypatch.setattr(recipe, "ProcessPoolExecutor", _InlinePool)
    recipe.seed_errors(configs, TINY, "cpu", seeds=(1, 2), train_steps=2, processes=4)
    assert threads == [8] * 4


class _InlinePool:
    """A ProcessPoolExecutor that runs its jobs here, in turn."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, jobs):
        return [fn(job) for job in jobs]
