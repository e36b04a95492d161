"""The doctor's rewrite of a loop of in-place tensor calls as foreach calls, against the loop."""

import copy
import itertools

import pytest
import torch
from torch import nn

from accel import doctor
from accel.doctor.loop_rewrite import NotRewritable, rewrite_loop

LR, DECAY = 0.1, 0.01
seen = 0


def line_of(function, text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def sgd_step_for(model: nn.Module):
    carried = torch.randn(3)

    def step(x):
        nonlocal carried
        global seen
        loss = (model(x) + carried).pow(2).sum()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is None:
                    continue
                p.mul_(1 - LR * DECAY)
                p.add_(p.grad, alpha=-LR)  # the update
        carried = carried * 0.5
        seen += 1
        return loss.detach()

    return step


@pytest.mark.parametrize("frozen", [False, True])
def test_the_rewritten_loop_updates_every_tensor_as_the_loop_does(seed, frozen):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].bias.requires_grad_(not frozen)  # a tensor without a gradient: the guard skips it
    twin = copy.deepcopy(model)
    step, step_twin = sgd_step_for(model), sgd_step_for(twin)
    step_twin.__closure__[0].cell_contents = step.__closure__[0].cell_contents.clone()
    rewrite = rewrite_loop(step_twin, line_of(step_twin, "p.add_("))
    before = seen
    for _ in range(3):
        x = torch.randn(5, 4)
        assert torch.equal(step(x), rewrite.step(x))
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    assert seen == before + 6  # the global and the nonlocal state are the step's own
    assert "torch._foreach_mul_(tensors, 1 - LR * DECAY)" in rewrite.diff
    assert "torch._foreach_add_(tensors, [p.grad for p in tensors], alpha=-LR)" in rewrite.diff
    assert "-                p.add_(p.grad, alpha=-LR)  # the update" in rewrite.diff


def test_a_tutorials_manual_update_with_augmented_assignments_is_rewritten(seed):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    twin = copy.deepcopy(model)

    def step_for(net):
        def step(x):
            loss = net(x).pow(2).mean()
            net.zero_grad()
            loss.backward()
            with torch.no_grad():
                for param in net.parameters():
                    param -= LR * param.grad
                    param *= 1 - DECAY
            return loss.detach()

        return step

    step, twin_step = step_for(model), step_for(twin)
    rewrite = rewrite_loop(twin_step, line_of(twin_step, "param -= "))
    for _ in range(3):
        x = torch.randn(5, 4)
        assert torch.allclose(step(x), rewrite.step(x), rtol=1e-5)  # lr * g rounded apart or not
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)  # c * g at once vs in the add: rounding
    diff = rewrite.diff
    assert "torch._foreach_sub_(tensors, [param.grad for param in tensors], alpha=LR)" in diff
    assert "torch._foreach_mul_(tensors, 1 - DECAY)" in diff


def test_a_loop_with_other_statements_is_not_rewritten_and_says_which_line():
    model = nn.Linear(2, 2)

    def step(x):
        for p in model.parameters():
            delta = p.grad * LR
            p.sub_(delta)
        return x

    with pytest.raises(NotRewritable, match=rf"line {line_of(step, 'delta = ')} is not an in-place"):
        rewrite_loop(step, line_of(step, "p.sub_("))
    with pytest.raises(NotRewritable, match="no for loop"):
        rewrite_loop(step, line_of(step, "return x"))


def test_a_keyword_that_depends_on_the_item_is_not_rewritten():
    model = nn.Linear(2, 2)

    def step():
        for p in model.parameters():
            p.add_(p.grad, alpha=-p.numel())

    with pytest.raises(NotRewritable, match="keyword depends on p"):
        rewrite_loop(step, line_of(step, "p.add_("))


def test_try_fixes_rewrites_the_loop_measures_it_and_hands_the_edit(seed):
    widths = [16, 32, 32, 32, 16, 3]  # ten parameters: a loop over them is worth a finding
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))
    step = sgd_step_for(model)
    code = step.__code__
    report = doctor.examine(step, torch.randn(8, 16), steps=2, warmup=1)
    loops = [f for f in report.findings if f.kind == "tensor_loop"]
    assert loops and "foreach_loop" in loops[0].fixes
    trials = report.try_fixes(["foreach_loop"], repeats=3, steps=2)
    (trial,) = trials[trials["fixes"] == "foreach_loop"].to_dict("records")
    assert trial["status"] in ("ok", "slower here"), trial
    assert step.__code__ is code  # the user's step is left as it was
    assert "torch._foreach_add_" in trial["edit"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_non_finite_values_go_through_the_rewrite_as_through_the_loop(seed, dtype):
    def update(weights, grads):
        for w, g in zip(weights, grads, strict=True):
            w.add_(g, alpha=-LR)

    def step(weights):
        for w in weights:
            w.mul_(1 - DECAY)
            w.addcmul_(w, w, value=-LR)

    weights = [torch.randn(n, dtype=dtype) for n in (3, 17, 1)]
    weights[1][[2, 5, 9]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    twin = [w.clone() for w in weights]
    rewrite = rewrite_loop(step, line_of(step, "w.mul_("))
    step(weights)
    rewrite.step(twin)
    for a, b in zip(weights, twin, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True)  # bf16: foreach may round otherwise
    with pytest.raises(NotRewritable, match="not `for name in items:`"):
        rewrite_loop(update, line_of(update, "w.add_("))
