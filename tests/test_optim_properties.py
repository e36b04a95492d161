"""MultiTensorAdamW against torch.optim.AdamW over generated runs: groups added on the way,
parameters frozen (no gradient) on some steps, NaN and inf gradients, weight decay per group,
both lerp branches of the first moment (beta1 below and above 0.5), and a save and resume in the
middle; on the reference path and on the kernel's (Triton's interpreter on a CPU, compiled on a
GPU). Each run matches torch's within test_optim's tolerance, NaN where torch has NaN, and a run
saved and resumed equals the same run uninterrupted exactly.
"""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accel.optim import MultiTensorAdamW

# the same float32 rounding differences as test_optim's TOL, over at most eight steps
TOL = {"atol": 2e-6, "rtol": 2e-5, "equal_nan": True}
# one element, less than a block, a block and a bit, several blocks (the kernel's BLOCK is 1024)
SHAPES = [(1,), (5, 3), (1030,), (3, 700)]
SETTINGS = dict(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

steps = st.tuples(
    st.just("step"),
    st.frozensets(st.integers(0, 5), max_size=3),  # the parameters without a gradient
    st.sampled_from([None, None, float("nan"), float("inf"), -float("inf")]),
)
# mostly steps, a group added or a resume now and then
events = st.lists(
    st.one_of(steps, steps, steps, st.just(("add",)), st.just(("resume",))), min_size=4, max_size=8
)


@st.composite
def runs(draw):
    return dict(
        shapes=draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=4)),
        late_shapes=draw(st.lists(st.sampled_from(SHAPES), min_size=3, max_size=3)),
        groups=draw(st.integers(1, 2)),
        lrs=draw(st.lists(st.sampled_from([1e-3, 1e-2, 0.1]), min_size=5, max_size=5)),
        decays=draw(st.lists(st.sampled_from([0.0, 0.05, 0.3]), min_size=5, max_size=5)),
        betas=draw(st.sampled_from([(0.9, 0.999), (0.8, 0.9), (0.3, 0.95), (0.0, 0.99)])),
        events=draw(events),
        seed=draw(st.integers(0, 2**16)),
    )


def through_bytes(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def play(make, run, device, *, resume=True):
    """The parameters and the optimizer after ``run``'s events, with ``make(groups, betas)``
    building the optimizer (again at each resume, from its saved state)."""
    seed = run["seed"]

    def param(shape, i):
        gen = torch.Generator().manual_seed(seed * 31 + i)
        return torch.randn(shape, generator=gen).to(device).requires_grad_()

    params = [param(s, i) for i, s in enumerate(run["shapes"])]
    cut = -(-len(params) // run["groups"])
    groups = [
        {"params": params[i : i + cut], "lr": run["lrs"][k], "weight_decay": run["decays"][k]}
        for k, i in enumerate(range(0, len(params), cut))
    ]
    opt = make(groups, run["betas"])
    late = list(run["late_shapes"])
    for n, event in enumerate(run["events"]):
        if event[0] == "add" and late:
            k = len(opt.param_groups)
            params.append(param(late.pop(), 100 + n))
            opt.add_param_group(
                {"params": [params[-1]], "lr": run["lrs"][k], "weight_decay": run["decays"][k]}
            )
        elif event[0] == "resume" and resume:
            saved = through_bytes(opt.state_dict())
            keep = ("params", "lr", "weight_decay")
            opt = make([{k: g[k] for k in keep} for g in opt.param_groups], run["betas"])
            opt.load_state_dict(saved)
        elif event[0] == "step":
            _, frozen, odd = event
            gen = torch.Generator().manual_seed(seed * 31 + 1000 + n)
            for i, p in enumerate(params):
                g = torch.randn(p.shape, generator=gen)  # drawn for every parameter, same order
                if odd is not None and i == n % len(params):
                    g.view(-1)[n % g.numel()] = odd
                p.grad = None if i in frozen else g.to(device)
            opt.step()
    return params, opt


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's NaN
@pytest.mark.parametrize("implementation", ["auto", "reference"])
@settings(**SETTINGS)
@given(run=runs())
def test_equals_torch_adamw_and_resumes_exactly(kdev, implementation, run):
    def ours(groups, betas):
        return MultiTensorAdamW(groups, betas=betas, eps=1e-8, implementation=implementation)

    def torchs(groups, betas):
        return torch.optim.AdamW(groups, betas=betas, eps=1e-8)

    mine, opt = play(ours, run, kdev)
    assert opt.uses_kernel == (implementation == "auto")
    theirs, ref = play(torchs, run, kdev)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, **TOL)
        assert (a in opt.state) == (b in ref.state)
        for key, value in opt.state.get(a, {}).items():
            torch.testing.assert_close(value, ref.state[b][key].to(value.device), **TOL)
    uninterrupted, _ = play(ours, run, kdev, resume=False)
    for a, b in zip(mine, uninterrupted, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)
