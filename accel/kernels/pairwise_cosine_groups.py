"""Pairwise-cosine kernels for many small groups (N <= 64 rows each), whole groups a program.

- ``pairs_kernel``: groups of N <= 4, each row a tensor of its own, only the distinct dot
  products formed (the mean and the nearest).
- ``group_dot_kernel``: the rows of all the program's groups as one (GROUPS * BLOCK_N, D) tile
  times its own transpose on the tensor cores (float32 in two TF32 passes, ``_gram_fp32``); each
  group's Gram matrix is a diagonal block of the product, reduced in registers by the epilogue
  (the mean, the nearest, or the matrix).
- ``closed_form_kernel``: the mean only, from the sum of the normalized rows (whole rows in
  registers a step, each read once, O(N D) work).

Each reads every element once, accumulates in float32 whatever the input dtype and normalizes
as ``F.normalize`` does, x / max(||x||, eps); rows past a group's count are never read.
``pairwise_cosine_config`` says how each launches.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _program_groups(counts_ptr, B, N, GROUPS: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """This program's groups ``b`` (GROUPS,), which exist (``live``: the last program may hold
    fewer than GROUPS) and their members ``n`` (0 for the groups past B)."""
    # int64: b * stride_xb may pass 2**31 elements.
    b = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    live = b < B
    return b, live, _group_counts(counts_ptr, b, live, N, GROUPS, HAS_COUNTS)


@triton.jit
def _aligned_rows(D, stride_xb, stride_xn, ALIGN: tl.constexpr):
    """The row width and strides, multiples of ALIGN (the launcher's ``row_alignment``),
    written so that the compiler sees it: rows then load ALIGN elements at a time, not one."""
    if ALIGN > 1:
        D = D // ALIGN * ALIGN
        stride_xb = stride_xb // ALIGN * ALIGN
        stride_xn = stride_xn // ALIGN * ALIGN
    return D, stride_xb, stride_xn


@triton.jit
def _group_epilogue(
    gram, b, live, rows, n, valid, N, eps, out_ptr, items_ptr, matrix_ptr, MODE: tl.constexpr
):
    """Per group, from its Gram matrix (BLOCK_N, BLOCK_N, GROUPS): norms from the diagonal,
    cosines, and the reduction of ``MODE`` stored."""
    row_i = rows[:, None, None]
    row_j = rows[None, :, None]
    squares = tl.sum(tl.where(row_i == row_j, gram, 0.0), axis=1)  # (BLOCK_N, GROUPS)
    inverse_norms = 1.0 / tl.maximum(tl.sqrt(squares), eps)
    # one reduction of the tile: the columns' norms are the rows' (a relayout of BLOCK_N values)
    cos = gram * inverse_norms[:, None, :] * inverse_norms[None, :, :]
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
        poison = tl.sum(tl.where(valid, squares * 0.0, 0.0), axis=0)
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
def _tf32_high(x):
    """``x`` (float32) rounded to TF32's 10-bit mantissa, so the tensor cores take it exactly;
    ``x - _tf32_high(x)`` is exact in float32 and under 2^-11 of ``x``."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _gram_fp32(x, acc):
    """``acc`` + h h^T + h (2 l)^T for float32 ``x`` = h + l, h exact in TF32: two TF32 passes.

    That sum M is not the Gram matrix, but (M + M^T) / 2 is, to float32 rounding: x x^T = h h^T +
    h l^T + (h l^T)^T + l l^T, and l l^T (under 2^-22 of it) is dropped, as three TF32 passes (the
    general product's h h^T, h l^T and l h^T) drop it. The caller symmetrizes once, after the
    last chunk."""
    high = _tf32_high(x)
    acc = tl.dot(high, tl.trans(high), acc, input_precision="tf32")
    return tl.dot(high, tl.trans(2.0 * (x - high)), acc, input_precision="tf32")


@triton.jit
def group_dot_kernel(
    X_ptr, counts_ptr, out_ptr, items_ptr, matrix_ptr, B, N, D, stride_xb, stride_xn, stride_xd,
    eps, MODE: tl.constexpr, HAS_COUNTS: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    D, stride_xb, stride_xn = _aligned_rows(D, stride_xb, stride_xn, ALIGN)
    # Tile row r is row r % BLOCK_N of the program's group r // BLOCK_N; rows past a group's
    # count (or past B) load as zeros, so their products are zero and the epilogue skips them.
    b, live, n = _program_groups(counts_ptr, B, N, GROUPS, HAS_COUNTS)
    rows = tl.arange(0, BLOCK_N)
    valid = rows[:, None] < n[None, :]  # (BLOCK_N, GROUPS)
    r = tl.arange(0, GROUPS * BLOCK_N)
    group_of_row = tl.program_id(0).to(tl.int64) * GROUPS + r // BLOCK_N
    row = r % BLOCK_N
    members = _group_counts(counts_ptr, group_of_row, group_of_row < B, N, GROUPS * BLOCK_N,
                            HAS_COUNTS)  # fmt: skip
    row_ok = row < members
    x_rows = X_ptr + group_of_row[:, None] * stride_xb + row[:, None] * stride_xn
    acc = tl.zeros([GROUPS * BLOCK_N, GROUPS * BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_rows + cols[None, :] * stride_xd, mask=row_ok[:, None] & (cols[None, :] < D),
                    other=0.0)  # fmt: skip
        # 16-bit products are exact in float32; float32 takes two TF32 passes
        acc = _gram_fp32(x.to(tl.float32), acc) if DOT_FP32 else tl.dot(x, tl.trans(x), acc)
    if GROUPS == 1:
        gram = tl.reshape(acc, (BLOCK_N, BLOCK_N, 1))
    else:
        blocks = tl.reshape(acc, (GROUPS, BLOCK_N, GROUPS, BLOCK_N))
        groups = tl.arange(0, GROUPS)
        same = groups[:, None, None, None] == groups[None, None, :, None]
        gram = tl.sum(tl.where(same, blocks, 0.0), axis=2)  # (GROUPS, BLOCK_N, BLOCK_N)
        gram = tl.permute(gram, (1, 2, 0))  # (BLOCK_N, BLOCK_N, GROUPS), as the epilogue takes it
    if DOT_FP32:  # the groups' blocks only: GROUPS times less to transpose than the tile
        gram = (gram + tl.permute(gram, (1, 0, 2))) * 0.5
    _group_epilogue(gram, b, live, rows, n, valid, N, eps, out_ptr, items_ptr, matrix_ptr, MODE)


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
def pairs_kernel(
    X_ptr, counts_ptr, out_ptr, items_ptr, B, N, D, stride_xb, stride_xn, stride_xd, eps,
    MODE: tl.constexpr, HAS_COUNTS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    # Groups of N = ROWS <= 4: each row a tensor of its own, (GROUPS, BLOCK_D) with D along the
    # lanes, so only the distinct dot products x_i . x_j (i <= j) are formed: (ROWS + 1) / 2
    # multiply-adds per element read, in registers, where a (row, row, ...) tile takes ROWS and
    # rearranges registers for the transpose. Rows past ROWS are
    # neither loaded nor multiplied (their products stay 0). The sums over D cross the lanes
    # once per chunk.
    D, stride_xb, stride_xn = _aligned_rows(D, stride_xb, stride_xn, ALIGN)
    b, live, n = _program_groups(counts_ptr, B, N, GROUPS, HAS_COUNTS)
    x_groups = X_ptr + b[:, None] * stride_xb
    d00 = tl.zeros([GROUPS], dtype=tl.float32)
    d11, d22, d33 = d00, d00, d00
    d01, d02, d03, d12, d13, d23 = d00, d00, d00, d00, d00, d00
    for d0 in range(0, D, BLOCK_D):
        x0 = _load_row(x_groups, 0, n, live, d0, D, stride_xn, stride_xd, BLOCK_D)
        x1 = _load_row(x_groups, 1, n, live, d0, D, stride_xn, stride_xd, BLOCK_D)
        d00 += tl.sum(x0 * x0, axis=1)
        d11 += tl.sum(x1 * x1, axis=1)
        d01 += tl.sum(x0 * x1, axis=1)
        if ROWS > 2:
            x2 = _load_row(x_groups, 2, n, live, d0, D, stride_xn, stride_xd, BLOCK_D)
            d22 += tl.sum(x2 * x2, axis=1)
            d02 += tl.sum(x0 * x2, axis=1)
            d12 += tl.sum(x1 * x2, axis=1)
            if ROWS > 3:
                x3 = _load_row(x_groups, 3, n, live, d0, D, stride_xn, stride_xd, BLOCK_D)
                d33 += tl.sum(x3 * x3, axis=1)
                d03 += tl.sum(x0 * x3, axis=1)
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
        items = items_ptr + b * ROWS  # ROWS per group in items (N, not the count)
        tl.store(items, dist0, mask=live)
        tl.store(items + 1, dist1, mask=live)
        if ROWS > 2:
            tl.store(items + 2, dist2, mask=live)
        if ROWS > 3:
            tl.store(items + 3, dist3, mask=live)
        group_mean = (dist0 + dist1 + dist2 + dist3) / tl.maximum(n, 1)
        tl.store(out_ptr + b, tl.where(many, group_mean, 0.0), mask=live)


@triton.jit
def closed_form_kernel(
    X_ptr, counts_ptr, out_ptr, B, N, D, stride_xb, stride_xn, stride_xd, eps,
    HAS_COUNTS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    # The mean only, by its closed form: sum_{i != j} cos_ij = ||sum_i x̂_i||^2 -
    # sum_i ||x̂_i||^2. Each step holds BLOCK_N whole rows of GROUPS groups, (GROUPS, BLOCK_N,
    # BLOCK_D): their norms come from registers, so every row is read once, and O(N D) work
    # replaces the N^2 D of a Gram matrix (two TF32 passes of it in float32).
    D, stride_xb, stride_xn = _aligned_rows(D, stride_xb, stride_xn, ALIGN)
    b, live, n = _program_groups(counts_ptr, B, N, GROUPS, HAS_COUNTS)
    cols = tl.arange(0, BLOCK_D)
    x_groups = X_ptr + b[:, None, None] * stride_xb + cols[None, None, :] * stride_xd
    column_sums = tl.zeros([GROUPS, BLOCK_D], dtype=tl.float32)  # sum_i x̂_i
    own = tl.zeros([GROUPS], dtype=tl.float32)  # sum_i ||x̂_i||^2
    # steps up to the largest count of the program's groups: a ragged batch skips its holes
    for n0 in range(0, tl.max(n, axis=0), BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        member = rows[None, :] < n[:, None]  # (GROUPS, BLOCK_N); rows past a count: not read
        x = tl.load(
            x_groups + rows[None, :, None] * stride_xn,
            mask=member[:, :, None] & (cols[None, None, :] < D),
            other=0.0,
        ).to(tl.float32)
        squares = tl.sum(x * x, axis=2)
        inv = 1.0 / tl.maximum(tl.sqrt(squares), eps)
        own += tl.sum(squares * inv * inv, axis=1)
        column_sums += tl.sum(x * inv[:, :, None], axis=1)
    pairs = tl.sum(column_sums * column_sums, axis=1) - own
    mean_cos = pairs / tl.maximum(n * (n - 1), 1)
    tl.store(out_ptr + b, tl.where(n >= 2, 1.0 - mean_cos, 0.0), mask=live)
