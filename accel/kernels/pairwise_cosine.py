"""Pairwise-cosine diversity in Triton: grouped (B, N, D) and large-set kernels.

Each kernel reads the embeddings from device memory once and keeps every cosine in registers:

- ``_group_kernel``: one program per group of N <= ``SMALL_N`` rows. It accumulates the group's
  N x N Gram matrix over chunks of D, takes the norms from its diagonal and reduces in the
  epilogue (mean over pairs, nearest other, or the distance matrix itself).
- ``_tiled_kernel``: for large N, the structure of fused attention. A program keeps one block of
  rows, streams blocks of columns past it, forms their dot products with ``tl.dot`` (a GEMM over
  chunks of D, in one flat pipelined loop) and folds each tile into a running maximum per row,
  so the N x N matrix never exists in device memory. ``_inv_norm_kernel`` first writes the N
  inverse norms it scales by.
- ``_normalized_sum_kernel``: the mean over pairs for large N by its closed form,
  sum_{i != j} cos_ij = ||sum_i x̂_i||^2 - sum_i ||x̂_i||^2, in O(N D): partial sums of the
  normalized rows per block of rows, finished by a few small PyTorch reductions.

All accumulate in float32 whatever the input dtype (float32, bfloat16, float16) and normalize
as ``F.normalize`` does, x / max(||x||, eps), so a zero vector has cosine 0 with every vector.
Inputs are read through their strides: non-contiguous tensors are handled without a copy.
The public functions here run the kernels unconditionally; ``accel.diversity`` decides whether
they can run (CUDA, or Triton's interpreter) and otherwise falls back to its references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel.diversity import EPS, check_embeddings

SMALL_N = 16  # groups up to this size take the one-program-per-group kernel
MODE_MEAN, MODE_NEAREST, MODE_MATRIX = 0, 1, 2
# The group kernel's (N, N, BLOCK_D) product tile stays at or under this many float32 elements
# (32 per thread at 8 warps), so it lives in registers.
GROUP_TILE_ELEMENTS = 8192


# ---- kernels -------------------------------------------------------------------------------


@triton.jit
def _group_size(counts_ptr, b, N, HAS_COUNTS: tl.constexpr):
    """Members of group b: its count clamped to [0, N], or N without counts."""
    if HAS_COUNTS:  # noqa: SIM108 (a constexpr branch: only the taken one is compiled)
        n = tl.minimum(tl.maximum(tl.load(counts_ptr + b).to(tl.int32), 0), N)
    else:
        n = N
    return n


@triton.jit
def _group_kernel(
    X_ptr,
    counts_ptr,
    out_ptr,
    items_ptr,
    matrix_ptr,
    N,
    D,
    stride_xb,
    stride_xn,
    stride_xd,
    eps,
    MODE: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # int64: b * stride_xb may pass 2**31 elements
    rows = tl.arange(0, BLOCK_N)
    n = _group_size(counts_ptr, b, N, HAS_COUNTS)
    valid = rows < n
    x_base = X_ptr + b * stride_xb
    # Each element of the group is read once; rows past the count are masked and never read.
    gram = tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(
            x_base + rows[:, None] * stride_xn + cols[None, :] * stride_xd,
            mask=valid[:, None] & (cols[None, :] < D),
            other=0.0,
        ).to(tl.float32)
        gram += tl.sum(x[:, None, :] * x[None, :, :], axis=2)  # (BLOCK_N, BLOCK_N)

    # Epilogue: norms from the diagonal, cosines, and the reduction; nothing else is stored.
    eye = rows[:, None] == rows[None, :]
    diagonal = tl.where(eye, gram, 0.0)
    inv_rows = 1.0 / tl.maximum(tl.sqrt(tl.sum(diagonal, axis=1)), eps)
    inv_cols = 1.0 / tl.maximum(tl.sqrt(tl.sum(diagonal, axis=0)), eps)
    cos = gram * inv_rows[:, None] * inv_cols[None, :]
    pair = valid[:, None] & valid[None, :] & (rows[:, None] != rows[None, :])
    if MODE == 0:  # mean over the n (n - 1) ordered pairs
        total = tl.sum(tl.sum(tl.where(pair, cos, 0.0), axis=1), axis=0)
        mean_cos = total / tl.maximum(n * (n - 1), 1)
        tl.store(out_ptr + b, tl.where(n >= 2, 1.0 - mean_cos, 0.0))
    elif MODE == 1:  # nearest other member, per row and its group mean
        best = tl.max(tl.where(pair, cos, float("-inf")), axis=1)
        dist = tl.where(valid & (n >= 2), 1.0 - best, 0.0)
        tl.store(items_ptr + b * N + rows, dist, mask=rows < N)
        group_mean = tl.sum(dist, axis=0) / tl.maximum(n, 1)
        tl.store(out_ptr + b, tl.where(n >= 2, group_mean, 0.0))
    else:  # the distance matrix; zero outside the first n rows and columns
        inside = valid[:, None] & valid[None, :]
        tl.store(
            matrix_ptr + b * N * N + rows[:, None] * N + rows[None, :],
            tl.where(inside, 1.0 - cos, 0.0),
            mask=(rows[:, None] < N) & (rows[None, :] < N),
        )


@triton.jit
def _inv_norm_kernel(
    X_ptr,
    inv_ptr,
    N,
    D,
    stride_xb,
    stride_xn,
    stride_xd,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    x_base = X_ptr + b * stride_xb
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(
            x_base + rows[:, None] * stride_xn + cols[None, :] * stride_xd,
            mask=row_ok[:, None] & (cols[None, :] < D),
            other=0.0,
        ).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
    tl.store(inv_ptr + b * N + rows, 1.0 / tl.maximum(tl.sqrt(sq), eps), mask=row_ok)


@triton.jit
def _tiled_kernel(
    X_ptr,
    inv_ptr,
    counts_ptr,
    items_ptr,
    matrix_ptr,
    N,
    D,
    stride_xb,
    stride_xn,
    stride_xd,
    MODE: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n = _group_size(counts_ptr, b, N, HAS_COUNTS)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    x_base = X_ptr + b * stride_xb
    inv_rows = tl.load(inv_ptr + b * N + rows, mask=row_ok, other=0.0)
    offs_d = tl.arange(0, BLOCK_D)
    best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Like fused attention: this block of rows stays, blocks of columns stream past it, and each
    # (BLOCK_M, BLOCK_N) tile of dot products is reduced in registers, never written out.
    # One flat loop over (column block, chunk of D) pairs rather than two nested loops: D = 384
    # is only 6 steps of 64, and a flat loop keeps the loads pipelined across column blocks
    # instead of refilling the pipeline for every tile (the persistent-matmul tutorial's shape).
    steps_d = tl.cdiv(D, BLOCK_D)
    for t in range(0, tl.cdiv(n, BLOCK_N) * steps_d):
        kd = t % steps_d
        cols = (t // steps_d) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        offs = kd * BLOCK_D + offs_d
        d_ok = offs[None, :] < D
        a = tl.load(
            x_base + rows[:, None] * stride_xn + offs[None, :] * stride_xd,
            mask=row_ok[:, None] & d_ok,
            other=0.0,
        )
        k = tl.load(
            x_base + cols[:, None] * stride_xn + offs[None, :] * stride_xd,
            mask=col_ok[:, None] & d_ok,
            other=0.0,
        )
        if DOT_FP32:  # exact float32 products ("ieee"), not TF32's 10-bit mantissa
            acc = tl.dot(a.to(tl.float32), tl.trans(k.to(tl.float32)), acc, input_precision="ieee")
        else:  # bf16 / fp16 tensor cores, float32 accumulator
            acc = tl.dot(a, tl.trans(k), acc)
        if kd == steps_d - 1:  # the tile is complete: the epilogue
            inv_cols = tl.load(inv_ptr + b * N + cols, mask=col_ok, other=0.0)
            cos = acc * inv_rows[:, None] * inv_cols[None, :]
            if MODE == 1:
                pair = row_ok[:, None] & col_ok[None, :] & (rows[:, None] != cols[None, :])
                best = tl.maximum(best, tl.max(tl.where(pair, cos, float("-inf")), axis=1))
            else:  # MODE 2: distance matrix (pre-zeroed by the launcher outside the first n)
                tl.store(
                    matrix_ptr + b * N * N + rows[:, None] * N + cols[None, :],
                    1.0 - cos,
                    mask=row_ok[:, None] & col_ok[None, :],
                )
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MODE == 1:
        dist = tl.where(row_ok & (n >= 2), 1.0 - best, 0.0)
        tl.store(items_ptr + b * N + rows, dist, mask=rows < N)


@triton.jit
def _normalized_sum_kernel(
    X_ptr,
    counts_ptr,
    partial_ptr,
    partial_sq_ptr,
    N,
    D,
    stride_xb,
    stride_xn,
    stride_xd,
    eps,
    HAS_COUNTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    blocks = tl.num_programs(0)
    n = _group_size(counts_ptr, b, N, HAS_COUNTS)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    x_base = X_ptr + b * stride_xb
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(
            x_base + rows[:, None] * stride_xn + cols[None, :] * stride_xd,
            mask=row_ok[:, None] & (cols[None, :] < D),
            other=0.0,
        ).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
    inv = 1.0 / tl.maximum(tl.sqrt(sq), eps)
    slot = b * blocks + pid
    tl.store(partial_sq_ptr + slot, tl.sum(sq * inv * inv, axis=0))  # sum of ||x̂_i||^2
    # Second pass over the same rows: they were just read, so it hits the cache, not memory.
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(
            x_base + rows[:, None] * stride_xn + cols[None, :] * stride_xd,
            mask=row_ok[:, None] & (cols[None, :] < D),
            other=0.0,
        ).to(tl.float32)
        tl.store(partial_ptr + slot * D + cols, tl.sum(x * inv[:, None], axis=0), mask=cols < D)


# ---- launch configurations -----------------------------------------------------------------

# Group kernel: memory-bound, one group per program. Only the warp count is tuned; the tile
# shape follows from N and D (``_group_block_d``).
_group_tuned = triton.autotune(
    configs=[triton.Config({}, num_warps=w) for w in (2, 4, 8)], key=["N", "D", "MODE"]
)(_group_kernel)

# Tiled kernel, 16-bit inputs: a GEMM main loop on the tensor cores (wgmma on sm_90), loads
# pipelined with cp.async, 96 KB of shared memory per program. Compiled for sm_90 offline
# (Triton 3.9), ptxas gives 188 registers at 128 x 128 and 8 warps (one program per SM) and
# 150-170 at 4 warps (two per SM, so one program's epilogue overlaps the other's products).
_TILED_16BIT = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_D": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_D": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_D": 64}, num_warps=8, num_stages=3),
]
# float32 with exact ("ieee") products runs on the CUDA cores: smaller tiles, fewer registers.
_TILED_FP32 = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 32}, num_warps=8, num_stages=2),
]
_tiled_16bit = triton.autotune(configs=_TILED_16BIT, key=["N", "D", "MODE", "HAS_COUNTS"])(
    _tiled_kernel
)
_tiled_fp32 = triton.autotune(configs=_TILED_FP32, key=["N", "D", "MODE", "HAS_COUNTS"])(
    _tiled_kernel
)

# Under TRITON_INTERPRET=1 (CPU tests) nothing is tuned: small fixed tiles keep it quick.
_INTERPRET_TILED = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": 32}
# Row kernels: 32 rows x 128 columns per step is 16 KB of float32 in flight per program.
_ROWS_BLOCK_M, _ROWS_BLOCK_D = 32, 128

# True when this module's kernels were decorated under TRITON_INTERPRET=1 (triton.jit reads it
# as it decorates); accel.diversity loads a second copy of the module when the mode changes.
INTERPRETED: bool = type(_group_kernel).__name__ == "InterpretedFunction"


# ---- host launchers ------------------------------------------------------------------------


def _check_runnable(x: torch.Tensor) -> None:
    if not INTERPRETED and x.device.type != "cuda":
        raise ValueError(
            f"the Triton kernels need a CUDA tensor, got one on {x.device.type} (set "
            "TRITON_INTERPRET=1 before the call to run them through Triton's interpreter)"
        )


def _group_block_d(block_n: int, d: int) -> int:
    """Chunk of D per step of the group kernel.

    The whole row when the (N, N, chunk) tile fits the budget (N = 4, D = 384: one step of 512,
    so every load of the group is in flight at once, as in a layer-norm kernel); else the chunk
    under the budget that masks the fewest lanes (N = 8, D = 384: three steps of 128).
    """
    whole = max(16, triton.next_power_of_2(d))
    if block_n * block_n * whole <= GROUP_TILE_ELEMENTS:
        return whole
    cap = max(16, GROUP_TILE_ELEMENTS // (block_n * block_n))
    options = [c for c in (16, 32, 64, 128, 256, 512) if c <= cap]
    return min(options, key=lambda c: (triton.cdiv(d, c) * c, -c))


def _run_group(x: torch.Tensor, counts: torch.Tensor | None, mode: int):
    """(out (B,), items (B, N), matrix (B, N, N)); only the mode's outputs are filled."""
    B, N, D = x.shape
    dev = x.device
    out = torch.empty(B, device=dev, dtype=torch.float32)
    items = torch.empty(B, N, device=dev, dtype=torch.float32) if mode == MODE_NEAREST else out
    matrix = torch.empty(B, N, N, device=dev, dtype=torch.float32) if mode == MODE_MATRIX else out
    block_n = max(2, triton.next_power_of_2(N))
    args = (x, counts if counts is not None else out, out, items, matrix, N, D, *x.stride(), EPS)
    meta = dict(
        MODE=mode,
        HAS_COUNTS=counts is not None,
        BLOCK_N=block_n,
        BLOCK_D=_group_block_d(block_n, D),
    )
    if INTERPRETED:
        _group_kernel[(B,)](*args, **meta)
    else:
        _group_tuned[(B,)](*args, **meta)
    return out, items, matrix


def _run_inv_norms(x: torch.Tensor) -> torch.Tensor:
    B, N, D = x.shape
    inv = torch.empty(B, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, _ROWS_BLOCK_M), B)
    _inv_norm_kernel[grid](
        x, inv, N, D, *x.stride(), EPS, BLOCK_M=_ROWS_BLOCK_M, BLOCK_D=_ROWS_BLOCK_D
    )
    return inv


def _run_tiled(x: torch.Tensor, counts: torch.Tensor | None, mode: int) -> torch.Tensor:
    """Nearest distances (B, N) or the distance matrix (B, N, N) of groups of any size."""
    B, N, D = x.shape
    inv = _run_inv_norms(x)
    if mode == MODE_NEAREST:
        out = torch.empty(B, N, device=x.device, dtype=torch.float32)
        items, matrix = out, inv
    else:
        out = torch.zeros(B, N, N, device=x.device, dtype=torch.float32)
        items, matrix = inv, out
    args = (x, inv, counts if counts is not None else inv, items, matrix, N, D, *x.stride())
    # float32 inputs take exact float32 products. So do bfloat16 ones in the interpreter, whose
    # dot multiplies bfloat16's raw bits (Triton 3.9); bf16 x bf16 products are exact in float32
    # anyway, so the result is the tensor cores' up to the order of the sums.
    dot_fp32 = x.dtype == torch.float32 or (INTERPRETED and x.dtype == torch.bfloat16)
    meta = dict(MODE=mode, HAS_COUNTS=counts is not None, DOT_FP32=dot_fp32)
    if INTERPRETED:
        grid = (triton.cdiv(N, _INTERPRET_TILED["BLOCK_M"]), B)
        _tiled_kernel[grid](*args, **meta, **_INTERPRET_TILED)
    else:
        tuned = _tiled_fp32 if x.dtype == torch.float32 else _tiled_16bit
        tuned[lambda m: (triton.cdiv(N, m["BLOCK_M"]), B)](*args, **meta)
    return out


def _run_closed_form_mean(x: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    B, N, D = x.shape
    blocks = triton.cdiv(N, _ROWS_BLOCK_M)
    partial = torch.empty(B, blocks, D, device=x.device, dtype=torch.float32)
    partial_sq = torch.empty(B, blocks, device=x.device, dtype=torch.float32)
    _normalized_sum_kernel[(blocks, B)](
        x,
        counts if counts is not None else partial_sq,
        partial,
        partial_sq,
        N,
        D,
        *x.stride(),
        EPS,
        HAS_COUNTS=counts is not None,
        BLOCK_M=_ROWS_BLOCK_M,
        BLOCK_D=_ROWS_BLOCK_D,
    )
    n = _members(counts, B, N, x.device)
    total = partial.sum(1).square().sum(-1) - partial_sq.sum(1)  # sum over pairs i != j
    mean_cos = total / (n * (n - 1)).clamp(min=1)
    return torch.where(n >= 2, 1.0 - mean_cos, 0.0)


def _members(counts: torch.Tensor | None, B: int, N: int, device) -> torch.Tensor:
    """Members per group as float32 (B,): the counts clamped to [0, N], or N."""
    if counts is None:
        return torch.full((B,), float(N), device=device)
    return counts.clamp(0, N).to(torch.float32)


# ---- public functions (inputs as in accel.diversity; results float32) ------------------------


def mean_diversity(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """1 - mean cosine over pairs i != j of each group: (B,), or () for one set (N, D)."""
    x3, counts, single = check_embeddings(x, counts)
    _check_runnable(x3)
    B, N, _ = x3.shape
    if B == 0 or N < 2:  # no pairs anywhere: diversity 0 by definition
        out = torch.zeros(B, device=x3.device)
    elif N <= SMALL_N:
        out = _run_group(x3, counts, MODE_MEAN)[0]
    else:
        out = _run_closed_form_mean(x3, counts)
    return out[0] if single else out


def nearest_distances(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Cosine distance from each member to its nearest other member: (B, N), or (N,)."""
    x3, counts, single = check_embeddings(x, counts)
    _check_runnable(x3)
    B, N, _ = x3.shape
    if B == 0 or N < 2:
        out = torch.zeros(B, N, device=x3.device)
    elif N <= SMALL_N:
        out = _run_group(x3, counts, MODE_NEAREST)[1]
    else:
        out = _run_tiled(x3, counts, MODE_NEAREST)
    return out[0] if single else out


def nearest_diversity(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Group mean of the nearest-other distances: (B,), or () for one set (N, D)."""
    x3, counts, single = check_embeddings(x, counts)
    _check_runnable(x3)
    B, N, _ = x3.shape
    if B == 0 or N < 2:
        out = torch.zeros(B, device=x3.device)
    elif N <= SMALL_N:
        out = _run_group(x3, counts, MODE_NEAREST)[0]
    else:
        n = _members(counts, B, N, x3.device)
        mean = _run_tiled(x3, counts, MODE_NEAREST).sum(-1) / n.clamp(min=1)
        out = torch.where(n >= 2, mean, 0.0)
    return out[0] if single else out


def pairwise_distances(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The matrix 1 - cos(x_i, x_j): (B, N, N), or (N, N); zero outside each group's count."""
    x3, counts, single = check_embeddings(x, counts)
    _check_runnable(x3)
    B, N, _ = x3.shape
    if B == 0 or N == 0:
        out = torch.zeros(B, N, N, device=x3.device)
    elif N <= SMALL_N:
        out = _run_group(x3, counts, MODE_MATRIX)[2]
    else:
        out = _run_tiled(x3, counts, MODE_MATRIX)
    return out[0] if single else out
