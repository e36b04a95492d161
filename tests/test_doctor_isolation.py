"""accel.doctor leaves the user's process as it found it: models and optimizers reached however
deep (class attributes, other modules, helpers of helpers) are copied or the doctor refuses; the
lists, iterators and random generators a step touches are the copies' own or put back; what
cannot be kept (files written) is named first in the report; only a plain step is examined.

The property test writes generated steps into modules of their own and checks, after the doctor
ran each, that parameters, gradients, optimizer state, random generators, globals and files are
exactly as they were, or that the report's first line names what changed."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import csv
import dataclasses
import errno
import functools
import importlib
import io
import itertools
import logging
import math
import os
import random
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import types
import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import plain_step, requires_cuda
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from accel import doctor
from accel.doctor.fixes import own_batch
from accel.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")

_modules = itertools.count()


def first_line(report) -> str:
    return str(report).splitlines()[0]


def named_before_numbers(report, what: str) -> bool:
    """``what`` is in the report's first line, before its first measured number."""
    line = first_line(report)
    return what in line and line.index(what) < line.index(" ms ")


def write_module(folder: Path, source: str, stem: str = "user_step"):
    """``source`` as a module of its own, imported from ``folder``."""
    name = f"{stem}_{next(_modules)}"
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


# ---- what the user holds, before and after -----------------------------------------------------
def held(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every value the doctor must leave alone: parameters, gradients, optimizer state, random
    generators."""
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [
            None if p.grad is None else (id(p.grad), p.grad.clone()) for p in model.parameters()
        ],
        "opt": copy.deepcopy(opt.state_dict()),
        "torch": torch.get_rng_state(),
        "random": random.getstate(),
        "numpy": np.random.get_state(),
    }


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def differences(before: dict, model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    after = held(model, opt)
    return [key for key in before if not same(before[key], after[key])]


def trained_once(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The user's own start: optimizer state made, gradients left in ``.grad``."""
    x = torch.randn(5, 4)
    model(x).square().mean().backward()
    opt.step()
    model(x).square().mean().backward()


def small() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    trained_once(model, opt)
    return model, opt


def one_update(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """The body of a plain training step: forward, backward, update, gradients zeroed."""
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def examined(step, *args, **kwargs):
    return doctor.examine(step, *args, steps=1, warmup=1, **kwargs)


# ---- reached however deep ----------------------------------------------------------------------
class Holder:
    model: nn.Module | None = None
    opt: torch.optim.Optimizer | None = None


def test_a_model_held_as_a_class_attribute_is_copied(seed, monkeypatch):
    model, opt = small()
    monkeypatch.setattr(Holder, "model", model)
    monkeypatch.setattr(Holder, "opt", opt)

    def step(x):
        loss = Holder.model(x).square().mean()
        loss.backward()
        Holder.opt.step()
        Holder.opt.zero_grad()
        return loss.detach()

    x = torch.randn(5, 4)
    before = held(model, opt)
    report = examined(step, x)
    assert differences(before, model, opt) == []
    assert "Sequential (Holder.model)" in report.parts.describe()
    assert Holder.model is model and not first_line(report).startswith("Caution")


class _Counted(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        _Counted.calls += 1
        return x * 2.0

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


class _CountingNet(nn.Sequential):
    forwards = 0

    def forward(self, x):
        type(self).forwards += 1
        return _Counted.apply(super().forward(x))


def test_a_count_kept_as_a_class_attribute_is_left_as_it_was(seed):
    model = _CountingNet(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls, forwards = _Counted.calls, _CountingNet.forwards
    step = plain_step(model, opt)
    x = torch.randn(5, 4)
    before = held(model, opt)
    report = examined(step, x)
    report.try_fixes(repeats=1, steps=1)
    assert differences(before, model, opt) == []
    assert (_Counted.calls, _CountingNet.forwards) == (calls, forwards)
    assert type(model) is _CountingNet


class _Seen(nn.Sequential):
    seen: ClassVar[list[int]] = []  # what the forward saw, kept on the class

    def forward(self, x):
        _Seen.seen.append(len(x))
        return super().forward(x)


def test_a_step_pickling_a_model_whose_class_the_copies_subclass_is_told_why_it_cannot(seed):
    """The copies' model is of a subclass (its class's list is the copies' own), which pickle
    refuses to save whole: the message says so, not that the step is wrong."""
    model = _Seen(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.save(model, io.BytesIO())  # a checkpoint of the whole model
        return loss.detach()

    step(torch.randn(3, 4))  # runs as written
    with pytest.raises(UsageError, match=r"subclass.*state_dict\(\)"):
        doctor.examine(step, torch.randn(3, 4))


def test_a_model_in_another_modules_function_is_copied(seed, tmp_path):
    other = write_module(
        tmp_path,
        """
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def train(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        """,
        "helpers",
    )
    trained_once(other.model, other.opt)
    train = other.train

    def step(x):  # the helper reached through this module's globals... or a closure
        return train(x)

    x = torch.randn(5, 4)
    before = held(other.model, other.opt)
    report = examined(step, x)
    assert differences(before, other.model, other.opt) == []
    assert f"Sequential ({other.__name__}.model)" in report.parts.describe()


def test_a_model_four_helpers_deep_is_copied(seed):
    model, opt = small()

    def forward(x):
        return model(x)

    def loss_of(x):
        return forward(x).square().mean()

    def backward(x):
        loss = loss_of(x)
        loss.backward()
        return loss

    def update(x):
        loss = backward(x)
        opt.step()
        opt.zero_grad()
        return loss

    def step(x):
        return update(x).detach()

    x = torch.randn(5, 4)
    before = held(model, opt)
    report = examined(step, x)
    assert differences(before, model, opt) == []
    assert len(report.parts.models) == 1 and len(report.parts.optimizers) == 1


def test_an_optimizer_whose_model_cannot_be_found_is_refused_unless_training_is_allowed(seed):
    model, opt = small()
    hidden = {"name": "model"}
    sys.modules[__name__].hidden_model = model  # reached by a name computed at run time

    def step(x):
        found = getattr(sys.modules[__name__], "hidden_" + hidden["name"])
        loss = found(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    x = torch.randn(5, 4)
    before = held(model, opt)
    with pytest.raises(UsageError, match=r"Adam \(closure 'opt'\) updates.*allow_training=True"):
        examined(step, x)
    assert differences(before, model, opt) == []
    report = examined(step, x, allow_training=True)
    assert named_before_numbers(report, "ran on your own objects (allow_training=True)")
    assert "params" in differences(before, model, opt)
    del sys.modules[__name__].hidden_model


@pytest.mark.parametrize("keyed", ["by parameter", "by name", "by module"])
def test_a_dict_keyed_by_the_parts_is_keyed_by_the_copies_on_the_copies(seed, keyed):
    # a per-parameter learning-rate scale or a name map: the copies' step looks up the copies
    model, opt = small()
    scale = {"by parameter": {p: 0.5 for p in model.parameters()},
             "by name": {p: n for n, p in model.named_parameters()},
             "by module": {m: 0.5 for m in model.modules()}}[keyed]  # fmt: skip
    order = list(scale)

    def step(x):
        loss = one_update(model, opt, x)
        if keyed == "by module":
            assert all(m in scale for m in model.modules())
        else:
            assert all(p in scale for p in model.parameters())
        return loss

    x = torch.randn(5, 4)
    before = held(model, opt)
    report = examined(step, x)
    report.try_fixes(["set_to_none"], steps=1, repeats=1)
    assert differences(before, model, opt) == []
    assert list(scale) == order  # yours keyed by yours, in its order


def test_a_step_that_looks_up_its_parameters_by_id_is_told_why_it_fails_on_the_copies(seed):
    model, opt = small()
    scale = {id(p): 0.5 for p in model.parameters()}

    def step(x):
        loss = one_update(model, opt, x)
        for p in model.parameters():
            p.data.mul_(1 - 1e-3 * scale[id(p)])
        return loss

    with pytest.raises(UsageError, match=r"KeyError.*identity.*id\(p\)"):
        examined(step, torch.randn(5, 4))


def test_a_scripted_model_is_examined_on_its_copy(seed):
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(scripted.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    weights = [p.detach().clone() for p in scripted.parameters()]

    def step(batch):
        return one_update(scripted, opt, batch)

    report = examined(step, x)
    assert report.evidence.parts.models[0] is not scripted
    assert all(torch.equal(a, b) for a, b in zip(weights, scripted.parameters(), strict=True))


class Logged(nn.Module):
    """A model that keeps what cannot be copied beside its layers: a lock, an open log, a
    generator of noise seeds (the writer-on-the-model pattern)."""

    def __init__(self, log):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.lock, self.log = threading.Lock(), log
        self.seeds = itertools.count()

    def forward(self, x):
        with self.lock:
            return self.layer(x)


def test_a_model_holding_what_cannot_be_copied_is_copied_sharing_it_and_says_so(seed, tmp_path):
    with open(tmp_path / "log.txt", "w") as log:
        model = Logged(log)
        model.seeds = (i for i in range(10**6))  # a generator: deepcopy refuses it
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(5, 4)
        weights = [p.detach().clone() for p in model.parameters()]

        def step(batch):
            return one_update(model, opt, batch)

        report = examined(step, x)
        said = first_line(report)
    assert report.evidence.parts.models[0] is not model
    assert report.evidence.parts.models[0].lock is model.lock
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert "closure 'model'.lock" in said and "closure 'model'.log" in said, said
    assert "seeds" not in said and next(model.seeds) == 0  # a generator: made again, not shared


def test_a_fix_no_finding_predicts_has_no_predicted_speedup(seed):
    # tried by name, or for a finding that predicts nothing here: unknown, not "no gain"
    model, opt = small()
    report = examined(lambda x: one_update(model, opt, x), torch.randn(5, 4))
    (row,) = report.try_fixes(["set_to_none"], steps=1, repeats=1).to_dict("records")
    assert math.isnan(row["predicted speedup"]) and math.isnan(row["predicted ms"])
    assert row["predicted from"].startswith("nothing")


def test_a_panel_of_the_fixed_steps_puts_back_what_the_steps_change(seed, tmp_path, monkeypatch):
    """A panel times the fixed steps many times; inside ``report.isolated`` what their code
    changes (a checkpoint it saves, the random state it draws from) is put back after each run."""
    from accel.lab.panel import FeaturePanel

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt.pt").write_bytes(b"old checkpoint")
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step(x):
        loss = model(x + torch.rand_like(x)).square().mean()
        loss.backward()
        for p in model.parameters():
            torch.nn.utils.clip_grad_norm_([p], 1.0)
        opt.step()
        opt.zero_grad()
        torch.save(model.state_dict(), "ckpt.pt")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    flags = report.fix_flags()
    panel = FeaturePanel(flags, report.fixed_step, device="cpu", warmup=1, repeats=2,
                         profile_steps=1, around=report.isolated)  # fmt: skip
    random_state = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what could not be kept is warned, as try_fixes does
        panel.run(flags(**{f.name: True for f in dataclasses.fields(flags)}))
    assert (tmp_path / "ckpt.pt").read_bytes() == b"old checkpoint"
    assert torch.equal(torch.get_rng_state(), random_state)


def test_a_fix_whose_finding_predicts_nothing_here_says_so(seed):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])  # 12 tensors clipped one by one
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        for p in model.parameters():
            torch.nn.utils.clip_grad_norm_([p], 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    (finding,) = [f for f in report.findings if "batched_clip" in f.fixes]
    assert finding.saved_us is None  # a CPU: no prediction
    (row,) = report.try_fixes(["batched_clip"], steps=1, repeats=1).to_dict("records")
    assert row["predicted from"] == "nothing: not predicted on cpu", row["predicted from"]


# ---- what Untouched sees -------------------------------------------------------------------------
def test_untouched_sees_gradients_and_optimizer_state(seed):
    from accel.doctor.parts import find_parts
    from accel.doctor.untouched import Untouched

    model, opt = small()

    def step(x):
        return model(x).sum()

    def changed_by(change) -> list[str]:
        untouched = Untouched(find_parts(step))
        change()
        return untouched.changed()

    weight = model[0].weight
    assert changed_by(lambda: None) == []
    assert changed_by(lambda: weight.grad.add_(1.0)) == ["closure 'model': 0.weight.grad"]
    grad = weight.grad
    assert changed_by(lambda: setattr(weight, "grad", grad.clone())) == [
        "closure 'model': 0.weight.grad"  # the same values in another tensor
    ]
    assert changed_by(lambda: setattr(weight, "grad", None)) == ["closure 'model': 0.weight.grad"]
    assert changed_by(lambda: weight.data.mul_(2.0)) == ["closure 'model': 0.weight"]
    (changed,) = changed_by(lambda: opt.param_groups[0].update(lr=0.5))
    assert changed.endswith("not found in the step: param_groups")
    assert any(": state[" in c for c in changed_by(opt.step))


def test_untouched_names_a_model_the_step_never_showed(seed):
    from accel.doctor.parts import find_parts
    from accel.doctor.untouched import Untouched

    model, _ = small()
    untouched = Untouched(find_parts(lambda x: x))
    model(torch.randn(5, 4)).sum().backward()
    assert "not found in the step" in untouched.report()[0]
    assert "0.weight.grad" in untouched.report()[0]


def test_untouched_leaves_out_the_copies_an_earlier_run_made(seed):
    """torch.compile's caches keep a compiled copy's parameters alive after its run, and a later
    CUDA graph replay writes over their gradients: the doctor's own copies are not the user's."""
    from accel.doctor.parts import copy_step, find_parts
    from accel.doctor.untouched import Untouched

    model, opt = small()

    def step(x):
        return one_update(model, opt, x)

    _, copied = copy_step(step, find_parts(step))  # an earlier run's copy, still alive
    untouched = Untouched(find_parts(step))
    for p in copied.models[0].parameters():
        p.grad = torch.randn_like(p)
    assert untouched.changed() == []


def test_untouched_compares_a_tensor_it_cannot_read_by_its_version(seed, monkeypatch):
    """A model left behind by CUDA graphs (compiled with mode="reduce-overhead", its gradients
    since run over by a later replay): torch refuses to read them, so they are compared by their
    version counter, and every other tensor still by its values."""
    from accel.doctor.parts import find_parts
    from accel.doctor.untouched import Untouched

    model, _ = small()
    left_behind, _ = small()
    left_behind(torch.randn(5, 4)).sum().backward()
    unreadable = {p.grad.data_ptr() for p in left_behind.parameters()}
    foreach_norm = torch._foreach_norm

    def refusing(tensors, *args, **kwargs):
        if any(t.data_ptr() in unreadable for t in tensors):
            raise RuntimeError("Error: accessing tensor output of CUDAGraphs that has been "
                               "overwritten by a subsequent run.")
        return foreach_norm(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", refusing)
    untouched = Untouched(find_parts(lambda x: model(x)))
    assert untouched.changed() == []
    model[0].weight.data.mul_(2.0)  # a write the version counter does not see
    next(left_behind.parameters()).grad.add_(1.0)  # one it does
    changed = untouched.changed()
    assert "closure 'model': 0.weight" in changed
    assert any(c.endswith("0.weight.grad") and "not found in the step" in c for c in changed)
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("CUDA error: an illegal memory access was encountered")))
    with pytest.raises(RuntimeError, match="illegal memory access"):  # any other error stays
        untouched.changed()


# ---- what the step touches besides them ------------------------------------------------------------
def test_a_numpy_array_the_step_writes_in_place_is_the_copies_own(seed):
    """Running statistics kept in a NumPy array the step writes into: the user's stay."""
    model, opt = small()
    running = np.zeros(4)
    seen = {"n": 0}

    def step(x):
        loss = one_update(model, opt, x).detach()
        running[seen["n"] % 4] = float(loss)
        seen["n"] += 1
        return loss

    examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
    assert np.array_equal(running, np.zeros(4)) and seen == {"n": 0}


def test_globals_iterators_and_random_generators_are_the_copies_own(seed):
    model, opt = small()
    losses: list[float] = []
    batches = iter([torch.randn(5, 4) for _ in range(500)])
    counts = {"steps": 0}

    def step():
        x = next(batches)
        loss = model(x).square().mean() + 0 * torch.rand(()) + 0 * random.random()
        loss = loss + 0 * float(np.random.rand())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        counts["steps"] += 1
        return loss.detach()

    first = batches.__reduce__()[-1]  # how far the list iterator has got
    before = held(model, opt)
    report = examined(step)
    assert differences(before, model, opt) == []
    assert losses == [] and counts == {"steps": 0}
    assert batches.__reduce__()[-1] == first
    assert not first_line(report).startswith("Caution")


class EmaTrainer:
    """A trainer keeping an average of the weights and a step count in tensors of its own."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.count = torch.zeros(())

    def training_step(self, x):
        loss = self.model(x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                self.ema[k].mul_(0.9).add_(v, alpha=0.1)
            self.count += 1
        return loss.detach()


def test_tensors_the_step_writes_in_place_are_the_copies_own(seed):
    trainer = EmaTrainer(*small())
    ema = {k: v.clone() for k, v in trainer.ema.items()}
    report = examined(trainer.training_step, torch.randn(5, 4))
    report.try_fixes(steps=1, repeats=1)
    assert all(torch.equal(trainer.ema[k], v) for k, v in ema.items())
    assert trainer.count.item() == 0
    assert not first_line(report).startswith("Caution")


def test_a_batch_the_step_changes_in_place_is_the_copies_own(seed):
    """A step that normalises its batch in place: the user's batch stays as it was, and each trial
    starts from it (on a batch changed by the runs before, the unchanged step and a fix would
    be compared on different inputs)."""
    model, opt = small()

    def step(batch):
        x = batch["x"]
        x.mul_(1.5)  # in place, as `x.sub_(mean).div_(std)` does
        return one_update(model, opt, x).detach()

    batch = {"x": torch.randn(5, 4)}
    kept = batch["x"].clone()
    report = examined(step, batch)
    rows = report.try_fixes("set_to_none", steps=2, repeats=1)
    assert torch.equal(batch["x"], kept)
    assert not first_line(report).startswith("Caution")
    assert list(rows["status"]) == ["ok"], rows[["status", "why"]].to_string()


def test_numeric_flags_the_step_sets_are_put_back(seed):
    """A step that turns on TF32 (as many scripts do at their top) changes every later float32
    product of the process: examining it must not."""
    model, opt = small()

    def step(x):
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = False
        return one_update(model, opt, x).detach()

    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    try:
        examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
        after = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
    assert after == before


def test_the_default_dtype_the_step_sets_is_put_back(seed):
    """A step that sets float64 as the default for a physics term: every later tensor the
    process makes would be float64 if examining it left it so."""
    model, opt = small()

    def step(x):
        torch.set_default_dtype(torch.float64)
        return one_update(model, opt, x).detach()

    try:
        examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
        after = torch.get_default_dtype()
    finally:
        torch.set_default_dtype(torch.float32)
    assert after == torch.float32


def test_grad_mode_the_step_turns_off_is_put_back(seed):
    """A step that turns gradients off for its logging and never back on: the user's process
    would build no graph for its next step."""
    model, opt = small()

    def step(x):
        torch.set_grad_enabled(True)
        loss = one_update(model, opt, x).detach()
        torch.set_grad_enabled(False)
        return loss

    try:
        examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
        after = torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)
    assert after


def test_a_dataframe_or_array_batch_the_step_changes_in_place_is_the_copies_own(seed):
    """A batch of pandas or NumPy data normalised in place by the step stays as the user had it."""
    pd = pytest.importorskip("pandas")
    model, opt = small()

    def step(batch):
        frame, extra = batch
        frame[list(frame.columns)] = (frame - frame.mean()) / frame.std()
        extra *= 2.0
        x = torch.tensor(frame.values + extra, dtype=torch.float32)
        return one_update(model, opt, x).detach()

    frame = pd.DataFrame(np.random.default_rng(0).normal(3.0, 2.0, (5, 4)), columns=list("abcd"))
    extra = np.random.default_rng(1).normal(size=(5, 4))
    kept = frame.copy(), extra.copy()
    examined(step, (frame, extra)).try_fixes("set_to_none", steps=1, repeats=1)
    assert frame.equals(kept[0]) and np.array_equal(extra, kept[1])


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor


class _Encoding(collections.UserDict):
    """A tokenizer's output: a mapping that is not a dict, its tensors behind attributes."""


@pytest.mark.parametrize(
    "make", [lambda x: _Batch(x, x.sum(1)), lambda x: _Encoding(x=x)], ids=["dataclass", "mapping"]
)
def test_a_batch_object_whose_tensors_the_step_changes_in_place_is_the_copies_own(seed, make):
    model, opt = small()

    def step(batch):
        x = batch.x if isinstance(batch, _Batch) else batch["x"]
        x.sub_(x.mean())  # normalised in place
        return one_update(model, opt, x).detach()

    x = torch.randn(5, 4)
    kept, batch = x.clone(), make(x)
    examined(step, batch).try_fixes("set_to_none", steps=1, repeats=1)
    assert torch.equal(x, kept)


def test_determinism_flags_a_seeding_helper_sets_are_put_back(seed):
    """A ``seed_everything`` called in the step (as many scripts do) turns on cuDNN's
    deterministic mode and torch's deterministic algorithms for the whole process: examining it
    must not."""
    model, opt = small()

    def step(x):
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.enabled = False
        torch.use_deterministic_algorithms(True, warn_only=True)
        return one_update(model, opt, x).detach()

    def flags():
        return (torch.backends.cudnn.deterministic, torch.backends.cudnn.enabled,
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip

    before = flags()
    try:
        examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
        after = flags()
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.enabled = before[:2]
        torch.use_deterministic_algorithms(before[2], warn_only=before[3])
    assert after == before


def test_process_switches_a_debugging_step_sets_are_put_back(seed):
    """Anomaly detection, an SDPA kernel switched off, reduced-precision reductions and the
    thread count are the whole process's: a step that sets them must leave them as they were."""
    model, opt = small()
    cuda = torch.backends.cuda

    def step(x):
        torch.autograd.set_detect_anomaly(True)
        cuda.enable_flash_sdp(False)
        cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.set_num_threads(3)
        return one_update(model, opt, x).detach()

    def switches():
        return (torch.is_anomaly_enabled(), cuda.flash_sdp_enabled(),
                cuda.matmul.allow_fp16_reduced_precision_reduction, torch.get_num_threads())  # fmt: skip

    before = switches()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # anomaly detection warns that it slows the step
            examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
        after = switches()
    finally:
        torch.autograd.set_detect_anomaly(before[0])
        cuda.enable_flash_sdp(before[1])
        cuda.matmul.allow_fp16_reduced_precision_reduction = before[2]
        torch.set_num_threads(before[3])
    assert after == before


def flushing_denormals() -> bool:
    return torch.tensor([1e-40]).item() == 0.0  # torch has no getter for set_flush_denormal


def test_denormal_flushing_print_options_and_warning_filters_a_step_sets_are_put_back(seed):
    """A step set up 'to be fast and quiet': denormals flushed changes every later float of
    the process, a warnings filter of "ignore" hides the user's warnings from then on."""
    model, opt = small()

    def step(x):
        torch.set_flush_denormal(True)
        torch.set_printoptions(precision=2)
        warnings.simplefilter("ignore")
        return one_update(model, opt, x).detach()

    def state():
        return flushing_denormals(), str(torch.tensor([1.23456])), list(warnings.filters)

    with warnings.catch_warnings():  # this test's own filters, whatever the doctor leaves
        before = state()
        try:
            examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
            after = state()
        finally:
            torch.set_flush_denormal(before[0])
            torch.set_printoptions(profile="default")
    assert after == before


def test_the_working_folder_onednn_and_autograds_threads_a_step_changes_are_put_back(
    seed, tmp_path
):
    """A step that moves into its run's folder to write there, and one that switches oneDNN or
    autograd's worker threads off to chase a bug: the user's process after is as before."""
    model, opt = small()

    def step(x):
        os.chdir(tmp_path)
        torch.backends.mkldnn.enabled = False
        torch.autograd.set_multithreading_enabled(False)
        return one_update(model, opt, x).detach()

    def state():
        return os.getcwd(), torch.backends.mkldnn.enabled, torch._C._is_multithreading_enabled()

    before = state()
    try:
        examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
        after = state()
    finally:
        os.chdir(before[0])
        torch.backends.mkldnn.enabled = before[1]
        torch.autograd.set_multithreading_enabled(before[2])
    assert after == before


def test_garbage_collection_umask_numpy_errors_and_the_default_device_a_step_sets_are_put_back(
    seed,
):
    """A step tuned 'for speed' turns the garbage collector off, a debugging one makes NumPy
    raise on overflow or torch warn always, one sets a default device or umask: each is the
    whole process's, and the user's later code runs under it."""
    import gc

    model, opt = small()

    def step(x):
        gc.disable()
        gc.set_threshold(100_000, 50, 50)
        os.umask(0o077)
        np.seterr(all="raise")
        np.set_printoptions(precision=2)
        torch.set_warn_always(True)
        torch.set_default_device("cpu")
        sys.setrecursionlimit(sys.getrecursionlimit() + 1000)
        return one_update(model, opt, x).detach()

    def state():
        umask = os.umask(0o022)
        os.umask(umask)
        return (gc.isenabled(), gc.get_threshold(), umask, np.geterr(),
                np.get_printoptions()["precision"], torch.is_warn_always_enabled(),
                getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None),
                sys.getrecursionlimit())  # fmt: skip

    before = state()
    try:
        examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
        after = state()
    finally:
        gc.enable()
        gc.set_threshold(*before[1])
        os.umask(before[2])
        np.seterr(**before[3])
        np.set_printoptions(precision=before[4])
        torch.set_warn_always(before[5])
        torch.set_default_device(None)
        sys.setrecursionlimit(before[7])
    assert after == before


def test_hooks_a_step_registers_for_every_module_and_optimizer_are_removed(seed):
    """A step that registers an activation logger for every module once, keeping the handle in
    a list of its own: the doctor's copies held the handles, and the hooks ran on every later
    forward and optimizer step of the user's process (a full backward hook on every module
    makes an in-place change of any module's output fail)."""
    import torch.optim.optimizer as optimizers

    model, opt = small()
    handles = []

    def step(x):
        if not handles:
            handles.append(nn.modules.module.register_module_forward_hook(lambda *_: None))
            handles.append(nn.modules.module.register_module_full_backward_hook(lambda *_: None))
            handles.append(optimizers.register_optimizer_step_post_hook(lambda *_: None))
        return one_update(model, opt, x).detach()

    def hooks():
        module = nn.modules.module
        return (len(module._global_forward_hooks), len(module._global_backward_hooks),
                module._global_is_full_backward_hook,
                len(optimizers._global_optimizer_post_hooks))  # fmt: skip

    before = hooks()
    examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
    after = hooks()
    for handle in handles:  # the hooks the step left in this process, if any
        handle.remove()
    assert not handles and after == before


def test_the_output_streams_import_path_and_signal_handlers_a_step_sets_up_are_put_back(
    seed, tmp_path
):
    """A cluster-style step sets itself up on its first call: it tees the output into a log,
    adds its folder to the import path, checkpoints on a preemption signal and shares tensors
    through files. Left, the user's every later print went to the copy's tee (into a log the
    doctor had removed) and the signal saved the doctor's copy."""
    import signal

    model, opt = small()
    log = tmp_path / "out.log"

    class Tee(io.TextIOBase):
        def __init__(self, stream):
            self.stream, self.file = stream, open(log, "a")  # noqa: SIM115

        def write(self, text):
            self.file.write(text)
            return self.stream.write(text)

    def step(x):
        sys.stdout, sys.stderr = Tee(sys.stdout), Tee(sys.stderr)
        sys.path.append(str(tmp_path))
        signal.signal(signal.SIGUSR1, lambda *_: torch.save(model.state_dict(), tmp_path / "x"))
        torch.multiprocessing.set_sharing_strategy("file_system")
        return one_update(model, opt, x).detach()

    def state():
        return (sys.stdout, sys.stderr, list(sys.path), signal.getsignal(signal.SIGUSR1),
                torch.multiprocessing.get_sharing_strategy())  # fmt: skip

    before = state()
    try:
        examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
        after = state()
    finally:
        sys.stdout, sys.stderr, sys.path[:] = before[0], before[1], before[2]
        signal.signal(signal.SIGUSR1, before[3])
        torch.multiprocessing.set_sharing_strategy(before[4])
    assert after == before


def test_the_exception_hooks_and_compiler_settings_a_step_sets_are_put_back(seed):
    """A script's step that installs its crash reporter (sys.excepthook, threading's) and tunes
    dynamo and inductor before compiling: left, the user's later crashes went to the copy's
    reporter and their own compiles ran with the copy's settings."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    model, opt = small()

    def report_crash(*_):
        pass

    def step(x):
        sys.excepthook, sys.displayhook, threading.excepthook = report_crash, print, report_crash
        dynamo_config.suppress_errors = not dynamo_config.suppress_errors
        inductor_config.coordinate_descent_tuning = not inductor_config.coordinate_descent_tuning
        return one_update(model, opt, x).detach()

    def state():
        return (sys.excepthook, sys.displayhook, threading.excepthook,
                dynamo_config.get_config_copy(), inductor_config.get_config_copy())  # fmt: skip

    before = state()
    try:
        examined(step, torch.randn(5, 4))
        after = state()
    finally:
        sys.excepthook, sys.displayhook, threading.excepthook = before[:3]
        dynamo_config.suppress_errors = before[3]["suppress_errors"]
        inductor_config.coordinate_descent_tuning = before[4]["coordinate_descent_tuning"]
    assert after[:3] == before[:3]
    assert after[3] == before[3] and after[4] == before[4]


def test_an_exit_handler_the_step_registers_is_removed_and_named(tmp_path):
    """A step that registers a last checkpoint to be saved when the process exits: left, the
    doctor's copy saved it over the user's files after the doctor had put them back."""
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(f"""
        import atexit
        import torch
        from torch import nn
        from accel import doctor

        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        registered = []

        def step(x):
            if not registered:
                registered.append(True)
                atexit.register(torch.save, model.state_dict(), {str(tmp_path / "last.pt")!r})
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        print(str(doctor.examine(step, torch.randn(5, 4), steps=1, warmup=1)).splitlines()[0])
    """))
    environment = {**os.environ, "PYTHONPATH": str(Path(doctor.__file__).parents[2])}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=environment, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "last.pt").exists()
    assert "registered save to run at exit, removed" in run.stdout, run.stdout


def test_examining_inside_the_users_own_profiler_is_refused_and_leaves_their_profile(seed):
    """The doctor profiles the step itself: started inside a profiler the user is running, it
    took the session over and the user's profile came back empty. Refused before any work."""
    model, opt = small()

    def step(x):
        return one_update(model, opt, x).detach()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as mine:
        with pytest.raises(UsageError, match=r"profiler.*already running"):
            examined(step, torch.randn(5, 4))
        torch.randn(3, 3).exp()
    assert any(e.key == "aten::exp" for e in mine.key_averages())


@functools.lru_cache(maxsize=8)
def cached_scale(width: int) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, width)


def test_a_cache_the_step_fills_is_the_copys_own(seed):
    """A helper under functools.lru_cache (rotary tables, masks by shape) keeps what the step
    made it compute: the copy fills a cache of its own, the user's stays as it was."""
    model, opt = small()

    def step(x):
        return one_update(model, opt, x * cached_scale(x.shape[-1])).detach()

    cached_scale.cache_clear()
    examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
    assert cached_scale.cache_info() == (0, 0, 8, 0)
    assert cached_scale(4) is cached_scale(4)  # still the user's cache, working


def test_environment_variables_the_step_sets_are_put_back(seed, monkeypatch):
    """A step that sets, changes or removes environment variables (a run marker, a library's
    switch) must leave the process's environment as it was after examining."""
    monkeypatch.setenv("ACCEL_TEST_KEPT", "before")
    monkeypatch.setenv("ACCEL_TEST_REMOVED", "here")
    monkeypatch.delenv("ACCEL_TEST_ADDED", raising=False)
    model, opt = small()

    def step(x):
        os.environ["ACCEL_TEST_ADDED"] = "1"
        os.environ["ACCEL_TEST_KEPT"] = "after"
        os.environ.pop("ACCEL_TEST_REMOVED", None)
        return one_update(model, opt, x).detach()

    before = dict(os.environ)
    examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
    assert dict(os.environ) == before


def test_logging_the_step_configures_is_put_back(seed):
    """A step that sets up logging as a script's main does (``basicConfig(force=True)``, a
    logger's level) leaves the user's loggers as they were: their levels and handlers."""
    root, mine = logging.getLogger(), logging.getLogger("accel.tests.configured_by_the_step")
    model, opt = small()

    def step(x):
        logging.basicConfig(level=logging.DEBUG, force=True)
        mine.setLevel(logging.ERROR)
        mine.propagate = False
        return one_update(model, opt, x).detach()

    def config():
        return [(log.level, list(log.handlers), log.propagate) for log in (root, mine)]

    before = config()
    examined(step, torch.randn(5, 4)).try_fixes("set_to_none", steps=1, repeats=1)
    assert config() == before


def test_a_step_that_logs_is_not_said_to_change_the_logging_registry(seed):
    """A logger's level cache and its manager's table of loggers belong to ``logging`` (any
    ``getLogger`` in the process changes them): not a change of the user's to report."""
    log = logging.getLogger("accel.tests.a_step_that_logs")
    log._cache.clear()  # the step's first debug() fills it
    model, opt = small()

    def step(x):
        loss = one_update(model, opt, x)
        log.debug("loss %s", loss)
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert not [s for s in report.side_effects if "_cache" in s or "manager" in s]


@requires_cuda
def test_a_pinned_staging_buffer_the_step_reaches_is_copied_pinned(seed):
    """A copy that lost its pinning would make the step's copy in pageable, and the doctor would
    report (and time) a problem the user's step does not have."""
    from accel.doctor.parts import copy_step, find_parts

    model = nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    staging = torch.empty(5, 4, pin_memory=True)

    def step(x):
        staging.copy_(x)
        loss = model(staging.to("cuda", non_blocking=True)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    run, _ = copy_step(step, find_parts(step))
    cells = dict(
        zip(run.__code__.co_freevars, (c.cell_contents for c in run.__closure__), strict=True)
    )
    assert cells["staging"] is not staging and cells["staging"].is_pinned()


def test_tensors_past_the_copy_budget_are_shared_and_named_where_written(seed, monkeypatch):
    """A data set held in memory is not copied whole: past the budget a tensor is shared, and a
    step writing into it is named in the report's first line."""
    from accel.doctor import parts

    trainer = EmaTrainer(*small())
    budget = sum(t.untyped_storage().nbytes() for t in trainer.ema.values())
    monkeypatch.setattr(parts, "COPIED_TENSOR_BYTES", budget)  # the EMA fits, the count does not
    report = examined(trainer.training_step, torch.randn(5, 4))
    assert trainer.count.item() > 0
    assert "count" in first_line(report) and first_line(report).startswith("Caution")


def test_random_generator_objects_the_step_draws_from_are_the_copies_own(seed):
    model, opt = small()
    drawn = {"numpy": np.random.default_rng(1), "python": random.Random(2)}
    generator = torch.Generator().manual_seed(3)

    def step(x):
        noise = torch.rand(x.shape, generator=generator) + drawn["numpy"].random()
        loss = model(x + 0 * noise).square().mean() + 0 * drawn["python"].random()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    states = (drawn["numpy"].bit_generator.state, drawn["python"].getstate(), generator.get_state())
    report = examined(step, torch.randn(5, 4))
    assert drawn["numpy"].bit_generator.state == states[0]
    assert drawn["python"].getstate() == states[1]
    assert torch.equal(generator.get_state(), states[2])
    assert not first_line(report).startswith("Caution")


def test_an_open_file_the_step_writes_to_is_named_first(seed, tmp_path):
    model, opt = small()
    log = open(tmp_path / "log.txt", "a")  # noqa: SIM115 - held open, as a notebook's log is

    def step(x):
        loss = one_update(model, opt, x)
        log.write(f"{loss.item()}\n")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    log.close()
    assert named_before_numbers(report, "changed closure 'log'")


def test_try_fixes_puts_the_random_generators_back(seed):
    model, opt = small()
    report = examined(plain_step(model, opt), torch.randn(5, 4))
    before = held(model, opt)
    report.try_fixes("set_to_none", steps=1, repeats=1)
    assert differences(before, model, opt) == []


@requires_cuda
def test_the_cuda_generator_and_model_are_as_they_were_after_examine_and_try_fixes(seed):
    cuda = torch.device("cuda")
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).to(cuda)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(x):
        loss = model(x).square().mean() + 0 * torch.rand((), device=cuda)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    x = torch.randn(5, 4, device=cuda)
    trained_once_on = [p.detach().clone() for p in model.parameters()]
    generator = torch.cuda.get_rng_state()
    report = examined(step, x)
    report.try_fixes(["set_to_none", "cuda_graph"], steps=1, repeats=1)
    assert torch.equal(torch.cuda.get_rng_state(), generator)
    assert all(torch.equal(a, b) for a, b in zip(trained_once_on, model.parameters(), strict=True))
    assert not first_line(report).startswith("Caution")


def random_batches(n: int):
    for _ in range(n):
        yield torch.randn(5, 4)


def counted_batches(n: int):
    while n:  # its argument assigned: what it was made with is no longer known
        n -= 1
        yield torch.randn(5, 4)


def test_a_started_generator_of_batches_is_made_again_from_its_arguments(seed):
    # its code never assigns its arguments, so they still say how it was made: the copies make
    # their own from its start, and yours gives up no item
    model, opt = small()
    batches = random_batches(500)
    next(batches)

    def step():
        return one_update(model, opt, next(batches))

    report = examined(step)
    report.try_fixes(["set_to_none"], steps=1, repeats=1)
    assert not first_line(report).startswith("Caution"), first_line(report)
    assert sum(1 for _ in batches) == 499


def test_an_iterator_that_cannot_be_copied_is_named_with_what_it_lost(seed):
    model, opt = small()
    batches = counted_batches(500)
    next(batches)  # a generator started: its place in its code is not copied

    def step():
        loss = model(next(batches)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    report = examined(step)
    assert named_before_numbers(report, "took 1 item from closure 'batches' (a generator")


def test_a_generator_not_yet_started_is_made_again_on_the_copies(seed):
    # a generator function's generator before its first item is its function and arguments:
    # the copies make their own (over the copies of what its code reaches), yours gives up none
    model, opt = small()
    data = [torch.randn(5, 4) for _ in range(3)]  # fewer than the calls: the copies start again
    served = []

    def batches(items):
        for x in items:
            served.append(x)  # a list the generator's code changes: the copies' own
            yield x

    gen = batches(data)

    def step():
        return one_update(model, opt, next(gen))

    report = examined(step)
    report.try_fixes(["set_to_none"], steps=1, repeats=1)
    assert not first_line(report).startswith("Caution"), first_line(report)
    assert served == []
    rest = list(gen)
    assert len(rest) == 3 and all(torch.equal(a, b) for a, b in zip(rest, data, strict=True))


def test_a_generator_reading_an_open_file_is_not_made_again_over_your_file(seed, tmp_path):
    # made again, the copies' generator would read the file handle both share: yours would
    # find it read through, and nothing said; read once instead, the report says what it took
    model, opt = small()
    path = tmp_path / "rows.txt"
    path.write_text("".join(f"{i} {i + 1} {i + 2} {i + 3}\n" for i in range(100)))

    def batches(handle):
        for line in handle:
            yield torch.tensor([[float(v) for v in line.split()]])

    with open(path) as handle:
        gen = batches(handle)

        def step():
            return one_update(model, opt, next(gen))

        report = examined(step)
        report.try_fixes(["set_to_none"], steps=1, repeats=1)
        said = first_line(report)
        rest = list(gen)
    assert "took 1 item" in said, said
    assert len(rest) == 99 and rest[0].tolist() == [[1.0, 2.0, 3.0, 4.0]]


@pytest.mark.parametrize("layout", ["a column slice", "transposed", "channels-last"])
def test_the_copies_batch_keeps_the_strides_of_yours(seed, layout):
    # a step that works only on the layout it is given (``x.view(-1)`` refuses a slice) must be
    # examined on that layout, not on a contiguous copy of it
    model, opt = small()
    x = {"a column slice": lambda: torch.randn(5, 6)[:, :4],
         "transposed": lambda: torch.randn(4, 5).t(),
         "channels-last": lambda: torch.randn(5, 4, 1, 1).contiguous(
             memory_format=torch.channels_last)}[layout]()  # fmt: skip
    strides = x.stride()

    def step(batch):
        assert batch.stride() == strides, batch.stride()
        return one_update(model, opt, batch.reshape(5, 4))

    examined(step, x).try_fixes(["set_to_none"], steps=1, repeats=1)


def test_a_finite_iterator_gives_one_item_which_the_step_gets_again(seed):
    model, opt = small()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)),
                                         batch_size=4)  # fmt: skip
    batches = iter(loader)  # 16 batches, fewer than the doctor's calls

    def step():
        (x,) = next(batches)
        return one_update(model, opt, x)

    report = examined(step)
    assert named_before_numbers(report, "took 1 item from closure 'batches'")
    assert "gave the step that item on every call" in first_line(report)
    report.try_fixes(["set_to_none"], steps=1, repeats=1)
    assert sum(1 for _ in batches) == 15


def test_an_iterator_at_its_end_is_said_to_start_again_on_the_copies(seed):
    """At its end the step's own restart (here a fresh pass over other data) runs on each of the
    doctor's copies: the time holds it, and the report says so."""
    model, opt = small()

    def passes():
        yield from torch.randn(2, 4, 4)

    batches = passes()
    for _ in batches:  # the epoch's end
        pass

    def step():
        nonlocal batches
        try:
            x = next(batches)
        except StopIteration:
            batches = passes()
            x = next(batches)
        return one_update(model, opt, x)

    assert named_before_numbers(examined(step), "found closure 'batches' (a generator, which "
                                "cannot be copied) at its end")  # fmt: skip


class Holding:
    def __init__(self, **items):
        vars(self).update(items)


@pytest.mark.parametrize("holder", [types.SimpleNamespace, Holding, dict])
def test_an_iterator_held_by_an_object_or_a_dict_is_read_on_the_copies(seed, holder):
    # the holder is rebuilt around the copies' reading: a list's iterator is not advanced, and
    # a generator started that cannot be made again gives up the one item the report names
    model, opt = small()
    data = [torch.randn(5, 4) for _ in range(8)]
    drawn = counted_batches(9)
    next(drawn)
    state = holder(copyable=iter(data), drawn=drawn)

    def step():
        if isinstance(state, dict):
            return one_update(model, opt, next(state["copyable"]) + next(state["drawn"]))
        return one_update(model, opt, next(state.copyable) + next(state.drawn))

    report = examined(step)
    report.try_fixes(["set_to_none"], steps=1, repeats=1)
    held_as = (lambda name: f"['{name}']") if holder is dict else (lambda name: f".{name}")
    assert named_before_numbers(report, f"took 1 item from closure 'state'{held_as('drawn')} (a")
    assert held_as("copyable") not in first_line(report)
    items = vars(state) if holder is not dict else state
    assert sum(1 for _ in items["drawn"]) == 7
    rest = list(items["copyable"])
    assert len(rest) == 8 and all(torch.equal(a, b) for a, b in zip(rest, data, strict=True))

def numbers(n: int):
    yield from range(n)


def test_a_count_that_runs_out_is_named_in_the_error(seed):
    model, opt = small()
    counts = numbers(4)
    next(counts)  # started, so not copied; not a batch: read through, as the step's code may need

    def step(x):
        return one_update(model, opt, x * next(counts))

    with pytest.raises(UsageError, match=r"closure 'counts' \(a generator, which cannot be "
                       r"copied\) ran out after a copy of the doctor's took 3 items"):
        examined(step, torch.randn(5, 4))
    # one not yet started is made again on the copies: that is what ran out, yours is whole
    counts = numbers(3)
    with pytest.raises(UsageError, match=r"closure 'counts' \(a generator\) ran out after a "
                       r"copy of the doctor's took 3 items"):
        examined(step, torch.randn(5, 4))
    assert list(counts) == [0, 1, 2]
    # a generator expression is made again over a copy of what it reads: that is what ran out
    counts = (i for i in range(3))
    with pytest.raises(UsageError, match=r"what closure 'counts' reads \(a range_iterator\) ran "
                       r"out after a copy of the doctor's took 3 items"):
        examined(step, torch.randn(5, 4))
    assert list(counts) == [0, 1, 2]


def test_a_short_list_of_batches_is_given_again_and_left_whole(seed):
    model, opt = small()
    batches = iter([torch.randn(5, 4) for _ in range(3)])  # copyable, fewer than the calls

    def step():
        return one_update(model, opt, next(batches))

    report = examined(step)
    report.try_fixes(["set_to_none"], steps=1, repeats=1)
    assert not first_line(report).startswith("Caution"), first_line(report)
    assert sum(1 for _ in batches) == 3


def test_a_step_count_is_copied_not_advanced(seed):
    model, opt = small()
    counter = itertools.count(5)

    def step(x):
        return one_update(model, opt, x * (1 + 0 * next(counter)))

    report = examined(step, torch.randn(5, 4))
    assert not first_line(report).startswith("Caution"), first_line(report)
    assert next(counter) == 5


def test_an_empty_copyable_iterator_is_named_in_the_error(seed):
    model, opt = small()
    batches = iter([])

    def step():
        return one_update(model, opt, next(batches))

    with pytest.raises(UsageError, match=r"closure 'batches' \(a list_iterator\) is empty"):
        examined(step)


def test_files_the_step_writes_are_named_first(seed, tmp_path):
    model, opt = small()
    log, checkpoint, scratch = tmp_path / "log.txt", tmp_path / "ckpt.pt", tmp_path / "scratch"

    def step(x):
        loss = one_update(model, opt, x)
        with open(log, "a") as out:
            out.write(f"{loss.item()}\n")
        torch.save(model.state_dict(), checkpoint)
        scratch.write_text("x")
        scratch.unlink()
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    for what in (f"wrote {log}", f"wrote {checkpoint}", f"removed {scratch}"):
        assert named_before_numbers(report, what)
    trials = len(report.side_effects)
    with pytest.warns(RuntimeWarning, match="trials.*wrote"):
        report.try_fixes(["set_to_none"], steps=1, repeats=1)
    assert len(report.side_effects) == trials  # the same files again: named once


def test_files_the_step_writes_are_put_back_as_they_were(seed, tmp_path):
    # a training log appended to and a checkpoint overwritten every step, as a real run has
    # them: the copies' rows and weights must not stay in the user's files
    model, opt = small()
    log, checkpoint, made = tmp_path / "log.csv", tmp_path / "last.pt", tmp_path / "made.txt"
    log.write_text("step,loss\n")
    torch.save({"the user's": 1}, checkpoint)
    before = {path: path.read_bytes() for path in (log, checkpoint)}

    def step(x):
        loss = one_update(model, opt, x)
        with open(log, "a") as out:
            out.write(f"1,{loss.item()}\n")
        torch.save(model.state_dict(), checkpoint)
        made.write_text("x")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert {path: path.read_bytes() for path in before} == before and not made.exists()
    assert named_before_numbers(report, f"wrote {log} (")
    assert "put back as it was" in first_line(report) and "accel-doctor" not in first_line(report)
    with pytest.warns(RuntimeWarning, match="trials.*wrote"):
        report.try_fixes(["set_to_none"], steps=1, repeats=1)
    assert {path: path.read_bytes() for path in before} == before and not made.exists()


def test_a_checkpoint_per_step_is_named_as_one_clause_for_its_folder(seed, tmp_path):
    """A step that saves ``ckpt/step_<n>.pt`` each call writes as many files as it is run: the
    first line names them as one clause (how many, the folder, the first and the last), and
    each is still removed."""
    model, opt = small()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    calls = itertools.count()

    def step(x):
        loss = one_update(model, opt, x)
        torch.save(model.state_dict(), folder / f"step_{next(calls)}.pt")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    line = first_line(report)
    assert line.count(str(folder)) == 1, line
    assert re.search(rf"wrote \d+ files in {re.escape(str(folder))} \(step_0\.pt to step_\d+\.pt\), "
                     "each put back as it was", line), line  # fmt: skip
    assert list(folder.iterdir()) == []


def test_a_file_outside_the_numbered_series_is_counted_beside_it(seed, tmp_path):
    model, opt = small()
    calls = itertools.count()

    def step(x):
        loss = one_update(model, opt, x)
        torch.save(model.state_dict(), tmp_path / f"ckpt_{next(calls)}.pt")
        torch.save(opt.state_dict(), tmp_path / "opt_last.pt")
        return loss.detach()

    line = first_line(examined(step, torch.randn(5, 4)))
    assert re.search(r"\(ckpt_0\.pt to ckpt_\d+\.pt and 1 other\)", line), line


@pytest.mark.parametrize("save", ["open", "torch.save"])
def test_relative_paths_after_the_step_changes_folder_are_named_where_they_are(
    seed, tmp_path, monkeypatch, save
):
    """A step that moves into its run's folder and saves ``ckpt.pt`` there: named as written,
    it would read as the ``ckpt.pt`` in the folder the user ran from. Each name is said where it
    is, put back there, and the working folder is the user's again."""
    monkeypatch.chdir(tmp_path)
    model, opt = small()
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.pt").write_bytes(b"the run's checkpoint")
    (tmp_path / "ckpt.pt").write_bytes(b"the user's checkpoint")

    def step(x):
        loss = one_update(model, opt, x)
        os.chdir(run)
        if save == "open":
            with open("ckpt.pt.tmp", "wb") as out:
                out.write(b"the step's")
        else:
            torch.save(model.state_dict(), "ckpt.pt.tmp")
        os.replace("ckpt.pt.tmp", "ckpt.pt")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    line = first_line(report)
    assert f"wrote {run / 'ckpt.pt.tmp'} (" in line, line
    assert f"renamed {run / 'ckpt.pt.tmp'} to {run / 'ckpt.pt'} (" in line, line
    assert not re.search(r"(wrote|renamed|to) ckpt\.pt", line), line
    assert Path.cwd() == tmp_path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report.try_fixes(["fused_optimizer"], steps=1, repeats=2)
    assert Path.cwd() == tmp_path
    assert (run / "ckpt.pt").read_bytes() == b"the run's checkpoint"
    assert (tmp_path / "ckpt.pt").read_bytes() == b"the user's checkpoint"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ckpt.pt", "ckpt.pt", "run"]


def test_files_a_rewritten_copy_of_the_step_writes_are_put_back_too(seed, tmp_path):
    """The loop rewrite runs the step as new code compiled from its source: what that code
    writes is the step's, named and put back like the rest."""
    samples = tmp_path / "samples"
    samples.mkdir()
    user = write_module(tmp_path, f"""
        import torch
        from torch import nn

        critic = nn.Sequential(*(nn.Linear(4 + i, 5 + i) for i in range(5)))
        opt = torch.optim.RMSprop(critic.parameters(), lr=5e-5)
        calls = [0]

        def step(x):
            loss = critic[0](x).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            for p in critic.parameters():
                p.data.clamp_(-0.01, 0.01)
            calls[0] += 1
            with open(f"{samples}/fake_{{calls[0]:05d}}.txt", "w") as out:
                out.write(str(calls[0]))
            return loss.detach()
    """)
    report = examined(user.step, torch.randn(8, 4))
    (trial,) = report.try_fixes(["foreach_loop"], steps=1, repeats=3).to_dict("records")
    assert trial["status"] == "ok", trial
    assert list(samples.iterdir()) == []


def test_a_folder_per_step_and_files_in_the_working_folder_are_named_in_a_few_clauses(
    seed, tmp_path, monkeypatch
):
    """``ckpt/step_<n>/model.pt`` each call: one clause for the folders made, one for the files
    written, each under ``ckpt``; files written where the step runs: in the working folder."""
    monkeypatch.chdir(tmp_path)
    model, opt = small()
    calls = itertools.count(1)

    def step(x):
        loss = one_update(model, opt, x)
        n = next(calls)
        os.makedirs(f"ckpt/step_{n}", exist_ok=True)
        torch.save(model.state_dict(), f"ckpt/step_{n}/model.pt")
        with open(f"metrics_{n}.csv", "w") as out:
            out.write("1")
        return loss.detach()

    line = first_line(examined(step, torch.randn(5, 4)))
    assert re.search(r"made \d+ folders in ckpt \(step_1 to step_\d+\), each put back as it was",
                     line), line  # fmt: skip
    assert re.search(r"wrote \d+ files in ckpt \(step_1/model\.pt to step_\d+/model\.pt\), each "
                     "put back", line), line  # fmt: skip
    assert re.search(r"wrote \d+ files in the working folder \(metrics_1\.csv to metrics_\d+\.csv\)",
                     line), line  # fmt: skip
    assert line.index(". cpu:") < 500, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_files_the_trials_write_join_the_clause_examining_named(seed, tmp_path):
    """The trials' copies save into the same folder as the step did while examined: the report
    still names that folder once, with every file and how often."""
    model, opt = small()
    folder = tmp_path / "ckpt"
    calls = [0]

    def step(x):
        loss = one_update(model, opt, x)
        calls[0] += 1
        folder.mkdir(exist_ok=True)
        torch.save(model.state_dict(), folder / f"step_{calls[0]}.pt")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    with pytest.warns(RuntimeWarning, match="trials"):
        report.try_fixes(["set_to_none"], steps=1, repeats=2)
    clauses = [c for c in report.side_effects if c.startswith("wrote")]
    assert len(clauses) == 1 and f"in {folder} (step_1.pt to " in clauses[0], clauses
    assert not folder.exists()


def trainer_save_step(folder: Path):
    """A Trainer's save each step: written under a temporary name, then renamed to
    ``checkpoint-<n>``, counted from a list (so each copy counts from the user's count)."""
    model, opt = small()
    calls = [0]

    def step(x):
        loss = one_update(model, opt, x)
        calls[0] += 1
        temporary = folder / f"tmp-checkpoint-{calls[0]}"
        temporary.mkdir()
        (temporary / "model.pt").write_bytes(b"w")
        os.rename(temporary, folder / f"checkpoint-{calls[0]}")
        return loss.detach()

    return step


def test_a_save_renamed_into_place_each_step_is_named_as_one_clause(seed, tmp_path):
    line = first_line(examined(trainer_save_step(tmp_path), torch.randn(5, 4)))
    assert re.search(rf"renamed \d+ entries into {re.escape(str(tmp_path))} \(checkpoint-1 to "
                     r"checkpoint-\d+\), each put back as it was", line), line  # fmt: skip
    assert line.index(". cpu:") < 700, line
    assert list(tmp_path.iterdir()) == []


def test_each_trial_starts_from_the_files_as_they_were(seed, tmp_path):
    """Each copy of the step counts its saves from the user's count: the copies must not meet
    what the copy before them left (a save renamed over it fails). Timed in turns, two copies
    still meet: the trial says how the step failed, and try_fixes goes on."""
    report = examined(trainer_save_step(tmp_path), torch.randn(5, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (trial,) = report.try_fixes(["fused_optimizer"], steps=1, repeats=2).to_dict("records")
    assert trial["status"] == "ok" or "Directory not empty" in trial["status"], trial
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_was_there_is_kept_again_in_each_trial(seed, tmp_path):
    """The copies of the files the user had are made again for each trial, after the trial
    before put them back: the trials run, and the file is as it was."""
    model, opt = small()
    log = tmp_path / "train.log"
    log.write_text("the user's log\n")

    def step(x):
        loss = one_update(model, opt, x)
        with open(log, "a") as f:
            f.write(f"{float(loss)}\n")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (trial,) = report.try_fixes(["fused_optimizer"], steps=1, repeats=2).to_dict("records")
    assert trial["status"] == "ok", trial
    assert log.read_text() == "the user's log\n"


def test_a_database_the_step_writes_to_is_put_back_and_a_temporary_file_is_no_folder(
    seed, tmp_path
):
    """sqlite writes its file from C, past the audit hook's ``open``: the connection is seen, and
    the database kept from it. A temporary file made in a folder opens the folder (unnamed)."""
    import sqlite3
    import tempfile

    model, opt = small()
    database = tmp_path / "metrics.db"
    with contextlib.closing(sqlite3.connect(database)) as connection:
        connection.execute("create table metrics(loss real)")
        connection.commit()
    before = database.read_bytes()

    def step(x):
        loss = one_update(model, opt, x)
        with contextlib.closing(sqlite3.connect(database)) as connection:
            connection.execute("insert into metrics values (?)", (float(loss),))
            connection.commit()
        with tempfile.NamedTemporaryFile(dir=tmp_path, delete=False) as out:
            out.write(b"1")
        return loss.detach()

    line = first_line(examined(step, torch.randn(5, 4)))
    assert database.read_bytes() == before and sorted(tmp_path.iterdir()) == [database]
    assert f"opened the database {database}" in line and f"wrote {tmp_path} (" not in line, line


def test_a_database_connection_opened_before_the_step_and_written_through_is_named(seed, tmp_path):
    import sqlite3

    model, opt = small()
    connection = sqlite3.connect(tmp_path / "metrics.db")
    connection.execute("create table metrics(loss real)")

    def step(x):
        loss = one_update(model, opt, x)
        connection.execute("insert into metrics values (?)", (float(loss),))
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    connection.close()
    assert named_before_numbers(
        report, "closure 'connection' (an open file or database written through, not put back)"
    ), first_line(report)


def test_a_file_a_thread_the_step_starts_writes_is_named_and_put_back(seed, tmp_path):
    # an asynchronous checkpoint: the step hands the save to a thread of its own, and the last
    # one may still be writing when the examination ends
    model, opt = small()
    checkpoint = tmp_path / "last.pt"
    checkpoint.write_bytes(b"the user's checkpoint")

    def step(x):
        loss = one_update(model, opt, x)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        threading.Thread(target=torch.save, args=(state, checkpoint)).start()
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert checkpoint.read_bytes() == b"the user's checkpoint"
    assert named_before_numbers(report, f"wrote {checkpoint}")


def test_a_file_a_thread_pool_made_before_the_step_writes_for_it_is_put_back(seed, tmp_path):
    """An executor made (and its thread started) before the step: what a task the step submits
    writes is the step's, named and put back; and the session does not wait for the idle
    worker."""
    from concurrent.futures import ThreadPoolExecutor

    model, opt = small()
    saved = tmp_path / "model.pt"
    saved.write_bytes(b"the user's model")
    pool = ThreadPoolExecutor(max_workers=1)
    pool.submit(int).result()  # its worker started

    def save(state):
        torch.save(state, f"{saved}.part")
        os.replace(f"{saved}.part", saved)

    def step(x):
        loss = one_update(model, opt, x)
        pool.submit(save, model.state_dict())
        return loss.detach()

    try:
        line = first_line(examined(step, torch.randn(5, 4)))
    finally:
        pool.shutdown()
    assert saved.read_bytes() == b"the user's model" and sorted(tmp_path.iterdir()) == [saved]
    assert f"to {saved}" in line and "put back as it was" in line and "running" not in line, line


def test_a_file_put_back_never_writes_through_a_link_the_step_left_in_its_place(seed, tmp_path):
    """The step swaps its checkpoint for a link to another file: putting the checkpoint back
    replaces the link with the file as it was, and the link's target stays untouched."""
    model, opt = small()
    checkpoint, other = tmp_path / "last.pt", tmp_path / "elsewhere.txt"
    checkpoint.write_bytes(b"the user's checkpoint")
    other.write_bytes(b"not to be written")

    def step(x):
        loss = one_update(model, opt, x)
        os.replace(checkpoint, tmp_path / "moved.pt")  # the step's own rename, then a link
        os.symlink(other, checkpoint)
        return loss.detach()

    examined(step, torch.randn(5, 4))
    assert not checkpoint.is_symlink() and checkpoint.read_bytes() == b"the user's checkpoint"
    assert other.read_bytes() == b"not to be written" and not (tmp_path / "moved.pt").exists()


def test_a_log_the_step_appends_to_through_a_link_is_put_back_and_stays_a_link(seed, tmp_path):
    """The step's log is a link to a file elsewhere (a run folder's ``latest.csv``): what the
    step appends through it lands in the target, which is put back; the link stays a link."""
    model, opt = small()
    target, log = tmp_path / "runs" / "log.csv", tmp_path / "latest.csv"
    target.parent.mkdir()
    target.write_text("step,loss\n")
    log.symlink_to(target)

    def step(x):
        loss = one_update(model, opt, x)
        with open(log, "a") as out:
            out.write(f"1,{loss.item()}\n")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert target.read_text() == "step,loss\n"
    assert log.is_symlink() and os.readlink(log) == str(target)
    assert named_before_numbers(report, f"wrote {log} (") and "put back" in first_line(report)


def test_a_link_the_step_saves_over_atomically_is_put_back_as_the_link(seed, tmp_path):
    """``last.pt`` is a link to the run's checkpoint, and the step saves atomically (a new file
    renamed over it): the link comes back, pointing where it pointed, its target untouched."""
    model, opt = small()
    real, last, tmp = tmp_path / "step100.pt", tmp_path / "last.pt", tmp_path / "last.pt.tmp"
    real.write_bytes(b"the user's checkpoint")
    last.symlink_to(real)

    def step(x):
        loss = one_update(model, opt, x)
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, last)
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert last.is_symlink() and os.readlink(last) == str(real) and not tmp.exists()
    assert real.read_bytes() == b"the user's checkpoint"
    assert named_before_numbers(report, f"renamed {tmp} to {last} (")
    assert "put back as it was" in first_line(report).split(f"to {last}")[1]


def test_a_file_too_large_to_keep_is_not_let_be_replaced(seed, tmp_path, monkeypatch):
    """A file over the size the doctor keeps is not changed at all: the step's change is refused
    before it is made, and the error says which file, how large and what to do."""
    monkeypatch.setattr("accel.doctor.kept_files.KEEP_BYTES", 64)
    model, opt = small()
    data, tmp = tmp_path / "big.bin", tmp_path / "big.bin.tmp"
    data.write_bytes(b"x" * 100)

    def step(x):
        loss = one_update(model, opt, x)
        tmp.write_bytes(b"small")
        os.replace(tmp, data)
        return loss.detach()

    with pytest.raises(UsageError, match=r"not let the step change .*big\.bin: 100 B, over the 64 B"):
        examined(step, torch.randn(5, 4))
    assert data.read_bytes() == b"x" * 100 and not tmp.exists()


def test_a_refused_change_the_step_handles_is_named(seed, tmp_path, monkeypatch):
    """A step that takes the refusal as the permission error it is (a cleanup that suppresses
    OSError) runs on; the file is as it was and the report names the refusal."""
    monkeypatch.setattr("accel.doctor.kept_files.KEEP_BYTES", 64)
    model, opt = small()
    data = tmp_path / "big.bin"
    data.write_bytes(b"x" * 100)

    def step(x):
        loss = one_update(model, opt, x)
        with contextlib.suppress(OSError):
            os.remove(data)
        return loss.detach()

    line = first_line(examined(step, torch.randn(5, 4)))
    assert data.read_bytes() == b"x" * 100
    assert f"did not let the step change {data}: 100 B, over the 64 B" in line, line


def test_files_past_the_sessions_total_are_not_let_be_changed(seed, tmp_path, monkeypatch):
    """Each file under the size kept, but together over the session's total: the file that
    would pass it is refused, the ones kept before it are put back."""
    monkeypatch.setattr("accel.doctor.kept_files.KEEP_TOTAL_BYTES", 250)
    model, opt = small()
    files = [tmp_path / f"f{i}" for i in range(4)]
    for f in files:
        f.write_bytes(b"y" * 100)

    def step(x):
        loss = one_update(model, opt, x)
        for f in files:
            f.write_bytes(b"z")
        return loss.detach()

    with pytest.raises(UsageError, match=r"f2: 100 B, .* 250 B the doctor keeps in all"):
        examined(step, torch.randn(5, 4))
    assert [f.read_bytes() for f in files] == [b"y" * 100] * 4


def test_folders_and_links_put_back_keep_their_times(seed, tmp_path):
    """An atomic checkpointer: a folder a step, a temporary file renamed into it, a 'latest'
    link replaced, all but the last two folders removed. Put back as they were includes the
    times of the folders it removed or wrote in and of the link it replaced."""
    model, opt = small()
    run = tmp_path / "run"
    run.mkdir()
    for name in ("step_1", "step_2"):
        (run / name).mkdir()
        (run / name / "model.pt").write_bytes(b"w")
    (run / "latest").symlink_to("step_2")
    calls = itertools.count(3)
    paths = [run / "step_1", run / "step_2", run / "latest", run]
    for i, path in enumerate(paths):
        os.utime(path, ns=(10**18 + i, 10**18 + i), follow_symlinks=False)
    before = [os.lstat(path).st_mtime_ns for path in paths]

    def step(x):
        loss = one_update(model, opt, x)
        folder = run / f"step_{next(calls)}"
        folder.mkdir()
        (folder / "model.pt.tmp").write_bytes(b"w")
        os.replace(folder / "model.pt.tmp", folder / "model.pt")
        os.symlink(folder.name, run / "latest.tmp")
        os.replace(run / "latest.tmp", run / "latest")
        for old in sorted(run.glob("step_*"), key=lambda p: int(p.name[5:]))[:-2]:
            shutil.rmtree(old)
        return loss.detach()

    examined(step, torch.randn(5, 4))
    assert [os.lstat(path).st_mtime_ns for path in paths] == before
    assert os.readlink(run / "latest") == "step_2"


# ---- files the step only appends to: kept by where they ended, cut back in place ------------
def file_state(path: Path) -> tuple[bytes, int, int, int]:
    """What a file put back in place has as it had: its bytes, mode, inode and time written."""
    found = path.stat()
    return path.read_bytes(), stat.S_IMODE(found.st_mode), found.st_ino, found.st_mtime_ns


def append_line(path: Path, line: str) -> None:
    with open(path, "a") as out:
        out.write(line)


def append_bytes_readable(path: Path, line: str) -> None:
    with open(path, "a+b") as out:
        out.write(line.encode())


def append_through_descriptor(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def append_csv_row(path: Path, line: str) -> None:
    with open(path, "a", newline="") as out:
        csv.writer(out).writerow(line.strip().split(","))


APPENDS = [append_line, append_bytes_readable, append_through_descriptor, append_csv_row]


@pytest.mark.parametrize("append", APPENDS, ids=lambda f: f.__name__)
def test_a_log_too_large_to_keep_that_the_step_appends_to_is_cut_back_in_place(
    seed, tmp_path, monkeypatch, append
):
    """A training log over the size the doctor copies, appended to each step (a line, a CSV
    row, through a descriptor): an append changes nothing before the old end, so the step runs,
    and the log is cut back to that end in place: its bytes, mode, inode and time as they were,
    and its other name (a hard link) still the same file."""
    monkeypatch.setattr("accel.doctor.kept_files.KEEP_BYTES", 64)
    model, opt = small()
    log, other = tmp_path / "train.log", tmp_path / "train.log.link"
    log.write_bytes(b"step,loss\n" * 10)
    log.chmod(0o640)
    os.utime(log, ns=(10**18, 10**18))
    os.link(log, other)
    before = file_state(log)

    def step(x):
        loss = one_update(model, opt, x)
        append(log, f"1,{loss.item()}\n")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert file_state(log) == before and file_state(other) == before
    assert named_before_numbers(report, f"wrote {log} (")
    assert "put back as it was" in first_line(report).split(f"wrote {log}")[1]
    with pytest.warns(RuntimeWarning, match="trials.*wrote"):
        report.try_fixes("set_to_none", steps=1, repeats=1)
    assert file_state(log) == before and file_state(other) == before


def test_a_log_handler_the_step_opens_in_append_mode_on_a_large_log_leaves_it_as_it_was(
    seed, tmp_path, monkeypatch
):
    pass  # TEMP
    model, opt = small()
    log = tmp_path / "train.log"
    log.write_text("INFO the user's run\n" * 10)
    before = file_state(log)
    logger = logging.getLogger(f"user_training_{seed}")

    def step(x):
        loss = one_update(model, opt, x)
        if not logger.handlers:
            logger.addHandler(logging.FileHandler(log, mode="a"))
        logger.warning("loss %s", loss.item())
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert file_state(log) == before and not logger.handlers
    with pytest.warns(RuntimeWarning, match="trials.*wrote"):
        report.try_fixes("set_to_none", steps=1, repeats=1)
    assert file_state(log) == before and not logger.handlers


@pytest.mark.parametrize("append", APPENDS, ids=lambda f: f.__name__)
def test_a_log_the_step_makes_by_appending_is_removed(seed, tmp_path, append):
    model, opt = small()
    log = tmp_path / "new.log"

    def step(x):
        loss = one_update(model, opt, x)
        append(log, f"1,{loss.item()}\n")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert list(tmp_path.iterdir()) == []
    with pytest.warns(RuntimeWarning, match="trials.*wrote"):
        report.try_fixes("set_to_none", steps=1, repeats=1)
    assert list(tmp_path.iterdir()) == []


def write_over_start(path: Path) -> None:
    with open(path, "r+b") as out:
        out.write(b"OVER")


def open_to_append_and_truncate(path: Path) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_TRUNC))


def replace_with_new(path: Path) -> None:
    new = path.with_suffix(".tmp")
    new.write_text("the step's log\n")
    os.replace(new, path)


# each change, and whether it leaves the same file (inode) to write back in place
CHANGES_AFTER_APPENDING = [
    (lambda path: path.write_text("rewritten\n"), True),
    (write_over_start, True),
    (open_to_append_and_truncate, True),
    (lambda path: os.truncate(path, 3), True),
    (os.remove, False),
    (replace_with_new, False),
]


@pytest.mark.parametrize(("change", "in_place"), CHANGES_AFTER_APPENDING,
                         ids=["w", "r+", "O_TRUNC", "truncate", "remove", "replace"])  # fmt: skip
def test_a_log_the_step_appends_to_then_changes_is_put_back_from_its_old_bytes(
    seed, tmp_path, monkeypatch, change, in_place
):
    """Appended to, then rewritten, cut, removed or replaced in the same step: from that change
    on the log is kept whole, copied as it was before the step appended (its old 100 bytes,
    within the 120 copied, though by then it holds more), and put back so. Over the size
    copied, the change is refused as any change of so large a file is, and the log cut back."""
    monkeypatch.setattr("accel.doctor.kept_files.KEEP_BYTES", 120)
    model, opt = small()
    log = tmp_path / "train.log"
    log.write_bytes(b"x" * 100)
    log.chmod(0o640)
    os.utime(log, ns=(10**18, 10**18))
    before = file_state(log)
    compared = [0, 1, 2, 3] if in_place else [0, 1, 3]

    def step(x):
        loss = one_update(model, opt, x)
        append_line(log, "y" * 50)
        change(log)
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert [file_state(log)[i] for i in compared] == [before[i] for i in compared]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.log"]
    with pytest.warns(RuntimeWarning, match="trials.*wrote"):
        report.try_fixes("set_to_none", steps=1, repeats=1)
    assert [file_state(log)[i] for i in compared] == [before[i] for i in compared]

    before = file_state(log)
    monkeypatch.setattr("accel.doctor.kept_files.KEEP_BYTES", 64)
    with pytest.raises(UsageError, match=rf"change {re.escape(str(log))}: 100 B, over the 64 B"):
        examined(step, torch.randn(5, 4))
    assert file_state(log) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.log"]


@pytest.mark.parametrize("rewritten", [False, True])
def test_a_log_a_thread_of_the_step_appends_to_is_cut_back(seed, tmp_path, monkeypatch, rewritten):
    """The step logs from a thread it starts (a background writer): the thread's appends are
    the step's, and the log comes back as it was, whether the step only appended to it (over
    the size copied) or rewrote it after the thread's append (within it)."""
    monkeypatch.setattr("accel.doctor.kept_files.KEEP_BYTES", 120 if rewritten else 64)
    model, opt = small()
    log = tmp_path / "train.log"
    log.write_bytes(b"x" * 100)
    before = file_state(log)

    def step(x):
        loss = one_update(model, opt, x)
        writer = threading.Thread(target=append_line, args=(log, f"{loss.item()}\n" * 20))
        writer.start()
        writer.join()
        if rewritten:
            log.write_text("rewritten\n")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert file_state(log) == before
    with pytest.warns(RuntimeWarning, match="trials.*wrote"):
        report.try_fixes("set_to_none", steps=1, repeats=1)
    assert file_state(log) == before


def test_a_file_rewritten_through_its_append_handle_is_put_back_or_said_not_to_be(
    seed, tmp_path, monkeypatch
):
    """An append handle can still cut its file (``truncate``, which raises no audit event): a
    small state file rewritten through "a+" (read, cut, written) is written back whole from the
    bytes kept of its end; a larger one whose end no longer reads as it did is said not put
    back, rather than cut to its old length and said to be as it was."""
    monkeypatch.setattr("accel.doctor.kept_files.KEEP_BYTES", 64)
    monkeypatch.setattr("accel.doctor.kept_files.KEPT_END_BYTES", 200)
    model, opt = small()
    state, log = tmp_path / "state.json", tmp_path / "train.log"
    state.write_text('{"step": 1}' + " " * 100)
    log.write_bytes(b"x" * 300)
    before = file_state(state)

    def rewrite(path: Path, text: str) -> None:
        with open(path, "a+") as out:
            out.seek(0)
            out.read()
            out.seek(0)
            out.truncate()
            out.write(text)

    def step(x):
        loss = one_update(model, opt, x)
        rewrite(state, '{"step": 2}')
        rewrite(log, "z" * 400)
        return loss.detach()

    line = first_line(examined(step, torch.randn(5, 4)))
    assert file_state(state) == before
    assert f"could not put back {log}" in line, line
    assert "put back as it was" not in line.split(f"wrote {log}")[1], line


def test_folders_the_step_makes_are_removed_with_what_it_wrote_in_them(seed, tmp_path):
    model, opt = small()
    run = tmp_path / "runs" / "exp1"

    def step(x):
        loss = one_update(model, opt, x)
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.txt").write_text(f"{loss.item()}\n")
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert not (tmp_path / "runs").exists() and list(tmp_path.iterdir()) == []
    assert re.search(
        rf"made the folder {re.escape(str(run))} \(\d+ times\), put back", first_line(report)
    )


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None: a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
            for p in sorted(folder.rglob("*"))}  # fmt: skip


@pytest.mark.parametrize("how", ["rmtree", "remove then rmdir", "rmdir of an empty folder"])
def test_a_folder_the_step_removes_is_put_back_with_what_it_held(seed, tmp_path, how):
    """A trainer that keeps its last checkpoints removes the oldest folder: the user's folder
    and the files in it come back as they were, and the report says so."""
    model, opt = small()
    old = tmp_path / "out" / "checkpoint-1"
    (old / "nested").mkdir(parents=True)
    if how != "rmdir of an empty folder":
        (old / "model.pt").write_bytes(b"the user's weights")
        (old / "nested" / "state.json").write_text("{}")
    else:
        (old / "nested").rmdir()
    before = tree(tmp_path)

    def step(x):
        loss = one_update(model, opt, x)
        if old.exists():
            if how == "rmtree":
                shutil.rmtree(old)
            elif how == "remove then rmdir":
                os.remove(old / "model.pt")
                os.remove(old / "nested" / "state.json")
                os.rmdir(old / "nested")
                os.rmdir(old)
            else:
                os.rmdir(old)
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert tree(tmp_path) == before
    line = first_line(report)
    assert f"removed the folder {old}, put back as it was" in line, line
    assert "removed model.pt" not in line and "(2 times)" not in line, line


def disk(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: a link's target, a file's bytes, a folder; each with its mode
    and its count of links."""
    found = {}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = Path(folder) / name
            mode = (path.lstat().st_mode & 0o7777, path.lstat().st_nlink)  # a hard link kept
            what = (("link", os.readlink(path)) if path.is_symlink() else ("folder",) if path.is_dir()
                    else ("file", path.read_bytes()))  # fmt: skip
            found[str(path.relative_to(root))] = (*what, mode)
    return found


def _link_where_a_removed_folder_was(root: Path):
    (root / "latest" / "sub").mkdir(parents=True)
    (root / "latest" / "a.txt").write_text("old")
    (root / "ckpt-7").mkdir()
    latest = root / "latest"
    return lambda: latest.is_symlink() or (shutil.rmtree(latest), latest.symlink_to(root / "ckpt-7"))


def _file_where_a_removed_folder_was(root: Path):
    (root / "out").mkdir()
    (root / "out" / "a.txt").write_text("A")
    out = root / "out"
    return lambda: (out.is_dir() and shutil.rmtree(out), out.write_text("now a file"))


def _folder_where_a_removed_file_was(root: Path):
    out = root / "out"
    out.write_text("a log file")
    return lambda: (out.is_file() and out.unlink(), out.mkdir(exist_ok=True))


def _folder_removed_and_made_again(root: Path):
    run = root / "run"
    run.mkdir(mode=0o700)
    (run / "a.txt").write_text("A")
    return lambda: (shutil.rmtree(run), run.mkdir())


def _folder_renamed(root: Path):
    (root / "run").mkdir()
    (root / "run" / "a.txt").write_text("A")
    return lambda: (root / "run").is_dir() and os.rename(root / "run", root / "run_old")


def _folder_moved_into_another(root: Path):
    (root / "d").mkdir()
    (root / "d" / "a.txt").write_text("A")
    (root / "other").mkdir()
    return lambda: (root / "d").is_dir() and shutil.move(root / "d", root / "other" / "d")


def _mode_changed(root: Path):
    key = root / "key"
    key.write_text("k")
    key.chmod(0o644)
    return lambda: key.chmod(0o600)


def _removedirs_up_to_a_folder_not_empty(root: Path):
    (root / "top" / "p").mkdir(parents=True)
    (root / "top" / "keep").write_text("k")
    os.link(root / "top" / "keep", root / "hard")  # rewriting keep would break the link
    return lambda: (root / "top" / "p").is_dir() and os.removedirs(root / "top" / "p")


def _folder_chmodded_renamed_and_removed(root: Path):
    (root / "a").mkdir()
    (root / "a" / "x").write_text("user data")

    def change():
        if (root / "a").is_dir():
            os.chmod(root / "a", 0o700)
            os.rename(root / "a", root / "b")
            shutil.rmtree(root / "b")

    return change


def _mode_changed_through_a_link(root: Path):
    (root / "t").write_text("t")
    (root / "t").chmod(0o600)
    (root / "l").symlink_to("t")
    return lambda: os.chmod(root / "l", 0o777)


def _file_replaced_by_a_folder_of_folders(root: Path):
    (root / "f").write_text("f")
    return lambda: (root / "f").is_file() and ((root / "f").unlink(), (root / "f" / "sub").mkdir(parents=True))


def _file_written_into_a_folder_renamed_and_back(root: Path):
    (root / "a").mkdir()
    return lambda: (os.rename(root / "a", root / "b"), (root / "b" / "new").write_text("n"),
                    os.rename(root / "b", root / "a"))


def _folder_renamed_away_and_made_again(root: Path):
    (root / "a").mkdir()
    (root / "a" / "x").write_text("x")
    return lambda: (root / "a.bak").exists() or (os.rename(root / "a", root / "a.bak"),
                                                 (root / "a").mkdir())


def _hard_linked_file_appended_to(root: Path):
    (root / "f").write_text("F")
    os.link(root / "f", root / "g")
    return lambda: (root / "f").open("a").write("+")


def _hard_linked_file_saved_over(root: Path):
    (root / "best.pt").write_text("B")
    os.link(root / "best.pt", root / "step-7.pt")
    return lambda: ((root / "tmp").write_text("new"), os.replace(root / "tmp", root / "best.pt"))


def _hard_linked_file_written_then_removed(root: Path):
    (root / "f").write_text("F")
    os.link(root / "f", root / "g")
    return lambda: (root / "f").exists() and ((root / "f").write_text("+"), (root / "f").unlink())


@pytest.mark.parametrize("make", [
    _link_where_a_removed_folder_was, _file_where_a_removed_folder_was,
    _folder_where_a_removed_file_was, _folder_removed_and_made_again, _folder_renamed,
    _folder_moved_into_another, _mode_changed, _removedirs_up_to_a_folder_not_empty,
    _folder_chmodded_renamed_and_removed, _mode_changed_through_a_link,
    _file_replaced_by_a_folder_of_folders, _file_written_into_a_folder_renamed_and_back,
    _folder_renamed_away_and_made_again, _hard_linked_file_appended_to,
    _hard_linked_file_saved_over, _hard_linked_file_written_then_removed,
], ids=lambda f: f.__name__.strip("_").replace("_", " "))  # fmt: skip
def test_what_a_step_puts_in_a_folders_place_or_moves_away_is_put_back(seed, tmp_path, make):
    # what the doctor keeps is not named
    assert_put_back_after_examine_and_trials(tmp_path, make, unsaid="accel-doctor-kept-")


def assert_put_back_after_examine_and_trials(tmp_path, make, *, unsaid: str) -> None:
    """A step that makes the change ``make(root)`` returns, in a folder under ``tmp_path``: the
    disk as it was after examine and after try_fixes, ``unsaid`` not in the report's first line."""
    model, opt = small()
    root = tmp_path / "root"
    root.mkdir()
    change = make(root)
    before = disk(tmp_path)

    def step(x):
        loss = one_update(model, opt, x)
        change()
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert disk(tmp_path) == before
    assert unsaid not in first_line(report)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report.try_fixes(["fused_optimizer"], steps=1, repeats=2)
    assert disk(tmp_path) == before


def copies_on_another_file_system(monkeypatch) -> None:
    """``os.link`` into the doctor's folder of copies fails as it does across file systems (the
    copies in a tmpfs ``/tmp``, the checkpoints on a disk)."""
    link = os.link

    def across_file_systems(source, target, *args, **kwargs):
        if "accel-doctor-kept-" in os.fsdecode(target):
            raise OSError(errno.EXDEV, "Invalid cross-device link", source, target)
        return link(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "link", across_file_systems)


@pytest.mark.parametrize("make", [_hard_linked_file_saved_over,
                                  _hard_linked_file_written_then_removed],
                         ids=lambda f: f.__name__.strip("_").replace("_", " "))  # fmt: skip
def test_a_hard_linked_file_kept_on_another_file_system_comes_back_linked(
    seed, tmp_path, monkeypatch, make
):
    """The copies' folder cannot hold a link to the file: the file is held open instead, and
    linked back under the name the step replaced or removed, so its other names share it."""
    copies_on_another_file_system(monkeypatch)
    assert_put_back_after_examine_and_trials(tmp_path, make, unsaid="as a separate copy")


def test_a_hard_linked_file_that_cannot_be_held_is_said_to_come_back_unlinked(
    seed, tmp_path, monkeypatch
):
    """Neither a link in the copies' folder nor an open descriptor holds the file (as many held
    open as the doctor holds): it comes back as a copy of its own, said so, not said put back as
    it was."""
    from accel.doctor import kept_files

    copies_on_another_file_system(monkeypatch)
    monkeypatch.setattr(kept_files, "HELD_OPEN", 0)
    model, opt = small()
    best, other = tmp_path / "best.pt", tmp_path / "step-7.pt"
    best.write_bytes(b"the user's checkpoint")
    os.link(best, other)

    def step(x):
        loss = one_update(model, opt, x)
        torch.save(model.state_dict(), tmp_path / "tmp.pt")
        os.replace(tmp_path / "tmp.pt", best)
        return loss.detach()

    line = first_line(examined(step, torch.randn(5, 4)))
    assert best.read_bytes() == other.read_bytes() == b"the user's checkpoint"
    assert (f"put back {best} as a separate copy, no longer hard-linked to its other names (they "
            "hold the file as the step left it)") in line, line  # fmt: skip
    assert "put back as it was" not in line.split(f"to {best}")[1], line


def test_a_file_that_cannot_be_put_back_is_said_so_and_not_said_put_back(
    seed, tmp_path, monkeypatch
):
    model, opt = small()
    log = tmp_path / "log.txt"
    log.write_text("the user's log\n")

    def step(x):
        loss = one_update(model, opt, x)
        log.write_text("the copy's\n")
        return loss.detach()

    def refused(path, *kept):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("accel.doctor.kept_files._file_back", refused)
    line = first_line(examined(step, torch.randn(5, 4)))
    assert f"could not put back {log}" in line and f"wrote {log} (" in line, line
    assert "put back as it was" not in line, line


def test_a_folder_holding_a_file_too_large_to_keep_is_not_let_be_removed(
    seed, tmp_path, monkeypatch
):
    monkeypatch.setattr("accel.doctor.kept_files.KEEP_BYTES", 64)
    model, opt = small()
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "small").write_text("s")
    (folder / "big").write_bytes(b"x" * 100)

    def removed(x):
        loss = one_update(model, opt, x)
        if folder.is_dir():
            shutil.rmtree(folder)
        return loss.detach()

    def renamed_then_removed(x):
        loss = one_update(model, opt, x)
        if folder.is_dir():
            os.rename(folder, tmp_path / "e")
            shutil.rmtree(tmp_path / "e")
        return loss.detach()

    for step in (removed, renamed_then_removed):
        with pytest.raises(UsageError, match=f"not let the step change {folder / 'big'}: 100 B"):
            examined(step, torch.randn(5, 4))
        found = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
        assert found == ["d", "d/big", "d/small"], found
        assert (folder / "big").read_bytes() == b"x" * 100


def test_many_files_in_a_folder_per_step_are_one_clause(seed, tmp_path):
    model, opt = small()
    calls = [0]

    def step(x):
        loss = one_update(model, opt, x)
        calls[0] += 1
        (tmp_path / "run" / f"step-{calls[0]}").mkdir(parents=True)
        for name in "abcd":
            (tmp_path / "run" / f"step-{calls[0]}" / name).write_text(name)
        return loss.detach()

    line = first_line(examined(step, torch.randn(5, 4)))
    assert line.count("wrote") == 1 and re.search(r"wrote \d+ files in \S+/run \(step-1/a to ", line), line


def test_a_folder_the_step_makes_and_removes_is_named_as_often_as_it_happened(seed, tmp_path):
    model, opt = small()
    scratch, old = tmp_path / "scratch", tmp_path / "old"
    old.mkdir()

    def step(x):
        loss = one_update(model, opt, x)
        scratch.mkdir()
        shutil.rmtree(scratch)
        shutil.rmtree(old, ignore_errors=True)  # there at the first call only
        return loss.detach()

    line = first_line(examined(step, torch.randn(5, 4)))
    made = re.search(rf"made the folder {re.escape(str(scratch))} \((\d+) times\)", line)
    removed = re.search(rf"removed the folder {re.escape(str(scratch))} \((\d+) times\)", line)
    assert made and removed and made[1] == removed[1], line
    assert f"removed the folder {old}, put back as it was" in line, line


def test_what_one_session_did_not_put_back_is_not_said_put_back_after_another():
    from accel.doctor.effects import Effects

    what = "removed the folder ckpt"
    effects = Effects(collections.Counter({what: 1}), set())  # a file in it too large to keep
    effects += Effects(collections.Counter({what: 1}), {what})
    assert effects.said() == [f"{what} (2 times)"]
    effects = Effects(collections.Counter({what: 1}), {what})
    effects += Effects(collections.Counter({"wrote x": 1}), {"wrote x"})
    assert effects.said() == [f"{what}, put back as it was", "wrote x, put back as it was"]


def test_modes_and_links_a_step_changes_in_one_folder_are_one_clause():
    """A save through a temporary made read-only, then renamed over one name, each step: a
    clause for the modes, one for the renames, naming the one name once."""
    from accel.doctor.effects import Effects

    found = collections.Counter()
    for i in range(30):
        found[f"changed the mode of /run/tmp{i}.json"] += 1
        found[f"renamed /run/tmp{i}.json to /run/config.json"] += 1
        found[f"linked /run/best-{i}.pt"] += 1
    said = Effects(found, set(found)).said()
    assert said == [
        "changed the mode of 30 files in /run (tmp0.json to tmp29.json), each put back as it was",
        "renamed 30 entries into /run (config.json), each put back as it was",
        "linked 30 files in /run (best-0.pt to best-29.pt), each put back as it was",
    ], said


def test_a_folder_that_was_there_is_not_said_to_be_made(seed, tmp_path):
    # os.makedirs(..., exist_ok=True) before each save, as checkpointing code writes it: the
    # folder the user already has was made by no one, and stays
    model, opt = small()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    checkpoint = folder / "last.pt"
    checkpoint.write_bytes(b"the user's checkpoint")

    def step(x):
        loss = one_update(model, opt, x)
        os.makedirs(folder, exist_ok=True)
        torch.save(model.state_dict(), checkpoint)
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert "made the folder" not in first_line(report)
    assert named_before_numbers(report, f"wrote {checkpoint}")
    assert checkpoint.read_bytes() == b"the user's checkpoint"


def test_files_a_compiler_writes_through_a_helper_library_are_not_the_steps(seed, tmp_path):
    """Inductor takes its cache's locks through a third-party package (filelock): the lock
    files are the compiler's, however deep the package sits below it."""
    import os
    import sysconfig

    helper = {"__name__": "lockfiles_for_a_test"}  # an installed package, by its file's place
    where = os.path.join(sysconfig.get_paths()["purelib"], "lockfiles_for_a_test.py")
    exec(compile("def acquire(path):\n    open(path, 'w').close()\n", where, "exec"), helper)
    compiler = {"__name__": "torch._inductor.a_cache_for_a_test", "acquire": helper["acquire"]}
    exec(compile("def build(path):\n    acquire(path)\n", "<a compiler>", "exec"), compiler)
    model, opt = small()
    lock, log = tmp_path / "graph.lock", tmp_path / "log.txt"

    def step(x):
        compiler["build"](lock)
        loss = one_update(model, opt, x)
        helper["acquire"](log)  # the step's own write through the same package: its own
        return loss.detach()

    report = examined(step, torch.randn(5, 4))
    assert str(lock) not in first_line(report)
    assert named_before_numbers(report, f"wrote {log}")


def test_the_audit_hook_records_nothing_outside_a_doctor_run(tmp_path):
    from accel.doctor.isolation import Session

    with Session() as session:
        pass
    (tmp_path / "after.txt").write_text("x")
    assert session.effects().said() == []


# ---- only a plain step -----------------------------------------------------------------------------
def generator_step(x):
    yield x.sum()


async def coroutine_step(x):
    return x.sum()


class GeneratorCall:
    def __call__(self, x):
        yield x


@pytest.mark.filterwarnings("ignore:accel.doctor. found no model:RuntimeWarning")
@pytest.mark.parametrize(
    ("step", "said"),
    [
        (generator_step, "a generator function"),
        (functools.partial(generator_step), "a generator function"),
        (coroutine_step, "a coroutine function"),
        (GeneratorCall(), "a generator function"),
        (lambda x: (v for v in [x]), "returned a generator"),
        (lambda x: asyncio.sleep(0), "returned a coroutine"),
    ],
)
def test_a_step_that_does_not_run_when_called_is_refused(step, said):
    with pytest.raises(UsageError, match=said):
        examined(step, torch.randn(3))


def test_a_maker_given_as_the_step_is_refused_with_the_call_to_make(seed):
    step = plain_step(*small())

    def make():
        return step, torch.randn(3)

    with pytest.raises(UsageError, match=r"examine\(\*make\(\)\)"):
        doctor.examine(make)


def test_a_step_that_fails_on_a_later_call_says_which_call_and_its_line(seed):
    # a one-cycle schedule sized for a short run raises once stepped past its end: the doctor
    # runs the step many times, and must say so beside the step's own error
    model, opt = small()
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=6)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad()
        return loss.detach()

    said = (
        rf"raised on call \d+ \(.*:{step.__code__.co_firstlineno + 4}\): ValueError: Tried to step"
    )
    with pytest.raises(UsageError, match=said):
        examined(step, torch.randn(5, 4))


@pytest.mark.parametrize(
    "batches",
    [lambda data: (pair for pair in [data] * 100), lambda data: torch.utils.data.DataLoader([data])],
    ids=["a generator", "a DataLoader"],
)
def test_a_source_of_batches_given_as_the_batch_is_named_when_the_step_fails_on_it(seed, batches):
    # examine(step, loader) for examine(step, batch): the step unpacks what it is given, fails,
    # and was told to fix itself; the error names what it was given and what to give instead
    model, opt = small()

    def step(batch):
        x, y = batch
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    given = batches((torch.randn(5, 4), torch.randn(5, 2)))
    with pytest.raises(UsageError, match=rf"the batch given is a {type(given).__name__}.*loader="):
        examined(step, given)


def test_a_step_that_exits_the_process_on_a_later_call_says_so_and_puts_files_back(
    seed, tmp_path, monkeypatch
):
    # a script's loop that ends with sys.exit() after some steps: the doctor's many calls reach
    # it; the process must not end silently, and the checkpoint it wrote comes back as it was
    monkeypatch.chdir(tmp_path)
    Path("ckpt.txt").write_text("the user's")
    model, opt = small()
    calls = []

    def step(x):
        calls.append(1)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        Path("ckpt.txt").write_text(f"step {len(calls)}")
        if len(calls) > 3:
            sys.exit(0)
        return loss.detach()

    with pytest.raises(UsageError, match=r"raised on call 4 \(.*\): SystemExit: sys.exit\(0\)"):
        examined(step, torch.randn(5, 4))
    assert Path("ckpt.txt").read_text() == "the user's"


def test_a_step_that_raises_on_its_second_call_is_said_to_have_run_once(seed):
    model, opt = small()
    calls = []

    def step(x):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the schedule ended")
        return one_update(model, opt, x)

    with pytest.raises(UsageError, match=r"the step ran once on the doctor's copies and raised "
                       r"on call 2"):  # fmt: skip
        examined(step, torch.randn(5, 4))


def test_try_fixes_refuses_counts_below_one_and_takes_a_name_as_one_name(seed):
    model, opt = small()
    report = examined(plain_step(model, opt), torch.randn(5, 4))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UsageError, match=f"steps as an int >= 1, got {bad!r}"):
            report.try_fixes(["set_to_none"], steps=bad)
    with pytest.raises(UsageError, match="repeats as an int >= 1, got 0"):
        report.try_fixes(["set_to_none"], repeats=0)
    with pytest.raises(
        UsageError, match=r"unknown fixes \['set_to_nothing'\]; expected .*set_to_none"
    ):
        report.try_fixes("set_to_nothing")
    trials = report.try_fixes("set_to_none", steps=1, repeats=1)
    assert list(trials["fixes"]) == ["set_to_none"]


def test_a_loader_given_as_an_iterator_is_refused(seed):
    model, _ = small()
    with pytest.raises(UsageError, match=r"loader must be an iterable.*got an iterator"):
        doctor.examine(lambda x: model(x).sum(), loader=iter([torch.randn(5, 4)]))


# ---- the property: generated steps ------------------------------------------------------------------
HOLDERS = ("closure", "global", "class", "instance", "module attribute", "module function")
EXTRAS = {
    "append": "losses.append(loss.item())",
    "random": "torch.rand(1); random.random(); np.random.rand()",
    "iterator": "next(stream)",
    "generator": "next(drawn)",
    "counter": "global count\ncount += 1",
    "file": "with open(LOG, 'a') as log:\n    log.write('step\\n')",
    "save": "torch.save({'loss': loss.detach()}, CKPT)",
}
NAMED = {"generator": "took items from", "file": "LOG", "save": "CKPT"}  # may be named instead


def generated_source(holder, depth, extras, call, other, log, ckpt) -> str:
    """A module whose ``make()`` returns (the step, its batch, the model, the optimizer)."""
    model = "nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))"
    defines = {
        "global": f"model = {model}\nopt = torch.optim.Adam(model.parameters(), lr=1e-2)",
        "class": f"class Holder:\n    model = {model}\n"
        "    opt = torch.optim.Adam(model.parameters(), lr=1e-2)",
        "instance": f"class Holder:\n    def __init__(self):\n        self.model = {model}\n"
        "        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)\nholder = Holder()",
    }
    names = {"global": ("model", "opt"), "class": ("Holder.model", "Holder.opt"),
             "instance": ("holder.model", "holder.opt"), "closure": ("model", "opt"),
             "module attribute": ("other.model", "other.opt"),
             "module function": ("other.model", "other.opt")}  # fmt: skip
    net, opt = names[holder]
    forward = "forward(x)" if holder == "module function" else f"{net}(x)"
    helpers = [f"def level_0(x):\n    return {forward}"]
    helpers += [f"def level_{i}(x):\n    return level_{i - 1}(x)" for i in range(1, depth + 1)]
    lines = [f"loss = level_{depth}(x).square().mean()", "loss.backward()"]
    lines += (
        ["update()"] if holder == "module function" else [f"{opt}.step()", f"{opt}.zero_grad()"]
    )
    counter = [EXTRAS["counter"]] if "counter" in extras else []
    lines = (
        counter + lines + [EXTRAS[e] for e in extras if e != "counter"] + ["return loss.detach()"]
    )
    body = (
        "\n".join(helpers)
        + "\n\ndef step(x, scale=1.0):\n"
        + textwrap.indent("\n".join(lines), "    ")
        + "\n"
    )
    made = {"function": "step", "partial": "functools.partial(step, scale=1.0)",
            "method": "Runner().run"}[call]  # fmt: skip
    runner = "class Runner:\n    def run(self, x):\n        return step(x)\n"
    inside = (f"model = {model}\nopt = torch.optim.Adam(model.parameters(), lr=1e-2)\n" + body
              if holder == "closure" else "")  # fmt: skip
    make = (f"def make():\n{textwrap.indent(inside + runner, '    ')}\n"
            f"    return {made}, torch.randn(5, 4), {net}, {opt}\n")  # fmt: skip
    head = [
        "import functools, random",
        "import numpy as np",
        "import torch",
        "from torch import nn",
    ]
    if holder in ("module attribute", "module function"):
        head += [f"import {other} as other", f"from {other} import forward, update"]
    head += ["losses = []", "stream = iter(list(range(1000)))",
             "drawn = (i for i in range(10**6))", "count = 0", f"LOG = {str(log)!r}",
             f"CKPT = {str(ckpt)!r}", defines.get(holder, "")]  # fmt: skip
    return "\n".join(head) + "\n\n" + ("" if holder == "closure" else body) + "\n\n" + make


OTHER = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)

def forward(x):
    return model(x)

def update():
    opt.step()
    opt.zero_grad()
"""


@settings(
    max_examples=24,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    holder=st.sampled_from(HOLDERS),
    depth=st.integers(0, 4),
    extras=st.lists(st.sampled_from(sorted(EXTRAS)), unique=True, max_size=4),
    call=st.sampled_from(("function", "partial", "method")),
)
def test_the_doctor_leaves_a_generated_steps_world_as_it_was(
    tmp_path_factory, holder, depth, extras, call
):
    folder = tmp_path_factory.mktemp("generated")
    log, ckpt = folder / "log.txt", folder / "ckpt.pt"
    other = write_module(folder, OTHER, "other").__name__
    module = write_module(folder, generated_source(holder, depth, extras, call, other, log, ckpt))
    step, batch, model, opt = module.make()
    torch.manual_seed(0)
    trained_once(model, opt)
    before = held(model, opt)

    report = examined(step, batch)

    assert differences(before, model, opt) == [], first_line(report)
    assert module.losses == [] and module.count == 0 and next(module.stream) == 0
    assert next(module.drawn) == 0 or named_before_numbers(report, "took items from")
    for path in (log, ckpt):
        assert not path.exists() or named_before_numbers(report, f"wrote {path}")
    assert len(report.parts.models) == 1 and len(report.parts.optimizers) == 1
    for extra in set(extras) - set(NAMED):
        assert extra not in first_line(report).split(". ")[0]  # isolated, so nothing to name


def test_a_dataset_a_batch_object_holds_is_not_copied(seed):
    # a batch object may keep a reference to its whole dataset: copying the batch must not copy it
    data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    batch = _Batch(torch.randn(5, 4), torch.randn(5))
    batch.source = data
    owned = own_batch(batch)
    assert owned.source is data and owned.x is not batch.x
    assert torch.equal(owned.x, batch.x)


def test_workers_are_not_proposed_where_a_copy_with_them_measured_slower(seed):
    # batches already in memory: a worker's handoff costs more than making one, which the
    # doctor measures on a copy of the loader before it proposes workers
    import multiprocessing

    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(256, 4)), batch_size=16, num_workers=0)
    model, opt = small()
    children = set(multiprocessing.active_children())
    report = doctor.examine(lambda batch: one_update(model, opt, batch[0]), loader=loader,
                            steps=1, warmup=1)  # fmt: skip
    found = report.evidence.loader
    wait_share = found["wait_us"] / report.evidence.step_us
    assert ("tried" in found) == (wait_share > 0.05), found  # timed only where it would be said
    if "tried" in found and found["tried"]["wait_us"] >= found["wait_us"]:
        assert "input" not in [f.kind for f in report.findings]
    assert loader.num_workers == 0 and set(multiprocessing.active_children()) == children


def test_a_loader_with_persistent_workers_is_left_without_the_doctors_workers(seed):
    # the doctor's reads of a loader start its workers; a persistent loader would keep them,
    # and its iterator, for the user's first epoch
    import multiprocessing

    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=16, num_workers=1, persistent_workers=True)
    model = nn.Linear(8, 1)
    step = plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    children = set(multiprocessing.active_children())
    doctor.examine(lambda batch: step(batch[0]), loader=loader, steps=1, warmup=1)
    assert loader._iterator is None
    assert set(multiprocessing.active_children()) == children


def test_a_loader_workers_batch_arriving_is_not_named_as_the_steps_connection(seed):
    # a worker's batch arrives as a file descriptor fetched over a socket multiprocessing opens
    # for itself: that connection is the loader's transport, not something the step did
    from torch.utils.data import DataLoader, TensorDataset

    model, opt = small()
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=16, num_workers=1)
    batches = iter(loader)

    def step():
        (x,) = next(batches)
        return one_update(model, opt, x)

    report = examined(step)
    assert "connected to" not in first_line(report), first_line(report)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "a pass held"])
@pytest.mark.parametrize("trainer", [True, False], ids=["held in a cycle", "a closure"])
def test_the_loader_copies_the_doctor_made_leave_no_worker_running(seed, trainer, persistent):
    # a step that starts a pass on every call starts workers on its copy of the loader (kept by
    # a persistent one, or by the pass the step holds); a copy held in a reference cycle (a
    # callback's reference back to its trainer) would keep them until the collector's next
    # pass, which here never comes
    import gc
    import multiprocessing

    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(24, 4))
    model, opt = small()
    held = Holding(loader=DataLoader(data, batch_size=4, num_workers=1,
                                     persistent_workers=persistent))  # fmt: skip
    held.callbacks = [held] if trainer else []

    def step():
        held.batches = iter(held.loader)
        (x,) = next(held.batches)
        return one_update(model, opt, x)

    children = set(multiprocessing.active_children())
    gc.disable()
    try:
        report = examined(step)
        assert set(multiprocessing.active_children()) == children
        report.try_fixes(["set_to_none"], steps=1, repeats=1)
        assert set(multiprocessing.active_children()) == children
    finally:
        gc.enable()
    assert held.loader._iterator is None
    assert "left the thread" not in first_line(report), first_line(report)


def shuffled_pipeline(data: torch.Tensor, seed: int, drawn: int, workers: int):
    """A shuffling loader (with ``workers``, kept between epochs), and its iterator ``drawn``
    batches in; built twice from one seed, two draw the same."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(data), batch_size=4, shuffle=True, num_workers=workers,
                        persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed))  # fmt: skip
    batches = iter(loader)
    for _ in range(drawn):
        next(batches)
    return loader, batches


@pytest.mark.parametrize("given", [True, False], ids=["loader given", "no loader"])
@pytest.mark.parametrize("drawn", [2, 6], ids=["mid-epoch", "at its end"])
@pytest.mark.parametrize("workers", [1, 0], ids=["persistent", "in the process"])
def test_a_loaders_iterator_the_step_holds_keeps_its_place(seed, drawn, given, workers):
    # iter() on a persistent loader resets the iterator it keeps: the user's, which the step
    # holds; and the step reaches its loader, so the copies draw from a copy of it, not from yours
    data = torch.randn(24, 4)
    loader, batches = shuffled_pipeline(data, seed, drawn, workers)
    twin, twins = shuffled_pipeline(data, seed, drawn, workers)
    model, opt = small()

    def step():
        nonlocal batches
        try:
            (x,) = next(batches)
        except StopIteration:
            batches = iter(loader)
            (x,) = next(batches)
        return one_update(model, opt, x)

    report = examined(step, loader=loader if given else None)
    report.try_fixes(["set_to_none"], steps=1, repeats=1)
    # the step reaches its loader: the copies get a batch of a copy of it, none of the user's
    assert "took 1 item" not in first_line(report) and "at its end" not in first_line(report)
    for mine, theirs in ((batches, twins), (loader, twin)):  # this epoch's rest, then the next
        rest, expected = [x for (x,) in mine], [x for (x,) in theirs]
        assert len(rest) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(rest, expected, strict=True))

class CountingStream(torch.utils.data.IterableDataset):
    """A stream that keeps its epoch and the items it served on itself, as resumable ones do."""

    def __init__(self, data: torch.Tensor):
        self.data, self.epoch, self.served = data, 0, 0

    def __iter__(self):
        self.epoch += 1
        for x in self.data.split(4):
            self.served += len(x)
            yield x


class CountingSampler(torch.utils.data.Sampler):
    def __init__(self, n: int):
        self.n, self.epoch = n, 0

    def __iter__(self):
        self.epoch += 1
        return iter(range(self.n))

    def __len__(self):
        return self.n


def test_a_loaders_data_set_and_sampler_are_left_as_they_were(seed):
    from torch.utils.data import DataLoader, TensorDataset

    stream = CountingStream(torch.randn(32, 4))
    model, opt = small()
    examined(lambda x: one_update(model, opt, x), loader=DataLoader(stream, batch_size=None))
    assert (stream.epoch, stream.served) == (0, 0)
    sampler = CountingSampler(32)
    loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4, sampler=sampler)
    examined(lambda batch: one_update(model, opt, batch[0]), loader=loader)
    assert sampler.epoch == 0


class NoisyData(torch.utils.data.Dataset):
    """A data set that draws its augmentation from a generator of its own."""

    def __init__(self, data: torch.Tensor, seed: int):
        self.data, self.rng = data, np.random.default_rng(seed)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i] + float(self.rng.normal())


class CountingData(NoisyData):
    """A noisy data set that also counts the items it served on itself."""

    served = 0

    def __getitem__(self, i):
        self.served += 1
        return super().__getitem__(i)


class CachingCounter(torch.utils.data.Dataset):
    """A data set that counts its reads in a tensor and a list, and caches what it served."""

    def __init__(self):
        self.seen, self.log, self.cache = torch.zeros(32), [], {}

    def __len__(self):
        return 32

    def __getitem__(self, i):
        self.seen[i] += 1
        self.log.append(i)
        return self.cache.setdefault(i, torch.full((4,), float(i)))


@pytest.mark.parametrize("wrap", ["plain", "subset"])
def test_what_a_data_set_holds_and_changes_in_place_is_put_back(seed, wrap):
    from torch.utils.data import DataLoader, Subset

    data = CachingCounter()
    loader = DataLoader(data if wrap == "plain" else Subset(data, list(range(32))), batch_size=4)
    model, opt = small()
    examined(lambda x: one_update(model, opt, x), loader=loader).try_fixes(
        ["set_to_none"], steps=1, repeats=1)  # fmt: skip
    assert data.seen.sum() == 0 and data.log == [] and data.cache == {}


def test_the_data_sets_a_subset_or_a_concatenation_wraps_are_left_as_they_were(seed):
    # the loading reaches them through the wrappers: their counts and generators are put back
    from torch.utils.data import ConcatDataset, DataLoader, Subset

    inner, deeper = CountingData(torch.randn(32, 4), seed), CountingData(torch.randn(32, 4), seed)
    data = ConcatDataset([Subset(inner, range(16)), Subset(Subset(deeper, range(24)), range(16))])
    inner.dataset = data  # a way back to the top: followed once
    states = [d.rng.bit_generator.state for d in (inner, deeper)]
    model, opt = small()
    report = examined(lambda x: one_update(model, opt, x),
                      loader=DataLoader(data, batch_size=4, shuffle=True))  # fmt: skip
    report.try_fixes(["set_to_none"], steps=1, repeats=1)
    assert (inner.served, deeper.served) == (0, 0)
    assert [d.rng.bit_generator.state for d in (inner, deeper)] == states


@pytest.mark.parametrize("holder", ["loader", "sampler", "data set"])
def test_the_random_generator_a_loader_draws_from_is_left_as_it_was(seed, holder):
    from torch.utils.data import DataLoader, RandomSampler

    data = torch.randn(32, 4)
    generator = torch.Generator().manual_seed(seed)
    if holder == "loader":
        loader = DataLoader(data, batch_size=4, shuffle=True, generator=generator)
    elif holder == "sampler":
        loader = DataLoader(data, batch_size=4, sampler=RandomSampler(data, generator=generator))
    else:
        loader = DataLoader(NoisyData(data, seed), batch_size=4)
    rng = loader.dataset.rng if holder == "data set" else None
    state = (generator.get_state(), rng and rng.bit_generator.state)
    model, opt = small()
    before = held(model, opt)
    report = examined(lambda x: one_update(model, opt, x), loader=loader)
    report.try_fixes(["set_to_none"], steps=1, repeats=1)
    assert differences(before, model, opt) == []
    assert torch.equal(generator.get_state(), state[0])
    assert rng is None or rng.bit_generator.state == state[1]
    assert not first_line(report).startswith("Caution"), first_line(report)


@pytest.mark.parametrize("missing", [False, True])
def test_a_step_drawing_its_own_batches_from_a_shuffled_loader_gets_no_caution(seed, missing):
    """The step starts the loader again when its iterator runs out, drawing from the shuffle's
    generator: the doctor puts that state back, and names nothing it put back as changed (a
    data set the sampler holds, with a missing value or not, left as it was, not written)."""
    from torch.utils.data import DataLoader

    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(16, 4)
    data[3, 1] = math.nan if missing else data[3, 1]
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=generator)
    batches = iter(loader)
    model, opt = small()

    def step():
        nonlocal batches
        x = next(batches, None)
        if x is None:
            batches = iter(loader)
            x = next(batches)
        return one_update(model, opt, x)

    state, version = generator.get_state(), data._version
    report = examined(step, loader=loader)
    assert torch.equal(generator.get_state(), state) and data._version == version
    assert not first_line(report).startswith("Caution"), first_line(report)
    assert report.changed == [], report.changed


def test_a_file_written_through_a_handle_opened_before_the_step_is_said_not_put_back(
    seed, tmp_path
):
    # a log opened at import: the doctor cannot put back what the step appends through it,
    # and says so (not only that something it holds changed)
    model, opt = small()
    log = open(tmp_path / "train.log", "a")  # noqa: SIM115 - held open, as a script holds it

    def step(x):
        loss = one_update(model, opt, x)
        print(float(loss), file=log, flush=True)
        return loss.detach()

    try:
        report = examined(step, torch.randn(5, 4))
    finally:
        log.close()
    said = f"closure 'log' (the open file {tmp_path / 'train.log'}, written through, not put back)"
    assert named_before_numbers(report, said)


def test_a_step_that_pops_from_its_batch_gets_the_whole_batch_every_call(seed):
    # ``labels = batch.pop("labels")``, as loops written after Trainer's compute_loss do: in
    # training each call has a batch of its own, so every call here starts from the whole one
    model, opt = small()
    batch = {"x": torch.randn(5, 4), "labels": torch.randn(5, 2)}

    def step(batch):
        labels = batch.pop("labels")
        loss = (model(batch["x"]) - labels).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    report = examined(step, batch)
    rows = report.try_fixes(["set_to_none"], steps=2, repeats=2)
    assert set(batch) == {"x", "labels"}
    assert not rows["status"].str.startswith("failed").any(), rows["status"].tolist()


def test_a_file_two_of_the_steps_threads_write_at_once_is_kept_as_it_was(tmp_path, monkeypatch):
    """One thread's write is held until another's copy of the file is taken, and the copying
    thread's state is its own: a write from another thread meanwhile is still the step's."""
    import shutil

    from accel.doctor import kept_files

    path = tmp_path / "last.pt"
    path.write_bytes(b"the user's checkpoint")
    files = kept_files.KeptFiles()
    copying, release = threading.Event(), threading.Event()
    copy2 = shutil.copy2

    def slow_copy(source, target):
        copying.set()
        release.wait(10)
        return copy2(source, target)

    monkeypatch.setattr(kept_files.shutil, "copy2", slow_copy)
    first = threading.Thread(target=files.keep, args=(str(path),))
    first.start()
    assert copying.wait(10)
    assert not files.busy  # this thread is not the one copying
    written = threading.Event()

    def second_writer():
        files.keep(str(path))  # what the audit event asks before the write
        path.write_bytes(b"a checkpoint of the doctor's copy")
        written.set()

    threading.Thread(target=second_writer).start()
    assert not written.wait(0.3)  # held while the first copy is taken
    release.set()
    first.join(10)
    assert written.wait(10)
    files.put_back()
    assert path.read_bytes() == b"the user's checkpoint"


def test_a_file_is_put_back_through_a_temporary_it_makes_itself(tmp_path, monkeypatch):
    """The temporary a kept file is copied into is created, never opened where something is
    already at its name: a link there is not written through."""
    from accel.doctor import kept_files

    kept, other = tmp_path / "kept", tmp_path / "elsewhere.txt"
    kept.write_bytes(b"the user's checkpoint")
    other.write_bytes(b"not to be written")
    path = tmp_path / "last.pt"
    path.write_bytes(b"the step's")
    monkeypatch.setattr(kept_files.secrets, "token_hex", lambda n: "0" * 2 * n)
    os.symlink(other, tmp_path / f".last.pt.{'0' * 16}.kept")
    with pytest.raises(FileExistsError):
        kept_files._replace(str(path), str(kept))
    assert other.read_bytes() == b"not to be written" and path.read_bytes() == b"the step's"


def test_a_copy_that_would_fill_the_disk_is_not_made(seed, tmp_path, monkeypatch):
    monkeypatch.setattr("accel.doctor.kept_files.FREE_AFTER_BYTES", 2**62)
    model, opt = small()
    data = tmp_path / "log.txt"
    data.write_text("the user's log")

    def step(x):
        loss = one_update(model, opt, x)
        data.write_text("the step's")
        return loss.detach()

    with pytest.raises(UsageError, match=f"{data}: 14 B, more than a copy in .* leaves free"):
        examined(step, torch.randn(5, 4))
    assert data.read_text() == "the user's log"


def test_a_file_the_user_holds_open_is_put_back_in_place(seed, tmp_path):
    """A log the user's handler holds open, appended to by the step under its name: put back
    into the same file, so that the handler's later writes land under that name."""
    model, opt = small()
    log = tmp_path / "train.log"
    handler = logging.FileHandler(log)
    logger = logging.getLogger(f"user_{tmp_path.name}")
    logger.addHandler(handler)
    logger.warning("before")
    inode = log.stat().st_ino

    def step(x):
        loss = one_update(model, opt, x)
        with open(log, "a") as f:
            f.write("the step's line\n")
        return loss.detach()

    examined(step, torch.randn(5, 4))
    logger.warning("after")
    handler.close()
    assert log.stat().st_ino == inode
    assert log.read_text() == "before\nafter\n"


def test_temporary_files_renamed_to_one_name_say_that_name_once(seed, tmp_path):
    model, opt = small()
    final = tmp_path / "final.bin"

    def step(x):
        loss = one_update(model, opt, x)
        with tempfile.NamedTemporaryFile(dir=tmp_path, delete=False) as temporary:
            temporary.write(b"w")
        os.replace(temporary.name, final)
        return loss.detach()

    line = first_line(examined(step, torch.randn(5, 4)))
    assert re.search(rf"renamed \d+ entries into {re.escape(str(tmp_path))} \(final\.bin\)", line), line
    assert not final.exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_the_users_compiled_model_stays_compiled_after_examine(device):
    """The recording's dispatch mode seen by dynamo on the user's own forward made dynamo skip
    that code for the rest of the process: the user's compiled model ran eagerly after."""

    class Waves(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            for _ in range(3):
                x = torch.sin(x * self.w) + torch.cos(x)
            return x

    model = Waves()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    batch = torch.randn(16, 16)

    def step(x):
        loss = compiled(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    def eager_sines() -> int:  # a compiled forward runs no aten::sin of its own
        with torch.profiler.profile() as prof:
            step(batch)
        return sum(e.name == "aten::sin" for e in prof.events())

    step(batch)
    assert eager_sines() == 0
    doctor.examine(step, batch, steps=1, warmup=1)
    assert eager_sines() == 0


# ---- torch.compile's caches --------------------------------------------------------------------
def _sine(x):
    return x.sin() + 1


def _cosine(x):
    return x.cos() * 2


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_a_session_empties_what_it_compiled_where_the_process_had_compiled_nothing():
    """A compiled copy stays in torch.compile's caches (with its memory) until a reset; in a
    process that had compiled nothing, the reset puts it back as it was."""
    from accel.doctor.isolation import Session

    torch._dynamo.reset()
    with Session() as session:
        torch.compile(_sine, backend="eager")(torch.randn(3))
    compiled = _graphs_compiled()
    torch.compile(_sine, backend="eager")(torch.randn(3))
    assert _graphs_compiled() == compiled + 1  # compiled again: nothing was left cached
    assert session.effects().said() == []
    torch._dynamo.reset()


def test_a_session_keeps_the_users_compiled_functions_and_says_what_it_left():
    from accel.doctor.isolation import Session

    torch._dynamo.reset()
    users = torch.compile(_cosine, backend="eager")
    users(torch.randn(3))
    with Session() as session:
        torch.compile(_sine, backend="eager")(torch.randn(3))
    compiled = _graphs_compiled()
    users(torch.randn(3))
    assert _graphs_compiled() == compiled  # the user's compiled function kept its cache
    (said,) = session.effects().said()
    assert "torch._dynamo.reset()" in said
    torch._dynamo.reset()


def test_a_session_whose_caches_ended_empty_says_nothing_was_left():
    """``examine(compile=True)`` resets torch.compile's caches (its trace of the step starts from
    an empty one): the user's compiled functions compile again, which its docstring says, and no
    copy is left in them to name."""
    from accel.doctor.isolation import Session

    torch._dynamo.reset()
    torch.compile(_cosine, backend="eager")(torch.randn(3))
    with Session() as session:
        torch.compile(_sine, backend="eager")(torch.randn(3))
        torch._dynamo.reset()
    assert session.effects().said() == []


def test_a_session_that_compiled_nothing_says_nothing_of_compiling():
    from accel.doctor.isolation import Session

    torch._dynamo.reset()
    users = torch.compile(_cosine, backend="eager")
    users(torch.randn(3))
    with Session() as session:
        _sine(torch.randn(3))
    assert session.effects().said() == []
    torch._dynamo.reset()


def test_a_progress_bars_monitor_thread_is_not_named_as_the_steps(monkeypatch):
    """tqdm starts its monitor thread (a daemon that ends itself) and its exit handler with the
    first bar after the last monitor ended: here one the step's code makes, as torch.compile's
    does on a GPU. Neither is the step's to name."""
    import tqdm.std

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        for _ in tqdm.std.tqdm(range(1), file=io.StringIO()):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.detach()

    report = doctor.examine(step, torch.randn(3, 4), steps=1, warmup=1)
    if tqdm.std.tqdm.monitor is not None:
        tqdm.std.tqdm.monitor.exit()
    monkeypatch.setattr(tqdm.std.tqdm, "monitor", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report.try_fixes(["set_to_none"], steps=1, repeats=1)
    assert not [str(w.message) for w in caught if "tqdm" in str(w.message).lower()]
    # nor left running: the process had none before the trials
    assert not [t for t in threading.enumerate() if t.name == "tqdm_monitor" and t.is_alive()]


def test_compile_workers_a_session_started_are_shut_down_and_the_users_kept():
    """Inductor keeps its pools of compile workers for the process's later compiles: one that a
    doctor's compiled copy started, where the process had none, ends with the session; one the
    process had before is left running."""
    from torch._inductor import async_compile

    from accel.doctor.isolation import Session

    pools = async_compile.AsyncCompile.pool
    with torch._inductor.config.patch(compile_threads=2):
        pools.cache_clear()  # this process compiles with one thread: none to keep
        with Session():
            started = pools()
            started.submit(int).result()
        assert started._shutdown and pools.cache_info().currsize == 0
        users = pools()
        with Session():
            pass
        assert pools() is users and not users._shutdown
        users.shutdown()
        pools.cache_clear()


def test_the_registry_of_warnings_shown_that_a_run_left_in_a_users_module_is_removed(monkeypatch):
    """Python keeps the warnings a module's code showed in its ``__warningregistry__``, so that
    each shows once: one made while the doctor ran the step would hide the user's first warning
    after, and is a name the module did not have."""
    module = types.ModuleType("_warns_in_its_step")
    exec(
        "import warnings\n"
        "def loss_of(model, x):\n"
        "    warnings.warn('a warning of the user\\'s code')\n"
        "    return model(x).square().mean()\n",
        module.__dict__,
    )
    monkeypatch.setitem(sys.modules, module.__name__, module)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = module.loss_of(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        doctor.examine(step, torch.randn(3, 4), steps=1, warmup=1)
    assert "__warningregistry__" not in vars(module)


def test_a_torch_whose_inductor_names_its_pools_otherwise_opens_and_closes_a_session(monkeypatch):
    """The compile workers are found by inductor's own names; another torch may lack them."""
    from torch._inductor import async_compile

    from accel.doctor.isolation import Session

    monkeypatch.delattr(async_compile, "_pool_set")
    with Session():
        pass
