"""Pairwise-cosine diversity in Triton: grouped (B, N, D) and large-set kernels.

Each kernel reads the embeddings from device memory once and keeps every cosine in registers:

- ``_group_kernel``: a few groups of N <= ``SMALL_N`` rows per program. It accumulates each
  group's N x N Gram matrix over chunks of D, takes the norms from its diagonal and reduces in
  the epilogue (mean over pairs, nearest other, or the matrix). Its launch (``GroupConfig``:
  where the sum over D happens, groups per program, chunk, unroll, warps) comes from
  ``GROUP_TABLE``, measured per (N, D bucket, dtype size), else from a rule on N and D.
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

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from accel.diversity import EPS, check_embeddings

SMALL_N = 16  # groups up to this size take the grouped kernel (a few groups per program)
MODE_MEAN, MODE_NEAREST, MODE_MATRIX = 0, 1, 2
# The fallback rule keeps the group kernel's (N, N, GROUPS, BLOCK_D) product tile at or under
# this many float32 elements, so it lives in registers: 64 per thread at 4 warps.
GROUP_TILE_ELEMENTS = 8192
GROUP_MAX = 8  # groups per program at most
GROUP_UNROLL = 4  # chunks of D whose loads a program issues together, at most
# Where the group kernel sums over D (see _group_kernel): its VARIANT constexpr.
# "pairs" is _pairs_kernel (groups of N <= 4, the distinct dot products only), not a VARIANT.
GroupVariant = Literal["tile", "vecsum", "gram", "pairs"]
GROUP_VARIANTS: dict[str, int] = {"tile": 0, "vecsum": 1, "gram": 2, "pairs": 3}
PAIRS_MAX_N = 4  # the rows _pairs_kernel spells out


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
def _group_counts(counts_ptr, b, live, N, GROUPS: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """Members of the groups ``b`` (GROUPS,): each count clamped to [0, N], or N without counts;
    0 for groups past B (``live`` false), so nothing is read for them."""
    if HAS_COUNTS:
        n = tl.load(counts_ptr + b, mask=live, other=0).to(tl.int32)
        n = tl.minimum(tl.maximum(n, 0), N)
    else:
        n = tl.full([GROUPS], N, tl.int32)
    return tl.where(live, n, 0)


@triton.jit
def _load_chunk(x_rows, valid, d0, D, stride_xd, BLOCK_D: tl.constexpr, VEC: tl.constexpr):
    """One chunk of D of every row, (row, 1, group, 16-byte piece, element), as float32.

    The last axis is one thread's 16-byte load, so a sum over it stays inside the thread. The
    unit axis is there already (not expanded afterwards, which would convert the layout through
    shared memory): ``x * tl.permute(x, (1, 0, 2, 3, 4))`` is then every product x_i * x_j of
    the chunk, and the transpose only renames registers of each thread.
    """
    pieces = tl.arange(0, BLOCK_D // VEC)
    cols = d0 + pieces[:, None] * VEC + tl.arange(0, VEC)[None, :]  # (BLOCK_D // VEC, VEC)
    cols = cols[None, None, None, :, :]
    return tl.load(
        x_rows + cols * stride_xd,
        mask=valid[:, None, :, None, None] & (cols < D),
        other=0.0,
    ).to(tl.float32)  # rows past a count are masked, never read


@triton.jit
def _group_kernel(
    X_ptr,
    counts_ptr,
    out_ptr,
    items_ptr,
    matrix_ptr,
    B,
    N,
    D,
    stride_xb,
    stride_xn,
    stride_xd,
    eps,
    MODE: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    VARIANT: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VEC: tl.constexpr,
    UNROLL: tl.constexpr,
):
    # Tiles are (row, group, feature): D is the fastest axis, so a warp's lanes take 16-byte
    # pieces of one row, and the groups come next, so the launcher's warps split the groups
    # (not the rows): each group's rows then sit in one thread's registers, the products
    # x_i * x_j need no exchange between threads and the sum over D none between warps.
    # VARIANT says where the sum over D happens, i.e. what the accumulator holds per thread
    # (N = 4, float32, 4 groups on 4 warps, 3 chunks of 128 loaded together; registers as ptxas
    # gives them for sm_90 with Triton 3.9, offline):
    #   0 "tile":   every product, (N, N, GROUPS, BLOCK_D) summed after the loop: 64 floats a
    #               thread, 128 registers in all (152 with Triton 3.6 on an H200: 12 warps per
    #               SM, 26.8 us, 44% of the copy bandwidth; ncu in results/);
    #   1 "vecsum": each chunk's products summed over the thread's own 16-byte piece at once
    #               (in-thread adds), (N, N, GROUPS, BLOCK_D / VEC): 16 floats, 64 registers,
    #               the same loads and 80 shuffles; predicted: twice the warps per SM, ~15 us;
    #   2 "gram":   each chunk summed over D at once, also across the lanes (240 shuffles
    #               instead of 80), an (N, N, GROUPS) Gram: 72 registers.
    # int64: b * stride_xb may pass 2**31 elements.
    b = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    live = b < B  # the last program may hold fewer than GROUPS groups
    rows = tl.arange(0, BLOCK_N)
    n = _group_counts(counts_ptr, b, live, N, GROUPS, HAS_COUNTS)
    valid = rows[:, None] < n[None, :]  # (BLOCK_N, GROUPS)
    x_rows = (
        X_ptr
        + b[None, None, :, None, None] * stride_xb
        + rows[:, None, None, None, None] * stride_xn
    )
    if VARIANT == 0:
        acc = tl.zeros([BLOCK_N, BLOCK_N, GROUPS, BLOCK_D // VEC, VEC], dtype=tl.float32)
    elif VARIANT == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_N, GROUPS, BLOCK_D // VEC], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_N, GROUPS], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D * UNROLL):
        for k in tl.static_range(UNROLL):
            x = _load_chunk(x_rows, valid, d0 + k * BLOCK_D, D, stride_xd, BLOCK_D, VEC)
            products = x * tl.permute(x, (1, 0, 2, 3, 4))  # (row i, row j, group, piece, elem)
            if VARIANT == 0:
                acc += products
            elif VARIANT == 1:
                acc += tl.sum(products, axis=4)
            else:
                acc += tl.sum(tl.sum(products, axis=4), axis=3)
    if VARIANT == 0:
        gram = tl.sum(tl.sum(acc, axis=4), axis=3)  # (BLOCK_N, BLOCK_N, GROUPS)
    elif VARIANT == 1:
        gram = tl.sum(acc, axis=3)
    else:
        gram = acc

    # Epilogue per group: norms from the diagonal, cosines, and the reduction.
    row_i = rows[:, None, None]
    row_j = rows[None, :, None]
    diagonal = tl.where(row_i == row_j, gram, 0.0)
    inv_rows = 1.0 / tl.maximum(tl.sqrt(tl.sum(diagonal, axis=1)), eps)  # (BLOCK_N, GROUPS)
    inv_cols = 1.0 / tl.maximum(tl.sqrt(tl.sum(diagonal, axis=0)), eps)
    cos = gram * inv_rows[:, None, :] * inv_cols[None, :, :]
    inside = valid[:, None, :] & valid[None, :, :]
    pair = inside & (row_i != row_j)
    if MODE == 0:  # mean over the n (n - 1) ordered pairs
        total = tl.sum(tl.sum(tl.where(pair, cos, 0.0), axis=1), axis=0)  # (GROUPS,)
        mean_cos = total / tl.maximum(n * (n - 1), 1)
        tl.store(out_ptr + b, tl.where(n >= 2, 1.0 - mean_cos, 0.0), mask=live)
    elif MODE == 1:  # nearest other member, per row and its group mean
        best = tl.max(tl.where(pair, cos, float("-inf")), axis=1)  # (BLOCK_N, GROUPS)
        # tl.max skips NaN; a member that is NaN or inf makes every nearest distance of its
        # group NaN, as torch's max does: its squared norm times 0 is NaN, else 0
        poison = tl.sum(tl.where(valid, tl.sum(diagonal, axis=1) * 0.0, 0.0), axis=0)
        dist = tl.where(valid & (n >= 2)[None, :], 1.0 - best + poison[None, :], 0.0)
        tl.store(
            items_ptr + b[None, :] * N + rows[:, None],
            dist,
            mask=(rows[:, None] < N) & live[None, :],
        )
        group_mean = tl.sum(dist, axis=0) / tl.maximum(n, 1)
        tl.store(out_ptr + b, tl.where(n >= 2, group_mean, 0.0), mask=live)
    else:  # the distance matrix; zero outside the first n rows and columns
        tl.store(
            matrix_ptr + b[None, None, :] * N * N + row_i * N + row_j,
            tl.where(inside, 1.0 - cos, 0.0),
            mask=(row_i < N) & (row_j < N) & live[None, None, :],
        )


@triton.jit
def _load_row(x_groups, r, n, live, d0, D, stride_xn, stride_xd, BLOCK_D: tl.constexpr):
    """Row ``r`` of each group, one chunk of D, (GROUPS, BLOCK_D) float32; zero where the row is
    past the group's count or the chunk past D (masked: never read)."""
    cols = d0 + tl.arange(0, BLOCK_D)
    ok = (live & (r < n))[:, None] & (cols[None, :] < D)
    ptrs = x_groups + r * stride_xn + cols[None, :] * stride_xd
    return tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _cos(dot, inv_i, inv_j, inside):
    """A cosine from its dot product and inverse norms, or -inf where the pair is outside."""
    return tl.where(inside, dot * inv_i * inv_j, float("-inf"))


@triton.jit
def _max3(a, b, c):
    """The largest of three, NaN if any is NaN (as torch's max over a row)."""
    ab = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    return tl.maximum(ab, c, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _pairs_kernel(
    X_ptr,
    counts_ptr,
    out_ptr,
    items_ptr,
    B,
    N,
    D,
    stride_xb,
    stride_xn,
    stride_xd,
    eps,
    MODE: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Groups of N <= 4: each row a tensor of its own, (GROUPS, BLOCK_D) with D along the lanes,
    # so only the 10 distinct dot products x_i . x_j (i <= j) are formed: 2.5 multiply-adds per
    # element read, in registers, where the (row, row, ...) tiles of _group_kernel take 4 and
    # rearrange registers for the transpose. The sums over D cross the lanes once per chunk.
    b = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    live = b < B
    n = _group_counts(counts_ptr, b, live, N, GROUPS, HAS_COUNTS)
    x_groups = X_ptr + b[:, None] * stride_xb
    d00 = tl.zeros([GROUPS], dtype=tl.float32)
    d11, d22, d33 = d00, d00, d00
    d01, d02, d03, d12, d13, d23 = d00, d00, d00, d00, d00, d00
    for d0 in range(0, D, BLOCK_D):
        x0 = _load_row(x_groups, 0, n, live, d0, D, stride_xn, stride_xd, BLOCK_D)
        x1 = _load_row(x_groups, 1, n, live, d0, D, stride_xn, stride_xd, BLOCK_D)
        x2 = _load_row(x_groups, 2, n, live, d0, D, stride_xn, stride_xd, BLOCK_D)
        x3 = _load_row(x_groups, 3, n, live, d0, D, stride_xn, stride_xd, BLOCK_D)
        d00 += tl.sum(x0 * x0, axis=1)
        d11 += tl.sum(x1 * x1, axis=1)
        d22 += tl.sum(x2 * x2, axis=1)
        d33 += tl.sum(x3 * x3, axis=1)
        d01 += tl.sum(x0 * x1, axis=1)
        d02 += tl.sum(x0 * x2, axis=1)
        d03 += tl.sum(x0 * x3, axis=1)
        d12 += tl.sum(x1 * x2, axis=1)
        d13 += tl.sum(x1 * x3, axis=1)
        d23 += tl.sum(x2 * x3, axis=1)
    i0 = 1.0 / tl.maximum(tl.sqrt(d00), eps)
    i1 = 1.0 / tl.maximum(tl.sqrt(d11), eps)
    i2 = 1.0 / tl.maximum(tl.sqrt(d22), eps)
    i3 = 1.0 / tl.maximum(tl.sqrt(d33), eps)
    # pair (i, j), i < j, is inside the group when j < n
    c01 = _cos(d01, i0, i1, n > 1)
    c02 = _cos(d02, i0, i2, n > 2)
    c12 = _cos(d12, i1, i2, n > 2)
    c03 = _cos(d03, i0, i3, n > 3)
    c13 = _cos(d13, i1, i3, n > 3)
    c23 = _cos(d23, i2, i3, n > 3)
    if MODE == 0:  # mean over the n (n - 1) ordered pairs: twice the unordered ones
        total = tl.where(n > 1, c01, 0.0) + tl.where(n > 2, c02 + c12, 0.0)
        total += tl.where(n > 3, c03 + c13 + c23, 0.0)
        mean_cos = 2.0 * total / tl.maximum(n * (n - 1), 1)
        tl.store(out_ptr + b, tl.where(n >= 2, 1.0 - mean_cos, 0.0), mask=live)
    else:  # nearest other member, per row and its group mean
        many = n >= 2
        dist0 = tl.where(many, 1.0 - _max3(c01, c02, c03), 0.0)
        dist1 = tl.where(many, 1.0 - _max3(c01, c12, c13), 0.0)
        dist2 = tl.where(many & (n > 2), 1.0 - _max3(c02, c12, c23), 0.0)
        dist3 = tl.where(many & (n > 3), 1.0 - _max3(c03, c13, c23), 0.0)
        items = items_ptr + b * N
        width = tl.full([GROUPS], N, tl.int32)  # rows per group in items (N, not the count)
        tl.store(items, dist0, mask=live)
        tl.store(items + 1, dist1, mask=live)
        tl.store(items + 2, dist2, mask=live & (width > 2))
        tl.store(items + 3, dist3, mask=live & (width > 3))
        group_mean = (dist0 + dist1 + dist2 + dist3) / tl.maximum(n, 1)
        tl.store(out_ptr + b, tl.where(many, group_mean, 0.0), mask=live)


@triton.jit
def _row_sq_norms(
    x_base, rows, row_ok, D, stride_xn, stride_xd, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Squared norms (BLOCK_M,) in float32 of the rows ``rows`` of one group, chunk by chunk."""
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(
            x_base + rows[:, None] * stride_xn + cols[None, :] * stride_xd,
            mask=row_ok[:, None] & (cols[None, :] < D),
            other=0.0,
        ).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
    return sq


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
    sq = _row_sq_norms(x_base, rows, row_ok, D, stride_xn, stride_xd, BLOCK_M, BLOCK_D)
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
    poison = tl.zeros([BLOCK_M], dtype=tl.float32)
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
    sq = _row_sq_norms(x_base, rows, row_ok, D, stride_xn, stride_xd, BLOCK_M, BLOCK_D)
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


@dataclass(frozen=True)
class GroupConfig:
    """One launch of the group kernel: where it sums over D, and its tile.

    ``num_warps`` should be ``groups * block_d / (32 * elements per 16-byte load)`` (one warp
    per row of 16-byte loads of the (group, feature) plane) so that warps split the groups,
    never the rows or D; other values are correct but exchange values through shared memory.
    """

    variant: GroupVariant
    groups: int  # groups per program (a power of 2)
    block_d: int  # features per chunk (a power of 2, >= 16)
    unroll: int  # chunks of D whose loads are issued together, at most
    num_warps: int

    def __post_init__(self):
        if self.variant not in GROUP_VARIANTS:
            raise ValueError(
                f"variant must be one of {', '.join(GROUP_VARIANTS)}, got {self.variant!r}"
            )
        powers = {"groups": self.groups, "block_d": self.block_d, "num_warps": self.num_warps}
        odd = {k: v for k, v in powers.items() if v < 1 or v & (v - 1)}
        if odd or self.block_d < 16 or self.unroll < 1:
            raise ValueError(
                "groups, block_d and num_warps must be powers of 2, block_d >= 16 and unroll "
                f">= 1; got {self}"
            )

    @property
    def name(self) -> str:
        return (
            f"{self.variant} G={self.groups} BD={self.block_d} U={self.unroll} W={self.num_warps}"
        )

    def meta(self, d: int, itemsize: int) -> dict:
        """The kernel's launch keywords for rows of ``d`` elements of ``itemsize`` bytes."""
        return dict(
            VARIANT=GROUP_VARIANTS[self.variant],
            GROUPS=self.groups,
            BLOCK_D=self.block_d,
            VEC=min(max(1, 16 // itemsize), self.block_d),  # elements per 16-byte load
            UNROLL=max(1, min(self.unroll, triton.cdiv(d, self.block_d))),
            num_warps=self.num_warps,
        )


# Best measured configuration per (BLOCK_N, D rounded up to a power of 2, bytes per element);
# every other shape takes the rule of _rule_config. Measured by group_kernel_sweep
# (accel.lab.cases.diversity) on an H200 at B=8192 N=4 D=384, copy 4250 GB/s (2026-11-22):
# float32 "pairs G=1 BD=128 W=1" 3530 GB/s for mean (83% of copy), 3475 for nearest; the
# same with BD=512 (one chunk, a quarter of it masked) 3357. Before "pairs": vecsum G=1 BD=128
# W=1, 2792 GB/s (66%); tile G=4 W=4 (the first kernel) 1667. bfloat16 "pairs G=1 BD=512 W=1"
# 2879 GB/s for mean (vecsum G=4 W=2 before it: 1518).
GROUP_TABLE: dict[tuple[int, int, int], GroupConfig] = {
    (4, 512, 4): GroupConfig("pairs", groups=1, block_d=128, unroll=1, num_warps=1),
    (4, 512, 2): GroupConfig("pairs", groups=1, block_d=512, unroll=1, num_warps=1),
}


def _rule_config(block_n: int, d: int, batch: int, itemsize: int) -> GroupConfig:
    """The fallback: a deterministic rule (no autotuning: the same launch compiled or interpreted).

    BLOCK_D is one warp's row of 16-byte loads (128 float32), fewer for short rows or large N;
    GROUPS fills the tile budget; UNROLL chunks of D are loaded before their products are taken.

    Warps: while a group's BLOCK_N^2 x (elements per 16-byte load) products fit a thread
    (N <= 4), as many warps as the (GROUPS, BLOCK_D) plane has rows of 16-byte loads, so warps
    split the groups, never the rows, and no value crosses warps before the epilogue. Beyond
    that the rows are split anyway, and the warps follow the tile: 64 products per thread.
    """
    vec = max(1, 16 // itemsize)  # elements per 16-byte load
    block_d = min(max(16, triton.next_power_of_2(d)), 32 * 4)
    block_d = max(16, min(block_d, GROUP_TILE_ELEMENTS // (block_n * block_n)))
    groups = GROUP_TILE_ELEMENTS // (block_n * block_n * block_d)
    groups = max(1, min(groups, GROUP_MAX, triton.next_power_of_2(batch)))
    rows_in_thread = block_n * block_n * vec <= 128
    plane_warps = groups * block_d // (32 * vec)  # one per row of 16-byte loads of the plane
    tile_warps = block_n * block_n * groups * block_d // (32 * 64)  # 64 products per thread
    warps = plane_warps if rows_in_thread else tile_warps
    return GroupConfig(
        "vecsum",
        groups=groups,
        block_d=block_d,
        unroll=min(GROUP_UNROLL, triton.cdiv(d, block_d)),
        num_warps=max(1, min(8, warps)),
    )


def group_config(block_n: int, d: int, batch: int, itemsize: int) -> GroupConfig:
    """The configuration the group kernel launches with: the table's, else the rule's."""
    table = GROUP_TABLE.get((block_n, triton.next_power_of_2(d), itemsize))
    return table if table is not None else _rule_config(block_n, d, batch, itemsize)


def _group_config(block_n: int, d: int, batch: int, itemsize: int) -> dict:
    """Launch keywords of :func:`group_config`: GROUPS, BLOCK_D, VEC, UNROLL, num_warps, ..."""
    return group_config(block_n, d, batch, itemsize).meta(d, itemsize)


def _run_group(
    x: torch.Tensor,
    counts: torch.Tensor | None,
    mode: int,
    config: GroupConfig | None = None,
):
    """(out (B,), items (B, N), matrix (B, N, N)); only the mode's outputs are filled.

    ``config`` overrides the table and rule (for sweeps and tests). A "pairs" configuration
    runs :func:`_pairs_kernel`; it has no matrix mode, which then takes the rule's launch.
    """
    B, N, D = x.shape
    dev = x.device
    out = torch.empty(B, device=dev, dtype=torch.float32)
    items = torch.empty(B, N, device=dev, dtype=torch.float32) if mode == MODE_NEAREST else out
    matrix = torch.empty(B, N, N, device=dev, dtype=torch.float32) if mode == MODE_MATRIX else out
    block_n = max(2, triton.next_power_of_2(N))
    itemsize = x.element_size()
    if config is None:
        config = group_config(block_n, D, B, itemsize)
    if config.variant == "pairs" and N > PAIRS_MAX_N:
        raise ValueError(f"the 'pairs' group kernel takes N <= {PAIRS_MAX_N}, got N={N}")
    if config.variant == "pairs" and mode == MODE_MATRIX:
        config = _rule_config(block_n, D, B, itemsize)
    args = (x, counts if counts is not None else out, out, items, matrix, B, N, D, *x.stride(), EPS)
    grid = (triton.cdiv(B, config.groups),)
    if config.variant == "pairs":
        block_d = min(config.block_d, max(16, triton.next_power_of_2(D)))
        _pairs_kernel[grid](
            *args[:4],
            *args[5:],
            MODE=mode,
            HAS_COUNTS=counts is not None,
            GROUPS=config.groups,
            BLOCK_D=block_d,
            num_warps=config.num_warps,
        )
        return out, items, matrix
    meta = config.meta(D, itemsize)
    _group_kernel[grid](*args, MODE=mode, HAS_COUNTS=counts is not None, BLOCK_N=block_n, **meta)
    return out, items, matrix


def run_group_kernel(
    x: torch.Tensor, reduction: str, config: GroupConfig | None = None
) -> torch.Tensor:
    """The group kernel alone on groups ``x`` (B, N <= SMALL_N, D): ``reduction`` "mean" or
    "nearest" gives (B,) diversities, "matrix" the (B, N, N) distances. For sweeps: no checks
    beyond the usual, no dispatch; ``config`` picks the launch (default: the table's)."""
    modes = {"mean": MODE_MEAN, "nearest": MODE_NEAREST, "matrix": MODE_MATRIX}
    if reduction not in modes:
        raise ValueError(f"reduction must be one of {', '.join(modes)}, got {reduction!r}")
    x3, _, _ = check_embeddings(x)
    _check_runnable(x3)
    if x3.shape[1] < 2 or x3.shape[1] > SMALL_N:
        raise ValueError(f"the group kernel takes 2 <= N <= {SMALL_N}, got {tuple(x3.shape)}")
    mode = modes[reduction]
    return _run_group(x3, None, mode, config)[2 if mode == MODE_MATRIX else 0]


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
