"""accel.attention: every SDPA backend against attention in float64, the default path as
PyTorch's own call, a query without keys, bad inputs, rotary embeddings cached against
recomputed, fused q/k/v against separate."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from accel import attention as A
from accel.attention import backends as AB

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; this machine has none")


pytestmark = pytest.mark.usefixtures("one_thread")


# (B, H, S, D): one element, odd lengths, a head dim the fused kernels like and one they may not
SHAPES = [(1, 1, 1, 8), (2, 3, 17, 16), (3, 2, 33, 64), (1, 2, 129, 24)]
DTYPES = [torch.float32, torch.bfloat16]
MODES = ["none", "causal", "bool mask", "float mask"]


def qkv(shape, dtype, device, gen, *, seq_k=None, requires_grad=False):
    b, h, s, d = shape
    out = []
    for length in (s, seq_k or s, seq_k or s):
        t = torch.randn(b, h, length, d, generator=gen, device="cpu").to(device, dtype)
        out.append(t.requires_grad_(requires_grad))
    return out


def make_mask(mode, shape, dtype, device, gen, seq_k=None):
    _, _, s, _ = shape
    sk = seq_k or s
    if mode in ("none", "causal"):
        return None
    keep = torch.rand(s, sk, generator=gen) > 0.4
    keep[:, 0] = True  # no fully masked row: softmax of nothing is defined by convention only
    if mode == "bool mask":
        return keep.to(device)
    bias = torch.randn(1, 1, s, sk, generator=gen).masked_fill(~keep, -math.inf)
    return bias.to(device, dtype)


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def exact(q, k, v, mask, causal):
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return A.attention_reference(q.double(), k.double(), v.double(), mask=m, causal=causal)


@pytest.mark.parametrize("backend", A.BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_every_backend_that_runs_equals_the_float64_reference(
    backend, dtype, shape, mode, device, gen
):
    q, k, v = qkv(shape, dtype, device, gen)
    mask, causal = make_mask(mode, shape, dtype, device, gen), mode == "causal"
    reason = A.unavailable_reason(backend, q, k, v, mask=mask, causal=causal)
    if reason:  # it cannot run here: a forced call must say so, naming the backend
        with pytest.raises(A.BackendUnavailableError, match=f"'{backend}' cannot run"):
            A.sdpa(q, k, v, mask=mask, causal=causal, backend=backend)
        return
    out = A.sdpa(q, k, v, mask=mask, causal=causal, backend=backend)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(
        out.double(), exact(q, k, v, mask, causal), **A.TOLERANCES[dtype], check_dtype=False
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_manual_path_equals_the_float64_reference(dtype, device, gen):
    shape = (2, 3, 17, 16)
    q, k, v = qkv(shape, dtype, device, gen)
    torch.testing.assert_close(
        A.attention_reference(q, k, v, causal=True).double(),
        exact(q, k, v, None, True),
        **A.TOLERANCES[dtype],
    )


@pytest.mark.parametrize("backend", A.BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_the_reference(backend, causal, device, gen):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = qkv((2, 2, 33, 32), dtype, device, gen, requires_grad=True)
    if A.unavailable_reason(backend, q, k, v, causal=causal):
        pytest.skip(f"{backend} cannot run {dtype} on {device.type}")
    grad = torch.randn(q.shape, generator=gen).to(device, dtype)
    got = torch.autograd.grad(A.sdpa(q, k, v, causal=causal, backend=backend), (q, k, v), grad)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(
        A.attention_reference(*ref_inputs, causal=causal), ref_inputs, grad.double()
    )
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g.double(), r, **A.TOLERANCES[dtype])


@pytest.mark.parametrize("backend", ["flash", "math", "default"])
def test_cross_attention_with_causal_is_top_left_aligned(backend, device, gen):
    q, k, v = qkv((1, 2, 5, 16), torch.float32, device, gen, seq_k=9)
    if A.unavailable_reason(backend, q, k, v, causal=True):
        pytest.skip(f"{backend} cannot run float32 here")
    out = A.sdpa(q, k, v, causal=True, backend=backend)
    torch.testing.assert_close(out.double(), exact(q, k, v, None, True), **A.TOLERANCES[q.dtype])


def test_non_contiguous_heads_view(device, gen):
    # how SelfAttention feeds it: (B, S, H, D) transposed to (B, H, S, D), last stride 1
    x = torch.randn(2, 17, 3, 16, generator=gen).to(device)
    q = k = v = x.transpose(1, 2)
    assert not q.is_contiguous()
    torch.testing.assert_close(
        A.sdpa(q, k, v), A.attention_reference(q, k, v), **A.TOLERANCES[q.dtype]
    )


def test_fully_masked_row_gives_zero_like_sdpa(device, gen):
    q, k, v = qkv((1, 1, 4, 8), torch.float32, device, gen)
    keep = torch.ones(4, 4, dtype=torch.bool, device=device)
    keep[2] = False
    ref = A.attention_reference(q, k, v, mask=keep)
    assert torch.equal(ref[0, 0, 2], torch.zeros(8, device=device))
    torch.testing.assert_close(A.sdpa(q, k, v, mask=keep, backend="math"), ref)


# an inf in q also meets the keys a mask hides, which SDPA's math path reads and the reference not
BAD_INPUTS = [("q", math.nan), *((t, x) for t in "kv" for x in (math.nan, math.inf, -math.inf))]


@pytest.mark.parametrize(("where", "bad"), BAD_INPUTS, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_nan_and_inf_reach_the_reference_output_as_they_reach_sdpas(mode, where, bad, gen):
    shape = (2, 2, 9, 8)
    q, k, v = qkv(shape, torch.float32, "cpu", gen)
    mask, causal = make_mask(mode, shape, torch.float32, "cpu", gen), mode == "causal"
    tensor = {"q": q, "k": k, "v": v}[where]
    tensor[0, 1, 0, 3] = bad  # query or key 0: every query sees key 0
    tensor[1, 0, 0, 5] = math.nan
    expected = A.sdpa(q, k, v, mask=mask, causal=causal, backend="math")
    assert expected.isnan().any()
    got = A.attention_reference(q, k, v, mask=mask, causal=causal)
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_only_a_query_with_no_key_becomes_zero_in_the_reference(gen):
    q, k, v = qkv((1, 2, 6, 8), torch.float32, "cpu", gen)
    keep = torch.rand(6, 6, generator=gen) < 0.7
    keep[:, 0], keep[4] = True, False  # query 4 sees no key
    q[0, 0, 1, 2] = math.nan
    out = A.attention_reference(q, k, v, mask=keep)
    assert out[0, 0, 1].isnan().all() and not out[0, 1].isnan().any()
    assert torch.equal(out[:, :, 4], torch.zeros(1, 2, 8))


@pytest.mark.parametrize("shape", [(0, 2, 5, 8), (1, 2, 0, 8)], ids=str)
def test_empty_batch_or_queries(shape, gen):
    q = torch.randn(shape, generator=gen)
    k = v = torch.randn(max(shape[0], 0), 2, 5, 8, generator=gen)
    out = A.sdpa(q, k, v)
    assert out.shape == shape
    assert A.attention_reference(q, k, v).shape == shape


@pytest.mark.parametrize("backend", ["default", "math"])
def test_no_keys_at_all_gives_zero_like_the_reference(backend, gen):
    q = torch.randn(2, 3, 5, 8, generator=gen)
    k = v = torch.randn(2, 3, 0, 8, generator=gen)
    expected = A.attention_reference(q, k, v)
    assert torch.equal(expected, torch.zeros(2, 3, 5, 8))
    assert torch.equal(A.sdpa(q, k, v, backend=backend), expected)


def test_the_default_path_is_pytorchs_own_call_and_nothing_else(gen):
    """No measurement, no cache, no key: ``sdpa`` calls ``F.scaled_dot_product_attention`` once
    and no other function, Python or builtin (its host time is two comparisons over it)."""
    q, k, v = qkv((1, 2, 17, 16), torch.float32, "cpu", gen)
    for causal in (False, True):
        out, entered = _order_of_calls(lambda c=causal: A.sdpa(q, k, v, causal=c))
        assert entered == ["sdpa", "scaled_dot_product_attention"], entered
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.equal(out, expected)


def _order_of_calls(fn):
    """The Python functions and builtins ``fn`` enters, in order (``fn`` itself and the
    profiler's own switch left out)."""
    entered = []

    def note(frame, event, arg):
        if event == "call":
            entered.append(frame.f_code.co_name)
        elif event == "c_call":
            entered.append(getattr(arg, "__name__", repr(arg)))

    sys.setprofile(note)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, entered[1:-1]


def test_an_unknown_backend_is_refused_naming_the_known_ones(gen):
    q, k, v = qkv((1, 2, 9, 8), torch.float32, "cpu", gen)
    for mask in (None, torch.ones(9, 9, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"unknown SDPA backend 'auto'; expected one of default"):
            A.sdpa(q, k, v, mask=mask, backend="auto")
    with pytest.raises(ValueError, match="takes no mask kind; with one, expected one of default"):
        A.sdpa(q, k, v, mask=A.SlidingWindow(3), backend="auto")
    with pytest.raises(ValueError, match="unknown SDPA backend 'auto'"):
        A.SelfAttention(16, 2, backend="auto")


# ---- errors --------------------------------------------------------------------------------------
def test_forced_backend_that_cannot_run_names_itself_and_the_reason(device, gen):
    if device.type == "cpu":
        backend, why = "cudnn", "no cudnn attention kernel for CPU tensors"
        q, k, v = qkv((1, 2, 17, 16), torch.float32, device, gen)
    else:  # flash takes only fp16 and bf16 on CUDA
        backend, why = "flash", "dtype"
        q, k, v = qkv((1, 2, 17, 16), torch.float32, device, gen)
    with pytest.raises(
        A.BackendUnavailableError, match=f"(?s)'{backend}' cannot run.*{why}"
    ) as err:
        A.sdpa(q, k, v, backend=backend)
    assert err.value.backend == backend and why in err.value.reason
    with pytest.raises(A.BackendUnavailableError, match=why):  # cached: same error again
        A.sdpa(q, k, v, backend=backend)


def test_reason_is_picked_out_of_torchs_warnings_for_that_backend():
    # what PyTorch emits on CUDA when no forced kernel can run, one warning per line
    messages = [
        "Flash attention kernel not used because:",
        "Flash attention only supports head dimension at most 256, got 512",
        "Memory efficient kernel not used because:",
        "Memory Efficient attention has been disabled",
        "CuDNN attention kernel not used because:",
        "cuDNN attention requires head dim <= 128",
    ]
    err = RuntimeError("No available kernel. Aborting execution.")
    q = torch.empty(1, 2, 8, 64, device="meta")  # shape and dtype only
    assert AB._reason("flash", q, None, err, messages) == messages[1]
    assert AB._reason("cudnn", q, None, err, messages) == messages[5]
    assert AB._reason("efficient", q, None, err, []) == "No available kernel. Aborting execution."


def test_documented_limits_explain_what_torch_no_longer_says():
    # PyTorch warns its reasons once per process; later failures fall back on these
    q32 = torch.empty(1, 2, 8, 20, dtype=torch.float32, device="meta")
    assert AB._documented_limits("flash", q32, mask=q32) == [
        "flash takes float16 or bfloat16 inputs, got dtype torch.float32",
        "flash takes no explicit attention mask (causal only)",
        "head dimension must be a multiple of 8 up to 256, got 20",
    ]
    assert AB._documented_limits("efficient", q32.to(torch.bfloat16)[..., :16], None) == []


@pytest.mark.parametrize(
    ("change", "match", "pytorch_takes_it"),
    [
        (lambda q, k, v: (q, k.double(), v), "share a dtype", False),
        (lambda q, k, v: (q, k[..., :8], v), "mismatched shapes", False),
        (lambda q, k, v: (q, k, v[:, :, :5]), "mismatched shapes", True),
        (lambda q, k, v: (q[:1], k, v), "mismatched shapes", True),  # broadcast by PyTorch
        (lambda q, k, v: (q[0], k[0], v[0]), r"shape \(batch, heads, seq, head_dim\)", True),
        (lambda q, k, v: (q.long(), k.long(), v.long()), "floating point", False),
        (lambda q, k, v: (q.numpy(), k, v), "must be a torch.Tensor", False),
    ],
)
def test_bad_inputs_raise_clear_errors(change, match, pytorch_takes_it, gen):
    """A forced kernel and the reference check every input; the default path passes them to
    F.scaled_dot_product_attention as they come and says in our words what it refuses."""
    q, k, v = qkv((2, 2, 7, 16), torch.float32, "cpu", gen)
    bad = change(q, k, v)
    error = TypeError if match.startswith("must be") else ValueError
    for backend in ("flash", "math") if pytorch_takes_it else ("default", "flash", "math"):
        with pytest.raises(error, match=match):
            A.sdpa(*bad, backend=backend)
    with pytest.raises(error, match=match):
        A.attention_reference(*bad)
    if pytorch_takes_it:  # as F.scaled_dot_product_attention itself answers
        torch.testing.assert_close(
            A.sdpa(*bad), torch.nn.functional.scaled_dot_product_attention(*bad)
        )


def test_bad_masks_and_backends_raise_clear_errors(gen):
    q, k, v = qkv((2, 2, 7, 16), torch.float32, "cpu", gen)
    keep = torch.ones(7, 7, dtype=torch.bool)
    with pytest.raises(ValueError, match="either a mask or causal=True"):
        A.sdpa(q, k, v, mask=keep, causal=True)
    with pytest.raises(ValueError, match="does not broadcast"):
        A.sdpa(q, k, v, mask=torch.ones(5, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be bool or q's dtype"):
        A.sdpa(q, k, v, mask=torch.ones(7, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match="unknown SDPA backend 'fastest'"):
        A.sdpa(q, k, v, backend="fastest")


# ---- rotary embeddings ---------------------------------------------------------------------------
@pytest.mark.parametrize("seq", [1, 17, 49])
def test_cached_rope_equals_recomputed(seq, device, gen):
    cached = A.RotaryEmbedding(16, 64, cached=True).to(device)
    fresh = A.RotaryEmbedding(16, 64, cached=False)
    q, k, _ = qkv((2, 3, seq, 16), torch.float32, device, gen)
    for a, b in zip(cached(q, k), fresh(q, k), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # vector vs scalar cos: 1 ulp
    assert cached.cos_cached.device == q.device and len(list(cached.buffers())) == 2
    assert list(fresh.buffers()) == []  # the "before" keeps nothing


def test_rope_is_a_rotation_by_relative_position(gen):
    rope = A.RotaryEmbedding(8, 32)
    q = torch.randn(1, 1, 1, 8, generator=gen).expand(1, 1, 32, 8)
    k = torch.randn(1, 1, 1, 8, generator=gen).expand(1, 1, 32, 8)
    rq, rk = rope(q, k)
    torch.testing.assert_close(rq[..., 0, :], q[..., 0, :])  # position 0 does not turn
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps lengths
    scores = rq[0, 0] @ rk[0, 0].T  # depends on m - n only: constant along each diagonal
    torch.testing.assert_close(
        scores.diagonal(3), scores.diagonal(3)[:1].expand(29), atol=1e-4, rtol=1e-4
    )


def test_rope_keeps_bf16_activations_bf16(gen):
    q, k, _ = qkv((1, 2, 9, 8), torch.bfloat16, "cpu", gen)
    assert all(t.dtype == torch.bfloat16 for t in A.RotaryEmbedding(8, 9)(q, k))


def test_rope_bad_sizes():
    with pytest.raises(ValueError, match="even head_dim"):
        A.RotaryEmbedding(7, 16)
    rope = A.RotaryEmbedding(8, 4)
    x = torch.randn(1, 1, 5, 8)
    with pytest.raises(ValueError, match="exceeds max_seq_len 4"):
        rope(x, x)
    with pytest.raises(ValueError, match="expected head_dim 8"):
        rope(x[..., :4], x[..., :4])


# ---- q, k, v projections and the module -----------------------------------------------------------
def test_fused_qkv_equals_separate_with_the_same_weights(gen):
    torch.manual_seed(3)
    separate = A.QKVProjection(24, fused=False)
    after_separate = torch.rand(1)
    torch.manual_seed(3)
    fused = A.QKVProjection(24, fused=True)
    assert torch.equal(torch.rand(1), after_separate)  # fusing draws no extra random numbers
    for name, tensor in separate.separate_parameters().items():
        assert torch.equal(fused.separate_parameters()[name], tensor), name
    x = torch.randn(3, 11, 24, generator=gen)
    for a, b in zip(fused(x), separate(x), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"expected inputs \(\.\.\., 24\)"):
        fused(x[..., :8])


@pytest.mark.parametrize("fused_qkv", [False, True])
@pytest.mark.parametrize("cached", [False, True])
def test_self_attention_sdpa_equals_manual(fused_qkv, cached, device, gen):
    def make(use_sdpa):
        torch.manual_seed(1)
        rope = A.RotaryEmbedding(8, 64, cached=cached)
        return A.SelfAttention(24, 3, use_sdpa=use_sdpa, fused_qkv=fused_qkv, rope=rope).to(device)

    x = torch.randn(2, 23, 24, generator=gen).to(device)
    fast, slow = make(True), make(False)
    torch.testing.assert_close(fast(x), slow(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast(x, causal=True), slow(x, causal=True), rtol=1e-5, atol=1e-5)


# ---- CUDA only -------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn", "math", "default"])
def test_profiler_sees_the_backend_that_was_asked_for(backend, gen):
    from accel.lab.cases.sdpa import which_backend

    q, k, v = qkv((2, 8, 1024, 128), torch.bfloat16, "cuda", gen)
    if A.unavailable_reason(backend, q, k, v):
        pytest.skip(f"{backend}: {A.unavailable_reason(backend, q, k, v)}")
    ran = which_backend(lambda: A.sdpa(q, k, v, backend=backend), torch.device("cuda"))
    expected = A.picked_kernel(q, k, v) if backend == "default" else backend
    assert ran["backend"] == expected, ran


@pytest.mark.parametrize("backend", A.BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_query_with_no_key_gets_zero_on_every_backend(device, backend, kind, seed):
    # CUDA's fused kernels return other values for such a row; the contract is 0, as on the CPU
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(2, 2, 5, 16, generator=gen).to(device, dtype) for _ in "qkv")
    keep = torch.rand(2, 1, 5, 5, generator=gen) < 0.7
    keep[..., 0] = True
    keep[:, :, 2, :] = False  # query 2 sees no key
    keep = keep.to(device)
    mask = (
        keep
        if kind == "bool"
        else torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))
    )
    try:
        out = A.sdpa(q, k, v, mask=mask, backend=backend)
    except A.BackendUnavailableError:
        pytest.skip(f"{backend} cannot run a mask of {dtype} on {device.type}")
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    expected = A.attention_reference(
        q.double(), k.double(), v.double(), mask=mask if kind == "bool" else mask.double()
    )
    torch.testing.assert_close(out.double(), expected, **A.TOLERANCES[dtype])


def test_an_additive_mask_is_made_once_per_bool_mask_and_version_while_it_lives(gen):
    keep = torch.rand(2, 1, 5, 7, generator=gen) < 0.6
    first = AB._additive_mask(keep, torch.float16)
    assert first.dtype == torch.float16 and torch.equal(first == 0, keep)
    assert torch.isneginf(first[~keep]).all()
    assert AB._additive_mask(keep, torch.float16) is first
    assert AB._additive_mask(keep, torch.float32) is not first  # another dtype
    keep[0, 0, 0, 0] = not keep[0, 0, 0, 0]  # changed in place: a new version
    again = AB._additive_mask(keep, torch.float32)
    assert torch.equal(again == 0, keep)
    key = id(keep)
    del keep
    assert key not in AB._ADDITIVE  # gone with its mask


def test_a_kernel_that_zeroes_only_with_an_additive_mask_gets_one(monkeypatch, gen):
    q, k, v = qkv((2, 2, 5, 16), torch.float32, "cpu", gen)
    keep = torch.rand(2, 1, 5, 5, generator=gen) < 0.7
    keep[..., 0] = True
    keep[:, :, 2] = False  # query 2 has no key
    seen = []
    monkeypatch.setattr(AB, "_zero_without_keys", lambda kernel, q, m: m.dtype != torch.bool)
    real = AB._call
    monkeypatch.setattr(
        AB, "_call", lambda b, q, k, v, m, *a: seen.append(m.dtype) or real(b, q, k, v, m, *a)
    )
    assert AB._mask_plan("default", q, k, v, keep, False, None) == (True, False)
    out = A.sdpa(q, k, v, mask=keep, backend="default")
    assert seen[-1] == torch.float32
    torch.testing.assert_close(out, A.attention_reference(q, k, v, mask=keep))


@pytest.mark.parametrize("backend", ["default", "math"])
@pytest.mark.parametrize("mode", ["bool mask", "float mask"])
def test_a_mask_traces_into_one_graph_and_a_query_without_keys_gets_zero(
    backend, mode, device, gen
):
    shape = (2, 3, 9, 8)
    q, k, v = qkv(shape, torch.float32, device, gen)
    mask = make_mask(mode, shape, torch.float32, device, gen)
    mask[..., 4, :] = False if mask.dtype == torch.bool else -math.inf  # query 4 sees no key
    torch._dynamo.reset()
    traced = torch.compile(
        lambda q, k, v, m: A.sdpa(q, k, v, mask=m, backend=backend), backend="eager", fullgraph=True
    )
    out = traced(q, k, v, mask)
    torch.testing.assert_close(out.double(), exact(q, k, v, mask, False), rtol=1e-5, atol=1e-5)
    assert not out[:, :, 4].any()


def test_self_attention_names_the_shape_it_takes():
    layer = A.SelfAttention(12, 3)
    with pytest.raises(ValueError, match=r"x of shape \(batch, seq, 12\), got \(7, 12\)"):
        layer(torch.randn(7, 12))


@pytest.mark.parametrize(("dim", "heads", "error", "match"), [
    (24, 3, ValueError, r"rotary embeddings of head_dim 4 for heads of 8 \(dim 24 / 3 heads\)"),
    (16, 0, ValueError, r"heads must be an int >= 1, got 0"),
    (16, True, TypeError, r"heads must be an int >= 1, got True"),
])
def test_self_attention_refuses_a_rotary_of_another_head_size_when_built(dim, heads, error, match):
    with pytest.raises(error, match=match):
        A.SelfAttention(dim, heads, rope=A.RotaryEmbedding(4, 16))
