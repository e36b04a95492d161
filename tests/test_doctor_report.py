"""accel.doctor.examine and Report on a small CPU step: the findings at the user's lines, the
table, the text, the HTML page, the fixes tried on copies; the fixes that run on a CPU applied to
the zoo's GPT within their tolerance."""

from __future__ import annotations

import copy
import dataclasses
import html
import inspect
import logging
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import plain_step
from torch import nn

from accel import doctor
from accel.doctor import agreement, fixes, trial, zoo
from accel.doctor.fixes import FIXES, NO_BATCH, StepCopy
from accel.doctor.parts import copy_step, find_parts
from accel.errors import UsageError
from accel.workloads.flags import describe

pytestmark = pytest.mark.usefixtures("one_thread")

COLUMNS = [
    "finding",
    "kind",
    "evidence",
    "where",
    "predicted saving (ms/step)",
    "predicted speedup",
    "cost model",
    "notebook",
    "change",
    "automatic fixes",
]
CUDA_ONLY = [name for name, fix in FIXES.items() if fix.needs_cuda]


def logging_step():
    """A step that reads its loss on the host three ways and zeroes its gradients in place."""
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 6), nn.ReLU(),
        nn.Linear(6, 1),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    log: list = []

    def step(batch):
        x, y = batch
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        log.append(loss.item())
        print(loss.detach())
        log.append(f"loss {loss.detach()}")
        return loss.detach()

    return step, model


def line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    (index,) = [i for i, line in enumerate(lines) if text in line]
    return start + index


def snapshot(model: nn.Module) -> list[tuple[torch.Tensor, int]]:
    return [(t.detach().clone(), t._version) for t in model.state_dict().values()]


def unchanged(before, model: nn.Module) -> bool:
    after = list(model.state_dict().values())
    return all(
        torch.equal(value, t) and version == t._version
        for (value, version), t in zip(before, after, strict=True)
    )


@pytest.fixture
def examined(seed, capsys):
    step, model = logging_step()
    before = snapshot(model)
    report = doctor.examine(step, (torch.randn(32, 8), torch.randn(32, 1)), steps=3, warmup=2)
    assert unchanged(before, model)
    assert "tensor(" in capsys.readouterr().out
    return report, step, model


def test_sync_finding_points_at_the_item_print_and_fstring_lines(examined):
    report, step, _ = examined
    (sync,) = [f for f in report.findings if f.kind == "sync"]
    lines = {line_of(step, text) for text in ("loss.item()", "print(", 'f"loss')}
    assert {s.line for s in sync.sites} == lines
    assert {s.file for s in sync.sites} == {__file__}
    assert sync.title.startswith("3 host reads per step")  # syncs on a GPU
    for what in ("a host read", "print() of a tensor", "a tensor in an f-string"):
        assert what in sync.evidence
    assert sync.saved_us is None


def test_text_shows_three_lines_of_a_finding_and_counts_the_rest(examined):
    report, _, _ = examined
    (sync,) = [f for f in report.findings if f.kind == "sync"]
    many = copy.copy(report)
    many.findings = [dataclasses.replace(sync, sites=[*sync.sites, *sync.sites[:2]])]
    text = str(many)
    assert text.count("   where: ") == 3 and "and 2 more lines (report.table())" in text
    assert "more line" not in str(report)


def test_zero_grad_finding_points_at_its_line_and_names_its_fix(examined):
    report, step, _ = examined
    (zeroing,) = [f for f in report.findings if f.kind == "zero_grad"]
    assert [s.line for s in zeroing.sites] == [line_of(step, "zero_grad(")]
    assert zeroing.fixes == ("set_to_none",)
    assert report.kinds() == {"sync", "zero_grad"}
    assert set(report.fixes()) == {"set_to_none", "deferred_reads"}  # the sync is an .item()


def test_table_has_one_row_per_finding_with_the_documented_columns(examined):
    report, step, _ = examined
    table = report.table()
    assert list(table.columns) == COLUMNS
    assert list(table["finding"]) == [f.title for f in report.findings]
    assert list(table["kind"]) == [f.kind for f in report.findings]
    assert table["predicted saving (ms/step)"].isna().all()
    zeroing = table[table["kind"] == "zero_grad"].iloc[0]
    assert zeroing["where"].endswith(f":{line_of(step, 'zero_grad(')} (step)")
    assert zeroing["automatic fixes"] == "set_to_none"
    assert zeroing["notebook"] == "02_fusion"


def test_text_lists_every_finding(examined):
    report, _, _ = examined
    text = str(report)
    assert text.startswith(report.summary())
    assert report.summary().startswith("cpu: a step takes")
    assert "2 findings" in report.summary()
    for i, f in enumerate(report.findings, 1):
        assert f"{i}. {f.title}" in text
    assert repr(report).startswith("<accel.doctor.Report: cpu:")


def test_html_has_the_findings_and_a_plotly_figure(examined, tmp_path):
    report, _, _ = examined
    page = report.html()
    for f in report.findings:
        assert html.escape(f.title) in page
    assert "plotly-graph-div" in page and "Plotly.newPlot" in page
    assert len(report._repr_html_()) < len(page)
    path = report.to_html(tmp_path / "report.html")
    written = path.read_text()
    assert written.startswith("<!doctype html>") and written.endswith("</html>")
    assert all(html.escape(f.title) in written for f in report.findings)
    assert report.figure().data


def test_html_reads_as_a_report(examined):
    """Each finding with its evidence, its gain (a dash and the reason where none is predicted)
    and its change as a code block; the trials rounded, with why nothing was measured."""
    report, _, _ = examined
    report.try_fixes(["set_to_none", "cuda_graph"], steps=2, repeats=2)
    page = report.html(plotlyjs=False)
    for f in report.findings:
        assert f"<pre><code>{html.escape(f.change)}</code></pre>" in page
        assert html.escape(f.evidence) in page
    assert "\\n" not in page and "NaN" not in page and "<table border" not in page
    assert "— not predicted on cpu: " in page  # the sync finding: no prediction on a CPU
    assert "— not applicable: cuda_graph needs a CUDA GPU" in page
    (row,) = report.trials[report.trials["fixes"] == "set_to_none"].to_dict("records")
    assert (
        f"{row['measured speedup']:.2f}x" in page and f"{row['measured speedup']:.6f}" not in page
    )


def test_text_gives_each_change_whole(examined):
    report, _, _ = examined
    text = str(report)
    for f in report.findings:
        assert all(line in text for line in f.change.splitlines())


def test_optimizer_fixes_run_on_a_cpu_too(examined):
    report, _, _ = examined
    trials = report.try_fixes(["foreach_optimizer", "fused_optimizer"], steps=2, repeats=2)
    assert list(trials["status"]) == ["ok", "ok"]


def test_set_to_none_fix_is_measured_on_copies(examined):
    report, _, model = examined
    before = snapshot(model)
    trials = report.try_fixes(["set_to_none"], steps=2, repeats=2)
    assert report.trials is trials
    (row,) = trials.to_dict("records")
    assert (row["fixes"], row["mode"], row["status"]) == ("set_to_none", "alone", "ok")
    assert row["error"] <= row["tolerance"] == FIXES["set_to_none"].rtol
    assert row["measured ms"] > 0 and math.isfinite(row["measured speedup"])
    assert row["unchanged peak MiB"] > 0 and row["fixed peak MiB"] > 0
    assert row["batch room"] == row["unchanged peak MiB"] / row["fixed peak MiB"]
    assert unchanged(before, model)
    assert "Fixes tried" in report.html(plotlyjs=False)


def test_a_speedup_interval_is_given_only_where_enough_rounds_were_timed(examined):
    """Five rounds give no 95% interval of the median: the cell stays empty, never half NaN."""
    report, _, _ = examined
    few, enough = (report.try_fixes(["set_to_none"], steps=1, repeats=n).iloc[0] for n in (5, 6))
    assert few["speedup interval"] == ""
    low, high = (float(x) for x in enough["speedup interval"].split("-"))
    assert 0 < low <= high


def test_fixes_that_need_cuda_are_not_applicable_on_cpu(examined, capsys):
    report, _, model = examined
    before = snapshot(model)
    trials = report.try_fixes(CUDA_ONLY, progress=True)
    bar = capsys.readouterr().err  # tqdm's text bar, off a notebook
    assert f"{len(CUDA_ONLY) + 2}/{len(CUDA_ONLY) + 2}" in bar and "trying" in bar
    assert list(trials["fixes"]) == CUDA_ONLY
    assert list(trials["status"]) == [f"not applicable: {n} needs a CUDA GPU" for n in CUDA_ONLY]
    assert unchanged(before, model)


def test_unknown_fix_is_refused_naming_the_known_ones(examined):
    report, _, _ = examined
    with pytest.raises(ValueError, match=r"unknown fixes \['nope'\]") as raised:
        report.try_fixes(["nope"])
    assert all(name in str(raised.value) for name in FIXES)


def test_fix_flags_turn_fixes_on_in_a_fresh_copy(examined, capsys):
    report, _, model = examined
    flags = report.fix_flags()
    assert {f.name for f in dataclasses.fields(flags)} == {"set_to_none", "deferred_reads"}
    # grouped as every panel groups its flags: by phase ("fusion"), not by notebook file
    phases = {
        f.name: i.phase for f, i in zip(dataclasses.fields(flags), describe(flags), strict=True)
    }
    assert phases["set_to_none"] == "fusion"
    before = snapshot(model)
    call = report.fixed_step(flags(set_to_none=True))
    call()
    assert unchanged(before, model)
    # one class however often asked: a panel built from one call takes flags made from another
    assert report.fix_flags() is flags


def test_bad_calls_to_examine_are_explained(seed):
    step, _ = logging_step()
    data = (torch.randn(4, 8), torch.randn(4, 1))
    with pytest.raises(TypeError, match="needs the training step as a callable, got int"):
        doctor.examine(42, data)
    with pytest.raises(TypeError, match="got tuple"):
        doctor.examine(data, step)
    for kwargs in ({"steps": 0}, {"warmup": 0}, {"steps": 2.5}):
        with pytest.raises(ValueError, match="steps and warmup must be ints >= 1"):
            doctor.examine(step, data, **kwargs)


def test_step_without_a_batch_and_a_step_fed_by_a_loader(seed):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)

    def step(batch=x):
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    before = snapshot(model)
    report = doctor.examine(step, steps=1, warmup=1)
    assert report.findings == [] and report.parts.models == [model]
    loader = [torch.randn(16, 4) for _ in range(4)]
    fed = doctor.examine(step, loader=loader, steps=1, warmup=1)
    assert fed.batch is loader[0]
    # None beside a loader means its first batch, as the command line reads a maker's None
    assert doctor.examine(step, None, loader=loader, steps=1, warmup=1).batch is loader[0]
    assert fed.evidence.loader["batches"] == 3 and len(fed.evidence.loader["shapes"]) == 1
    assert unchanged(before, model)


def test_a_step_that_draws_from_its_own_loader_is_examined_with_that_loader(seed):
    """torchvision's loop, folded into a step: ``next(it)`` inside it, the loader given beside
    it so that the doctor reads how long its batches take; the step is called as it is written."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(40, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    it = iter(loader)

    def step():
        (x,) = next(it)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    before = snapshot(model)
    report = doctor.examine(step, loader=loader, steps=1, warmup=1)
    assert report.batch is NO_BATCH  # the step was called as written, step()
    assert report.evidence.loader["num_workers"] == 0 and report.evidence.loader["batches"] >= 1
    assert unchanged(before, model)
    # the copies took their batch from the doctor's copy of the loader, not from the user's `it`
    assert torch.equal(next(it)[0], data.tensors[0][:8])
    assert "took 1 item" not in str(report).splitlines()[0]


def test_a_generator_expression_over_the_loader_keeps_every_batch(seed):
    """``batches = (... for x in loader)`` read by the step: its copies read a copy of it over the
    doctor's copy of the loader, each batch made by the user's expression."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(40, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    width = 2
    batches = (x[:, :width] for (x,) in loader)  # the copies' batches must be cut as these are
    assert torch.equal(next(batches), data.tensors[0][:8, :2])

    def step():
        model(next(batches)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    report = doctor.examine(step, loader=loader, steps=1, warmup=1)
    assert "took 1 item" not in str(report).splitlines()[0]
    assert torch.equal(next(batches), data.tensors[0][8:16, :2])


def test_examine_hands_the_given_ceilings_and_costs_to_the_checks(seed):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    ceilings = SimpleNamespace(copy_gb_s=123.0, matmul_tflop_s=4.5)
    costs = SimpleNamespace(launch_us=7.0, sync_us=30.0)
    report = doctor.examine(
        step, torch.randn(8, 4), steps=1, warmup=1, ceilings=ceilings, costs=costs
    )
    assert report.evidence.ceilings is ceilings and report.evidence.costs is costs


# ---- fixes that run on a CPU, on the zoo's GPT ----------------------------------------------------
def gpt_copies(fix: str):
    case = zoo.build("gpt", True)
    found = find_parts(case.step)
    base = StepCopy(*copy_step(case.step, found), case.batch, torch.device("cpu"))
    fixed = StepCopy(*copy_step(case.step, found), case.batch, torch.device("cpu"))
    FIXES[fix].apply(fixed)
    return found, base, fixed


def test_bf16_autocast_on_the_zoo_gpt_stays_within_its_tolerance():
    found, base, fixed = gpt_copies("bf16_autocast")
    before = snapshot(found.models[0])
    errors, first_s = agreement.result_error(base.build(), fixed.build(), base, fixed, 3)
    assert 0 < max(errors) <= FIXES["bf16_autocast"].rtol
    assert first_s > 0
    assert unchanged(before, found.models[0])


def test_checkpointing_on_the_zoo_gpt_recomputes_the_same_numbers():
    found, base, fixed = gpt_copies("checkpointing")
    (model,) = fixed.parts.models
    assert all("forward" in vars(block) for block in model.blocks)
    assert not any("forward" in vars(block) for block in found.models[0].blocks)
    errors, _ = agreement.result_error(base.build(), fixed.build(), base, fixed, 3)
    assert max(errors) <= FIXES["checkpointing"].rtol


def batchnorm_blocks_step():
    model = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)) for _ in range(2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return plain_step(model, opt)


def test_checkpointing_a_batchnorm_counts_its_running_statistics_as_results(seed):
    """Recomputing a block in backward runs its BatchNorm twice in training: the running
    statistics move twice, which the trained parameters and the loss do not show."""
    step = batchnorm_blocks_step()
    found = find_parts(step)
    base, fixed = (StepCopy(*copy_step(step, found), torch.randn(8, 6), torch.device("cpu"))
                   for _ in range(2))  # fmt: skip
    FIXES["checkpointing"].apply(fixed)
    errors, _ = agreement.result_error(base.build(), fixed.build(), base, fixed, 2)
    assert errors.trained_state > FIXES["checkpointing"].rtol


def test_the_losses_and_the_trained_state_are_each_judged_on_their_own_scale(seed):
    """A fix that changes the forward by 1% at a small learning rate: the parameters after the
    steps stay within 1e-6 of the unchanged step's, the losses, read with .item(), do not."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    plain = plain_step(model, opt)
    found = find_parts(plain)
    batch = torch.randn(8, 16)
    base, fixed = (StepCopy(*copy_step(plain, found), batch, torch.device("cpu")) for _ in range(2))
    fixed.batch = batch * 1.01
    read = lambda copy: (lambda call: lambda: call().item())(copy.build())  # noqa: E731
    errors, _ = agreement.result_error(read(base), read(fixed), base, fixed, 2)
    assert errors.outputs > 1e-3 and errors.trained_state < 1e-6


def test_a_noisy_loss_does_not_widen_the_trained_states_allowance(seed, monkeypatch):
    """Checkpointing a BatchNorm moves its running statistics twice: a beyond-tolerance change of
    the trained state, whatever the unchanged step's spread in its losses."""
    monkeypatch.setattr(trial, "own_spread", lambda report, steps: agreement.Errors(1.0, 0.0))
    report = doctor.examine(batchnorm_blocks_step(), torch.randn(8, 6), steps=1, warmup=1)
    (row,) = report.try_fixes(["checkpointing"], steps=2, repeats=2).to_dict("records")
    assert row["status"] == "changes results beyond the allowance"
    assert row["allowance"] == FIXES["checkpointing"].rtol < row["error"]


def test_a_step_whose_results_are_nan_in_both_runs_differs_by_nothing(seed):
    """Labels all ignored: the mean over no label is NaN, and so is every parameter after it, in
    the unchanged step and in a fix that changes nothing alike."""
    model = nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y, ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    found = find_parts(step)
    batch = (torch.randn(8, 6), torch.full((8,), -100))
    base, fixed = (StepCopy(*copy_step(step, found), batch, torch.device("cpu")) for _ in range(2))
    assert max(agreement.result_error(base.build(), fixed.build(), base, fixed, 2)[0]) == 0.0
    fixed.batch = (batch[0], torch.randint(0, 3, (8,)))  # numbers where the unchanged has NaN
    assert max(agreement.result_error(base.build(), fixed.build(), base, fixed, 2)[0]) > 1.0


class Spectral(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, dtype=torch.cfloat))

    def forward(self, x):
        return torch.fft.fft(x.to(torch.cfloat)) @ self.weight


def test_the_result_error_sees_a_change_in_complex_parameters_imaginary_part(seed):
    model = Spectral()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(x):
        model(x).abs().square().mean().backward()
        opt.step()

    found = find_parts(step)
    base, fixed = (StepCopy(*copy_step(step, found), torch.randn(5, 4), torch.device("cpu"))
                   for _ in range(2))  # fmt: skip
    with torch.no_grad():
        fixed.parts.models[0].weight.imag.add_(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # casting complex to real warns, and drops the change
        errors, _ = agreement.result_error(base.build(), fixed.build(), base, fixed, 2)
    expected = 0.5 * math.sqrt(model.weight.numel()) / float(model.weight.detach().abs().norm())
    assert errors.trained_state == pytest.approx(expected, rel=1e-6)


def ensemble_step():
    """torch.func's model ensembling: the stacked parameters trained, through a skeleton of the
    model on the meta device (it holds no values and runs nothing)."""
    members = [nn.Linear(4, 3) for _ in range(3)]
    params, buffers = torch.func.stack_module_state(members)
    skeleton = nn.Linear(4, 3).to("meta")
    opt = torch.optim.Adam(params.values(), lr=1e-3)

    def one(p, b, x):
        return torch.func.functional_call(skeleton, (p, b), (x,))

    def step(x):
        loss = torch.vmap(one, in_dims=(0, 0, None))(params, buffers, x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def test_a_skeleton_model_on_the_meta_device_is_not_where_the_step_runs(seed):
    report = doctor.examine(ensemble_step(), torch.randn(5, 4), steps=1, warmup=1)
    assert report.evidence.device == torch.device("cpu")


def test_the_result_error_leaves_out_tensors_on_the_meta_device(seed):
    report = doctor.examine(ensemble_step(), torch.randn(5, 4), steps=1, warmup=1)
    assert trial.own_spread(report, 2) == (0.0, 0.0)


def test_checkpointing_without_repeated_blocks_is_not_applicable(seed):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        model(x).sum().backward()
        opt.step()

    copied = StepCopy(*copy_step(step, find_parts(step)), torch.randn(3, 4), torch.device("cpu"))
    with pytest.raises(fixes.FixNotApplicable, match="no repeated blocks"):
        FIXES["checkpointing"].apply(copied)


class CountedNet(torch.nn.Linear):
    """A model class only the test below makes: its instances alive are counted."""


COUNTED = {}  # the step below reaches its model and optimizer through these module globals


def counted_step(x):
    loss = COUNTED["model"](x).square().mean()
    loss.backward()
    COUNTED["opt"].step()
    COUNTED["opt"].zero_grad()
    return loss.detach()


def test_listing_compiles_breaks_keeps_no_copy_of_the_model_alive(seed):
    """dynamo's cleanup hooks keep the globals of what it traced, here the copies': let go
    after the listing, so no examine leaves a copy behind."""
    import gc

    COUNTED["model"] = CountedNet(8, 8)
    COUNTED["opt"] = torch.optim.SGD(COUNTED["model"].parameters(), lr=0.1)
    for _ in range(2):
        report = doctor.examine(counted_step, torch.randn(4, 8), steps=1, warmup=1, compile=True)
        assert not str(report).startswith("Caution"), str(report).splitlines()[0]
        del report
    gc.collect()
    assert sum(type(o) is CountedNet for o in gc.get_objects()) == 1  # the user's own
    COUNTED.clear()


def test_compile_lists_the_graph_breaks_with_their_lines(seed):
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).square().mean()
        if loss.item() > 1e6:  # a host read: dynamo breaks the graph here
            loss = loss * 0
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    report = doctor.examine(step, torch.randn(4, 8), steps=1, warmup=1, compile=True)
    (found,) = [f for f in report.findings if f.kind == "compile"]
    assert line_of(step, "loss.item()") in {s.line for s in found.sites}
    assert "item" in found.evidence and found.fixes == ("compile",)
    # the breaks every step makes are said apart, not counted as the step's own
    expected = {line_of(step, call) for call in ("backward(", "opt.step(", "zero_grad(")}
    assert not expected & {s.line for s in found.sites}
    assert "where every step breaks" in found.evidence or len(report.evidence.graph_breaks) == 1
    assert "if loss.item() > 1e6" in found.evidence  # the line's own code, as the user wrote it
    assert all("torch_dynamo" not in s.function for s in found.sites)  # the user's function
    own = len(found.evidence.split("; ")) - ("where every step breaks" in found.evidence)
    assert f"{len(report.evidence.graph_breaks)} graph break" in report.summary()
    assert "besides where every step breaks" in report.summary() or own == len(
        report.evidence.graph_breaks)


def test_compile_finds_nothing_in_a_step_whose_only_breaks_are_backward_and_the_optimizer(seed):
    """Every step breaks at loss.backward() (and the optimizer's step): the change itself calls
    those expected, so a step with no other break has no finding, and dynamo's own warnings
    (an optimizer's record_function ignored) stay out of the user's stderr."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    said = []
    heard = logging.Handler(logging.WARNING)
    heard.emit = lambda record: said.append(record.getMessage())
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(heard)
    torch._logging._internal.warning_once.cache_clear()  # each warning is said once a process
    try:
        report = doctor.examine(step, torch.randn(4, 8), steps=1, warmup=1, compile=True)
    finally:
        dynamo_log.removeHandler(heard)
    assert "compile" not in report.kinds(), str(report)
    assert not [line for line in said if "record function" in line], said
    assert "torch.compile traced: " in report.summary()  # the check ran, and says so
    assert "none but where every step breaks" in report.summary()
    lines = {site.line for _, site in report.evidence.graph_breaks}
    assert lines and all(f".py:{line}" in report.summary() for line in lines)  # said where


def test_a_reordering_fix_is_allowed_16_bit_rounding_where_the_products_run_in_16_bits(seed):
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    x = torch.randn(4, 8)
    low = doctor.examine(step, x)
    full = doctor.examine(lambda x: _fp32(model, opt, x), x)
    for name in ("compile", "cuda_graph"):
        fix = FIXES[name]
        assert trial.tolerance(low, [name]) == fix.rtol_16bit > fix.rtol
        assert trial.tolerance(full, [name]) == fix.rtol
    assert trial.tolerance(low, ["set_to_none"]) == FIXES["set_to_none"].rtol


def _fp32(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_no_fix_to_try_gives_an_empty_table_with_its_columns(examined):
    report, _, _ = examined
    trials = report.try_fixes([])
    assert trials.empty
    assert {"label", "status", "predicted speedup", "measured speedup", "error"} <= set(trials)


PLAIN_STEP = '''
import torch


def make():
    """A step whose only finding (a host read) has no automatic fix."""
    model = torch.nn.Linear(7, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        opt.zero_grad()
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        return float(loss)

    return step, torch.randn(5, 7)
'''


def test_cli_try_fixes_on_a_step_without_fixes_says_so_and_writes_the_report(
    tmp_path, monkeypatch, capsys
):
    from accel.__main__ import main

    (tmp_path / "plain_user_step.py").write_text(PLAIN_STEP)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "report.html"

    assert (
        main(["doctor", "plain_user_step:make", "--try-fixes", "--steps", "2", "--out", str(out)])
        == 0
    )

    printed = capsys.readouterr().out
    assert "no automatic fix applies" in printed
    assert "Findings" in out.read_text() and "Fixes tried" not in out.read_text()


OWN_FILE_STEP = """
import os
import torch


class Logged(torch.nn.Linear):
    def __init__(self):
        super().__init__(7, 3)
        self.log = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "log.txt"), "a")

    def __deepcopy__(self, memo):  # as a wrapper of a driver's handle refuses
        raise TypeError("a Logged layer cannot be copied")


def make():
    model = Logged()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        opt.zero_grad()
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        model.log.write(f"{float(loss)}\\n")
        return loss

    return step, torch.randn(5, 7)
"""


def test_cli_try_fixes_on_the_users_own_objects_prints_the_report_and_says_why_none_ran(
    tmp_path, monkeypatch, capsys
):
    """A model that cannot be copied: with --allow-training the examination runs on it, and its
    report stands though no fix can be tried."""
    from accel.__main__ import main

    (tmp_path / "own_file_step.py").write_text(OWN_FILE_STEP)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "report.html"
    argv = ["doctor", "own_file_step:make", "--try-fixes", "--allow-training", "--steps", "2",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Caution: ran on your own objects (allow_training=True)")
    assert "host-device sync" in printed
    assert "fixes not tried: try_fixes needs copies" in printed
    assert "Findings" in out.read_text()


LOGGING_STEP = """
import os
import torch

model = torch.nn.Linear(7, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "losses.txt")


def step(batch):
    loss = model(batch).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with open(LOG, "a") as log:
        log.write(f"{loss.item()}\\n")


def make():
    return step, torch.randn(5, 7)
"""


def test_cli_says_what_the_trials_changed_in_the_report_not_in_a_warning_of_its_own_code(
    tmp_path, capsys
):
    # the report's first line names the file the step wrote; a warning pointing at the
    # doctor's own source line would only repeat it
    from accel.__main__ import main

    (tmp_path / "logging_step.py").write_text(LOGGING_STEP)
    out = str(tmp_path / "d.html")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["doctor", f"{tmp_path / 'logging_step.py'}:make", "--try-fixes",
                     "--steps", "1", "--out", out]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert printed.startswith("Caution: wrote") and "losses.txt" in printed
    assert not [w for w in caught if "accel/doctor" in w.filename], [str(w) for w in caught]
    assert not (tmp_path / "losses.txt").exists()


def test_fixes_that_cannot_run_here_are_not_said_to_have_made_nothing_faster(seed):
    """On a CPU a step's only fix (its .item() read later) needs a GPU: nothing was measured."""
    model = nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = []

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        log.append(loss.item())

    report = doctor.examine(step, torch.randn(4, 6), steps=1, warmup=1)
    report.try_fixes(steps=1, repeats=1)
    assert report.trials["measured ms"].isna().all()
    said = report.reached()
    assert "faster" not in said and "needs a CUDA GPU" in said


def test_a_step_with_nothing_found_says_no_fix_was_tried(seed, tmp_path, monkeypatch, capsys):
    from accel.__main__ import main

    (tmp_path / "clean_user_step.py").write_text(PLAIN_STEP.replace("return float(loss)",
                                                                    "return loss.detach()"))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "report.html"
    assert main(["doctor", "clean_user_step:make", "--try-fixes", "--steps", "1", "--out",
                 str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "0 findings" in printed and "nothing was found, so no fix was tried" in printed
    assert "faster" not in printed and "these findings" not in printed


SELF_FED_STEP = """
import torch

def make_model():
    model = torch.nn.Linear(7, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():  # draws its own batch, as nanoGPT's get_batch() does
        x = torch.randn(5, 7)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step

def make_pair():
    return make_model(), None
"""


def test_cli_takes_a_step_that_draws_its_own_batch(tmp_path):
    from accel.doctor.cli import load_step
    from accel.doctor.fixes import NO_BATCH

    path = tmp_path / "self_fed_step.py"
    path.write_text(SELF_FED_STEP)
    for make in ("make_model", "make_pair"):  # the step alone, or with None for its batch
        step, batch, _ = load_step(f"{path}:{make}")
        assert batch is NO_BATCH
        assert doctor.examine(step, batch, steps=1, warmup=1).evidence.step_us > 0


def test_cli_takes_the_loaders_first_batch_where_the_batch_is_none(tmp_path):
    from accel.doctor.cli import load_step
    from accel.doctor.fixes import NO_BATCH

    path = tmp_path / "loader_step.py"
    path.write_text(PLAIN_STEP + """
def make_with_loader():
    step, batch = make()
    return step, None, [batch, batch]
""")
    step, batch, loader = load_step(f"{path}:make_with_loader")
    assert batch is NO_BATCH and len(loader) == 2
    assert doctor.examine(step, batch, loader=loader, steps=1, warmup=1).batch.shape == (5, 7)


def test_a_batch_the_step_cannot_take_is_refused_before_any_work(seed):
    model = nn.Linear(7, 3)

    def step():
        return model(torch.randn(5, 7)).square().mean()

    with pytest.raises(UsageError, match=r"takes no batch.*examine\(step\)"):
        doctor.examine(step, torch.randn(5, 7))
    with pytest.raises(UsageError, match=r"needs 2 arguments.*one batch"):
        doctor.examine(lambda x, y: model(x).sum(), torch.randn(5, 7))


def test_a_batch_taken_by_keyword_only_is_refused_with_the_call_that_works(seed):
    model = nn.Linear(7, 3)

    def step(*, batch):
        return model(batch).square().mean()

    for given in ((torch.randn(5, 7),), ()):
        with pytest.raises(UsageError, match=r"'batch' as keyword-only.*"
                           r"examine\(lambda batch: step\(batch=batch\), batch\)"):
            doctor.examine(step, *given)


def test_a_step_of_two_arguments_is_shown_the_one_argument_call(seed):
    model = nn.Linear(7, 3)

    def training_step(batch, batch_idx):
        return model(batch).square().mean()

    with pytest.raises(UsageError, match=r"examine\(lambda batch: training_step\(batch, \.\.\.\)"):
        doctor.examine(training_step, torch.randn(5, 7))


def test_an_empty_loader_is_said_in_one_line(seed):
    model = nn.Linear(7, 3)
    empty = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(0, 7)))

    with pytest.raises(UsageError, match=r"loader= gave no batch.*empty"):
        doctor.examine(lambda batch: model(batch[0]).sum(), loader=empty)


def test_a_loader_whose_batches_the_step_cannot_take_is_said_in_one_line(seed):
    model = nn.Linear(7, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        x, y = batch
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    batch = (torch.randn(5, 7), torch.randn(5, 3))
    data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randn(10, 3))
    other = torch.utils.data.DataLoader(data)
    with pytest.raises(UsageError, match=r"raised on a batch of loader= \(a DataLoader\).*"
                                         r"RuntimeError: mat1 and mat2.*what the step takes"):
        doctor.examine(step, batch, loader=other, steps=1, warmup=1)
    with pytest.raises(UsageError, match=r"loader must be an iterable.*got int"):
        doctor.examine(step, batch, loader=5, steps=1, warmup=1)


def test_a_model_given_as_the_step_is_told_what_a_step_is(seed):
    model = nn.Linear(7, 3)
    with pytest.raises(UsageError, match=r"a model \(Linear\) was given as the step.*backward"):
        doctor.examine(model, (torch.randn(5, 7), torch.randn(5, 3)))


def test_cli_says_a_warning_without_the_doctors_own_source_line(tmp_path, monkeypatch, capsys):
    from accel.__main__ import main

    (tmp_path / "no_training_step.py").write_text(
        "import torch\n\ndef make():\n    return (lambda x: (x * 2).sum()), torch.randn(4)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["doctor", "no_training_step:make", "--out", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    assert "RuntimeWarning: accel.doctor: found no model" in err and "cli.py" not in err, err


def test_cli_takes_a_file_path_as_well_as_a_module(tmp_path):
    from accel.doctor.cli import load_step

    path = tmp_path / "plain_user_file.py"
    path.write_text(PLAIN_STEP)
    step, batch, loader = load_step(f"{path}:make")
    assert callable(step) and batch.shape == (5, 7) and loader is None
    with pytest.raises(doctor.cli.UsageError, match=r"no such file.*absent\.py"):
        load_step(f"{tmp_path / 'absent.py'}:make")
    path.write_text(PLAIN_STEP + "\nSTEPS = 42\n")
    with pytest.raises(doctor.cli.UsageError, match=r":STEPS is a value \(int: 42\), not a function"):
        load_step(f"{path}:STEPS")
    with pytest.raises(doctor.cli.UsageError, match=r"has no function 'absent'"):
        load_step(f"{path}:absent")
    path.write_text(PLAIN_STEP + "\ndef three():\n    return (*make(), 5)\n")
    with pytest.raises(doctor.cli.UsageError, match=r"three\(\) returned a third item of type int"):
        load_step(f"{path}:three")



def test_cli_takes_a_file_of_a_package_that_imports_its_siblings_relatively(tmp_path, monkeypatch):
    # train.py in a package (its folder has __init__.py), ``from .model import ...`` as
    # ``python -m pkg.train`` runs it: named by its path, it imports as pkg.train
    from accel.doctor.cli import load_step

    package = tmp_path / "user_pkg_rel"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(PLAIN_STEP)
    (package / "train.py").write_text("from .model import make\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    step, batch, _ = load_step("user_pkg_rel/train.py:make")
    assert callable(step) and batch.shape == (5, 7)
    assert str(tmp_path) not in sys.path



@pytest.mark.parametrize("target", ["scripts/late_import.py:make", "late_import:make"])
def test_cli_keeps_the_scripts_folder_importable_while_its_functions_run(
    tmp_path, monkeypatch, target
):
    # a script that imports its sibling inside a function, as it runs alone (``python
    # scripts/late_import.py``, ``python -m late_import``): the import works when make runs
    from accel.__main__ import main

    folder = tmp_path / "scripts" if target.startswith("scripts/") else tmp_path
    folder.mkdir(exist_ok=True)
    (folder / "sibling_of_late_import.py").write_text(PLAIN_STEP)
    (folder / "late_import.py").write_text(
        "def make():\n    from sibling_of_late_import import make\n    return make()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    path = list(sys.path)
    assert main(["doctor", target, "--steps", "1", "--out", str(tmp_path / "d.html")]) == 0
    assert sys.path == path


PICKLING_SCRIPT = """
import pickle
from dataclasses import dataclass

import torch


@dataclass
class Config:
    lr: float = 0.1


config = Config()
model = torch.nn.Linear(7, 3)
opt = torch.optim.SGD(model.parameters(), lr=config.lr)


def step(batch):
    loss = model(batch).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return len(pickle.dumps(config))  # as a checkpoint saved with its config


def make():
    return step, torch.randn(5, 7)
"""


def test_cli_runs_a_script_named_by_its_path_that_pickles_its_own_classes(tmp_path):
    # run alone, the script pickles its own Config; loaded from its path it must too
    from accel.__main__ import main

    (tmp_path / "pickling_script.py").write_text(PICKLING_SCRIPT)
    target = f"{tmp_path / 'pickling_script.py'}:make"
    try:
        assert main(["doctor", target, "--steps", "1", "--out", str(tmp_path / "d.html")]) == 0
    finally:
        sys.modules.pop("pickling_script", None)


ARGV_SCRIPT = '''
import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", default="last.pt")
args = parser.parse_args()  # at import, as a training script reads its command line
model = torch.nn.Linear(7, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(batch):
    loss = model(batch).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    torch.save(model.state_dict(), args.ckpt)
    return loss.detach()


def make():
    return step, torch.randn(5, 7)
'''


def test_cli_gives_a_script_that_reads_its_command_line_the_arguments_after_a_double_dash(
    tmp_path, capsys
):
    # the script's own parser sees its own arguments, never the doctor's
    from accel.__main__ import main

    path, checkpoint = tmp_path / "train_with_args.py", tmp_path / "elsewhere.pt"
    path.write_text(ARGV_SCRIPT)
    argv = list(sys.argv)
    out = str(tmp_path / "d.html")
    assert main(["doctor", f"{path}:make", "--out", out, "--", "--ckpt", str(checkpoint)]) == 0
    assert f"wrote {checkpoint}" in capsys.readouterr().out and not checkpoint.exists()
    assert sys.argv == argv


def test_cli_writes_the_report_where_it_was_asked_when_the_script_changes_folder(
    tmp_path, monkeypatch
):
    # a script that moves into its own folder at import (to read its data by relative paths):
    # --out, and the default doctor.html, still name a file where the command ran
    from accel.__main__ import main

    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "moving.py").write_text(
        "import os\nos.chdir(os.path.dirname(os.path.abspath(__file__)))\n" + PLAIN_STEP
    )
    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "scripts/moving.py:make", "--steps", "1"]) == 0
    assert (tmp_path / "doctor.html").is_file()
    assert not (tmp_path / "scripts" / "doctor.html").exists()


def test_a_read_made_every_few_steps_counts_the_share_of_steps_it_is_made_in(seed):
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    calls, logged = [0], []

    def step(batch):
        calls[0] += 1
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if calls[0] % 4 == 0:  # whichever call the doctor records, 1 in 4 consecutive ones reads
            logged.append(loss.item())
        return loss.detach()

    report = doctor.examine(step, torch.randn(16, 8), steps=2, warmup=1)
    (sync,) = [f for f in report.findings if f.kind == "sync"]
    assert sync.title.startswith("0.25 host reads per step")
    assert {s.line for s in sync.sites} == {line_of(step, "loss.item()")}
    assert "not every step" in sync.evidence
    assert calls == [0] and logged == []  # the user's counter and log were the copy's to change



class WrittenOutAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 32, 3, 2, 8).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / 8**0.5
        att = att.softmax(dim=-1)
        return (att @ v).sum()


def test_a_panel_flag_for_a_code_change_applies_it_to_the_fresh_copy(seed):
    # the attention rewrite acts on what the findings located: the panel's copy gets them too
    model = WrittenOutAttention()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x):
        loss = model(x)
        loss.backward()
        opt.step()
        return loss.detach()

    report = doctor.examine(step, torch.randn(2, 32, 16), steps=1, warmup=1)
    flags = report.fix_flags()
    assert "sdpa_attention" in {f.name for f in dataclasses.fields(flags)}
    assert torch.isfinite(report.fixed_step(flags(sdpa_attention=True))())


def test_rendering_the_report_leaves_the_warning_filters_as_they_were(tmp_path):
    """plotly's first import adds warning filters of its own; the report imports it to draw."""
    code = textwrap.dedent("""
        import warnings, torch
        from accel import doctor
        from conftest import plain_step
        model = torch.nn.Linear(4, 2)
        step = plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        report = doctor.examine(step, torch.randn(3, 4), steps=1, warmup=1)
        before = list(warnings.filters)
        report.html()
        print([f for f in warnings.filters if f not in before])
    """)
    here = Path(__file__).resolve().parent  # conftest's plain_step, the repository's accel
    paths = [str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_a_trial_row_and_its_html_give_one_prediction():
    """A combined set is predicted from its fixes measured alone even where no finding predicts
    on this device: the page shows the row's own figure, and a dash only where it has none."""
    from accel.doctor import page

    row = {"fixes": "foreach_loop+fused_optimizer", "predicted speedup": 1.335}
    assert page.predicted(row) == "1.33x"
    unpredicted = row | {"predicted speedup": math.nan, "predicted from": "nothing: not predicted on cpu"}
    assert page.predicted(unpredicted) is None
    assert page.unpredicted(unpredicted) == "not predicted on cpu"  # the row's own reason

