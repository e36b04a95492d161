"""MultiTensorAdamW (one launch for every group) against torch.optim.AdamW and its reference."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from accel import graphs
from accel.optim import MultiTensorAdamW, adamw_reference

CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not (CUDA and HAS_TRITON), reason="needs a CUDA GPU and Triton")
# float32 rounding over a few steps: lerp and the bias corrections are computed in another order
TOL = {"atol": 2e-6, "rtol": 2e-5}
# odd sizes: one element, less than a block, one block and a bit, several blocks and a remainder
SHAPES = [(1,), (7, 3), (2049,), (3, 1500)]


def make_params(device, gen, shapes=SHAPES, dtype=torch.float32):
    return [torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in shapes]


def groups_of(params, lrs=(1e-2, 3e-3), wds=(0.1, 0.0)):
    """Two groups with their own learning rate and weight decay."""
    cut = len(params) // 2
    return [
        {"params": params[:cut], "lr": lrs[0], "weight_decay": wds[0]},
        {"params": params[cut:], "lr": lrs[1], "weight_decay": wds[1]},
    ]


def run_steps(optimizer, params, gen, steps=4, between=None):
    for i in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
        if between is not None:
            between(optimizer, i)
        optimizer.step()


def twins(device, seed, **kw):
    """Equal parameters for MultiTensorAdamW and torch's AdamW, and a generator per side."""
    ours = make_params(device, torch.Generator().manual_seed(seed))
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    betas = kw.pop("betas", (0.9, 0.95))
    return (
        ours,
        theirs,
        MultiTensorAdamW(groups_of(ours), betas=betas, eps=1e-8, **kw),
        torch.optim.AdamW(groups_of(theirs), betas=betas, eps=1e-8, foreach=False),
    )


@pytest.mark.parametrize("implementation", ["auto", "reference"])
def test_equals_torch_adamw_over_several_steps(kdev, seed, implementation):
    ours, theirs, opt, ref = twins(kdev, seed, implementation=implementation)
    assert opt.uses_kernel == (implementation == "auto")
    run_steps(opt, ours, torch.Generator().manual_seed(seed + 1))
    run_steps(ref, theirs, torch.Generator().manual_seed(seed + 1))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"], **TOL)
    assert float(opt.step_count) == 4


def test_tensor_learning_rates_can_change_between_steps(kdev, seed):
    ours, theirs, opt, ref = twins(kdev, seed)
    for g in opt.param_groups:
        g["lr"] = torch.tensor(g["lr"], device=kdev)

    def decay(optimizer, i):
        for g in optimizer.param_groups:
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].mul_(0.5)  # in place: what a graph sees
            else:
                g["lr"] *= 0.5

    run_steps(opt, ours, torch.Generator().manual_seed(seed + 1), between=decay)
    run_steps(ref, theirs, torch.Generator().manual_seed(seed + 1), between=decay)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_parameters_without_gradients_are_left_alone(kdev, seed):
    gen = torch.Generator().manual_seed(seed)
    params = make_params(kdev, gen)
    opt = MultiTensorAdamW(groups_of(params))
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(kdev)
    params[1].grad = None
    opt.step()
    assert torch.equal(params[1], before[1]) and params[1] not in opt.state
    assert not torch.equal(params[0], before[0])  # and the others moved


def test_reference_equals_torch_on_one_tensor(seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(33, generator=gen)
    q = p.clone().requires_grad_()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    torch_opt = torch.optim.AdamW([q], lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)
    for step in range(1, 4):
        g = torch.randn(33, generator=gen)
        q.grad = g.clone()
        torch_opt.step()
        adamw_reference(
            [p], [g], [m], [v], [0],
            step=torch.tensor(float(step)), lrs=torch.tensor([1e-2]),
            weight_decays=torch.tensor([0.3]), betas=(0.8, 0.9), eps=1e-6,
        )  # fmt: skip
    torch.testing.assert_close(p, q.detach(), **TOL)


def test_falls_back_to_the_reference_with_a_warning(monkeypatch, seed):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(seed)
    if not CUDA:
        with pytest.warns(RuntimeWarning, match="the kernel needs CUDA"):
            opt = MultiTensorAdamW(make_params("cpu", gen))
        assert not opt.uses_kernel
        with pytest.raises(RuntimeError, match=r"implementation='triton'.*needs CUDA"):
            MultiTensorAdamW(make_params("cpu", gen), implementation="triton")
    device = "cuda" if CUDA else "cpu"
    with pytest.warns(RuntimeWarning, match="using the reference"):
        half = MultiTensorAdamW(make_params(device, gen, dtype=torch.float64))
    assert not half.uses_kernel


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"betas": (1.0, 0.9)}, "expected 0 <= betas < 1"),
        ({"implementation": "fast"}, "implementation must be"),
    ],
)
def test_bad_arguments(kwargs, match, seed):
    with pytest.raises(ValueError, match=match):
        MultiTensorAdamW(make_params("cpu", torch.Generator().manual_seed(seed)), **kwargs)


def test_groups_must_share_betas_and_eps(seed):
    params = make_params("cpu", torch.Generator().manual_seed(seed))
    groups = groups_of(params)
    groups[1]["betas"] = (0.8, 0.9)
    with pytest.raises(ValueError, match="every group must share betas and eps"):
        MultiTensorAdamW(groups, implementation="reference")


@needs_cuda
def test_graphed_step_equals_eager_over_many_replays(seed):
    gen = torch.Generator().manual_seed(seed)
    eager_params = make_params("cuda", gen, shapes=[(4096, 33), (5,), (1000, 7)])
    graph_params = [p.detach().clone().requires_grad_() for p in eager_params]
    lr = torch.tensor(1e-2, device="cuda")
    eager = MultiTensorAdamW([{"params": eager_params, "lr": lr.clone()}])
    graphed_opt = MultiTensorAdamW([{"params": graph_params, "lr": lr}])
    for p in eager_params + graph_params:
        p.grad = torch.zeros_like(p)
    graphed = graphs.GraphedOptimizerStep(graphed_opt)
    for _ in range(20):
        fresh = [torch.randn(p.shape, generator=gen).cuda() for p in eager_params]
        for p, q, g in zip(eager_params, graph_params, fresh, strict=True):
            p.grad.copy_(g)
            q.grad.copy_(g)  # in place: the graph reads these addresses
        eager.step()
        graphed()
    assert graphed.graphed.graphs == 1
    for a, b in zip(eager_params, graph_params, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
