"""Pairwise-cosine kernels for large sets: the nearest other member and the mean over pairs.

- ``tiled_kernel``: the structure of fused attention. A program keeps one block of rows, streams
  blocks of columns past it, forms their dot products with ``tl.dot`` (a GEMM over chunks of D,
  in one flat pipelined loop) and folds each tile into a running maximum per row (or stores it,
  for the distance matrix), so the N x N matrix never exists in device memory.
  ``inv_norm_kernel`` first writes the N inverse norms it scales by.
- ``normalized_sum_kernel``: the mean over pairs by its closed form,
  sum_{i != j} cos_ij = ||sum_i x̂_i||^2 - sum_i ||x̂_i||^2, in O(N D): partial sums of the
  normalized rows per block of rows, which the launcher finishes per group.

All accumulate in float32 and normalize as ``F.normalize`` does, x / max(||x||, eps).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _group_size(counts_ptr, b, N, HAS_COUNTS: tl.constexpr):
    """Members of group b: its count clamped to [0, N], or N without counts."""
    if HAS_COUNTS:  # noqa: SIM108 (a constexpr branch: only the taken one is compiled)
        n = tl.minimum(tl.maximum(tl.load(counts_ptr + b).to(tl.int32), 0), N)
    else:
        n = N
    return n


@triton.jit
def _load_rows(x_base, rows, row_ok, d0, D, stride_xn, stride_xd, BLOCK_D: tl.constexpr):
    """The chunk of D at ``d0`` of the rows ``rows`` of one group, (BLOCK_M, BLOCK_D) float32,
    zero where masked (never read), and the chunk's column numbers."""
    cols = d0 + tl.arange(0, BLOCK_D)
    x = tl.load(
        x_base + rows[:, None] * stride_xn + cols[None, :] * stride_xd,
        mask=row_ok[:, None] & (cols[None, :] < D),
        other=0.0,
    ).to(tl.float32)
    return x, cols


@triton.jit
def _row_sq_norms(
    x_base, rows, row_ok, D, stride_xn, stride_xd, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Squared norms (BLOCK_M,) in float32 of the rows ``rows`` of one group, chunk by chunk."""
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        x, _ = _load_rows(x_base, rows, row_ok, d0, D, stride_xn, stride_xd, BLOCK_D)
        sq += tl.sum(x * x, axis=1)
    return sq


@triton.jit
def inv_norm_kernel(
    X_ptr, inv_ptr, N, D, stride_xb, stride_xn, stride_xd, eps, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    x_base = X_ptr + b * stride_xb
    sq = _row_sq_norms(x_base, rows, row_ok, D, stride_xn, stride_xd, BLOCK_M, BLOCK_D)
    tl.store(inv_ptr + b * N + rows, 1.0 / tl.maximum(tl.sqrt(sq), eps), mask=row_ok)


@triton.jit
def tiled_kernel(
    X_ptr, inv_ptr, counts_ptr, items_ptr, matrix_ptr, N, D, stride_xb, stride_xn, stride_xd,
    MODE: tl.constexpr, HAS_COUNTS: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n = _group_size(counts_ptr, b, N, HAS_COUNTS)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    x_base = X_ptr + b * stride_xb
    inv_rows = tl.load(inv_ptr + b * N + rows, mask=row_ok, other=0.0)
    offs_d = tl.arange(0, BLOCK_D)
    best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    poison = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Like fused attention: this block of rows stays, blocks of columns stream past it, and each
    # (BLOCK_M, BLOCK_N) tile of dot products is reduced in registers, never written out.
    # One flat loop over (column block, chunk of D) pairs rather than two nested loops: the
    # loads stay pipelined across column blocks instead of the pipeline refilling every tile,
    # which a short D (a few chunks) would pay often (the persistent-matmul tutorial's shape).
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
                # tl.max skips NaN: a NaN (or inf) member poisons every row, as in torch
                poison += tl.sum(tl.where(pair, cos * 0.0, 0.0), axis=1)
            else:  # MODE 2: distance matrix (pre-zeroed by the launcher outside the first n)
                tl.store(
                    matrix_ptr + b * N * N + rows[:, None] * N + cols[None, :],
                    1.0 - cos,
                    mask=row_ok[:, None] & col_ok[None, :],
                )
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MODE == 1:
        dist = tl.where(row_ok & (n >= 2), 1.0 - best + poison, 0.0)
        tl.store(items_ptr + b * N + rows, dist, mask=rows < N)


@triton.jit
def normalized_sum_kernel(
    X_ptr, counts_ptr, partial_ptr, partial_sq_ptr, N, D, stride_xb, stride_xn, stride_xd, eps,
    HAS_COUNTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    blocks = tl.num_programs(0)
    n = _group_size(counts_ptr, b, N, HAS_COUNTS)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    x_base = X_ptr + b * stride_xb
    sq = _row_sq_norms(x_base, rows, row_ok, D, stride_xn, stride_xd, BLOCK_M, BLOCK_D)
    inv = 1.0 / tl.maximum(tl.sqrt(sq), eps)
    slot = b * blocks + pid
    tl.store(partial_sq_ptr + slot, tl.sum(sq * inv * inv, axis=0))  # sum of ||x̂_i||^2
    # Second pass over the same rows: they were just read, so it hits the cache, not memory.
    for d0 in range(0, D, BLOCK_D):
        x, cols = _load_rows(x_base, rows, row_ok, d0, D, stride_xn, stride_xd, BLOCK_D)
        tl.store(partial_ptr + slot * D + cols, tl.sum(x * inv[:, None], axis=0), mask=cols < D)


# ---- launch configurations -----------------------------------------------------------------

# Tiled kernel, 16-bit inputs: a GEMM main loop on the tensor cores, loads pipelined over
# num_stages; 4-warp tiles fit two programs per SM, so one's epilogue overlaps the other's dots.
TILED_16BIT = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_D": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_D": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_D": 64}, num_warps=8, num_stages=3),
]
# float32 with exact ("ieee") products runs on the CUDA cores: smaller tiles, fewer registers.
TILED_FP32 = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 32}, num_warps=8, num_stages=2),
]
tiled_16bit = triton.autotune(configs=TILED_16BIT, key=["N", "D", "MODE", "HAS_COUNTS"])(
    tiled_kernel
)
tiled_fp32 = triton.autotune(configs=TILED_FP32, key=["N", "D", "MODE", "HAS_COUNTS"])(tiled_kernel)

# Under TRITON_INTERPRET=1 (CPU tests) nothing is tuned: small fixed tiles keep it quick.
INTERPRET_TILED = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": 32}
# Row kernels: 32 rows x 128 columns per step is 16 KB of float32 in flight per program.
ROWS_BLOCK_M, ROWS_BLOCK_D = 32, 128
