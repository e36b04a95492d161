"""Pairwise-cosine diversity in Triton: the launchers behind ``accel.diversity``.

Groups of N <= ``SMALL_N`` rows take the group kernels (``pairwise_cosine_groups``: whole groups
a program, every cosine in registers or in one tensor-core product, the mean by the O(N D)
closed form), launched as the rule of ``pairwise_cosine_config`` says. Larger groups (and means
of rows too long to hold whole) take the large-set kernels (``pairwise_cosine_large``): the mean
by the closed form with a group's rows split over programs, the nearest distances and the matrix
by a fused-attention-shaped tiled kernel (autotuned on N and D) that never stores the N x N
matrix. Each kernel reads the embeddings once, through their strides (no copy), and accumulates
in float32. Kernels are launched as Triton launches them, ``kernel[grid](...)``.

The functions here take embeddings ``(B, N, D)`` and ``counts`` already checked by the caller
(``accel.diversity.check_embeddings``; counts contiguous) and ``eps`` (vectors are normalized as
x / max(||x||, eps)), and run the kernels unconditionally; ``accel.diversity`` decides whether
they can run (CUDA, or Triton's interpreter) and otherwise falls back to its references.
Results are float32.
"""

from __future__ import annotations

import torch
import triton

from .pairwise_cosine_config import (
    SMALL_N,
    block_rows,
    group_config,
    group_kernel_takes_mean,
    mean_config,
)
from .pairwise_cosine_groups import closed_form_kernel, group_dot_kernel, pairs_kernel
from .pairwise_cosine_large import (
    INTERPRET_TILED,
    ROWS_BLOCK_D,
    ROWS_BLOCK_M,
    inv_norm_kernel,
    normalized_sum_kernel,
    tiled_16bit,
    tiled_fp32,
    tiled_kernel,
)

MODE_MEAN, MODE_NEAREST, MODE_MATRIX = 0, 1, 2

# True when the kernels were decorated under TRITON_INTERPRET=1 (triton.jit reads it as it
# decorates, once per process: accel.diversity's first kernel call imports this module).
INTERPRETED: bool = type(pairs_kernel).__name__ == "InterpretedFunction"


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot takes ``dtype``'s values as float32: float32 inputs, and bfloat16 in the
    interpreter, whose dot multiplies bfloat16's raw bits (Triton 3.9). 16-bit products are
    exact in float32 anyway, so the tensor cores' result differs only in the order of sums."""
    return dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)


def check_runnable(x: torch.Tensor) -> None:
    if not (INTERPRETED or x.is_cuda):
        raise ValueError(
            f"the Triton kernels need a CUDA tensor, got one on {x.device.type} (set "
            "TRITON_INTERPRET=1 before the first kernel call to run them through Triton's "
            "interpreter)"
        )


def row_alignment(x: torch.Tensor) -> int:
    """Elements of each row of ``x`` (..., D) a kernel may load at once that Triton cannot see
    for itself: the largest power of 2, up to 16 bytes, dividing D, every other stride and the
    start; 1 where Triton sees 16 elements already, or the rows are strided.

    Triton marks an integer argument 16-aligned only when it is a multiple of 16, and sizes its
    loads from that, so rows of 100 float32 (16-byte aligned) or 300 float16 (8) would load one
    element at a time; the group kernels take this as their ``ALIGN`` and round D and the
    strides to multiples of it where the compiler sees them."""
    if x.dim() == 0 or x.stride(-1) != 1 or x.data_ptr() % 16:
        return 1  # a start off 16 bytes: Triton assumes no alignment at all
    values = (x.shape[-1], *x.stride()[:-1])  # all of them: the kernel rounds each it is given
    if all(v % 16 == 0 for v in values):
        return 1
    align = 16 // x.element_size()
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


# ---- groups of N <= SMALL_N ------------------------------------------------------------------


def run_group(x: torch.Tensor, counts: torch.Tensor | None, mode: int, *, eps: float):
    """(out (B,), items (B, N), matrix (B, N, N)) float32, launched as the rule says; only the
    mode's outputs are filled, the others are ``out`` itself (a pointer the kernel never writes)."""
    B, N, D = x.shape
    block_n, has_counts = block_rows(N), counts is not None
    if mode == MODE_MEAN:
        config = mean_config(block_n, D, B, x.element_size(), ragged=has_counts)
    else:
        config = group_config(block_n, D, B, x.element_size(), ragged=has_counts,
                              matrix=mode == MODE_MATRIX)  # fmt: skip
    out = torch.empty(B, device=x.device, dtype=torch.float32)
    items = torch.empty(B, N, device=x.device, dtype=torch.float32) if mode == MODE_NEAREST else out
    matrix = (
        torch.empty(B, N, N, device=x.device, dtype=torch.float32) if mode == MODE_MATRIX else out
    )
    grid = (triton.cdiv(B, config.groups),)
    args = (x, counts if has_counts else out, out)
    sizes = (B, N, D, *x.stride(), eps)
    stages = {} if config.num_stages is None else {"num_stages": config.num_stages}
    common = dict(HAS_COUNTS=has_counts, GROUPS=config.groups, BLOCK_D=config.block_d,
                  ALIGN=row_alignment(x), num_warps=config.num_warps, **stages)  # fmt: skip
    if config.variant == "pairs":
        pairs_kernel[grid](*args, items, *sizes, MODE=mode, ROWS=N, **common)
    elif config.variant == "closed":
        closed_form_kernel[grid](*args, *sizes, BLOCK_N=min(block_n, config.step_rows), **common)
    else:
        group_dot_kernel[grid](*args, items, matrix, *sizes, MODE=mode, BLOCK_N=block_n,
                               DOT_FP32=_dot_in_fp32(x.dtype), **common)  # fmt: skip
    return out, items, matrix


# ---- large groups ------------------------------------------------------------------------------


def _members(counts: torch.Tensor | None, B: int, N: int, device) -> torch.Tensor:
    """Each group's members as float32 (B,): its count clamped to [0, N], or N."""
    if counts is None:
        return torch.full((B,), float(N), device=device)
    return counts.clamp(0, N).float()


def _run_tiled(x: torch.Tensor, counts: torch.Tensor | None, mode: int, eps: float) -> torch.Tensor:
    """Nearest distances (B, N) or the distance matrix (B, N, N) of groups of any size."""
    B, N, D = x.shape
    inv = torch.empty(B, N, device=x.device, dtype=torch.float32)
    inv_norm_kernel[(triton.cdiv(N, ROWS_BLOCK_M), B)](
        x, inv, N, D, *x.stride(), eps, BLOCK_M=ROWS_BLOCK_M, BLOCK_D=ROWS_BLOCK_D
    )
    if mode == MODE_NEAREST:
        out = torch.empty(B, N, device=x.device, dtype=torch.float32)
        items, matrix = out, inv
    else:
        out = torch.zeros(B, N, N, device=x.device, dtype=torch.float32)
        items, matrix = inv, out
    args = (x, inv, counts if counts is not None else inv, items, matrix, N, D, *x.stride())
    meta = dict(MODE=mode, HAS_COUNTS=counts is not None, DOT_FP32=_dot_in_fp32(x.dtype))
    if INTERPRETED:
        grid = (triton.cdiv(N, INTERPRET_TILED["BLOCK_M"]), B)
        tiled_kernel[grid](*args, **meta, **INTERPRET_TILED)
    else:
        tuned = tiled_fp32 if x.dtype == torch.float32 else tiled_16bit
        tuned[lambda m: (triton.cdiv(N, m["BLOCK_M"]), B)](*args, **meta)
    return out


def _run_closed_form_mean(x: torch.Tensor, counts: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The mean by the closed form over blocks of rows: the kernel's partial sums, finished by
    1 - (||sum x̂||^2 - sum ||x̂||^2) / (n (n - 1)), 0 for fewer than two members."""
    B, N, D = x.shape
    blocks = triton.cdiv(N, ROWS_BLOCK_M)
    partial = torch.empty(B, blocks, D, device=x.device, dtype=torch.float32)
    partial_sq = torch.empty(B, blocks, device=x.device, dtype=torch.float32)
    normalized_sum_kernel[(blocks, B)](
        x, counts if counts is not None else partial_sq, partial, partial_sq, N, D, *x.stride(),
        eps, HAS_COUNTS=counts is not None, BLOCK_M=ROWS_BLOCK_M, BLOCK_D=ROWS_BLOCK_D,
    )  # fmt: skip
    n = _members(counts, B, N, x.device)
    pairs = partial.sum(1).square().sum(-1) - partial_sq.sum(1)
    return torch.where(n >= 2, 1.0 - pairs / (n * (n - 1)).clamp(min=1), 0.0)


# ---- the functions accel.diversity dispatches to: x (B, N, D) checked, results float32 --------


def mean_diversity(x: torch.Tensor, counts: torch.Tensor | None = None, *, eps: float):
    """1 - mean cosine over pairs i != j of each group: (B,)."""
    check_runnable(x)
    B, N, D = x.shape
    if B == 0 or N < 2:  # no pairs anywhere: diversity 0 by definition
        return torch.zeros(B, device=x.device)
    if group_kernel_takes_mean(N, D):
        return run_group(x, counts, MODE_MEAN, eps=eps)[0]
    return _run_closed_form_mean(x, counts, eps)


def nearest_distances(x: torch.Tensor, counts: torch.Tensor | None = None, *, eps: float):
    """Cosine distance from each member to its nearest other member: (B, N)."""
    check_runnable(x)
    B, N, _ = x.shape
    if B == 0 or N < 2:
        return torch.zeros(B, N, device=x.device)
    if N <= SMALL_N:
        return run_group(x, counts, MODE_NEAREST, eps=eps)[1]
    return _run_tiled(x, counts, MODE_NEAREST, eps)


def nearest_diversity(x: torch.Tensor, counts: torch.Tensor | None = None, *, eps: float):
    """Group mean of the nearest-other distances: (B,)."""
    check_runnable(x)
    B, N, _ = x.shape
    if B == 0 or N < 2:
        return torch.zeros(B, device=x.device)
    if N <= SMALL_N:
        return run_group(x, counts, MODE_NEAREST, eps=eps)[0]
    n = _members(counts, B, N, x.device)  # distances past a count are 0
    mean = _run_tiled(x, counts, MODE_NEAREST, eps).sum(1) / n.clamp(min=1)
    return torch.where(n >= 2, mean, 0.0)


def pairwise_distances(x: torch.Tensor, counts: torch.Tensor | None = None, *, eps: float):
    """The matrix 1 - cos(x_i, x_j): (B, N, N); zero outside each group's count."""
    check_runnable(x)
    B, N, _ = x.shape
    if B == 0 or N == 0:
        return torch.zeros(B, N, N, device=x.device)
    if N <= SMALL_N:
        return run_group(x, counts, MODE_MATRIX, eps=eps)[2]
    return _run_tiled(x, counts, MODE_MATRIX, eps)
