"""MultiTensorAdamW (one launch for every group) against torch.optim.AdamW and its reference."""

from __future__ import annotations

import importlib.util
import io
import re

import pytest
import torch

from accel import graphs, triton_support
from accel.optim import MultiTensorAdamW, adamw_reference, load_state_in_place

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
    assert all(float(opt.state[p]["step"]) == 4 for p in ours)


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
    m, v, step = torch.zeros_like(p), torch.zeros_like(p), torch.tensor(0.0)
    torch_opt = torch.optim.AdamW([q], lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)
    for _ in range(3):
        g = torch.randn(33, generator=gen)
        q.grad = g.clone()
        torch_opt.step()
        adamw_reference(
            [p], [g], [m], [v], [step], [0], lrs=torch.tensor([1e-2]),
            weight_decays=torch.tensor([0.3]), betas=(0.8, 0.9), eps=1e-6,
        )  # fmt: skip
    torch.testing.assert_close(p, q.detach(), **TOL)
    assert float(step) == 3


@pytest.mark.triton
def test_falls_back_to_the_reference_with_a_warning(monkeypatch, seed):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(seed)
    if not CUDA:  # the reason: Triton missing, or (installed) CPU tensors without its interpreter
        why = re.escape(triton_support.unavailable("cpu"))
        with pytest.warns(RuntimeWarning, match=why):
            opt = MultiTensorAdamW(make_params("cpu", gen))
        assert not opt.uses_kernel
        with pytest.raises(RuntimeError, match=rf"implementation='triton'.*{why}"):
            MultiTensorAdamW(make_params("cpu", gen), implementation="triton")
    device = "cuda" if CUDA else "cpu"
    with pytest.warns(RuntimeWarning, match="using the reference"):
        half = MultiTensorAdamW(make_params(device, gen, dtype=torch.bfloat16))
    assert not half.uses_kernel


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"betas": (1.0, 0.9)}, r"expected two betas with 0 <= beta < 1, got \(1.0, 0.9\)"),
        ({"lr": -1e-3}, "expected lr >= 0, got -0.001"),
        ({"lr": torch.tensor(-1e-3)}, "expected lr >= 0"),
        ({"lr": torch.ones(2)}, "a tensor lr must hold one value"),
        ({"weight_decay": -0.1}, "expected weight_decay >= 0, got -0.1"),
        ({"eps": -1e-8}, "expected eps >= 0"),
        ({"implementation": "fast"}, "implementation must be"),
    ],
)
def test_bad_arguments(kwargs, match, seed):
    with pytest.raises(ValueError, match=match):
        MultiTensorAdamW(make_params("cpu", torch.Generator().manual_seed(seed)), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": "1e-3"}, r"lr must be a number, got '1e-3' \(str\)"),
        ({"lr": True}, r"lr must be a number, got True \(bool\)"),
        ({"eps": "x"}, r"eps must be a number, got 'x' \(str\)"),
        ({"weight_decay": None}, r"weight_decay must be a number, got None \(NoneType\)"),
        ({"betas": 0.9}, r"betas must be two numbers, got 0.9 \(float\)"),
        ({"betas": ("0.9", 0.99)}, r"betas\[0\] must be a number, got '0.9' \(str\)"),
    ],
)
def test_hyperparameters_of_the_wrong_type_are_refused_saying_what_came(kwargs, match, seed):
    """torch.optim.AdamW refuses these too; here each says what was expected, and a string
    learning rate is not read as a number."""
    with pytest.raises(TypeError, match=match):
        MultiTensorAdamW(make_params("cpu", torch.Generator().manual_seed(seed)), **kwargs)


@pytest.mark.parametrize("implementation", ["auto", "reference"])
def test_sparse_gradients_are_refused_as_torch_adamw_refuses_them(implementation, recwarn):
    embedding = torch.nn.Embedding(11, 4, sparse=True)
    opt = MultiTensorAdamW(embedding.parameters(), implementation=implementation)
    embedding(torch.tensor([1, 5, 5])).sum().backward()
    with pytest.raises(RuntimeError, match=r"sparse gradients.*SparseAdam"):
        opt.step()
    assert all(float(s["step"]) == 0 for s in opt.state.values())  # nothing stepped


def test_a_group_added_later_is_checked_as_the_first_ones(recwarn):
    """One launch takes betas and eps once: a later group with its own would be stepped with the
    first group's, so it is refused, and the optimizer stays as it was."""
    opt = MultiTensorAdamW([torch.nn.Parameter(torch.randn(3))], implementation="reference")
    for bad, match in [
        ({"betas": (0.5, 0.6)}, "every group must share betas and eps"),
        ({"eps": 1e-3}, "every group must share betas and eps"),
        ({"lr": -1.0}, r"expected lr >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], **bad})
        assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="parameters on one device"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, device="meta"))]})
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "lr": 0.5})
    assert len(opt.param_groups) == 2
    theirs = torch.optim.AdamW([{"params": g["params"]} for g in opt.param_groups])
    theirs.param_groups[1]["betas"] = (0.5, 0.6)
    with pytest.raises(ValueError, match="every group must share betas and eps"):
        opt.load_state_dict(theirs.state_dict())


def test_a_group_with_a_negative_learning_rate_is_refused(seed):
    groups = groups_of(make_params("cpu", torch.Generator().manual_seed(seed)), lrs=(1e-3, -1e-3))
    with pytest.raises(ValueError, match=r"expected lr >= 0, got -0\.001"):
        MultiTensorAdamW(groups, implementation="reference")


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
    graphed = graphs.GraphedStep(graphed_opt.step, device="cuda")
    for _ in range(20):
        fresh = [torch.randn(p.shape, generator=gen).cuda() for p in eager_params]
        for p, q, g in zip(eager_params, graph_params, fresh, strict=True):
            p.grad.copy_(g)
            q.grad.copy_(g)  # in place: the graph reads these addresses
        eager.step()
        graphed()
    assert graphed.graphs == 1
    for a, b in zip(eager_params, graph_params, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _grads(params, seed, steps):
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(p.shape, generator=gen).to(p.device) for p in params] for _ in range(steps)
    ]


def _step_with(optimizer, params, grads):
    """A step per list of gradients; a None gradient skips its parameter on that step."""
    for g_list in grads:
        for p, g in zip(params, g_list, strict=True):
            p.grad = None if g is None else g.clone()
        optimizer.step()


def _through_bytes(state: dict) -> dict:
    """A state_dict as a checkpoint file gives it back."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("implementation", ["auto", "reference"])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_saved_and_resumed_equals_uninterrupted(kdev, seed, implementation, tensor_lr):
    def fresh(params):
        groups = groups_of(params)
        if tensor_lr:
            for g in groups:
                g["lr"] = torch.tensor(g["lr"], device=kdev)
        return MultiTensorAdamW(groups, implementation=implementation)

    start = make_params(kdev, torch.Generator().manual_seed(seed))
    grads = _grads(start, seed + 1, steps=10)
    whole = [p.detach().clone().requires_grad_() for p in start]
    _step_with(fresh(whole), whole, grads)

    first = [p.detach().clone().requires_grad_() for p in start]
    opt = fresh(first)
    _step_with(opt, first, grads[:5])
    saved = _through_bytes(opt.state_dict())
    resumed = [p.detach().clone().requires_grad_() for p in first]
    opt = fresh(resumed)
    opt.load_state_dict(saved)
    assert all(float(s["step"]) == 5 for s in opt.state.values())
    _step_with(opt, resumed, grads[5:])
    for a, b in zip(resumed, whole, strict=True):
        assert torch.equal(a, b)


def test_a_state_without_its_step_count_is_refused(seed):
    params = make_params("cpu", torch.Generator().manual_seed(seed))
    opt = MultiTensorAdamW(params, implementation="reference")
    _step_with(opt, params, _grads(params, seed, steps=2))
    saved = opt.state_dict()
    for state in saved["state"].values():
        del state["step"]
    with pytest.raises(ValueError, match=r"parameter 0 of group 0 has no \['step'\]"):
        MultiTensorAdamW(params, implementation="reference").load_state_dict(saved)


def test_torch_adamw_state_resumes_in_multi_tensor_adamw_and_back(seed):
    start = make_params("cpu", torch.Generator().manual_seed(seed))
    grads = _grads(start, seed + 1, steps=6)
    whole = [p.detach().clone().requires_grad_() for p in start]
    _step_with(torch.optim.AdamW(whole, foreach=False), whole, grads)
    # torch's AdamW for 2 steps, ours for 2, torch's again for 2
    params = [p.detach().clone().requires_grad_() for p in start]
    theirs = torch.optim.AdamW(params, foreach=False)
    _step_with(theirs, params, grads[:2])
    ours = MultiTensorAdamW(params, implementation="reference")
    ours.load_state_dict(_through_bytes(theirs.state_dict()))
    _step_with(ours, params, grads[2:4])
    theirs = torch.optim.AdamW(params, foreach=False)
    theirs.load_state_dict(_through_bytes(ours.state_dict()))
    _step_with(theirs, params, grads[4:])
    for a, b in zip(params, whole, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("foreach", [False, None])
def test_a_fresh_multi_tensor_adamw_state_steps_on_in_torch_adamw(seed, foreach):
    """Saved on a CPU it says capturable=False, as torch can step it there; loading a torch
    state leaves ours capturable, as it is by construction."""
    start = make_params("cpu", torch.Generator().manual_seed(seed))
    grads = _grads(start, seed + 1, steps=4)
    whole = [p.detach().clone().requires_grad_() for p in start]
    _step_with(torch.optim.AdamW(whole, foreach=False), whole, grads)
    params = [p.detach().clone().requires_grad_() for p in start]
    ours = MultiTensorAdamW(params, implementation="reference")
    _step_with(ours, params, grads[:2])
    theirs = torch.optim.AdamW(params, foreach=foreach)
    theirs.load_state_dict(_through_bytes(ours.state_dict()))
    _step_with(theirs, params, grads[2:])
    for a, b in zip(params, whole, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    again = MultiTensorAdamW(params, implementation="reference")
    again.load_state_dict(_through_bytes(theirs.state_dict()))
    assert all(g["capturable"] for g in again.param_groups)


def test_a_torch_state_whose_parameters_skipped_steps_resumes_as_torch(seed):
    """Parameters with their own step counts (some had no gradient on some steps) resume in
    MultiTensorAdamW each with its own, as in torch's AdamW."""
    start = make_params("cpu", torch.Generator().manual_seed(seed))
    grads = _grads(start, seed + 1, steps=5)
    for g_list in grads[:2]:
        g_list[1] = None  # skipped by both
    whole = [p.detach().clone().requires_grad_() for p in start]
    _step_with(torch.optim.AdamW(whole, foreach=False), whole, grads)
    params = [p.detach().clone().requires_grad_() for p in start]
    theirs = torch.optim.AdamW(params, foreach=False)
    _step_with(theirs, params, grads[:3])
    ours = MultiTensorAdamW(params, implementation="reference")
    ours.load_state_dict(_through_bytes(theirs.state_dict()))
    assert [float(ours.state[p]["step"]) for p in params] == [3, 1, 3, 3]
    _step_with(ours, params, grads[3:])
    for a, b in zip(params, whole, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("make", ["ours", "torch"])
def test_a_load_copies_into_the_state_tensors_it_has(make, seed):
    # a CUDA graph captured before the load reads these addresses
    params = make_params("cpu", torch.Generator().manual_seed(seed))
    groups = groups_of(params)
    for g in groups:
        g["lr"] = torch.tensor(g["lr"])
    if make == "ours":
        opt = MultiTensorAdamW(groups, implementation="reference")
    else:
        opt = load_state_in_place(torch.optim.AdamW(groups, foreach=False))
    grads = _grads(params, seed, steps=3)
    _step_with(opt, params, grads[:1])
    saved = _through_bytes(opt.state_dict())
    kept = {k: v for s in opt.state.values() for k, v in s.items()}
    held = {id(t) for s in opt.state.values() for t in s.values()}
    lrs = [g["lr"] for g in opt.param_groups]
    expected = [v.clone() for s in saved["state"].values() for v in s.values()]
    _step_with(opt, params, grads[1:])  # moves the state on
    opt.load_state_dict(saved)
    assert {id(t) for s in opt.state.values() for t in s.values()} == held
    assert all(g["lr"] is lr for g, lr in zip(opt.param_groups, lrs, strict=True))
    now = [v for s in opt.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(now, expected, strict=True)) and kept


def test_resumed_through_distributed_checkpoint_equals_uninterrupted(tmp_path, seed):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def model_of(params):
        model = torch.nn.Module()
        for i, p in enumerate(params):
            model.register_parameter(f"p{i}", torch.nn.Parameter(p.detach().clone()))
        return model

    start = make_params("cpu", torch.Generator().manual_seed(seed))
    grads = _grads(start, seed + 1, steps=6)
    whole = model_of(start)
    _step_with(
        MultiTensorAdamW(groups_of(list(whole.parameters())), implementation="reference"),
        list(whole.parameters()),
        grads,
    )
    model = model_of(start)
    opt = MultiTensorAdamW(groups_of(list(model.parameters())), implementation="reference")
    _step_with(opt, list(model.parameters()), grads[:3])
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path)

    model = model_of(start)  # the first weights: the load must bring the saved ones
    opt = MultiTensorAdamW(groups_of(list(model.parameters())), implementation="reference")
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=tmp_path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert all(float(s["step"]) == 3 for s in opt.state.values())
    _step_with(opt, list(model.parameters()), grads[3:])
    for a, b in zip(model.parameters(), whole.parameters(), strict=True):
        assert torch.equal(a, b)


@needs_cuda
@pytest.mark.parametrize("make", ["ours", "torch fused"])
def test_a_graph_captured_before_a_load_resumes_from_the_loaded_state(make, seed):
    def optimizer(params):
        lr = torch.tensor(1e-2, device="cuda")
        if make == "ours":
            return MultiTensorAdamW([{"params": params, "lr": lr}])
        return torch.optim.AdamW([{"params": params, "lr": lr}], fused=True, capturable=True)

    gen = torch.Generator().manual_seed(seed)
    start = make_params("cuda", gen, shapes=[(4096, 33), (5,), (1000, 7)])
    grads = _grads(start, seed + 1, steps=10)
    params = [p.detach().clone().requires_grad_() for p in start]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = load_state_in_place(optimizer(params))  # a load reaches the captured graph
    graphed = graphs.GraphedStep(opt.step, device="cuda")

    def steps(these):
        for g_list in these:
            for p, g in zip(params, g_list, strict=True):
                p.grad.copy_(g)  # in place: the graph reads these addresses
            graphed()

    steps(grads[:5])
    saved = _through_bytes(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    steps(grads[5:])
    uninterrupted = [p.detach().clone() for p in params]
    opt.load_state_dict(saved)  # back to step 5, into the captured graph
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)
    steps(grads[5:])
    assert graphed.graphs == 1
    for a, b in zip(params, uninterrupted, strict=True):
        assert torch.equal(a, b)


# ---- a loaded state must fit its parameters -----------------------------------------------------
def mlp(hidden: int, device, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)
    )
    return model.to(device)


def train(model, optimizer, seed, steps=2):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=gen).to(next(model.parameters()).device)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("implementation", ["auto", "reference"])
@pytest.mark.parametrize(("saved", "loading"), [(7, 8), (8, 7)])
@pytest.mark.parametrize("stepped", [False, True])
def test_a_state_saved_for_other_shapes_is_refused_before_any_change(
    kdev, seed, implementation, saved, loading, stepped
):
    """A hidden-7 model's state in a hidden-8 model's optimizer (the kernel would update 8 rows
    of moments that hold 7), and the reverse (it would step with another model's moments)."""
    source = mlp(saved, kdev, seed)
    opt = MultiTensorAdamW(source.parameters(), implementation=implementation)
    train(source, opt, seed)
    state = _through_bytes(opt.state_dict())
    target = mlp(loading, kdev, seed + 1)
    loads = MultiTensorAdamW(target.parameters(), implementation=implementation)
    if stepped:
        train(target, loads, seed + 2)
    kept = {id(p): {k: (id(t), t.clone()) for k, t in s.items()} for p, s in loads.state.items()}
    with pytest.raises(
        ValueError,
        match=rf"parameter 0 of group 0 has shape \({loading}, 4\).*'exp_avg' for it has shape "
        rf"\({saved}, 4\)",
    ):
        loads.load_state_dict(state)
    now = {id(p): {k: (id(t), t) for k, t in s.items()} for p, s in loads.state.items()}
    assert now.keys() == kept.keys()  # the state as it was: same tensors, same values
    for p, s in now.items():
        assert all(s[k][0] == i and torch.equal(s[k][1], v) for k, (i, v) in kept[p].items())
    train(target, loads, seed + 3)  # and it still steps


@pytest.mark.parametrize("implementation", ["auto", "reference"])
@pytest.mark.parametrize(
    ("moment", "match"),
    [
        (
            lambda m: torch.rand(3, 1499).to(m) + 0.5,
            r"\(3, 1500\) float32.*'exp_avg_sq' is \(3, 1499\)",
        ),
        (lambda m: m.double(), r"\(3, 1500\) float32.*'exp_avg_sq' is \(3, 1500\) float64"),
    ],
    ids=["smaller", "float64"],
)
def test_a_moment_put_in_the_state_by_hand_is_checked_before_the_step(
    kdev, seed, implementation, moment, match
):
    """The kernel would read and write past a smaller moment's end, or read float64 as float32;
    torch's ops would fail half-way through the tensors."""
    params = make_params(kdev, torch.Generator().manual_seed(seed))
    opt = MultiTensorAdamW(groups_of(params), implementation=implementation)
    _step_with(opt, params, _grads(params, seed, steps=1))
    opt.state[params[3]]["exp_avg_sq"] = moment(opt.state[params[3]]["exp_avg_sq"])
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=rf"parameter 1 of group 1 is {match}"):
        _step_with(opt, params, _grads(params, seed + 1, steps=1))
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    assert all(float(s["step"]) == 1 for s in opt.state.values())


# ---- a step count per parameter, as torch's AdamW keeps -----------------------------------------
def assert_as_torch(ours, theirs, opt, ref):
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b.to(a.device), **TOL)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[a][key], ref.state[b][key].to(a.device), **TOL)


@pytest.mark.parametrize("implementation", ["auto", "reference"])
def test_a_group_added_after_ten_steps_equals_torch_adamw(kdev, seed, implementation):
    ours, theirs, opt, ref = twins(kdev, seed, implementation=implementation)
    gen = torch.Generator().manual_seed(seed + 1)
    run_steps(opt, ours, gen, steps=10)
    run_steps(ref, theirs, torch.Generator().manual_seed(seed + 1), steps=10)
    late = make_params(kdev, torch.Generator().manual_seed(seed + 2), shapes=[(5,), (33, 2)])
    late_theirs = [p.detach().clone().requires_grad_() for p in late]
    opt.add_param_group({"params": late, "lr": 2e-2, "weight_decay": 0.05})
    ref.add_param_group({"params": late_theirs, "lr": 2e-2, "weight_decay": 0.05})
    run_steps(opt, ours + late, torch.Generator().manual_seed(seed + 3), steps=3)
    run_steps(ref, theirs + late_theirs, torch.Generator().manual_seed(seed + 3), steps=3)
    assert_as_torch(ours + late, theirs + late_theirs, opt, ref)
    assert float(opt.state[late[0]]["step"]) == 3 and float(opt.state[ours[0]]["step"]) == 13


@pytest.mark.parametrize("implementation", ["auto", "reference"])
def test_parameters_that_skip_steps_equal_torch_adamw(kdev, seed, implementation):
    """Frozen, then unfrozen (a fine-tuning pattern): a parameter's count advances only on the
    steps where it has a gradient."""
    ours, theirs, opt, ref = twins(kdev, seed, implementation=implementation)

    def freeze_some(optimizer, i):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for k, p in enumerate(params):
            if (k == 0 and i < 6) or (k == 2 and i % 3 == 1):
                p.grad = None

    run_steps(opt, ours, torch.Generator().manual_seed(seed + 1), steps=9, between=freeze_some)
    run_steps(ref, theirs, torch.Generator().manual_seed(seed + 1), steps=9, between=freeze_some)
    assert_as_torch(ours, theirs, opt, ref)
    assert [float(opt.state[p]["step"]) for p in ours] == [3, 9, 6, 9]


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"amsgrad": True}, r"does not implement amsgrad=True"),
        ({"maximize": True}, r"does not implement maximize=True"),
        ({"decoupled_weight_decay": False}, r"decoupled_weight_decay=False and weight_decay=0.1"),
    ],
)
def test_options_it_does_not_implement_are_refused_not_ignored(option, match, seed):
    """In a group given to it, added later, or in a loaded state (torch.optim.Adam's is AdamW's
    with weight decay as an L2 penalty): before anything changes."""
    params = make_params("cpu", torch.Generator().manual_seed(seed))
    with pytest.raises(ValueError, match=match):
        MultiTensorAdamW([{"params": params, "weight_decay": 0.1, **option}])
    opt = MultiTensorAdamW(params[:2], weight_decay=0.1, implementation="reference")
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": params[2:], **option})
    assert len(opt.param_groups) == 1
    adam = torch.optim.Adam if "decoupled_weight_decay" in option else torch.optim.AdamW
    theirs = adam(params[:2], weight_decay=0.1, **option)
    _step_with(theirs, params[:2], _grads(params[:2], seed, steps=1))
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(theirs.state_dict())
    assert not opt.state and not any(k in opt.param_groups[0] for k in option)


# ---- a load into state tensors held in place (a captured graph reads their addresses) ----------
def test_a_loaded_state_without_a_parameter_starts_it_afresh_in_the_tensors_it_has(seed):
    """Rolled back to a state saved before parameter 1 had a gradient: its counts and moments
    are zeroed where they are (freed, a captured graph would write into reused memory), and the
    run goes on as torch's AdamW loaded with the same state."""
    start = make_params("cpu", torch.Generator().manual_seed(seed))
    grads = _grads(start, seed + 1, steps=5)
    early = [p.detach().clone().requires_grad_() for p in start]
    theirs = torch.optim.AdamW(early, foreach=False)
    _step_with(
        theirs, early, [[None if i == 1 else g for i, g in enumerate(gs)] for gs in grads[:2]]
    )
    saved = _through_bytes(theirs.state_dict())
    assert 1 not in saved["state"]
    params = [p.detach().clone().requires_grad_() for p in start]
    ours = MultiTensorAdamW(params, implementation="reference")
    _step_with(ours, params, grads[:3])
    held = {id(p): {k: id(t) for k, t in s.items()} for p, s in ours.state.items()}
    ours.load_state_dict(saved)
    assert {id(p): {k: id(t) for k, t in s.items()} for p, s in ours.state.items()} == held
    assert float(ours.state[params[1]]["step"]) == 0
    assert not ours.state[params[1]]["exp_avg"].any()
    copies = [p.detach().clone().requires_grad_() for p in params]
    theirs = torch.optim.AdamW(copies, foreach=False)
    theirs.load_state_dict(saved)
    _step_with(ours, params, grads[3:])
    _step_with(theirs, copies, grads[3:])
    for a, b in zip(params, copies, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_a_load_in_place_refuses_a_state_without_a_held_tensor(seed):
    """torch's optimizer wrapped to load in place: a state that has nothing for a tensor it holds
    cannot be copied into it (and dropping it would leave a graph on freed memory)."""
    params = make_params("cpu", torch.Generator().manual_seed(seed))
    early = torch.optim.AdamW(params, foreach=False)
    _step_with(early, params, [[None, *gs[1:]] for gs in _grads(params, seed, steps=1)])
    saved = _through_bytes(early.state_dict())
    opt = load_state_in_place(torch.optim.AdamW(params, foreach=False))
    _step_with(opt, params, _grads(params, seed + 1, steps=1))
    held = {id(t) for s in opt.state.values() for t in s.values()}
    with pytest.raises(
        ValueError,
        match=r"parameter 0 of group 0 has its \[.step., .exp_avg., .exp_avg_sq.\] held in place",
    ):
        opt.load_state_dict(saved)
    assert {id(t) for s in opt.state.values() for t in s.values()} == held


def test_float64_parameters_are_refused_and_torchs_off_switches_accepted():
    doubles = [torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]
    with pytest.raises(ValueError, match=r"float64.*torch.optim.AdamW"):
        MultiTensorAdamW(doubles, implementation="reference")
    floats = [torch.nn.Parameter(torch.randn(4))]
    opt = MultiTensorAdamW(floats, amsgrad=False, maximize=False, implementation="reference")
    with pytest.raises(ValueError, match=r"float64"):
        opt.add_param_group({"params": doubles})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=r"amsgrad=True"):
        MultiTensorAdamW(floats, amsgrad=True, implementation="reference")

