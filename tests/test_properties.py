"""Every public fast component against its plain reference, on inputs drawn by hypothesis:
shapes with empty and size-1 dimensions, non-contiguous and broadcast layouts, every supported
dtype, NaN and inf where the contract defines the result. Each either matches its reference
within the tolerance stated beside it or raises a clear error; none returns a different answer.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accel import attention as A
from accel import diversity as dv
from accel import fusion, sync
from accel.optim import MultiTensorAdamW

# CI-friendly and reproducible: a fixed, small number of examples, no example database
SETTINGS = dict(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
LAYOUTS = ("contiguous", "transposed", "strided", "broadcast")


def tensor(shape, dtype, layout, seed, *, scale=1.0):
    """Random values (never zeros) of ``shape`` in ``layout``: a transposed or strided view of a
    larger tensor, or a size-1 dimension expanded (stride 0)."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "transposed" and len(shape) >= 2:
        flipped = (*shape[:-2], shape[-1], shape[-2])
        return (scale * torch.randn(flipped, generator=gen)).to(dtype).transpose(-1, -2)
    if layout == "strided" and len(shape) >= 1:
        wide = (*shape[:-1], 2 * shape[-1])
        return (scale * torch.randn(wide, generator=gen)).to(dtype)[..., ::2]
    if layout == "broadcast" and len(shape) >= 2:
        one = (1, *shape[1:])
        return (scale * torch.randn(one, generator=gen)).to(dtype).expand(shape)
    return (scale * torch.randn(shape, generator=gen)).to(dtype)


# ---- diversity: the Triton kernels (interpreted on a CPU) against the N x N references --------
# The kernels accumulate in float32 from whatever dtype comes in, as the references do after
# their upcast: the difference is float32 summation order over D terms (test_diversity's).
DIVERSITY_TOL = dict(atol=2e-5, rtol=1e-5)
DIVERSITY = [
    (dv.mean_diversity, dv.mean_diversity_reference),
    (dv.nearest_distances, dv.nearest_distances_reference),
    (dv.nearest_diversity, dv.nearest_diversity_reference),
    (dv.pairwise_distances, dv.pairwise_distances_reference),
]


@pytest.mark.parametrize(("fast", "reference"), DIVERSITY, ids=lambda f: f.__name__)
@settings(**SETTINGS)
@given(
    B=st.integers(0, 3),
    N=st.integers(1, 6),
    D=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    layout=st.sampled_from(LAYOUTS),
    ragged=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_diversity_equals_its_reference(
    kdev, fast, reference, B, N, D, dtype, layout, ragged, seed
):
    x = tensor((B, N, D), dtype, layout, seed).to(kdev)
    counts = None
    if ragged:  # counts from 0 (an empty group) to N (whole), and beyond (clamped)
        counts = torch.randint(0, N + 2, (B,), generator=torch.Generator().manual_seed(seed))
        counts = counts.to(kdev)
    torch.testing.assert_close(
        fast(x, counts), reference(x, counts), **DIVERSITY_TOL, equal_nan=True
    )


@settings(**SETTINGS)
@given(N=st.integers(1, 5), D=st.integers(1, 16), where=st.sampled_from(["nan", "inf"]))
def test_diversity_propagates_nan_and_inf_as_its_reference(kdev, N, D, where):
    x = tensor((2, N, D), torch.float32, "contiguous", N * D)
    x[0, 0, 0] = math.nan if where == "nan" else math.inf
    x = x.to(kdev)
    for fast, reference in DIVERSITY:
        torch.testing.assert_close(fast(x), reference(x), **DIVERSITY_TOL, equal_nan=True)


# ---- attention: SDPA (PyTorch's pick and math forced) against softmax(q k^T) v written out ------
@settings(**{**SETTINGS, "max_examples": 20})
@given(
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    Sq=st.integers(1, 9),
    Sk=st.integers(1, 9),
    D=st.sampled_from([1, 3, 8, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    layout=st.sampled_from(("contiguous", "transposed")),
    masking=st.sampled_from(["none", "causal", "bool", "float", "empty row"]),
    backend=st.sampled_from(["default", "math"]),
    seed=st.integers(0, 2**16),
)
def test_sdpa_equals_the_reference(device, B, H, Sq, Sk, D, dtype, layout, masking, backend, seed):
    def qkv(S, salt):
        if layout == "transposed":  # (B, S, H, D) memory, as a projection's output reads
            t = tensor((B, S, H, D), dtype, "contiguous", seed + salt).transpose(1, 2)
        else:
            t = tensor((B, H, S, D), dtype, "contiguous", seed + salt)
        return t.to(device)

    q, k, v = qkv(Sq, 0), qkv(Sk, 1), qkv(Sk, 2)
    gen = torch.Generator().manual_seed(seed + 3)
    mask, causal = None, masking == "causal"
    if masking in ("bool", "empty row"):  # broadcast over batch and heads
        mask = torch.rand(1, 1, Sq, Sk, generator=gen) < 0.7
        mask[..., 0] = True
        if masking == "empty row":
            mask[..., -1, :] = False  # a query with no key: 0, by SDPA's contract
    elif masking == "float":
        mask = torch.randn(1, 1, Sq, Sk, generator=gen).to(dtype)
    mask = None if mask is None else mask.to(device)
    out = A.sdpa(q, k, v, mask=mask, causal=causal, backend=backend)
    exact = A.attention_reference(
        q.double(), k.double(), v.double(), mask=None if mask is None else (
            mask if mask.dtype == torch.bool else mask.double()
        ), causal=causal,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), exact, **A.TOLERANCES[dtype])


# ---- fusion: foreach norms and the fused steps against their loops ------------------------------
# Norms accumulate in float32 for every dtype; the loop and foreach differ in summation order
# only (test_fusion's tolerances).
NORM_TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-3, rtol=8e-3)}


def tensor_list(shapes, dtype, layout, seed):
    return [tensor(s, dtype, layout, seed + i) for i, s in enumerate(shapes)]


SHAPE_LISTS = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 7)), min_size=1, max_size=5
)  # empty and size-1 tensors among them


@settings(**SETTINGS)
@given(
    groups=st.lists(SHAPE_LISTS, min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_group_stats_foreach_equals_the_loop(groups, dtype, seed):
    params = []
    for g, shapes in enumerate(groups):
        ps = tensor_list(shapes, dtype, "contiguous", seed + 10 * g)
        for i, p in enumerate(ps):
            if (g + i) % 3:  # some parameters without a gradient
                p.grad = tensor(p.shape, dtype, "strided", seed + 10 * g + i + 5)
        params.append(ps)
    torch.testing.assert_close(
        fusion.group_stats(params), fusion.group_stats(params, foreach=False), **NORM_TOL[dtype]
    )


@settings(**SETTINGS)
@given(
    rows=st.integers(0, 5),
    d=st.integers(1, 6),
    full=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lior_step_fused_equals_the_reference(rows, d, full, seed):
    v = tensor((rows, d), torch.float32, "contiguous", seed)
    g = tensor((d, d), torch.float32, "contiguous", seed + 1)
    g = g @ g.T + torch.eye(d) if full else g[0].abs() + 0.1  # positive definite, or a diagonal
    r = tensor((rows,), torch.float32, "contiguous", seed + 2)
    loss, speed = fusion.lior_step_fused(r, v, g, 1e-6)
    assert torch.equal(loss, fusion.lior_step(r, v, g, 1e-6))  # the same operations
    assert torch.equal(speed, fusion.quad_form(v, g, 1e-6))


# ---- sync: the sync-free forms against the loops that read back ---------------------------------
@settings(**SETTINGS)
@given(
    dim=st.integers(2, 9),
    layers=st.integers(1, 3),
    batch=st.sampled_from([(), (1,), (4,), (2, 3)]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_givens_rotations_equal_the_plane_by_plane_loop(dim, layers, batch, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, dim // 2 + 1, (), generator=gen))
    planes = torch.stack(
        [torch.randperm(dim, generator=gen)[: 2 * k].view(k, 2) for _ in range(layers)]
    )
    planes = sync.check_planes(planes, dim)
    theta = torch.randn(layers, k, generator=gen)
    v = tensor((*batch, dim), dtype, "contiguous", seed)
    # one rotation per plane either way, in the same order within disjoint planes: 1 ulp apart
    torch.testing.assert_close(
        sync.apply_givens(v, planes, theta),
        sync.apply_givens_reference(v, planes, theta),
        rtol=1e-6 if dtype == torch.float32 else 1e-12,
        atol=1e-6 if dtype == torch.float32 else 1e-12,
    )


@settings(**SETTINGS)
@given(
    values=st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int64]),
            st.floats(-1e6, 1e6, allow_nan=False),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_read_scalars_equals_one_item_each(values):
    tensors = {f"v{i}": torch.tensor(x).to(dtype) for i, (dtype, x) in enumerate(values)}
    assert sync.read_scalars(tensors) == sync.read_scalars_reference(tensors)


# ---- the one-launch AdamW against its reference, on odd shapes --------------------------------
@settings(**{**SETTINGS, "max_examples": 10})
@given(
    shapes=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
    lr=st.sampled_from([0.0, 1e-3, 0.1]),
    weight_decay=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_adamw_kernel_equals_its_reference(kdev, shapes, lr, weight_decay, seed):
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(n, generator=gen) for n in shapes]
    grads = [[torch.randn(n, generator=gen) for n in shapes] for _ in range(3)]

    def run(implementation):
        ps = [p.clone().to(kdev).requires_grad_() for p in start]
        opt = MultiTensorAdamW(ps, lr=lr, weight_decay=weight_decay, implementation=implementation)
        for gs in grads:
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.to(kdev)
            opt.step()
        return ps

    # float32 either way; lerp and the bias corrections in another order (test_optim's tolerance)
    for a, b in zip(run("auto"), run("reference"), strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-5)
