"""accel.diversity: the Triton kernels against the references, edge cases and dispatch.

The ``kdev`` fixture runs the kernel tests where the kernels can run: compiled on a CUDA GPU, or
on a CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest before anything
imports Triton). The interpreter is not used on a CUDA machine. Tests marked ``gpu`` need CUDA (larger sizes,
memory, graph capture).
"""

import contextlib
import importlib.util
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from accel import diversity as dv
from accel import errors, triton_support

CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(
    not (CUDA and HAS_TRITON), reason="needs a CUDA GPU and Triton; this machine lacks one"
)

FUNCTIONS = ["mean_diversity", "nearest_distances", "nearest_diversity", "pairwise_distances"]
# Odd sizes; (3, 77) is one (N, D) set; N = 40 takes the tensor-core group kernel, N = 70 the
# large-set (tiled, tl.dot) kernels.
SHAPES = [(3, 77), (2, 3, 77), (4, 5, 123), (2, 40, 77), (2, 70, 77)]
# Kernels and references read the same 16-bit values and multiply them exactly in float32
# (products of bf16 / fp16 numbers fit in a float32), so every dtype agrees to float32
# rounding of sums of up to 123 products taken in another order.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL, RTOL = 2e-5, 1e-5
CONFIG = "accel.kernels.pairwise_cosine_config"


# every path of accel.diversity depends on whether Triton is installed
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.triton]


def reference(name: str):
    return getattr(dv, f"{name}_reference")


def embeddings(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(shape).to(device=device, dtype=dtype)  # random; never zeros


def check_all(x: torch.Tensor, counts: torch.Tensor | None = None) -> None:
    for name in FUNCTIONS:
        fast = getattr(dv, name)(x, counts)
        with float32_matmul("highest"):  # a TF32 reference would be the inexact one
            ref = reference(name)(x, counts)
        assert fast.dtype == torch.float32 and fast.shape == ref.shape, name
        torch.testing.assert_close(fast, ref, atol=ATOL, rtol=RTOL, msg=name)


@contextlib.contextmanager
def float32_matmul(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def random_counts(batch: int, n: int) -> torch.Tensor:
    """Ragged counts that include an empty group, a lone member and a full group."""
    fixed = torch.tensor([0, 1, n])
    return torch.cat([fixed, torch.randint(0, n + 1, (max(batch - 3, 0),))])[:batch]


# ---- the definitions, checked by explicit loops ------------------------------------------------


def test_references_match_explicit_pair_loops(seed):
    x = embeddings((5, 9))
    cos = [[F.cosine_similarity(x[i], x[j], dim=0).item() for j in range(5)] for i in range(5)]
    pairs = [cos[i][j] for i in range(5) for j in range(5) if i != j]
    nearest = [1 - max(cos[i][j] for j in range(5) if j != i) for i in range(5)]
    assert dv.mean_diversity_reference(x).item() == pytest.approx(1 - sum(pairs) / 20, abs=1e-6)
    assert dv.nearest_distances_reference(x).tolist() == pytest.approx(nearest, abs=1e-6)
    assert dv.nearest_diversity_reference(x).item() == pytest.approx(sum(nearest) / 5, abs=1e-6)
    matrix = dv.pairwise_distances_reference(x)
    torch.testing.assert_close(matrix, 1 - torch.tensor(cos), atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", [(3, 77), (4, 5, 123), (3, 40, 16)])
def test_closed_form_equals_the_matrix_mean(shape, seed):
    x = embeddings(shape)
    torch.testing.assert_close(
        dv.mean_diversity_closed_form(x), dv.mean_diversity_reference(x), atol=1e-5, rtol=1e-5
    )
    if len(shape) == 3:
        counts = random_counts(shape[0], shape[1])
        torch.testing.assert_close(
            dv.mean_diversity_closed_form(x, counts),
            dv.mean_diversity_reference(x, counts),
            atol=1e-5,
            rtol=1e-5,
        )


# ---- kernels against the references (compiled on CUDA, else the interpreter) ---------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernels_match_references(kdev, shape, dtype, seed):
    x = embeddings(shape, dtype, kdev)
    assert dv.backend(x)[0] != "reference"
    check_all(x)


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernels"])
def test_one_set_takes_its_count_as_a_scalar_too(kernels, request, seed):
    where = request.getfixturevalue("kdev") if kernels else "cpu"
    x = embeddings((9, 40), device=where)
    for name in FUNCTIONS:
        scalar = getattr(dv, name)(x, torch.tensor(5, device=where))
        torch.testing.assert_close(scalar, getattr(dv, name)(x, torch.tensor([5], device=where)))


@pytest.mark.parametrize(
    ("shape", "ragged"), [((6, 4, 33), False), ((6, 4, 33), True), ((9, 40), False)], ids=str
)
def test_a_loss_on_the_kernel_path_trains_with_the_reference_gradient(kdev, shape, ragged, seed):
    """The kernels have no backward: the result is the kernel's, the gradient the reference's."""
    x = embeddings(shape, device=kdev).requires_grad_()
    counts = random_counts(shape[0], shape[1]).to(kdev) if ragged else None
    for name in FUNCTIONS:
        fast = getattr(dv, name)(x, counts)
        weights = torch.randn(fast.shape, device=kdev)  # a loss that reads every entry
        (grad,) = torch.autograd.grad((fast * weights).sum(), x)
        ref = reference(name)(x, counts)
        (expected,) = torch.autograd.grad((ref * weights).sum(), x)
        torch.testing.assert_close(fast, ref, atol=ATOL, rtol=RTOL, msg=name)
        torch.testing.assert_close(grad, expected, atol=ATOL, rtol=RTOL, msg=name)
        with torch.no_grad():  # without a graph to build: the kernel's result, no grad_fn
            assert getattr(dv, name)(x, counts).grad_fn is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape",
    [(5, 7, 33), (3, 37, 20), (3, 67, 20), (5, 3, 2050)],  # the last: long rows, 16-bit on "dot"
    ids=lambda s: "x".join(map(str, s)),
)
def test_ragged_groups(kdev, shape, dtype, seed):
    x = embeddings(shape, dtype, kdev)
    counts = random_counts(shape[0], shape[1]).to(kdev)
    check_all(x, counts)
    # Rows past a group's count are ignored: changing them changes nothing.
    scrambled = x.clone()
    for b, c in enumerate(counts.tolist()):
        scrambled[b, c:] = embeddings(scrambled[b, c:].shape, dtype, kdev)
    for name in FUNCTIONS:
        torch.testing.assert_close(
            getattr(dv, name)(scrambled, counts), getattr(dv, name)(x, counts), msg=name
        )


@pytest.mark.parametrize("shape", [(5, 7, 33), (3, 37, 20)], ids=lambda s: "x".join(map(str, s)))
def test_counts_that_are_a_strided_view_are_read_as_their_values(kdev, shape, seed):
    x = embeddings(shape, torch.float32, kdev)
    every_other = random_counts(2 * shape[0], shape[1]).to(kdev)[::2]  # stride 2
    assert every_other.stride() == (2,)
    check_all(x, every_other)
    check_all(x, every_other.to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(13, 4, 40), (11, 2, 100), (9, 3, 60), (13, 6, 40)], ids=str)
def test_grouped_kernel_partial_last_program(kdev, shape, dtype, seed):
    """Several groups per program: B not a multiple of GROUPS, ragged counts within a program."""
    rules = pytest.importorskip(CONFIG)
    x = embeddings(shape, dtype, kdev)
    config = rules.group_config(rules.block_rows(shape[1]), shape[2], shape[0], x.element_size())
    assert config.groups > 1 and shape[0] % config.groups != 0, config
    counts = random_counts(shape[0], shape[1]).to(kdev)
    check_all(x)
    check_all(x, counts)
    check_all(x.transpose(0, 1).contiguous().transpose(0, 1), counts)  # strided over groups


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [(5, 4, 123), (33, 2, 20), (7, 3, 77), (6, 4, 600), (9, 16, 40), (3, 7, 200), (5, 8, 123),
     (7, 40, 77), (3, 64, 200), (6, 12, 600)],
    ids=str,
)  # fmt: skip
def test_the_group_kernels_match_references(kdev, shape, dtype, seed):
    """Every group kernel the rule picks (pairs up to 4 rows; the tensor-core tile of 16, 32 or
    64 rows; the closed-form mean from 8 padded rows): ragged counts (an empty group, a lone
    member), a zero row, strided groups, B not a multiple of the groups a program takes, D over
    several chunks; float32 in two TF32 passes stays within float32 rounding."""
    x = embeddings(shape, dtype, kdev)
    x[0, 1] = 0  # a zero vector: cosine 0 with every other, no NaN
    counts = random_counts(shape[0], shape[1]).to(kdev)
    strided = x.transpose(0, 1).contiguous().transpose(0, 1)
    for inputs, members in ((x, None), (x, counts), (strided, counts)):
        check_all(inputs, members)


def test_the_rule_takes_pairs_up_to_4_rows_then_whole_groups_on_the_tensor_cores():
    """Groups of up to 4 rows: the pairs kernel (but the matrix); larger: the smallest tile of
    whole groups (16 rows, or the group's own 32 or 64), a warp per 16 rows (16-bit tiles of
    32 rows: one); never more groups a program than the batch has."""
    rules = pytest.importorskip(CONFIG)
    for block_n in (2, 4, 8, 16, 32, 64):
        for itemsize in (4, 2):
            for d in (16, 100, 384, 3000):
                config = rules.group_config(block_n, d, 8192, itemsize)
                matrix = rules.group_config(block_n, d, 8192, itemsize, matrix=True)
                assert matrix.variant == "dot", matrix
                if block_n <= 4:
                    assert config.variant == "pairs" and config.block_d <= 128 * 4 // itemsize
                    continue
                rows = max(16, block_n)
                assert config == matrix and config.groups * block_n == rows, config
                assert config.num_warps == (1 if rows == 32 and itemsize == 2 else rows // 16)
    assert rules.group_config(2, 16, 2, 4).groups == 2  # 16 fit, but the batch has 2
    assert rules.group_config(4, 384, 8192, 4) == rules.GroupConfig("pairs", 1, 128, 1)


def test_the_mean_takes_the_closed_form_from_eight_rows_where_whole_rows_fit():
    rules = pytest.importorskip(CONFIG)
    for block_n, d, itemsize in [(8, 64, 4), (64, 2048, 4), (16, 8192, 2), (8, 100, 2)]:
        for ragged in (False, True):
            config = rules.mean_config(block_n, d, 8192, itemsize, ragged=ragged)
            assert config.variant == "closed" and config.block_d >= d, config
            assert config.step_rows <= (8 if ragged else block_n), config
            assert config.groups * config.step_rows * config.block_d <= 2048 * config.num_warps
    assert rules.mean_config(4, 64, 4096, 4).variant == "pairs"
    assert rules.group_kernel_takes_mean(64, 8192) and rules.group_kernel_takes_mean(4, 16384)
    assert not rules.group_kernel_takes_mean(5, 8193)  # the large-set closed form
    assert not rules.group_kernel_takes_mean(65, 64)


def test_rows_off_16_bytes_are_loaded_in_the_largest_pieces_they_allow():
    """Triton sees a stride or width as 16-aligned only when it is a multiple of 16 elements; the
    alignment the rows do have (D = 100 in float32: 16 bytes; in 16 bits: 8) is told to the
    kernel, none where Triton sees it anyway or the rows are strided along D."""
    pytest.importorskip("triton")
    from accel.kernels.pairwise_cosine import row_alignment

    def rows(shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype)

    assert row_alignment(rows((3, 5, 100))) == 4  # 16 bytes
    assert row_alignment(rows((3, 5, 100), torch.bfloat16)) == 4  # 8 bytes
    assert row_alignment(rows((3, 5, 300), torch.float16)) == 4
    assert row_alignment(rows((3, 5, 50), torch.bfloat16)) == 2
    assert row_alignment(rows((3, 5, 99))) == 1
    assert row_alignment(rows((3, 5, 256), torch.bfloat16)) == 1  # Triton's own
    assert row_alignment(rows((3, 5, 64))) == 1
    assert row_alignment(rows((3, 5, 128))[..., :100]) == 4  # a view: strides of 128
    assert row_alignment(rows((3, 5, 102))[..., :100]) == 2  # rows 102 apart
    assert row_alignment(rows((3, 100, 5)).transpose(1, 2)) == 1  # strided along D
    assert row_alignment(rows((3, 5, 104))[..., 4:]) == 4
    assert row_alignment(rows((3, 5, 104))[..., 1:101]) == 1  # starts 4 bytes past 16


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 5, 40])
def test_rows_loaded_several_elements_at_a_time_match_the_references(kdev, n, dtype, seed):
    """Views of wider rows (rows 104 apart, 100 long: 4 elements a load) and rows of 50 (2),
    through every kernel the rule picks, with and without counts."""
    from accel.kernels.pairwise_cosine import row_alignment

    wide = embeddings((7, n, 104), dtype, kdev)[..., 2:102]  # starts 4-8 bytes past 16: no hint
    for x in (embeddings((7, n, 104), dtype, kdev)[..., :100], embeddings((7, n, 50), dtype, kdev)):
        assert row_alignment(x) > 1
        check_all(x)
        check_all(x, random_counts(x.shape[0], n).to(kdev))
    assert row_alignment(wide) == 1
    check_all(wide)


def test_counts_are_clamped_to_the_group(kdev, seed):
    x = embeddings((3, 4, 16), device=kdev)
    clamped = torch.tensor([-2, 4, 9], device=kdev)
    expected = torch.tensor([0, 4, 4], device=kdev)
    for name in FUNCTIONS:
        torch.testing.assert_close(getattr(dv, name)(x, clamped), getattr(dv, name)(x, expected))


@pytest.mark.parametrize("n", [4, 40, 70])
def test_zero_vectors_give_distance_one_and_no_nan(kdev, n, seed):
    x = embeddings((2, n, 24), device=kdev)
    x[0, 1] = 0.0  # the edge case itself: the one place a zero input is the point
    for name in FUNCTIONS:
        out = getattr(dv, name)(x)
        assert not out.isnan().any(), name
    matrix = dv.pairwise_distances(x)
    others = [j for j in range(n) if j != 1]
    torch.testing.assert_close(matrix[0, 1, others], torch.ones(n - 1, device=kdev))
    check_all(x)


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_members_have_no_pairs(kdev, n):
    x = embeddings((3, n, 8), device=kdev)
    assert dv.mean_diversity(x).tolist() == [0.0] * 3
    assert dv.nearest_diversity(x).tolist() == [0.0] * 3
    assert dv.nearest_distances(x).shape == (3, n)
    assert not dv.nearest_distances(x).any()
    check_all(x)
    assert dv.mean_diversity(embeddings((n, 8), device=kdev)).shape == ()


def test_empty_batch(kdev):
    x = embeddings((0, 4, 8), device=kdev)
    for name in FUNCTIONS:
        assert getattr(dv, name)(x).shape == reference(name)(x).shape


def test_non_contiguous_inputs(kdev, seed):
    base = embeddings((5, 123, 4), device=kdev)
    strided = base.transpose(1, 2)  # (5, 4, 123) with stride 1 along N, not D
    sliced = embeddings((6, 10, 80), device=kdev)[::2, 1:9:2, ::3]  # every dimension strided
    expanded = embeddings((1, 3, 17), device=kdev).expand(4, 3, 17)  # stride 0 over groups
    for x in (strided, sliced, expanded):
        assert not x.is_contiguous()
        check_all(x)
        for name in FUNCTIONS:
            torch.testing.assert_close(getattr(dv, name)(x), getattr(dv, name)(x.contiguous()))


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, error, words",
    [
        (torch.randn(7), ValueError, "shape (N, D) or (B, N, D)"),
        (torch.randn(2, 3, 4, 5), ValueError, "shape (N, D) or (B, N, D)"),
        (torch.randn(3, 4, dtype=torch.float64), TypeError, "float32, bfloat16 or float16"),
        (torch.randint(0, 9, (3, 4)), TypeError, "float32, bfloat16 or float16"),
        (torch.randn(3, 0), ValueError, "D >= 1"),
        ([[1.0, 2.0]], TypeError, "torch.Tensor"),
    ],
)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_bad_embeddings_raise_clear_errors(name, bad, error, words):
    for fn in (getattr(dv, name), reference(name)):
        with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
            fn(bad)


@pytest.mark.parametrize(
    "counts, error, words",
    [
        (torch.tensor([1.0, 2.0]), TypeError, "integer"),
        (torch.tensor([True, False]), TypeError, "integer"),
        (torch.tensor([1, 2, 3]), ValueError, "one per group"),
        (torch.tensor([[1, 2]]), ValueError, "one per group"),
        (torch.tensor([1, 2], device="meta"), ValueError, "counts are on meta"),
        ([1, 2], TypeError, "tensor"),
    ],
)
def test_bad_counts_raise_clear_errors(counts, error, words):
    with pytest.raises(error, match=words):
        dv.mean_diversity(embeddings((2, 3, 4)), counts)


# ---- dispatch ---------------------------------------------------------------------------------------


def test_without_triton_on_cpu_falls_back_once_with_a_reason(monkeypatch, seed):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(errors, "_warned", set())
    x = embeddings((3, 4, 16))
    why = triton_support.unavailable("cpu")  # Triton missing, or CPU tensors it cannot compile for
    with pytest.warns(RuntimeWarning, match=f"PyTorch reference.*{re.escape(why)}"):
        out = dv.mean_diversity(x)
    torch.testing.assert_close(out, dv.mean_diversity_reference(x), atol=0, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail here
        dv.nearest_diversity(x)
        dv.pairwise_distances(x)


def test_triton_support_says_why_kernels_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if HAS_TRITON:
        assert triton_support.unavailable("cuda") is None
        assert "TRITON_INTERPRET=1" in triton_support.unavailable("cpu")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert triton_support.unavailable("cpu") is None
    monkeypatch.setattr(triton_support, "installed", lambda: False)
    assert triton_support.unavailable("cuda").startswith("Triton is not installed")


def test_importing_diversity_imports_no_triton():
    import subprocess
    import sys

    code = "import sys, accel.diversity; print('triton' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"


# ---- the bench phase, on a CPU at tiny sizes ---------------------------------------------------


def test_bench_phase_runs_and_marks_cpu_rows(monkeypatch):
    from accel.lab.bench import BenchContext
    from accel.lab.cases import diversity as case
    from accel.measure.ceilings import Ceilings

    tiny = (case.GroupCase(8, 4, 16, torch.float32), case.LargeCase(40, 16, torch.bfloat16))
    monkeypatch.setitem(case.CASES, "cpu", tiny)
    monkeypatch.setattr(case.polychromic.Sizes, "preset", classmethod(lambda cls, name: cls()))
    ceilings = Ceilings("cpu", 10.0, 0.1, "float32", 1 << 20, 64)  # made up: no measuring here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's one warning
        rows = case.run(BenchContext(torch.device("cpu"), "cpu", ceilings))
    assert {r.phase for r in rows} == {"diversity"}
    assert all(r.met is None and r.note.startswith("not judged: ") for r in rows)
    cases = {r.case for r in rows}
    assert {"mean B=8 N=4 D=16 float32", "polychromic step"} <= cases
    bandwidth = next(r for r in rows if r.unit == "GB/s")
    assert bandwidth.fraction_of_ceiling == pytest.approx(bandwidth.optimized / 10.0)


# ---- CUDA: the compiled kernels -----------------------------------------------------------------------


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    "shape",
    [(8192, 4, 384), (64, 16, 384), (3, 300, 384), (2048, 384)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_compiled_kernels_match_references(shape, dtype, seed):
    x = embeddings(shape, dtype, "cuda")
    assert dv.backend(x)[0] == "triton"
    check_all(x)
    if len(shape) == 3:
        check_all(x, random_counts(shape[0], shape[1]).cuda())
        check_all(x.transpose(0, 1).contiguous().transpose(0, 1))  # strided over groups


@pytest.mark.gpu
@requires_gpu
def test_large_set_nearest_stores_no_n_by_n_matrix(seed):
    n, d = 8192, 384
    x = embeddings((n, d), torch.bfloat16, "cuda")
    dv.nearest_diversity(x)  # autotune outside the measured call
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = dv.nearest_diversity(x)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 0.01 * n * n * 4, f"{extra / 1e6:.1f} MB: an N x N buffer was allocated"
    with float32_matmul("highest"):
        expected = dv.nearest_diversity_reference(x)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert math.isfinite(out.item())


@pytest.mark.gpu
@requires_gpu
def test_grouped_kernel_can_be_captured_in_a_cuda_graph(seed):
    x = embeddings((512, 4, 384), torch.float32, "cuda")
    expected = dv.mean_diversity(x)  # autotune before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dv.mean_diversity(x)
    x.copy_(embeddings(x.shape, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, dv.mean_diversity_reference(x), atol=ATOL, rtol=RTOL)
    assert not torch.equal(out, expected)


@pytest.mark.parametrize("N", [3, 6, 40, 70])  # pairs, group, tensor-core group, tiled kernels
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nan_or_inf_member_makes_its_groups_nearest_distances_nan(kdev, N, bad, seed):
    # tl.max skips NaN where torch's max keeps it: the group must not look finite
    x = torch.randn(3, N, 8, generator=torch.Generator().manual_seed(seed))
    x[1, N // 2, 3] = bad
    counts = torch.tensor([N, N, N // 2]).to(kdev)  # group 2's bad-free members only
    x = x.to(kdev)
    for c in (None, counts):
        got, ref = dv.nearest_distances(x, c), dv.nearest_distances_reference(x, c)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL, equal_nan=True)
        assert got[1].isnan().all() and not got[0].isnan().any()
        torch.testing.assert_close(
            dv.nearest_diversity(x, c), dv.nearest_diversity_reference(x, c), equal_nan=True,
            atol=ATOL, rtol=RTOL,
        )  # fmt: skip


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_rows_past_a_groups_count_are_never_read_by_the_references(bad, seed):
    x = torch.randn(2, 6, 5)
    counts = torch.tensor([6, 2])
    spoiled = x.clone()
    spoiled[1, 2:] = bad  # past group 1's count: not members
    for reference in (dv.mean_diversity_reference, dv.mean_diversity_closed_form,
                      dv.nearest_diversity_reference):  # fmt: skip
        torch.testing.assert_close(reference(spoiled, counts), reference(x, counts))

