"""accel.fusion: every foreach form against its per-tensor reference (and torch's own clipping)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from accel import fusion, sync

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

SHAPES = {
    "one element": [(1,)],
    "odd shapes": [(1, 1, 1023), (5, 123, 123), (7,), (3, 1)],
    "many small": [(3,)] * 40 + [(2, 5)] * 9,
}
# (dtype, atol, rtol). Norms are accumulated in float32 for every dtype; the per-tensor reference
# and the foreach kernel sum in different orders: fp32 agrees to a few ulps of the sum. For
# bf16/fp16 tensors the reference squares in fp32 too, so only summation order differs.
DTYPES = [
    (torch.float32, 1e-6, 1e-5),
    (torch.bfloat16, 1e-5, 1e-5),
    (torch.float16, 1e-5, 1e-5),
]
# Clipped gradients are stored in their own dtype: one rounding of the product.
GRAD_TOL = {
    torch.float32: {"atol": 1e-7, "rtol": 1e-6},
    torch.bfloat16: {"atol": 1e-3, "rtol": 8e-3},
    torch.float16: {"atol": 1e-5, "rtol": 1e-3},
}


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def params_with_grads(gen, shapes, dtype=torch.float32, device="cpu", scale=1.0, missing=()):
    params = []
    for i, shape in enumerate(shapes):
        p = torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()
        if i not in missing:
            p.grad = (torch.randn(*shape, generator=gen) * scale).to(device, dtype)
        params.append(p)
    return params


def float64_norm(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


# ---- group statistics ---------------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("case", list(SHAPES))
def test_group_stats_foreach_equals_loop(gen, case, dtype, atol, rtol):
    shapes = SHAPES[case]
    params = params_with_grads(
        gen, shapes, dtype, missing={len(shapes) - 1} if len(shapes) > 1 else ()
    )
    cut = max(1, len(params) // 3)
    groups = [params[:cut], params[cut:]] if len(params) > 1 else [params]
    fast = fusion.group_stats(groups)
    ref = fusion.group_stats(groups, foreach=False)
    assert fast.shape == (len(groups), 2) and fast.dtype == torch.float32
    torch.testing.assert_close(fast, ref, atol=atol, rtol=rtol)
    for i, g in enumerate(groups):  # against float64 sums of the same values
        grads = [p.grad for p in g if p.grad is not None]
        expected = torch.tensor([float64_norm(grads), float64_norm(g)], dtype=torch.float32)
        torch.testing.assert_close(fast[i], expected, atol=atol, rtol=1e-5)


def test_group_stats_follows_gradients_that_come_and_go(gen):
    """The gather's indices are cached per layout: dropping a gradient must change them."""
    params = params_with_grads(gen, [(3, 4), (5,), (2, 2)])
    groups = [params[:1], params[1:]]
    first = fusion.group_stats(groups)
    params[1].grad = None
    second = fusion.group_stats(groups)
    torch.testing.assert_close(second, fusion.group_stats(groups, foreach=False))
    assert second[1, 0] < first[1, 0] and torch.equal(second[:, 1], first[:, 1])


def test_group_stats_mixed_dtypes_and_non_contiguous(gen):
    a = torch.randn(6, 10, generator=gen).T.detach().requires_grad_()  # (10, 6), strided
    a.grad = torch.randn(10, 6, generator=gen).T.contiguous().T  # strided grad
    b = torch.randn(33, generator=gen).bfloat16().requires_grad_()
    b.grad = torch.randn(33, generator=gen).bfloat16()
    c = torch.randn(4, 4, generator=gen).half()[:, ::2].detach().requires_grad_()
    groups = [[a, b], [c]]
    assert not a.is_contiguous() and not c.is_contiguous()
    fast, ref = fusion.group_stats(groups), fusion.group_stats(groups, foreach=False)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    assert fast[1, 0] == 0  # c has no gradient
    assert (fast[:, 1] > 0).all()


def test_group_stats_writes_out_and_has_no_graph(gen):
    params = params_with_grads(gen, [(4, 5), (9,)])
    out = torch.full((2, 2), -1.0)
    for foreach in (True, False):
        result = fusion.group_stats([params[:1], params[1:]], foreach=foreach, out=out)
        assert result.data_ptr() == out.data_ptr()
        assert not result.requires_grad and result.grad_fn is None
        assert (out > 0).all()
    with pytest.raises(ValueError, match=r"out must be float32 of shape \(2, 2\)"):
        fusion.group_stats([params[:1], params[1:]], out=torch.zeros(3, 2))


@pytest.mark.parametrize(
    ("groups", "error", "match"),
    [
        ([], ValueError, "got no groups"),
        ([[]], ValueError, "group 0: got no tensors"),
        ([[torch.ones(2)], iter([])], ValueError, "group 1: got no tensors"),
        ([[torch.arange(3)]], TypeError, "dtype torch.int64"),
        ([[torch.ones(2)], [torch.ones(2, device="meta")]], ValueError, "several devices"),
    ],
    ids=["no groups", "empty group", "consumed generator", "integer tensor", "mixed devices"],
)
def test_group_stats_bad_input(groups, error, match):
    with pytest.raises(error, match=match):
        fusion.group_stats(groups)


# ---- norms and clipping -------------------------------------------------------------------------
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("case", list(SHAPES))
def test_global_norm_foreach_equals_loop(gen, case, norm_type):
    tensors = [torch.randn(*s, generator=gen) for s in SHAPES[case]]
    fast = fusion.global_norm(tensors, norm_type)
    ref = fusion.global_norm(tensors, norm_type, foreach=False)
    torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-5)
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]), norm_type)
    torch.testing.assert_close(fast, expected, atol=1e-6, rtol=1e-5)


def clones(params):
    out = []
    for q in params:
        p = q.detach().clone().requires_grad_()
        p.grad = None if q.grad is None else q.grad.clone()
        out.append(p)
    return out


def clip_three_ways(params, max_norm, norm_type=2.0):
    """Clip copies of ``params`` with the foreach form, the loop form and torch's own."""
    copies = [clones(params) for _ in range(3)]
    fast = fusion.clip_grad_norm_(copies[0], max_norm, norm_type)
    ref = fusion.clip_grad_norm_(copies[1], max_norm, norm_type, foreach=False)
    torch_norm = torch.nn.utils.clip_grad_norm_(copies[2], max_norm, norm_type)
    return (fast, ref, torch_norm), copies


# torch sums per-tensor norms of bf16/fp16 gradients in their own dtype (~3 digits); we use fp32
TORCH_NORM_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
TORCH_GRAD_TOL = {  # its coefficient carries that difference into every gradient
    torch.float32: GRAD_TOL[torch.float32],
    torch.bfloat16: {"atol": 1e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 4e-3},
}


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("case", list(SHAPES))
@pytest.mark.parametrize("clips", [True, False], ids=["clipping", "within max_norm"])
def test_clip_foreach_equals_loop_and_torch(gen, case, dtype, atol, rtol, clips):
    params = params_with_grads(gen, SHAPES[case], dtype)
    total = float64_norm([p.grad for p in params])
    max_norm = 0.3 * total if clips else 10.0 * total
    (fast, ref, torch_norm), copies = clip_three_ways(params, max_norm)
    torch.testing.assert_close(fast, ref, atol=atol, rtol=rtol)
    assert float(fast) == pytest.approx(total, rel=1e-5)
    assert float(torch_norm) == pytest.approx(total, rel=TORCH_NORM_RTOL[dtype])
    for a, b, c in zip(*copies, strict=True):
        torch.testing.assert_close(a.grad, b.grad, **GRAD_TOL[dtype])
        torch.testing.assert_close(a.grad, c.grad, **TORCH_GRAD_TOL[dtype])
    after = float64_norm([p.grad for p in copies[0]])
    # clipped: max_norm / (total + 1e-6) scales every gradient, so the norm ends a little under
    # max_norm (1e-6 / total relative: above 1e-5 for small gradients), up to rounding
    expected = max_norm * total / (total + 1e-6) if clips else total
    assert after == pytest.approx(expected, rel=1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("norm_type", [1.0, 3.0, 0.5, math.inf, -math.inf, 0.0])
def test_clip_other_norm_types_equal_torch(gen, norm_type):
    params = params_with_grads(gen, SHAPES["odd shapes"])
    (fast, ref, torch_norm), copies = clip_three_ways(params, 0.5, norm_type)
    for a, b in zip(copies[0], copies[1], strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast, torch_norm, rtol=1e-5, atol=1e-6)
    for a, c in zip(copies[0], copies[2], strict=True):
        torch.testing.assert_close(a.grad, c.grad, rtol=1e-5, atol=1e-7)


def test_clip_mixed_dtypes_and_missing_grads(gen):
    fp32 = params_with_grads(gen, [(17, 3), (5,)], missing={1})
    bf16 = params_with_grads(gen, [(8, 8)], torch.bfloat16)
    params = fp32 + bf16
    grads = [p.grad.clone() if p.grad is not None else None for p in params]
    total = fusion.clip_grad_norm_(params, 0.5)
    expected = float64_norm([g for g in grads if g is not None])
    assert float(total) == pytest.approx(expected, rel=1e-5)
    assert params[1].grad is None
    coef = 0.5 / (expected + 1e-6)
    torch.testing.assert_close(params[0].grad, grads[0] * coef, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(
        params[2].grad, (grads[2].float() * coef).bfloat16(), **GRAD_TOL[torch.bfloat16]
    )


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("mixed", [False, True], ids=["float64", "float64 and float32"])
def test_clip_float64_gradients_like_torch(gen, mixed, norm_type):
    params = params_with_grads(gen, SHAPES["odd shapes"], torch.float64)
    if mixed:
        params += params_with_grads(gen, [(7, 5)])
    max_norm = 0.3 * float64_norm([p.grad for p in params])
    (fast, ref, torch_norm), copies = clip_three_ways(params, max_norm, norm_type)
    assert fast.dtype == ref.dtype == torch_norm.dtype == torch.float64
    rtol = 1e-6 if mixed else 1e-12  # float32 norms, summed in another order than torch's
    torch.testing.assert_close(fast, torch_norm, rtol=rtol, atol=0)
    torch.testing.assert_close(ref, torch_norm, rtol=rtol, atol=0)
    for a, b, c in zip(*copies, strict=True):
        torch.testing.assert_close(a.grad, c.grad, rtol=1e-6, atol=0)
        torch.testing.assert_close(b.grad, c.grad, rtol=1e-6, atol=0)


def test_float64_norms_and_group_stats(gen):
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64) for s in [(3, 4), (5,)]]
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]))
    for foreach in (True, False):
        torch.testing.assert_close(fusion.global_norm(tensors, foreach=foreach), expected)
    params = params_with_grads(gen, [(3, 4), (5,)], torch.float64)
    stats = fusion.group_stats([params[:1], params[1:]])
    assert stats.dtype == torch.float32
    torch.testing.assert_close(stats, fusion.group_stats([params[:1], params[1:]], foreach=False))


def test_clip_without_any_gradient_returns_zero(gen):
    params = params_with_grads(gen, [(3,), (4,)], missing={0, 1})
    for foreach in (True, False):
        total = fusion.clip_grad_norm_(params, 1.0, foreach=foreach)
        assert total.item() == 0.0 and all(p.grad is None for p in params)


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_clip_non_finite_is_reported_like_torch(gen, bad):
    params = params_with_grads(gen, SHAPES["odd shapes"])
    params[1].grad[0, 7, 3] = bad
    copies = [clones(params) for _ in range(3)]
    fast = fusion.clip_grad_norm_(copies[0], 1.0)
    ref = fusion.clip_grad_norm_(copies[1], 1.0, foreach=False)
    torch_norm = torch.nn.utils.clip_grad_norm_(copies[2], 1.0)
    assert not torch.isfinite(fast) and not torch.isfinite(ref)
    assert torch.isnan(fast) == torch.isnan(torch_norm)
    for a, b, c in zip(copies[0], copies[1], copies[2], strict=True):
        torch.testing.assert_close(a.grad, c.grad, equal_nan=True)
        torch.testing.assert_close(b.grad, c.grad, equal_nan=True)


@pytest.mark.parametrize("foreach", [True, False])
def test_clip_raises_on_request_naming_the_tensor(gen, foreach):
    params = params_with_grads(gen, [(3, 4), (5,), (2, 2)])
    params[1].grad[2] = math.inf
    before = [p.grad.clone() for p in params]
    with pytest.raises(fusion.NonFiniteGradientError, match=r"gradient 1 \(shape \(5,\)\)"):
        fusion.clip_grad_norm_(params, 1.0, foreach=foreach, error_if_nonfinite=True)
    for p, b in zip(params, before, strict=True):  # nothing was scaled
        assert torch.equal(p.grad, b)


def test_foreach_clip_reads_nothing_back_the_loop_once(gen, count_host_reads):
    params = params_with_grads(gen, SHAPES["many small"])
    assert sum(count_host_reads(lambda: fusion.clip_grad_norm_(params, 0.1)).values()) == 0
    loop = count_host_reads(lambda: fusion.clip_grad_norm_(params, 0.1, foreach=False))
    assert loop == {"__bool__": 1}  # `if coef < 1`: the common version's sync
    stats = count_host_reads(lambda: fusion.group_stats([params[:10], params[10:]]))
    assert sum(stats.values()) == 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda p: fusion.clip_grad_norm_([], 1.0), "got no parameters"),
        (lambda p: fusion.clip_grad_norm_(p, 0.0), "max_norm must be finite and > 0"),
        (lambda p: fusion.clip_grad_norm_(p, math.nan), "max_norm must be finite"),
        (lambda p: fusion.global_norm([]), "got no tensors"),
        (
            lambda p: fusion.clip_grad_norm_([*p, torch.ones(2, device="meta")], 1.0),
            "several devices",
        ),
    ],
    ids=["empty", "zero max_norm", "nan max_norm", "empty norm", "mixed devices"],
)
def test_clip_bad_input(gen, call, match):
    with pytest.raises(ValueError, match=match):
        call(params_with_grads(gen, [(3,)]))


def test_clip_refuses_a_nested_list_naming_the_item(gen):
    params = params_with_grads(gen, [(3,), (4,)])
    with pytest.raises(TypeError, match=r"item 1 is a list, not a tensor"):
        fusion.clip_grad_norm_([params[0], [params[1]]], 1.0)


def test_clip_accepts_a_single_tensor(gen):
    (p,) = params_with_grads(gen, [(50,)], scale=3.0)
    expected = float(p.grad.norm())
    assert float(fusion.clip_grad_norm_(p, 1.0)) == pytest.approx(expected, rel=1e-6)
    assert float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)


# ---- fused LIoR and retrieval -------------------------------------------------------------------
@pytest.mark.parametrize("metric", ["full", "diag"])
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (3, 9, 16)])
def test_lior_fused_equals_reference(gen, metric, shape):
    d = shape[-1]
    v = torch.randn(*shape, generator=gen)
    R = torch.rand(*shape[:-1], generator=gen) + 0.1
    a = torch.randn(d, d, generator=gen)
    g = a @ a.T + torch.eye(d) if metric == "full" else torch.rand(d, generator=gen) + 0.5
    dlior, spd = fusion.lior_step_fused(R, v, g, 1e-6)
    assert torch.equal(dlior, fusion.lior_step(R, v, g, 1e-6))  # same ops, same order
    assert torch.equal(spd, fusion.quad_form(v, g, 1e-6))
    q = (
        ((v.double() @ g.double()) * v.double()).sum(-1)
        if metric == "full"
        else (v.double() ** 2 * g.double()).sum(-1)
    )
    torch.testing.assert_close(spd.double(), (q + 1e-6).sqrt(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "atol", "rtol"),
    [(torch.float32, 1e-6, 1e-5), (torch.float64, 1e-12, 1e-12), (torch.bfloat16, 2e-2, 2e-2)],
)
@pytest.mark.parametrize(("B", "M", "d"), [(1, 1, 1), (5, 123, 7), (64, 33, 16)])
def test_retrieval_mix_fused_equals_reference(gen, B, M, d, dtype, atol, rtol):
    cost = (torch.rand(B, M, generator=gen) * 3).to(dtype)
    values = torch.randn(M, d, generator=gen).to(dtype)
    fast = fusion.retrieval_mix_fused(cost, values, 2.0)
    torch.testing.assert_close(fast, fusion.retrieval_mix(cost, values, 2.0), atol=atol, rtol=rtol)


# ---- compile once per shape ---------------------------------------------------------------------
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale + x


def test_compiled_function_counts_one_compile_per_shape(gen):
    # the "eager" backend runs dynamo's capture without code generation: seconds, not minutes
    f = fusion.compile_per_shape(scaled_tanh, backend="eager")
    a, b = torch.randn(4, 3, generator=gen), torch.randn(5, 3, generator=gen)
    f.check(a, 2.0)
    for _ in range(3):
        torch.testing.assert_close(f(a, 2.0), scaled_tanh(a, 2.0))
    assert f.compiles == 1 and f.calls == 4
    f(b, 2.0)
    assert f.compiles == 2 and f.signatures == [((4, 3),), ((5, 3),)]
    f(a, 3.0)  # a Python float is a constant to dynamo: a new value is a new compile
    assert f.compiles == 3
    assert "compiles=3" in repr(f)


def test_compiled_function_warns_on_shape_churn(gen):
    f = fusion.compile_per_shape(scaled_tanh, backend="eager", max_compiles=2)
    with pytest.warns(RuntimeWarning, match="compiled 3 graphs"):
        for n in range(1, 4):
            f(torch.randn(n, generator=gen), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(torch.randn(2, generator=gen), 1.0)  # seen before: no compile, no warning


def _scaled_sin(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.sin(x) * scale - x  # its own code object: dynamo's recompile limit is per code


def test_direct_calls_skip_dynamo_once_the_signature_is_known(gen):
    f = fusion.compile_per_shape(_scaled_sin, backend="eager", direct=True)
    a, b = torch.randn(4, 3, generator=gen), torch.randn(5, 3, generator=gen)
    f.check(a, 2.0)  # compiles, then checks the direct call against dynamo's result
    for x in (a, torch.randn(4, 3, generator=gen)):  # fresh values, same signature
        torch.testing.assert_close(f(x, 2.0), _scaled_sin(x, 2.0), rtol=0, atol=0)
    assert (f.compiles, f.calls, f.direct_calls) == (1, 4, 3)
    torch.testing.assert_close(f(b, 2.0), _scaled_sin(b, 2.0))  # new shape: dynamo compiles
    torch.testing.assert_close(f(a, 3.0), _scaled_sin(a, 3.0))  # new constant: compiles too
    torch.testing.assert_close(f(a.T, 2.0), _scaled_sin(a.T, 2.0))  # other strides
    assert f.compiles == 4 and len(f._direct) == 4
    assert "direct_calls=" in repr(f)


def _two_outputs(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + y, x * y


def test_direct_calls_return_tuples_and_keep_dynamo_where_unsafe(gen):
    f = fusion.compile_per_shape(_two_outputs, backend="eager", direct=True)
    x, y = torch.randn(3, generator=gen), torch.randn(3, generator=gen)
    for _ in range(2):
        out = f(x, y)
        assert isinstance(out, tuple) and len(out) == 2
        torch.testing.assert_close(out, _two_outputs(x, y), rtol=0, atol=0)
    assert f.direct_calls == 1
    # inputs that need grad: the graph is an autograd one, dynamo keeps it
    w = x.clone().requires_grad_(True)
    for _ in range(2):
        (f(w, y)[1].sum()).backward()
    torch.testing.assert_close(w.grad, 2 * y)
    # a graph that reads a tensor other than its arguments is never called directly
    bias = torch.randn(3, generator=gen)
    g = fusion.compile_per_shape(lambda t: t + bias, backend="eager", direct=True)
    for _ in range(2):
        torch.testing.assert_close(g(x), x + bias)
    assert g.direct_calls == 0 and not g._direct
    # an unhashable argument: dynamo, every time
    h = fusion.compile_per_shape(lambda t, ks: t * ks[0], backend="eager", direct=True)
    for _ in range(2):
        torch.testing.assert_close(h(x, [2.0]), x * 2.0)
    assert h.direct_calls == 0


# ---- on a GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_foreach_equals_cpu_reference_and_is_sync_free(gen, dtype):
    shapes = SHAPES["odd shapes"] + SHAPES["many small"]
    cpu = params_with_grads(gen, shapes, dtype)
    cuda = [p.detach().cuda().requires_grad_() for p in cpu]
    for p, q in zip(cuda, cpu, strict=True):
        p.grad = q.grad.cuda()
    groups = [cuda[:5], cuda[5:]]
    torch.testing.assert_close(
        fusion.group_stats(groups).cpu(),
        fusion.group_stats([cpu[:5], cpu[5:]], foreach=False),
        atol=1e-5,
        rtol=1e-5,
    )
    torch.cuda.synchronize()
    assert sync.count_syncs(lambda: fusion.group_stats(groups)) == 0
    assert sync.count_syncs(lambda: fusion.clip_grad_norm_(cuda, 0.1)) == 0
    assert sync.count_syncs(lambda: fusion.clip_grad_norm_(cuda, 0.1, foreach=False)) == 1


@pytest.mark.gpu
@needs_cuda
def test_the_first_group_stats_call_is_sync_free_too(gen):
    """The first call builds the gather index for these group sizes: a pageable copy there
    would sync in a CUDA graph's first warm-up call and keep GraphedStep from capturing."""
    params = [
        p.detach().cuda().requires_grad_() for p in params_with_grads(gen, [(7, 3), (5,), (2, 9)])
    ]
    for p in params:
        p.grad = torch.randn_like(p)
    fusion._group_index.cache_clear()
    torch.cuda.synchronize()
    assert sync.count_syncs(lambda: fusion.group_stats([params[:1], params[1:]])) == 0


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_an_empty_tensor_adds_nothing_to_a_norm(foreach, norm_type, seed, device):
    # torch refuses the infinity norm of an empty tensor ("no identity"); a norm is >= 0, so an
    # empty gradient (a parameter of size 0) contributes 0
    full = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed)).to(device)
    empty = torch.randn(0, 3, device=device)
    expected = torch.linalg.vector_norm(full, norm_type)
    got = fusion.global_norm([empty, full], norm_type, foreach=foreach)
    torch.testing.assert_close(got, expected)
    assert fusion.global_norm([empty], norm_type, foreach=foreach).item() == 0


def test_global_norm_is_a_statistic_without_a_gradient():
    w = torch.randn(3, 4, requires_grad=True)
    norm = fusion.global_norm([w])
    assert not norm.requires_grad
    torch.testing.assert_close(norm, torch.linalg.vector_norm(w.detach()))
