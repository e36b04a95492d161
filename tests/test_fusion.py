"""accel.fusion: every foreach and fused form against its per-tensor reference."""

from __future__ import annotations

import math

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
        (5, TypeError, r"expected a sequence of groups .*got 5 \(int\)"),
        (torch.ones(2), TypeError, r"expected a sequence of groups .*got a tensor"),
        ("params", TypeError, r"expected a sequence of groups .*got 'params' \(str\)"),
    ],
    ids=["no groups", "empty group", "consumed generator", "integer tensor", "mixed devices",
         "a number", "one tensor", "a string"],
)
def test_group_stats_bad_input(groups, error, match):
    with pytest.raises(error, match=match):
        fusion.group_stats(groups)


def test_float64_group_stats(gen):
    params = params_with_grads(gen, [(3, 4), (5,)], torch.float64)
    stats = fusion.group_stats([params[:1], params[1:]])
    assert stats.dtype == torch.float32
    torch.testing.assert_close(stats, fusion.group_stats([params[:1], params[1:]], foreach=False))
    expected = [[float64_norm([p.grad]), float64_norm([p])] for p in params]
    torch.testing.assert_close(stats, torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_group_stats_propagates_a_non_finite_gradient(gen, bad):
    params = params_with_grads(gen, [(3, 4), (5,), (2, 2)])
    params[1].grad[2] = bad
    groups = [params[:1], params[1:]]
    fast, ref = fusion.group_stats(groups), fusion.group_stats(groups, foreach=False)
    torch.testing.assert_close(fast, ref, equal_nan=True)
    assert torch.isfinite(fast[0]).all() and torch.isfinite(fast[1, 1])
    assert torch.isnan(fast[1, 0]) if math.isnan(bad) else fast[1, 0] == math.inf


def test_group_stats_reads_nothing_back(gen, count_host_reads):
    params = params_with_grads(gen, SHAPES["many small"])
    stats = count_host_reads(lambda: fusion.group_stats([params[:10], params[10:]]))
    assert sum(stats.values()) == 0


# ---- fused LIoR ---------------------------------------------------------------------------------
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
def test_an_empty_tensor_adds_nothing_to_group_stats(foreach, seed, device):
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(5, 3, generator=gen).to(device).requires_grad_()
    empty = torch.randn(0, 3).to(device).requires_grad_()
    full.grad, empty.grad = (
        torch.randn(5, 3, generator=gen).to(device),
        torch.zeros(0, 3).to(device),
    )
    got = fusion.group_stats([[empty, full], [empty]], foreach=foreach)
    expected = [torch.linalg.vector_norm(full.grad), torch.linalg.vector_norm(full.detach())]
    torch.testing.assert_close(got[0], torch.stack(expected).float())
    assert torch.equal(got[1], torch.zeros(2, device=device))
