"""accel.doctor.parts: the models and optimizers a step reaches, found wherever its code looks for
them, copied together, and the step rebuilt around the copies; the user's tensors stay as they
were."""

from __future__ import annotations

import collections
import copy
import functools
import sys
import warnings

import pytest
import torch
from torch import nn

from accel import doctor
from accel.doctor import parts as parts_module
from accel.doctor.parts import StepParts, copy_step, find_parts
from accel.doctor.untouched import Untouched
from accel.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")

IN, OUT, ROWS = 6, 3, 5


def pair(momentum: float = 0.9) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(IN, 12), nn.Tanh(), nn.Linear(12, OUT))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def batch() -> torch.Tensor:
    return torch.randn(ROWS, IN)


def train(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def snapshot(models) -> list[tuple[torch.Tensor, int]]:
    return [(t.detach().clone(), t._version) for m in models for t in m.state_dict().values()]


def unchanged(before, models) -> bool:
    after = [t for m in models for t in m.state_dict().values()]
    return all(
        torch.equal(value, t) and version == t._version
        for (value, version), t in zip(before, after, strict=True)
    )


def trains_copies_only(step, originals, calls: int = 2) -> StepParts:
    """Run the rebuilt step; the originals keep their values and versions, the copies train."""
    found = find_parts(step)
    untouched = Untouched(found)
    before = snapshot(originals)
    rebuilt, copied = copy_step(step, found)
    for _ in range(calls):
        rebuilt(batch())
    assert untouched.changed() == []
    assert unchanged(before, originals)
    assert not unchanged(before, copied.models[: len(originals)])
    for opt in copied.optimizers:
        owned = {id(p) for m in copied.models for p in m.parameters()}
        assert all(id(p) in owned for g in opt.param_groups for p in g["params"])
    return found


def where(found: StepParts) -> dict[str, str]:
    return {found.where[id(v)]: type(v).__name__ for v in found.all}


# ---- closures, partials, objects ------------------------------------------------------------------
def test_closure_step_trains_copies_only(seed):
    model, opt = pair()

    def step(x):
        return train(model, opt, x)

    found = trains_copies_only(step, [model])
    assert where(found) == {"closure 'model'": "Sequential", "closure 'opt'": "SGD"}


def test_the_copies_start_from_the_gradients_the_models_hold(seed):
    """A step that accumulates (backward every call, zero_grad after the update) starts from the
    gradients already there: its copies must too, each its own."""
    model, opt = pair()
    for p in model.parameters():
        p.grad = torch.randn_like(p)

    def step(x):
        return train(model, opt, x)

    _, copied = copy_step(step, find_parts(step))
    for mine, theirs in zip(model.parameters(), copied.models[0].parameters(), strict=True):
        assert theirs.grad is not None and theirs.grad is not mine.grad
        assert torch.equal(theirs.grad, mine.grad)


def test_legacy_weight_and_spectral_norm_models_are_copied(seed):
    """torch.nn.utils.weight_norm and spectral_norm (the hook versions, still in GAN and audio
    code) keep the weight they compute from their parameters as a non-leaf tensor, which deepcopy
    refuses; the copy's hooks compute it again before each forward."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm's deprecation
        model = nn.Sequential(nn.utils.weight_norm(nn.Linear(IN, 12)), nn.Tanh(),
                              nn.utils.spectral_norm(nn.Linear(12, OUT)))  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(x):
        return train(model, opt, x)

    trains_copies_only(step, [model])


def test_nested_modules_are_one_part(seed):
    model, opt = pair()
    head = model[2]

    def step(x):
        head.weight.grad = None
        return train(model, opt, x)

    found = find_parts(step)
    assert found.models == [model]
    assert found.parameters() == list(model.parameters())


def test_parts_in_a_list_or_dict_are_swapped_for_copies(seed):
    model, opt = pair()
    kept = {"model": model, "opt": opt}
    listed = [model, opt]

    def from_dict(x):
        return train(kept["model"], kept["opt"], x)

    def from_list(x):
        return train(listed[0], listed[1], x)

    assert where(trains_copies_only(from_dict, [model])) == {
        "closure 'kept'['model']": "Sequential",
        "closure 'kept'['opt']": "SGD",
    }
    assert where(trains_copies_only(from_list, [model])) == {
        "closure 'listed'[0]": "Sequential",
        "closure 'listed'[1]": "SGD",
    }


def test_parts_in_a_namedtuple_are_swapped_for_copies(seed):
    Trainables = collections.namedtuple("Trainables", "model opt")
    model, opt = pair()
    held = Trainables(model, opt)

    def step(x):
        return train(held.model, held.opt, x)

    trains_copies_only(step, [model])


def test_partial_arguments_are_copied(seed):
    model, opt = pair()
    found = trains_copies_only(functools.partial(train, model, opt), [model])
    assert where(found) == {"partial argument 0": "Sequential", "partial argument 1": "SGD"}

    def keyword_step(x, *, model, opt):
        return train(model, opt, x)

    found = trains_copies_only(functools.partial(keyword_step, model=model, opt=opt), [model])
    assert where(found) == {
        "partial argument 'model'": "Sequential",
        "partial argument 'opt'": "SGD",
    }


class Trainer:
    def __init__(self):
        self.net, self.optim = pair()
        self.losses: list[torch.Tensor] = []

    def train_step(self, x):
        loss = train(self.net, self.optim, x)
        self.losses.append(loss)
        return loss

    __call__ = train_step


def test_bound_method_of_a_trainer_trains_copies_only(seed):
    trainer = Trainer()
    found = trains_copies_only(trainer.train_step, [trainer.net])
    assert where(found) == {"self.net": "Sequential", "self.optim": "SGD"}
    assert trainer.losses == []  # the copy's list gained the losses, not the trainer's
    rebuilt, _ = copy_step(trainer.train_step, found)
    rebuilt(batch())
    assert len(rebuilt.__self__.losses) == 1 and trainer.losses == []


def test_callable_object_trains_copies_only(seed):
    trainer = Trainer()
    found = trains_copies_only(trainer, [trainer.net])
    assert where(found) == {"self.net": "Sequential", "self.optim": "SGD"}


class TrainStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, 12), nn.GELU(), nn.Linear(12, OUT))
        self.optim = torch.optim.AdamW(self.net.parameters(), lr=1e-2)

    def forward(self, x):
        return train(self.net, self.optim, x)


def test_module_step_is_copied_whole(seed):
    step = TrainStep()
    found = trains_copies_only(step, [step])
    assert where(found) == {"the step itself": "TrainStep", "self.optim": "AdamW"}
    rebuilt, copied = copy_step(step, found)
    assert rebuilt is copied.models[0] and rebuilt.optim is copied.optimizers[0]


class EMA:
    """An average of a model's weights, updated after each step."""

    def __init__(self, model: nn.Module, decay: float = 0.8):
        self.model, self.decay = model, decay
        self.shadow = copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def update(self):
        for s, p in zip(self.shadow.parameters(), self.model.parameters(), strict=True):
            s.lerp_(p, 1 - self.decay)


def test_object_holding_the_model_is_copied_with_it(seed):
    model, opt = pair()
    ema = EMA(model)

    def step(x):
        loss = train(ema.model, opt, x)
        ema.update()
        return loss

    found = trains_copies_only(step, [model, ema.shadow])
    assert where(found) == {
        "closure 'ema'.model": "Sequential",
        "closure 'ema'.shadow": "Sequential",
        "closure 'opt'": "SGD",
    }
    rebuilt, copied = copy_step(step, found)
    copied_ema = rebuilt.__closure__[step.__code__.co_freevars.index("ema")].cell_contents
    assert isinstance(copied_ema, EMA) and copied_ema is not ema
    assert copied_ema.model is copied.models[0] and copied_ema.shadow is copied.models[1]


# ---- module globals and helpers -------------------------------------------------------------------
_net: nn.Module | None = None
_opt: torch.optim.Optimizer | None = None


@pytest.fixture
def module_pair(monkeypatch, seed):
    net, opt = pair()
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "_net", net)
    monkeypatch.setattr(this, "_opt", opt)
    return net, opt


def _global_step(x):
    return train(_net, _opt, x)


def _forward_of(x):
    return _net(x)


def _loss_of(x):
    return _forward_of(x).square().mean()


def _step_through_helpers(x):
    loss = _loss_of(x)
    loss.backward()
    _opt.step()
    _opt.zero_grad()
    return loss.detach()


def test_module_global_step_trains_copies_only(module_pair):
    net, _ = module_pair
    found = trains_copies_only(_global_step, [net])
    assert where(found) == {"global '_net'": "Sequential", "global '_opt'": "SGD"}
    assert _net is net


def test_model_reached_through_same_module_helpers_is_copied(module_pair):
    net, _ = module_pair
    found = trains_copies_only(_step_through_helpers, [net])
    assert where(found) == {"global '_net'": "Sequential", "global '_opt'": "SGD"}
    assert _step_through_helpers.__globals__["_net"] is net


SCRIPT = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)

def loss_of(x):
    return model(x).square().mean()

def step(x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()

def step_via_helper(x):
    loss = loss_of(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()
"""


def script_namespace() -> dict:
    namespace = {"__name__": "user_script"}
    exec(compile(SCRIPT, "<user_script>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("name", ["step", "step_via_helper"])
def test_step_of_an_exec_namespace_trains_copies_only(seed, name):
    namespace = script_namespace()
    model, step = namespace["model"], namespace[name]
    found = trains_copies_only(step, [model])
    assert where(found) == {"global 'model'": "Sequential", "global 'opt'": "Adam"}
    rebuilt, copied = copy_step(step, found)
    assert namespace["model"] is model and rebuilt.__globals__ is not namespace
    reader = rebuilt if name == "step" else rebuilt.__globals__["loss_of"]
    assert reader.__globals__["model"] is copied.models[0]


def test_model_reached_through_a_helper_in_the_closure_is_copied(seed):
    model, opt = pair()

    def loss_of(x):
        return model(x).square().mean()

    def step(x):
        loss = loss_of(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    assert find_parts(step).models == [model]


def test_attribute_names_do_not_pull_in_same_named_functions(seed):
    namespace = {"__name__": "user_notebook"}
    source = """
import torch
from torch import nn
model = nn.Linear(6, 3)
teacher = nn.Linear(6, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def train(x):
    return teacher(x)

def train_step(x):
    model.train()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
    exec(compile(source, "<user_notebook>", "exec"), namespace)
    assert find_parts(namespace["train_step"]).models == [namespace["model"]]


# ---- schedulers ----------------------------------------------------------------------------------
class KeepsItsAttributes(torch.optim.AdamW):
    """An optimizer whose copies keep every attribute, the scheduler's ``step`` wrapper too."""

    def __getstate__(self):
        return dict(self.__dict__)


def scheduled(optimizer_class):
    model = nn.Sequential(nn.Linear(IN, 12), nn.Tanh(), nn.Linear(12, OUT))
    opt = optimizer_class(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        train(model, opt, batch())
        scheduler.step()
    model(batch()).square().mean().backward()  # the user's model holds gradients

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
        return loss.detach()

    return step, model, opt, scheduler


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, KeepsItsAttributes])
def test_copy_with_a_scheduler_never_steps_the_users_optimizer(seed, optimizer_class):
    step, model, opt, scheduler = scheduled(optimizer_class)
    lr, epoch = opt.param_groups[0]["lr"], scheduler.last_epoch
    found = trains_copies_only(step, [model])
    assert where(found) == {
        "closure 'model'": "Sequential",
        "closure 'opt'": optimizer_class.__name__,
        "closure 'scheduler'": "StepLR",
    }
    assert (opt.param_groups[0]["lr"], scheduler.last_epoch) == (lr, epoch)
    rebuilt, copied = copy_step(step, found)
    rebuilt(batch())
    (copied_scheduler,) = copied.others
    assert copied_scheduler.optimizer is copied.optimizers[0]
    assert copied_scheduler.last_epoch == epoch + 1
    assert copied.optimizers[0].param_groups[0]["lr"] == pytest.approx(lr / 2)


class EveryOther(torch.optim.SGD):
    """An optimizer with attributes of its own (as LBFGS has its ``_params``), which
    ``Optimizer.__getstate__`` leaves out of a deep copy."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.every, self.calls = 2, 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure) if self.calls % self.every == 0 else None


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.LBFGS(params, lr=0.1, max_iter=3),
    lambda params: EveryOther(params, lr=0.1),
], ids=["lbfgs", "own_attributes"])  # fmt: skip
def test_an_optimizers_own_attributes_are_copied_with_it(seed, make_optimizer):
    model = nn.Sequential(nn.Linear(IN, 12), nn.Tanh(), nn.Linear(12, OUT))
    opt = make_optimizer(model.parameters())

    def step(x):
        def closure():
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        closure()
        return opt.step(closure)

    found = trains_copies_only(step, [model])
    (copied,) = copy_step(step, found)[1].optimizers
    own = {k for k in vars(opt) if k not in ("state", "param_groups", "defaults")}
    assert own <= set(vars(copied))
    if isinstance(opt, torch.optim.LBFGS):
        assert copied._params is copied.param_groups[0]["params"]


def test_without_the_rewrap_a_kept_wrapper_steps_the_users_optimizer(seed, monkeypatch):
    monkeypatch.setattr(parts_module, "_rewrap_scheduler_patch", lambda original, opt: None)
    step, model, _, _ = scheduled(KeepsItsAttributes)
    before = snapshot([model])
    rebuilt, _ = copy_step(step, find_parts(step))
    rebuilt(batch())
    assert not unchanged(before, [model])


def test_examine_of_a_step_with_a_fresh_scheduler_warns_nothing(seed):
    model, _ = pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
        return loss.detach()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        doctor.examine(step, batch(), steps=1, warmup=1)
    assert [str(w.message) for w in caught] == []


# ---- proving the user's tensors untouched ---------------------------------------------------------
def test_untouched_reports_in_place_changes_and_nothing_else(seed):
    model = nn.Sequential(nn.Linear(IN, 8), nn.BatchNorm1d(8), nn.Linear(8, OUT))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, batch())

    def step(x):
        return train(model, opt, x)

    untouched = Untouched(find_parts(step))
    model.eval()
    with torch.no_grad():
        model(batch())
    assert untouched.changed() == []
    with torch.no_grad():
        model[0].weight.mul_(1.0)
    assert untouched.changed() == ["closure 'model': 0.weight"]
    next(iter(opt.state.values()))["exp_avg"].add_(torch.randn(8, IN))
    model.train()
    model(batch())
    changed = untouched.changed()
    assert "closure 'model': 1.num_batches_tracked" in changed
    assert "closure 'opt': state[0]['exp_avg']" in changed
    assert "closure 'model': 2.weight" not in changed


# ---- parts that cannot be copied ------------------------------------------------------------------
class Locked(nn.Linear):
    """A layer that refuses to be copied, as a wrapper of a driver's handle may (a lock or an
    open file it holds beside its weights is shared with the copies instead)."""

    def __init__(self):
        super().__init__(IN, OUT)

    def __deepcopy__(self, memo):
        raise TypeError("cannot pickle 'Locked' object")


def locked_step():
    model = Locked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        return train(model, opt, x)

    return step, model


def test_uncopyable_part_raises_type_error_naming_it(seed):
    step, _ = locked_step()
    with pytest.raises(TypeError, match="cannot be deep-copied") as raised:
        copy_step(step, find_parts(step))
    assert "Locked (closure 'model')" in str(raised.value)
    assert "cannot pickle 'Locked' object" in str(raised.value)


def test_examine_refuses_to_train_parts_it_cannot_copy_unless_allowed(seed):
    step, model = locked_step()
    before = snapshot([model])
    with pytest.raises(UsageError, match=r"cannot be deep-copied.*allow_training=True"):
        doctor.examine(step, batch(), steps=1, warmup=1)
    assert unchanged(before, [model])
    report = doctor.examine(step, batch(), steps=1, warmup=1, allow_training=True)
    assert not unchanged(before, [model])
    assert report.parts.models == [model]
    first = str(report).splitlines()[0]
    assert first.startswith("Caution: ran on your own objects (allow_training=True), which trained")
    assert first.index("Locked (closure 'model')") < first.index(" ms ")
    with pytest.raises(UsageError, match="try_fixes needs copies"):
        report.try_fixes(["set_to_none"])


def test_examine_warns_when_the_step_reaches_no_parts(seed):
    weights = torch.randn(IN, OUT)

    def step(x):
        return (x @ weights).sum()

    with pytest.warns(RuntimeWarning, match="found no model or optimizer"):
        report = doctor.examine(step, batch(), steps=1, warmup=1)
    assert report.parts.all == []
    with pytest.raises(ValueError, match="needs the step's model or optimizer"):
        report.try_fixes(["set_to_none"])


def test_a_state_carried_from_step_to_step_with_its_graph_is_copied_without_it(seed):
    """An RNN's hidden state, kept from the last step and detached in the next (PyTorch's
    word-language-model example): the copy starts from its values, the user's stays as it was."""
    from accel import doctor

    rnn = torch.nn.GRU(4, 8, batch_first=True)
    opt = torch.optim.SGD(rnn.parameters(), lr=0.1)
    hidden = rnn(torch.randn(2, 3, 4))[1]  # computed with gradients

    def step(x):
        nonlocal hidden
        out, hidden = rnn(x, hidden.detach())
        loss = out.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    before = hidden
    report = doctor.examine(step, torch.randn(2, 3, 4), steps=1, warmup=1)
    assert report.step_ms > 0 and hidden is before


def test_a_compiled_model_is_described_by_the_users_class():
    model = nn.Sequential(nn.Linear(4, 4))
    compiled = torch.compile(model)
    parts = StepParts()
    parts.add(compiled, "global 'cmodel'")
    assert parts.describe() == "Sequential, compiled (global 'cmodel')"
