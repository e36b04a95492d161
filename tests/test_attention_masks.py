"""Masked attention: every mask kind against its rule written as a loop, its block mask against
``create_block_mask``, FlexAttention and the dense mask against attention in float64, forward and
backward, the default path (compiled FlexAttention, its fallback), caches, bad inputs. On the CPU
FlexAttention runs uncompiled when forced (forward only, PyTorch's limit) and once compiled;
compiled on a GPU in the tests marked gpu."""

from __future__ import annotations

import math
import os
import shutil
import sys
import warnings

import pytest
import torch

from accel import attention as A
from accel import errors
from accel.attention import ALiBi, Causal, Document, PrefixLM, SlidingWindow, dense_mask
from accel.attention import flex as AF

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; this machine has none")
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")

# name -> a mask for 2 batch rows on a device: shared and per-row data, zero-length documents,
# padding after the last document, a window wider than the keys, ALiBi over three patterns
KINDS = {
    "causal": lambda dev: Causal(),
    "window": lambda dev: SlidingWindow(7),
    "window wider than the keys": lambda dev: SlidingWindow(200),
    "document": lambda dev: Document(torch.tensor([9, 0, 20], device=dev)),
    "document per row": lambda dev: Document(
        torch.tensor([[30, 7, 0], [3, 0, 34]], device=dev), causal=False
    ),
    "prefix": lambda dev: PrefixLM(11),
    "prefix per row": lambda dev: PrefixLM(torch.tensor([0, 40], device=dev)),
    "alibi": lambda dev: ALiBi(),
    "alibi window": lambda dev: ALiBi(SlidingWindow(5)),
    "alibi everywhere": lambda dev: ALiBi(None),
}
SELF, CROSS = (37, 37), [(29, 45), (45, 29)]  # (Sq, Sk); documents are self-attention only


def shapes_of(kind: str) -> list[tuple[int, int]]:
    return [SELF] if "document" in kind else [SELF, *CROSS]


CASES = [(kind, shape) for kind in KINDS for shape in shapes_of(kind)]


def document_of(lengths: list[int], seq: int) -> list[int]:
    """Each position's document: in order, zero-length ones skipped, the rest one more."""
    ids = [i for i, n in enumerate(lengths) for _ in range(n)]
    return (ids + [len(lengths)] * seq)[:seq]


def sees(mask, row: int, i: int, j: int, seq: int) -> bool:
    """The rule of each kind, for query i and key j of batch row ``row``, written plainly."""
    if isinstance(mask, ALiBi):
        return True if mask.mask is None else sees(mask.mask, row, i, j, seq)
    if isinstance(mask, Causal):
        return j <= i
    if isinstance(mask, SlidingWindow):
        return i - mask.window < j <= i
    if isinstance(mask, PrefixLM):
        p = mask.prefix
        p = int(p[row if p.numel() > 1 else 0]) if isinstance(p, torch.Tensor) else p
        return j < p or j <= i
    lengths = mask.lengths.reshape(-1, mask.lengths.shape[-1])
    doc = document_of(lengths[row if lengths.shape[0] > 1 else 0].tolist(), seq)
    return doc[i] == doc[j] and (j <= i or not mask.causal)


def loop_mask(mask, rows: int, seq_q: int, seq_k: int) -> torch.Tensor:
    return torch.tensor(
        [
            [[sees(mask, r, i, j, seq_q) for j in range(seq_k)] for i in range(seq_q)]
            for r in range(rows)
        ]
    )


def qkv(batch, heads, seq_q, seq_k, dtype, device, gen, *, head_dim=16, grad=False):
    out = []
    for length in (seq_q, seq_k, seq_k):
        t = torch.randn(batch, heads, length, head_dim, generator=gen).to(device, dtype)
        out.append(t.requires_grad_(grad))
    return out


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def fresh_caches():
    A.clear_masked_cache()
    yield
    A.clear_masked_cache()


@pytest.fixture
def quiet_fallback():
    """The CPU's default path takes the dense mask after one warning: not what these tests ask."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "accel.attention: FlexAttention cannot run here")
        yield


def exact(q, k, v, mask):
    return A.masked_reference(q.double(), k.double(), v.double(), mask)


# ---- the kinds' rules, dense and block-sparse ----------------------------------------------------
@pytest.mark.parametrize(("kind", "shape"), CASES, ids=str)
def test_dense_mask_and_mask_mod_are_the_kinds_rule(kind, shape, gen):
    from torch.nn.attention.flex_attention import create_mask

    mask, (seq_q, seq_k) = KINDS[kind](CPU), shape
    q, k, _ = qkv(2, 3, seq_q, seq_k, torch.float32, CPU, gen)
    expected = loop_mask(mask, mask.rows or 1, seq_q, seq_k)
    dense = dense_mask(mask, q, k)
    keep = dense if dense.dtype == torch.bool else ~torch.isneginf(dense)
    assert keep.shape[1] in (1, 3) and torch.equal(keep[:, 0], expected)
    evaluated = create_mask(mask.mask_mod(seq_q, seq_k, CPU), mask.rows or 1, 1, seq_q, seq_k, CPU)
    assert torch.equal(evaluated[:, 0], expected)


def test_alibi_bias_is_minus_slope_times_distance(gen):
    q, k, _ = qkv(1, 4, 5, 7, torch.float64, CPU, gen)
    dense = dense_mask(ALiBi(None), q, k)
    slopes = [2 ** (-8 * (h + 1) / 4) for h in range(4)]
    expected = torch.tensor(
        [[[-s * abs(i - j) for j in range(7)] for i in range(5)] for s in slopes],
        dtype=torch.float64,
    )
    torch.testing.assert_close(dense[0], expected)
    causal = dense_mask(ALiBi(), q, k)
    assert torch.isneginf(causal[0, :, 0, 1:]).all() and torch.equal(
        causal[0, :, 4, :5], expected[:, 4, :5]
    )


BLOCK_SHAPES = [(300, 300), (256, 256), (200, 330), (330, 200)]
BLOCK_KINDS = {
    **KINDS,
    "window over tiles": lambda dev: SlidingWindow(150),
    "document with whole tiles": lambda dev: Document(  # fills the 300 positions exactly
        torch.tensor([[260, 40], [5, 295]], device=dev), causal=False
    ),
    "prefix over a tile": lambda dev: PrefixLM(140),
}


@pytest.mark.parametrize(
    ("kind", "shape"),
    [
        (kind, shape)
        for kind in BLOCK_KINDS
        for shape in BLOCK_SHAPES[: 1 if "whole tiles" in kind else 2 if "document" in kind else 4]
    ],
    ids=str,
)
def test_block_mask_equals_create_block_mask(kind, shape, gen):
    from torch.nn.attention.flex_attention import create_block_mask

    mask, (seq_q, seq_k) = BLOCK_KINDS[kind](CPU), shape
    q, k, _ = qkv(2, 1, seq_q, seq_k, torch.float32, CPU, gen, head_dim=8)
    ours = A.block_mask(mask, q, k)
    rows = mask.rows or 1
    mask_mod = mask.mask_mod(seq_q, seq_k, CPU)
    theirs = create_block_mask(mask_mod, rows if rows > 1 else None, None, seq_q, seq_k, CPU)
    for name in ("kv", "full_kv", "q", "full_q"):
        for part in ("num_blocks", "indices"):
            assert torch.equal(
                getattr(ours, f"{name}_{part}"), getattr(theirs, f"{name}_{part}")
            ), f"{name}_{part}"
    assert ours.seq_lengths == (seq_q, seq_k) and ours.BLOCK_SIZE == (128, 128)


def test_block_mask_is_small_and_built_without_reading_the_device(count_host_reads, gen):
    seq = 8192
    lengths = torch.tensor([[1000, 3000, 4192], [8192, 0, 0]])
    q, k, _ = qkv(2, 1, seq, seq, torch.float32, CPU, gen, head_dim=8)
    built = []
    document = Document(lengths)  # on a CPU its lengths are checked (>= 0) here, a CPU read
    reads = count_host_reads(lambda: built.append(A.block_mask(document, q, k)))
    assert sum(reads.values()) == 0, reads
    (blocks,) = built
    tensors = [t for t in blocks.as_tuple() if isinstance(t, torch.Tensor)]
    assert sum(t.nbytes for t in tensors) <= 0.01 * 2 * seq * seq  # the dense bool mask's bytes


# ---- every path against attention in float64 ------------------------------------------------
@pytest.mark.parametrize(("kind", "shape"), CASES, ids=str)
def test_every_path_equals_the_float64_reference(kind, shape, gen, quiet_fallback):
    mask, (seq_q, seq_k) = KINDS[kind](CPU), shape
    q, k, v = qkv(2, 3, seq_q, seq_k, torch.float32, CPU, gen)
    expected = exact(q, k, v, mask)
    for backend in A.MASKED_BACKENDS:
        out = A.sdpa(q, k, v, mask=mask, backend=backend)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(
            out.double(), expected, **A.TOLERANCES[q.dtype], msg=lambda m, b=backend: f"{b}: {m}"
        )
    manual = A.masked_reference(q, k, v, mask)
    torch.testing.assert_close(manual.double(), expected, **A.TOLERANCES[q.dtype])


@pytest.mark.parametrize("kind", list(KINDS))
def test_bf16_paths_equal_the_float64_reference(kind, gen):
    mask = KINDS[kind](CPU)
    q, k, v = qkv(2, 3, 37, 37, torch.bfloat16, CPU, gen)
    expected = exact(q, k, v, mask)
    for backend in ("flex", "dense"):
        out = A.sdpa(q, k, v, mask=mask, backend=backend)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), expected, **A.TOLERANCES[torch.bfloat16])


def test_a_query_with_no_key_gets_zero_on_every_path(gen):
    # a window over a shorter key sequence: queries 12.. see no key
    q, k, v = qkv(1, 2, 20, 10, torch.float32, CPU, gen)
    mask = SlidingWindow(3)
    for backend in ("flex", "dense"):
        out = A.sdpa(q, k, v, mask=mask, backend=backend)
        assert torch.equal(out[:, :, 12:], torch.zeros_like(out[:, :, 12:])), backend
    assert torch.equal(A.masked_reference(q, k, v, mask)[:, :, 12:], torch.zeros(1, 2, 8, 16))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("kind", ["window", "document per row", "prefix per row", "alibi window"])
def test_the_reference_gives_nan_to_the_queries_that_see_nan_or_inf(kind, bad, gen):
    mask, seq = KINDS[kind](CPU), 37
    q, k, v = qkv(2, 2, seq, seq, torch.float32, CPU, gen)
    # query 5 sees its own key at least; that key's positive component makes an infinite query's
    # score +inf there (a row of only -inf scores would be a row without keys)
    k[0, 0, 5, 1] = k[0, 0, 5, 1].abs() + 1
    clean = A.masked_reference(q, k, v, mask)
    q[0, 0, 5, 1] = bad  # its row is NaN
    k[1, 1, 20, 3] = math.nan  # every query that sees key 20 gets NaN
    out = A.masked_reference(q, k, v, mask)
    expected = torch.zeros(2, 2, seq, dtype=torch.bool)
    expected[0, 0, 5] = True
    expected[1, 1] = loop_mask(mask, 2, seq, seq)[1, :, 20]
    assert torch.equal(out.isnan().all(-1), expected) and torch.equal(out.isnan().any(-1), expected)
    torch.testing.assert_close(out[~expected], clean[~expected], rtol=0, atol=0)


def test_a_query_with_no_key_stays_zero_beside_a_nan_key(gen):
    q, k, v = qkv(1, 2, 20, 10, torch.float32, CPU, gen)
    k[0, 1, 9, 0] = math.nan
    out = A.masked_reference(q, k, v, SlidingWindow(3))  # queries 12.. see no key
    assert torch.equal(out[:, :, 12:], torch.zeros(1, 2, 8, 16))
    assert out[0, 1, 9:12].isnan().all() and not out[0, 0].isnan().any()


@pytest.mark.parametrize("kind", ["window", "document per row", "prefix per row", "alibi"])
def test_dense_path_gradients_match_the_reference(kind, gen):
    mask = KINDS[kind](CPU)
    q, k, v = qkv(2, 3, 37, 37, torch.float32, CPU, gen, grad=True)
    grad = torch.randn(q.shape, generator=gen)
    got = torch.autograd.grad(A.sdpa(q, k, v, mask=mask, backend="dense"), (q, k, v), grad)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(A.masked_reference(*ref_inputs, mask), ref_inputs, grad.double())
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g.double(), r, **A.TOLERANCES[torch.float32])


# ---- the default path, caches, the CPU's limits --------------------------------------------
def test_the_default_path_is_flex_attention_with_a_block_mask_made_once(monkeypatch, gen):
    """What a user writes with attention-gym: the compiled flex_attention called with the mask's
    block mask, made on the first call and kept for later calls of the same mask and shapes."""
    calls = []

    def flex(q, k, v, **kwargs):
        calls.append(kwargs)
        return AF._uncompiled(q, k, v, **kwargs)

    monkeypatch.setattr(AF, "FLEX_COMPILE_ON_CPU", True)
    monkeypatch.setitem(AF._FLEX, "cpu", flex)
    built = []
    real = AF.block_mask
    monkeypatch.setattr(AF, "block_mask", lambda *a, **kw: built.append(1) or real(*a, **kw))
    q, k, v = qkv(2, 2, 37, 37, torch.float32, CPU, gen)
    for mask in (SlidingWindow(5), SlidingWindow(5), ALiBi(SlidingWindow(5))):
        out = A.sdpa(q, k, v, mask=mask)
        torch.testing.assert_close(out.double(), exact(q, k, v, mask), **A.TOLERANCES[q.dtype])
    assert len(built) == 2  # equal kinds share one block mask; ALiBi's is its inner window's
    assert [set(c) for c in calls] == [{"block_mask", "scale"}] * 2 + [
        {"block_mask", "scale", "score_mod"}
    ]
    assert calls[0]["block_mask"] is calls[1]["block_mask"]


def test_causal_alone_runs_sdpas_causal_kernel(monkeypatch, gen):
    q, k, v = qkv(2, 2, 29, 45, torch.float32, CPU, gen)
    monkeypatch.setattr(AF, "_flex_function", lambda device: pytest.fail("flex was called"))
    out = A.sdpa(q, k, v, mask=Causal())
    assert torch.equal(
        out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    )


def test_where_flex_cannot_run_the_default_path_warns_once_and_takes_the_dense_mask(gen):
    q, k, v = qkv(1, 2, 17, 17, torch.float32, CPU, gen, grad=True)
    errors._warned.clear()
    with pytest.warns(RuntimeWarning, match="FlexAttention cannot run here.*dense mask"):
        out = A.sdpa(q, k, v, mask=SlidingWindow(4))
    out.sum().backward()
    torch.testing.assert_close(
        out.double(), exact(q, k, v, SlidingWindow(4)), **A.TOLERANCES[q.dtype]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A.sdpa(q, k, v, mask=SlidingWindow(5))  # another mask, the same reason: no warning


def test_a_compile_that_fails_falls_back_to_the_dense_mask_with_its_reason(monkeypatch, gen):
    def broken(q, k, v, **kwargs):
        raise RuntimeError("no kernel for this head size\nmore lines")

    monkeypatch.setattr(AF, "FLEX_COMPILE_ON_CPU", True)
    monkeypatch.setitem(AF._FLEX, "cpu", broken)
    errors._warned.clear()
    q, k, v = qkv(1, 2, 17, 17, torch.float32, CPU, gen)
    with pytest.warns(RuntimeWarning, match=r"RuntimeError: no kernel for this head size\)"):
        out = A.sdpa(q, k, v, mask=SlidingWindow(4))
    torch.testing.assert_close(out, A.sdpa(q, k, v, mask=SlidingWindow(4), backend="dense"))
    with pytest.raises(A.BackendUnavailableError, match=r"'flex' cannot run.*head size"):
        A.sdpa(q, k, v, mask=SlidingWindow(4), backend="flex")


def test_flex_has_no_backward_on_the_cpu_so_forcing_it_says_so(gen):
    q, k, v = qkv(1, 2, 17, 17, torch.float32, CPU, gen, grad=True)
    with pytest.raises(A.BackendUnavailableError, match=r"'flex' cannot run.*no backward"):
        A.sdpa(q, k, v, mask=SlidingWindow(4), backend="flex")


def test_block_masks_are_cached_per_mask_and_rebuilt_when_its_data_changes(gen):
    q, k, v = qkv(2, 2, 37, 37, torch.float32, CPU, gen)
    lengths = torch.tensor([[20, 17], [5, 32]])
    mask = Document(lengths)
    A.sdpa(q, k, v, mask=mask, backend="flex")
    first = dict(AF._BLOCK_MASKS)
    A.sdpa(q, k, v, mask=mask, backend="flex")
    assert first == AF._BLOCK_MASKS  # the same mask: the same block mask
    lengths[0] = torch.tensor([30, 7])  # changed in place: never a stale mask
    for backend in ("flex", "dense"):
        out = A.sdpa(q, k, v, mask=mask, backend=backend)
        expected = exact(q, k, v, mask)
        torch.testing.assert_close(out.double(), expected, **A.TOLERANCES[q.dtype], msg=backend)
    assert len(AF._BLOCK_MASKS) == 2
    A.sdpa(q, k, v, mask=SlidingWindow(3), backend="flex")
    A.sdpa(q, k, v, mask=SlidingWindow(3), backend="flex")  # equal kinds share one
    assert len(AF._BLOCK_MASKS) == 3
    for make in (lambda: PrefixLM(11), lambda: ALiBi(PrefixLM(11))):  # a new object per call
        A.sdpa(q, k, v, mask=make(), backend="flex")
        A.sdpa(q, k, v, mask=make(), backend="flex")
    assert len(AF._BLOCK_MASKS) == 5 and len(AF._READY) == 6  # one each, not one per object


def test_cached_calls_read_nothing_on_the_host(count_host_reads, gen):
    q, k, v = qkv(2, 2, 37, 37, torch.float32, CPU, gen)
    for backend in A.MASKED_BACKENDS:
        A.sdpa(q, k, v, mask=Causal(), backend=backend)
        reads = count_host_reads(lambda b=backend: A.sdpa(q, k, v, mask=Causal(), backend=b))
        assert sum(reads.values()) == 0, (backend, reads)
    document = Document(torch.tensor([[20, 17], [5, 32]]))  # its CPU check outside the count
    reads = count_host_reads(lambda: A.sdpa(q, k, v, mask=document, backend="flex"))
    assert sum(reads.values()) == 0, reads  # a new document: its block mask built on the device


def test_a_repeated_masked_call_is_one_key_and_one_lookup(gen):
    """After its first call a masked key runs its path with what it needs bound: no checks, no
    block mask looked up again."""
    q, k, v = qkv(2, 2, 37, 37, torch.float32, CPU, gen)
    for backend in ("flex", "dense"):
        first = A.sdpa(q, k, v, mask=SlidingWindow(5), backend=backend)
        entered = []

        def note(frame, event, _, entered=entered):
            if event == "call":
                entered.append((os.path.basename(frame.f_code.co_filename), frame.f_code.co_name))

        sys.setprofile(note)
        try:
            again = A.sdpa(q, k, v, mask=SlidingWindow(5), backend=backend)
        finally:
            sys.setprofile(None)
        slow = {("flex.py", n) for n in ("_check", "_ready", "_bound_flex", "block_mask")}
        slow.add(("reference.py", "check_inputs"))
        assert not slow & set(entered), (backend, entered)
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        with pytest.raises(ValueError, match="not both"):  # what the bound call skips: checked
            A.sdpa(q, k, v, mask=SlidingWindow(5), causal=True, backend=backend)


@pytest.mark.parametrize("backend", A.MASKED_BACKENDS)
def test_causal_with_a_mask_kind_is_refused_after_the_same_inputs_ran_without_it(
    backend, gen, quiet_fallback
):
    q, k, v = qkv(1, 2, 17, 17, torch.float32, CPU, gen)
    A.sdpa(q, k, v, mask=SlidingWindow(4), backend=backend)
    with pytest.raises(ValueError, match="either a mask or causal=True, not both"):
        A.sdpa(q, k, v, mask=SlidingWindow(4), causal=True, backend=backend)


def test_repeated_calls_are_kept_for_a_bounded_number_of_masks(monkeypatch, gen):
    monkeypatch.setattr(AF, "_READY_KEPT", 8)
    q, k, v = qkv(1, 2, 37, 37, torch.float32, CPU, gen)
    for split in range(1, 37):  # a new Document per batch: each its own bound call
        A.sdpa(q, k, v, mask=Document(torch.tensor([split, 37 - split])), backend="dense")
    assert 0 < len(AF._READY) <= AF._READY_KEPT < 36
    A.clear_masked_cache()
    assert AF._READY == {}


def test_sdpa_hands_mask_kinds_on_and_tensors_not(gen):
    q, k, v = qkv(1, 2, 17, 17, torch.float32, CPU, gen)
    kind = A.sdpa(q, k, v, mask=SlidingWindow(4), backend="dense")
    tensor = A.sdpa(q, k, v, mask=dense_mask(SlidingWindow(4), q, k))
    torch.testing.assert_close(kind, tensor)
    assert AF._DENSE_MASKS and not AF._BLOCK_MASKS  # the kind's dense mask, made and kept


def test_inside_torch_compile_nothing_is_timed_and_the_answer_holds(gen):
    q, k, v = qkv(1, 2, 37, 37, torch.float32, CPU, gen)

    def attend(q, k, v):
        return A.sdpa(q, k, v, mask=SlidingWindow(5)) + A.sdpa(q, k, v, mask=Causal())

    out = torch.compile(attend, backend="eager")(q, k, v)
    expected = exact(q, k, v, SlidingWindow(5)) + exact(q, k, v, Causal())
    torch.testing.assert_close(out.double(), expected, **A.TOLERANCES[torch.float32])
    assert AF._READY == {} and AF._BLOCK_MASKS == {}


# ---- compiled FlexAttention: guards, room to compile, and once for real on the CPU -----------
@pytest.fixture
def compiled_flex(monkeypatch):
    """FlexAttention through torch.compile with the eager backend: dynamo's guards and
    recompiles as on a GPU, without building kernels."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(AF, "FLEX_COMPILE_ON_CPU", True)
    monkeypatch.setitem(AF._FLEX, "cpu", torch.compile(flex_attention, backend="eager"))
    return lambda: counters["stats"]["unique_graphs"]


def test_new_documents_of_one_shape_reuse_the_compiled_code(compiled_flex, gen):
    q, k, v = qkv(2, 2, 37, 37, torch.float32, CPU, gen)
    A.sdpa(q, k, v, mask=Document(torch.tensor([[10, 27], [30, 7]])), backend="flex")
    graphs = compiled_flex()
    for split in (5, 20):
        mask = Document(torch.tensor([[split, 37 - split], [37 - split, split]]))
        out = A.sdpa(q, k, v, mask=mask, backend="flex")
        torch.testing.assert_close(out.double(), exact(q, k, v, mask), **A.TOLERANCES[q.dtype])
    assert compiled_flex() == graphs


def test_each_new_signature_gets_room_to_compile(compiled_flex, gen):
    # flex compiles one variant per head size: more than torch.compile's default limit of 8
    graphs = compiled_flex()
    for head_dim in range(8, 8 * 12, 8):
        q, k, v = qkv(1, 1, 17, 17, torch.float32, CPU, gen, head_dim=head_dim)
        A.sdpa(q, k, v, mask=SlidingWindow(4), backend="flex")
    assert compiled_flex() - graphs == 11


@pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="compiling FlexAttention for the CPU needs a C++ compiler; none found",
)
def test_compiled_flex_on_the_cpu_equals_the_reference(monkeypatch, gen):
    # the one real compile of the CPU tests (tens of seconds): full and partial tiles, per row
    monkeypatch.setattr(AF, "FLEX_COMPILE_ON_CPU", True)
    monkeypatch.setattr(AF, "_FLEX", {})
    q, k, v = qkv(2, 2, 300, 300, torch.float32, CPU, gen)
    mask = ALiBi(Document(torch.tensor([[260, 40], [5, 295]]), causal=False))
    out = A.sdpa(q, k, v, mask=mask, backend="flex")
    torch.testing.assert_close(out.double(), exact(q, k, v, mask), **A.TOLERANCES[q.dtype])


# ---- bad inputs -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: SlidingWindow(0), ValueError, r"window \(keys seen\) must be an int >= 1"),
        (lambda: SlidingWindow(2.5), TypeError, r"must be an int >= 1, got 2.5 \(float\)"),
        (lambda: PrefixLM(-1), ValueError, "prefix must be an int >= 0"),
        (lambda: PrefixLM("3"), TypeError, r"prefix must be an int >= 0, got '3' \(str\)"),
        (lambda: Document([3, 4]), TypeError, "lengths must be a torch.Tensor"),
        (lambda: Document(torch.tensor([3.0, 4.0])), ValueError, "must hold integers"),
        (lambda: Document(torch.zeros(2, 2, 2, dtype=torch.long)), ValueError, "1 or 2 dim"),
        (lambda: Document(torch.tensor([-3, 5])), ValueError, r"lengths must be >= 0, got -3"),
        (lambda: PrefixLM(torch.tensor([4, -1])), ValueError, r"prefix must be >= 0, got -1"),
        (lambda: ALiBi(ALiBi()), ValueError, "adds the bias twice"),
        (lambda: ALiBi("causal"), TypeError, "mask kind or None"),
        (lambda: dense_mask(Causal(), 7, 7), TypeError, r"q must be a tensor .*, got int"),
    ],
)
def test_bad_masks_raise_clear_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda q, k, v: A.sdpa(q, k, v, mask=Causal(), causal=True), ValueError, "not both"),
        (lambda q, k, v: A.sdpa(q, k, v, mask="causal"), TypeError, "mask kind of"),
        (
            lambda q, k, v: A.sdpa(q, k, v, mask=SlidingWindow(3), backend="flash"),
            ValueError,
            "takes no mask kind; with one, expected one of default, flex, dense",
        ),
        (
            lambda q, k, v: A.sdpa(q, k[:, :, :5], v[:, :, :5], mask=Document(torch.tensor([7]))),
            ValueError,
            "as many queries as keys",
        ),
        (
            lambda q, k, v: A.sdpa(q, k, v, mask=Document(torch.tensor([[7]] * 3))),
            ValueError,
            "holds 3 batch rows, q has batch 2",
        ),
        (
            lambda q, k, v: A.sdpa(q, k.double(), v, mask=Causal()),
            ValueError,
            "share a dtype",
        ),
        (
            lambda q, k, v: A.masked_reference(q, k, v, PrefixLM(torch.tensor([1, 2, 3]))),
            ValueError,
            "holds 3 batch rows",
        ),
    ],
)
def test_bad_calls_raise_clear_errors(call, error, match, gen):
    q, k, v = qkv(2, 2, 7, 7, torch.float32, CPU, gen)
    with pytest.raises(error, match=match):
        call(q, k, v)


TOO_LONG = r"Document lengths sum to {} in batch row {}, past the 7 positions of the sequence"


@pytest.mark.parametrize(
    ("lengths", "match"),
    [([3, 5], TOO_LONG.format(8, 0)), ([[3, 4], [2, 6]], TOO_LONG.format(8, 1))],
    ids=["shared", "per row"],
)
@pytest.mark.parametrize("path", ["reference", "dense", "flex", "default", "dense_mask"])
def test_documents_longer_than_the_sequence_are_refused_on_every_path(lengths, match, path, gen):
    q, k, v = qkv(2, 2, 7, 7, torch.float32, CPU, gen)
    mask = Document(torch.tensor(lengths))
    with pytest.raises(ValueError, match=match):
        if path == "reference":
            A.masked_reference(q, k, v, mask)
        elif path == "dense_mask":
            dense_mask(mask, q, k)
        else:
            A.sdpa(q, k, v, mask=mask, backend=path)
    A.sdpa(q, k, v, mask=Document(torch.tensor([3, 4])))  # exactly the sequence: fine


@pytest.mark.gpu
@needs_cuda
def test_mask_data_on_another_device_is_refused():
    q = torch.randn(1, 1, 8, 16, device="cuda")
    with pytest.raises(ValueError, match=r"tensor is on cpu, q on cuda.*non_blocking"):
        A.sdpa(q, q, q, mask=Document(torch.tensor([8])))


# ---- compiled on a GPU -----------------------------------------------------------------------
# every kind in bf16 (self-attention, and across lengths where the kind allows), three kinds in
# float32 and float16 too: each case compiles its own kernels, seconds apiece
GPU_FORWARD = [(kind, (300, 300), torch.bfloat16) for kind in KINDS]
GPU_FORWARD += [(kind, (200, 330), torch.bfloat16) for kind in ("causal", "window", "prefix")]
GPU_FORWARD += [
    (kind, (300, 300), dtype)
    for kind in ("window", "document per row", "alibi")
    for dtype in (torch.float32, torch.float16)
]
GPU_BACKWARD = [
    (kind, torch.bfloat16)
    for kind in ("causal", "window", "document per row", "prefix per row", "alibi window")
] + [("window", torch.float32)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("kind", "shape", "dtype"), GPU_FORWARD, ids=str)
def test_gpu_every_path_equals_the_float64_reference(kind, shape, dtype, gen):
    mask, (seq_q, seq_k) = KINDS[kind]("cuda"), shape
    if "document" in kind:
        mask = Document(mask.lengths * 8, causal=mask.causal)  # 37 tokens become 296 of 300
    q, k, v = qkv(2, 3, seq_q, seq_k, dtype, "cuda", gen, head_dim=64)
    expected = exact(q, k, v, mask)
    for backend in A.MASKED_BACKENDS:
        out = A.sdpa(q, k, v, mask=mask, backend=backend)
        torch.testing.assert_close(
            out.double(), expected, **A.TOLERANCES[dtype], msg=lambda m, b=backend: f"{b}: {m}"
        )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("kind", "dtype"), GPU_BACKWARD, ids=str)
def test_gpu_flex_gradients_match_the_reference(kind, dtype, gen):
    mask = KINDS[kind]("cuda")
    if "document" in kind:
        mask = Document(mask.lengths * 8, causal=mask.causal)
    q, k, v = qkv(2, 3, 300, 300, dtype, "cuda", gen, head_dim=64, grad=True)
    grad = torch.randn(q.shape, generator=gen).to("cuda", dtype)
    got = torch.autograd.grad(A.sdpa(q, k, v, mask=mask, backend="flex"), (q, k, v), grad)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(A.masked_reference(*ref_inputs, mask), ref_inputs, grad.double())
    for name, g, r in zip("qkv", got, ref, strict=True):
        torch.testing.assert_close(
            g.double(), r, **A.TOLERANCES[dtype], msg=lambda m, n=name: f"d{n}: {m}"
        )


@pytest.mark.gpu
@needs_cuda
def test_gpu_the_default_path_compiles_flex_once_and_matches_the_users_own(gen):
    """sdpa(mask=kind) on a GPU is torch.compile(flex_attention) on a block mask made once: the
    same numbers as a user's own compiled flex_attention with create_block_mask's block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = qkv(2, 4, 1000, 1000, torch.bfloat16, "cuda", gen, head_dim=64, grad=True)
    mask = Document(torch.tensor([[300, 700], [999, 1]], device="cuda"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = A.sdpa(q, k, v, mask=mask)
    assert not [w for w in caught if "accel.attention" in str(w.message)]  # no fallback
    blocks = create_block_mask(mask.mask_mod(1000, 1000, "cuda"), 2, None, 1000, 1000, "cuda")
    theirs = torch.compile(flex_attention)(q, k, v, block_mask=blocks)
    torch.testing.assert_close(out, theirs, **A.TOLERANCES[torch.bfloat16])
    assert len(AF._BLOCK_MASKS) == 1 and len(AF._READY) == 1
    A.sdpa(q, k, v, mask=mask).sum().backward()
    assert all(t.grad is not None for t in (q, k, v))


@pytest.mark.gpu
@needs_cuda
def test_gpu_cached_flex_calls_read_nothing_and_compile_nothing_new(count_host_reads, gen):
    from torch._dynamo.utils import counters

    q, k, v = qkv(2, 4, 512, 512, torch.bfloat16, "cuda", gen, head_dim=64)
    lengths = torch.tensor([[100, 412], [256, 256]], device="cuda")
    A.sdpa(q, k, v, mask=Document(lengths), backend="flex")
    graphs = counters["stats"]["unique_graphs"]
    other = torch.tensor([[300, 212], [12, 500]], device="cuda")
    reads = count_host_reads(lambda: A.sdpa(q, k, v, mask=Document(other), backend="flex"))
    assert sum(reads.values()) == 0, reads
    assert counters["stats"]["unique_graphs"] == graphs
    out = A.sdpa(q, k, v, mask=Document(other), backend="flex")
    torch.testing.assert_close(
        out.double(), exact(q, k, v, Document(other)), **A.TOLERANCES[torch.bfloat16]
    )
