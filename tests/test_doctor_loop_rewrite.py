"""The doctor's rewrite of a loop of in-place tensor calls as foreach calls, against the loop."""

import copy
import itertools
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from accel import doctor
from accel.doctor.fixes import FIXES
from accel.doctor.loop_rewrite import NotRewritable, rewrite_loop

LR, DECAY = 0.1, 0.01
CLIP, AVERAGE = 0.01, 0.9  # a WGAN critic's weight clipping, an EMA's decay
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

    said = (rf"the loop `for p in model.parameters\(\):` at line {line_of(step, 'for p in')} is "
            rf"left as written: line {line_of(step, 'delta = ')} \(`delta = p.grad \* LR`\) is not "
            r"an in-place update of p")  # fmt: skip
    with pytest.raises(NotRewritable, match=said):
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
    assert "if p.grad is not None]" in trial["edit"]  # the guard negated as one would write it
    # the terminal's and the page's trials carry the edit to paste
    from accel.doctor.page import trials_html, trials_text

    assert "torch._foreach_add_" in trials_text(report)
    assert "torch._foreach_add_" in trials_html(report)


EMA_SCRIPT = """
{imports}
from torch import nn

model, ema = (nn.Sequential(nn.Linear(4, 8), *(nn.Linear(8, 8) for _ in range(6)), nn.Linear(8, 4))
              for _ in range(2))
opt = {optim}.SGD(model.parameters(), lr=0.1)


def step(x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    with no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.9)
            e.add_(p, alpha=0.1)
    return loss.detach()
"""


@pytest.mark.parametrize(("imports", "optim", "called"), [
    ("import torch as th\nno_grad = th.no_grad", "th.optim", "th._foreach_"),  # its own name
    ("from torch import no_grad, optim", "optim", "torch._foreach_"),  # none: imported in the edit
])  # fmt: skip
def test_the_edit_calls_torch_by_the_name_the_users_module_gives_it(
    seed, tmp_path, imports, optim, called
):
    import importlib.util

    path = tmp_path / "ema_script.py"
    path.write_text(EMA_SCRIPT.format(imports=imports, optim=optim))
    spec = importlib.util.spec_from_file_location("ema_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    report = doctor.examine(script.step, torch.randn(8, 4), steps=1, warmup=1)
    (row,) = report.try_fixes(["foreach_loop"], steps=2, repeats=2).to_dict("records")
    assert row["status"] == "ok", row
    added = [line[1:].strip() for line in row["edit"].splitlines()
             if line.startswith("+") and not line.startswith("+++")]  # fmt: skip
    assert any(called in line for line in added), row["edit"]
    if "th." in called:
        assert not any("torch." in line for line in added), row["edit"]
    else:
        assert added[0] == "import torch", row["edit"]
    # the edit is a patch of the file itself, with its full context: applied without fuzz, the
    # module runs as the user's is
    applied = subprocess.run(["patch", "--fuzz=0", "--force", str(path)], input=row["edit"],
                             text=True, capture_output=True)  # fmt: skip
    assert applied.returncode == 0, applied.stdout + applied.stderr + row["edit"]
    assert row["edit"].splitlines()[1] == f"+++ {path}"  # the file it patches, both sides
    spec.loader.exec_module(script)
    assert torch.isfinite(script.step(torch.randn(8, 4)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_non_finite_values_go_through_the_rewrite_as_through_the_loop(seed, dtype):
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


def clamp_data(params, averages):
    for p in params:
        p.data.clamp_(-CLIP, CLIP)


def clamp_bounds(params, averages):
    with torch.no_grad():
        for p in params:
            p.clamp_(min=-CLIP, max=CLIP)


def average_chained(params, averages):
    for e, p in zip(averages, params, strict=True):
        e.mul_(AVERAGE).add_(p, alpha=1 - AVERAGE)


def average_lerp(params, averages):
    for e, p in zip(averages, params, strict=True):
        e.data.lerp_(p.data, 1 - AVERAGE)


def average_copy(params, averages):
    for e, p in zip(averages, params, strict=True):
        e.copy_(AVERAGE * e + (1 - AVERAGE) * p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("loop", "call"), [
    (clamp_data, "torch._foreach_clamp_min_([p.data for p in tensors], -CLIP)"),
    (clamp_bounds, "torch._foreach_clamp_max_(tensors, CLIP)"),
    (average_chained, "torch._foreach_add_([e for e, p in tensors], [p for e, p in tensors], "
                      "alpha=1 - AVERAGE)"),
    (average_lerp, "torch._foreach_lerp_([e.data for e, p in tensors], [p.data for e, p in "
                   "tensors], 1 - AVERAGE)"),
    (average_copy, "torch._foreach_mul_([e for e, p in tensors], AVERAGE)"),
])  # fmt: skip
def test_clamp_and_average_loops_become_foreach_calls_non_finite_values_included(
    seed, loop, call, dtype
):
    params = [torch.randn(n, dtype=dtype) for n in (3, 17, 1)]
    averages = [torch.randn_like(p) for p in params]
    bad = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    params[1][[2, 5, 9]], averages[1][[4, 5, 11]] = bad, bad
    twin = [[t.clone() for t in ts] for ts in (params, averages)]
    rewrite = rewrite_loop(loop, line_of(loop, "_("))
    loop(params, averages)
    rewrite.step(*twin)
    for a, b in zip(params + averages, twin[0] + twin[1], strict=True):
        # the EMA's two terms rounded apart or inside one add
        torch.testing.assert_close(a, b, rtol=FIXES["foreach_loop"].rtol, atol=1e-6, equal_nan=True)
    assert call in rewrite.diff


def critic_step_for(critic, opt, clip: bool):
    def step(batch):
        real, fake = batch
        loss = critic(fake).mean() - critic(real).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if clip:
            for p in critic.parameters():
                p.data.clamp_(-CLIP, CLIP)  # weight clipping
        return loss.detach()

    return step


def average_step_for(model, opt, average: bool):
    averaged = copy.deepcopy(model)

    def step(batch):
        real, fake = batch
        loss = (model(real) - model(fake)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if average:
            with torch.no_grad():
                for e, p in zip(averaged.parameters(), model.parameters(), strict=True):
                    e.mul_(AVERAGE).add_(p, alpha=1 - AVERAGE)  # the EMA
        return loss.detach()

    return step, averaged


@pytest.mark.parametrize("with_average", [False, True])
def test_a_weight_clipping_or_ema_loop_is_found_at_its_line_and_rewritten_on_the_copy_only(
    seed, with_average
):
    widths = [16, 32, 32, 32, 16, 1]  # ten parameters
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))
    twin = copy.deepcopy(model)
    make = average_step_for if with_average else lambda m, *a: (critic_step_for(m, *a), m)
    step, kept = make(model, torch.optim.RMSprop(model.parameters(), lr=5e-5), True)
    plain, _ = make(twin, torch.optim.RMSprop(twin.parameters(), lr=5e-5), False)
    held = [t.detach().clone() for t in (*model.parameters(), *kept.parameters())]
    batch = (torch.randn(8, 16), torch.randn(8, 16) + 1)
    rng, script = torch.get_rng_state(), Path(__file__).read_bytes()
    report = doctor.examine(step, batch, steps=2, warmup=1)
    (loop,) = [f for f in report.findings if f.kind == "tensor_loop"]
    assert [s.line for s in loop.sites] == [line_of(step, "_(-CLIP" if not with_average else ".add_(p")]
    (trial,) = report.try_fixes(["foreach_loop"], repeats=2, steps=2).to_dict("records")
    assert trial["status"] in ("ok", "slower here") and trial["error"] <= trial["allowance"], trial
    assert "torch._foreach_" in trial["edit"]
    now = [t.detach() for t in (*model.parameters(), *kept.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(held, now, strict=True))
    assert torch.equal(torch.get_rng_state(), rng) and Path(__file__).read_bytes() == script
    twin = doctor.examine(plain, batch, steps=2, warmup=1)
    assert not [f for f in twin.findings if f.kind == "tensor_loop"]


def test_a_loop_left_as_written_says_which_loop_and_why_in_the_trial(seed):
    widths = [16, 32, 32, 32, 16, 3]
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))

    def step(x):
        loss = model(x).pow(2).sum()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad * LR)
                print_norm = p.norm()  # noqa: F841
        return loss.detach()

    report = doctor.examine(step, torch.randn(8, 16), steps=2, warmup=1)
    (trial,) = report.try_fixes(["foreach_loop"], repeats=2, steps=2).to_dict("records")
    assert trial["status"].startswith(
        f"not applicable: the loop `for p in model.parameters():` at line {line_of(step, 'for p')} "
        f"is left as written: line {line_of(step, 'print_norm')} (`print_norm = p.norm()`) is not "
        "an in-place update of p"
    ), trial["status"]


def test_the_loops_of_one_step_are_rewritten_in_one_edit_and_one_left_as_written_says_why(seed):
    def step(params, averages, kept):
        for p in params:
            p.clamp_(-CLIP, CLIP)
        for e, p in zip(averages, params, strict=True):
            e.lerp_(p, 1 - AVERAGE)
        for p in params:
            kept.append(p.sum())

    lines = [line_of(step, text) for text in ("p.clamp_(", "e.lerp_(", "kept.append(")]
    rewrite = rewrite_loop(step, *lines)
    params = [torch.randn(n) for n in (3, 17, 1)]
    averages = [torch.randn_like(p) for p in params]
    twin = [[t.clone() for t in ts] for ts in (params, averages)]
    step(params, averages, [])
    rewrite.step(*twin, [])
    for a, b in zip(params + averages, twin[0] + twin[1], strict=True):
        torch.testing.assert_close(a, b, rtol=FIXES["foreach_loop"].rtol, atol=1e-6)
    assert rewrite.diff.count("+++ ") == 1 and "_foreach_clamp_max_" in rewrite.diff
    assert "_foreach_lerp_" in rewrite.diff
    assert rewrite.refused == [
        f"the loop `for p in params:` at line {lines[2] - 1} is left as written: line {lines[2]} "
        "(`kept.append(p.sum())`) is not an in-place update of p (.add_(...), .mul_(...), "
        ".lerp_(...), .clamp_(...), -= and the like), which one foreach call makes on every item "
        "at once"
    ]


def ema_over_state_for(model: nn.Module, ema: nn.Module):
    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for e, p in zip(ema.state_dict().values(), model.state_dict().values(), strict=True):
                e.mul_(AVERAGE).add_(p, alpha=1 - AVERAGE)
        return loss.detach()

    return step


def test_a_rewritten_loop_refuses_items_that_share_memory(seed):
    """Tied weights list one tensor twice: the loop updates it in turn, one foreach call would
    apply both multiplies before both adds."""
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    model[1].weight = model[0].weight  # tied, as a language model's head and embedding
    ema = copy.deepcopy(model)
    step = ema_over_state_for(model, ema)
    rewrite = rewrite_loop(step, line_of(step, "e.mul_("))
    with pytest.raises(RuntimeError, match="share memory"):
        rewrite.step(torch.randint(0, 6, (5,)))


def test_a_rewritten_loop_refuses_integer_items_it_would_change_otherwise(seed):
    """A BatchNorm's step counter is an integer: `copy_` truncates into it, foreach arithmetic
    cannot; the trial says so instead of a cast error."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ema = copy.deepcopy(model)
    step = ema_over_state_for(model, ema)
    rewrite = rewrite_loop(step, line_of(step, "e.mul_("))
    with pytest.raises(RuntimeError, match="integer"):
        rewrite.step(torch.randn(5, 4))


def test_a_loop_in_a_function_the_step_calls_is_named_as_such():
    def update(ema, model):
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.lerp_(p, 0.1)

    def step(x):
        update(x, x)

    with pytest.raises(NotRewritable, match="outside the step function"):
        rewrite_loop(step, line_of(update, "e.lerp_("))


def test_the_edit_numbers_its_lines_as_the_file_does(seed):
    model = nn.Linear(4, 3)
    step = sgd_step_for(model)
    line = line_of(step, "p.add_(")
    diff = rewrite_loop(step, line).diff
    hunk = next(text for text in diff.splitlines() if text.startswith("@@"))
    start = int(hunk.split()[1].split(",")[0].lstrip("-"))
    assert start <= line_of(step, "for p in model.parameters()") <= start + 6


# ---- gradient clipping one tensor at a time ----------------------------------------------------
def clip_step_for(model: nn.Module, opt, form: str):
    def step(x):
        loss = model(x).pow(2).sum() * 100  # large gradients: every clip binds
        opt.zero_grad()
        loss.backward()
        if form == "list":
            for p in model.parameters():
                torch.nn.utils.clip_grad_norm_([p], 0.5)  # each to its own norm
        elif form == "named":
            for param_name, param in model.named_parameters():
                if "bias" in param_name and param.grad is None:
                    continue
                nn.utils.clip_grad_norm_(param, max_norm=0.5, norm_type=float("inf"))
        opt.step()
        return loss.detach()

    return step


@pytest.mark.parametrize("form", ["list", "named"])
def test_a_clip_per_tensor_loop_is_rewritten_as_one_pass_that_clips_each_to_its_own_norm(seed, form):
    from accel.doctor.loop_rewrite import rewrite_clip_loop

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].bias.requires_grad_(False)  # no gradient: the loop's clip leaves it alone
    twin = copy.deepcopy(model)
    step = clip_step_for(model, torch.optim.SGD(model.parameters(), lr=LR), form)
    plain = clip_step_for(twin, torch.optim.SGD(twin.parameters(), lr=LR), form)
    rewrite = rewrite_clip_loop(plain, line_of(plain, "clip_grad_norm_(param" if form == "named" else "[p]"))
    for _ in range(3):
        x = torch.randn(5, 4)
        torch.testing.assert_close(step(x), rewrite.step(x))
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    norm = "float('inf')" if form == "named" else ""
    assert f"norms = torch.stack(torch._foreach_norm(grads{', ' if norm else ''}{norm}))" in rewrite.diff
    assert "torch._foreach_mul_(grads, (0.5 / (norms + 1e-06)).clamp(max=1.0).unbind())" in rewrite.diff
    assert "-                torch.nn.utils.clip_grad_norm_([p], 0.5)" in rewrite.diff or form == "named"
    # the loop's own names, the guard kept
    assert form == "list" or ("grads = [param.grad for param_name, param in model.named_parameters() "
                              "if not ('bias' in param_name and param.grad is None) and "
                              "param.grad is not None]") in rewrite.diff


def test_a_clip_loop_that_keeps_the_norm_or_checks_it_is_left_as_written(seed):
    from accel.doctor.loop_rewrite import rewrite_clip_loop

    model = nn.Linear(4, 2)

    def step(x):
        model(x).sum().backward()
        norms = []
        for p in model.parameters():
            norms.append(torch.nn.utils.clip_grad_norm_([p], 1.0))
        for p in model.parameters():
            torch.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
        return norms

    for text in ("norms.append", "error_if_nonfinite"):
        with pytest.raises(NotRewritable, match="clip_grad_norm_"):
            rewrite_clip_loop(step, line_of(step, text))


def test_the_batched_clip_fix_pastes_the_rewrite_it_measured(seed):
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))
    step = clip_step_for(model, torch.optim.SGD(model.parameters(), lr=LR), "list")
    held = [p.detach().clone() for p in model.parameters()]
    report = doctor.examine(step, torch.randn(8, 16), steps=2, warmup=1)
    (clip,) = [f for f in report.findings if f.kind == "clip_loop"]
    assert clip.fixes == ("batched_clip",)
    (trial,) = report.try_fixes(["batched_clip"], repeats=2, steps=2).to_dict("records")
    assert trial["status"] in ("ok", "slower here") and trial["error"] <= trial["allowance"], trial
    assert "torch._foreach_norm(grads)" in trial["edit"] and "+++ " in trial["edit"]
    assert all(torch.equal(a, b) for a, b in zip(held, model.parameters(), strict=True))


def test_the_clip_edit_takes_names_the_step_does_not_use_and_a_guard_written_as_a_block(seed):
    from accel.doctor.loop_rewrite import rewrite_clip_loop

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    twin = copy.deepcopy(model)

    def step_for(net):
        def step(x):
            norms = {"scale": 2.0}  # the step's own names: the edit must not take them
            grads = None  # noqa: F841
            (net(x).pow(2).sum() * 100 * norms["scale"]).backward()
            for p in net.parameters():
                if p.grad is not None:
                    torch.nn.utils.clip_grad_norm_([p], 0.5)
            return norms["scale"]

        return step

    step, plain = step_for(model), step_for(twin)
    rewrite = rewrite_clip_loop(plain, line_of(plain, "clip_grad_norm_"))
    assert "grads_2 = [p.grad for p in net.parameters() if p.grad is not None]" in rewrite.diff
    assert "norms_2 = torch.stack(torch._foreach_norm(grads_2))" in rewrite.diff
    x = torch.randn(5, 4)
    assert step(x) == rewrite.step(x)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_a_loop_whose_variable_is_read_after_it_is_left_as_written(seed):
    from accel.doctor.loop_rewrite import rewrite_clip_loop

    model = nn.Linear(4, 2)

    def step(x):
        model(x).sum().backward()
        for p in model.parameters():
            torch.nn.utils.clip_grad_norm_([p], 1.0)
        return p.grad.sum()  # the last item, after the loop

    with pytest.raises(NotRewritable, match=r"reads p after the loop"):
        rewrite_clip_loop(step, line_of(step, "clip_grad_norm_"))


def test_a_clip_loop_that_reads_the_norms_is_not_batched_and_says_why(seed):
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(x):
        loss = model(x).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        total = 0.0
        for p in model.parameters():
            total += torch.nn.utils.clip_grad_norm_([p], 1.0) ** 2  # the norms, logged
        opt.step()
        return loss.detach() + 0 * total

    report = doctor.examine(step, torch.randn(8, 16), steps=2, warmup=1)
    (trial,) = report.try_fixes(["batched_clip"], repeats=2, steps=2).to_dict("records")
    assert trial["status"].startswith("not applicable") and "reads each clip's norm" in trial["status"]


def test_a_clip_loop_in_a_step_whose_source_is_not_a_function_is_batched_as_it_runs(seed):
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    class Step:  # a callable object: no function source to rewrite
        def __call__(self, x):
            return clip_step_for(model, opt, "list")(x)

    report = doctor.examine(Step(), torch.randn(8, 16), steps=2, warmup=1)
    (trial,) = report.try_fixes(["batched_clip"], repeats=2, steps=2).to_dict("records")
    assert trial["status"] in ("ok", "slower here") and trial["edit"] == "", trial
