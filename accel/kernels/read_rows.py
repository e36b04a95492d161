"""Reading a batch of row sets at the device's pace: the rows each set's count holds, summed.

No component uses it. It is the lab's ceiling for a diversity kernel's reads: on ragged counts the
rows past a set's count are holes in the stream that a contiguous copy does not have, so the time
to read just the held rows, in the same layout, is what such a kernel can approach. Programs split
the batch by sets and each set by blocks of rows, so a few large sets still fill the device. No
one launch shape reads every layout fastest (past holes, small tiles often win), so the lab times
each of :data:`TILE_BYTES_TRIED` and takes the fastest as the ceiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import row_alignment
from .pairwise_cosine_groups import aligned_rows

# Bytes a program loads per step, the launch shapes tried: 16 KB reads full sets at the copy's
# pace; 4 KB reads ragged sets faster at most widths (results/diversity-notes.md).
TILE_BYTES_TRIED = (16 << 10, 4 << 10)
TILE_BYTES = TILE_BYTES_TRIED[0]
ROWS_PER_PROGRAM = 16  # at most: larger sets are split over programs


@triton.jit
def _sum_rows_kernel(
    X_ptr,
    counts_ptr,
    out_ptr,
    B,
    N,
    D,
    stride_b,
    stride_n,
    stride_d,
    HAS_COUNTS: tl.constexpr,
    G: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Program (i, j): sets i*G.. of the batch, their rows j*ROWS..; one partial sum per set
    and row block, in ``out`` (B, row blocks). Rows load ALIGN elements at a time, as the
    diversity kernels' do."""
    D, stride_b, stride_n = aligned_rows(D, stride_b, stride_n, ALIGN)
    sets = tl.program_id(0) * G + tl.arange(0, G)
    block = tl.program_id(1)
    set_ok = sets < B
    if HAS_COUNTS:
        held = tl.load(counts_ptr + sets, mask=set_ok, other=0).to(tl.int32)
        held = tl.minimum(tl.maximum(held, 0), N)
    else:
        held = tl.zeros([G], dtype=tl.int32) + N
    rows = block * ROWS + tl.arange(0, ROWS)
    row_ok = set_ok[:, None] & (rows[None, :] < held[:, None])  # (G, ROWS)
    base = X_ptr + sets.to(tl.int64)[:, None, None] * stride_b + rows[None, :, None] * stride_n
    acc = tl.zeros([G, ROWS, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = row_ok[:, :, None] & (cols[None, None, :] < D)
        acc += tl.load(base + cols[None, None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    blocks = tl.num_programs(1)
    tl.store(out_ptr + sets * blocks + block, tl.sum(tl.sum(acc, axis=2), axis=1), mask=set_ok)


def launch_shape(
    n: int, d: int, itemsize: int, tile_bytes: int = TILE_BYTES
) -> tuple[int, int, int]:
    """(sets per program, rows per program, columns per step): a power of 2 each, together
    ``tile_bytes`` of loads per step where the set allows."""
    elements = tile_bytes // itemsize
    rows = min(triton.next_power_of_2(n), ROWS_PER_PROGRAM)
    block_d = min(triton.next_power_of_2(d), max(16, elements // rows))
    sets = max(1, elements // (rows * block_d))
    return sets, rows, block_d


def sum_rows_partials(
    x: torch.Tensor, counts: torch.Tensor | None = None, *, tile_bytes: int = TILE_BYTES
) -> torch.Tensor:
    """Per set of ``x`` (B, N, D) and block of rows, the sum of the rows ``counts`` (B,) holds
    (all N without counts; counts clamped to [0, N]), in float32: (B, row blocks); each program
    loads ``tile_bytes`` a step where the set allows."""
    batch, n, d = x.shape
    sets, rows, block_d = launch_shape(n, d, x.element_size(), tile_bytes)
    out = torch.empty((batch, triton.cdiv(n, rows)), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(batch, sets), out.shape[1])
    _sum_rows_kernel[grid](
        x,
        x if counts is None else counts,  # not read without counts
        out,
        batch,
        n,
        d,
        *x.stride(),
        HAS_COUNTS=counts is not None,
        G=sets,
        ROWS=rows,
        BLOCK_D=block_d,
        ALIGN=row_alignment(x),
        num_warps=4,
    )
    return out


def sum_rows_reference(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Per set of ``x`` (B, N, D), the float32 sum of the rows ``counts`` holds: (B,)."""
    batch, n, _ = x.shape
    held = torch.full((batch,), n, device=x.device) if counts is None else counts.clamp(0, n)
    rows = torch.arange(n, device=x.device)[None, :] < held[:, None]
    return (x.float() * rows[:, :, None]).sum(dim=(1, 2))


# True when this module's kernels were decorated under TRITON_INTERPRET=1 (triton.jit reads it
# as it decorates); accel.triton_support.kernel_module keeps one set of modules per mode.
INTERPRETED: bool = type(_sum_rows_kernel).__name__ == "InterpretedFunction"
