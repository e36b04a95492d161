"""How the small-group diversity kernels launch: one rule on N, D, the batch and the dtype.

Plain integer arithmetic, no Triton (notebook 06 shows the launch a shape gets on a machine that
cannot run the kernels), and deterministic: the same launch compiled or interpreted.

- the mean and the nearest of groups of up to 4 rows: ``pairs_kernel``, chunks of one warp's row
  of 16-byte loads, whole groups filling about :data:`PAIRS_PROGRAM_BYTES` a program;
- the nearest of larger groups, and every matrix: ``group_dot_kernel``, the smallest tile of
  whole groups the tensor cores take (16 rows, or the group's own 32 or 64), a warp per 16 rows
  (16-bit tiles of 32 rows: one);
- the mean of groups padded to 8 rows or more: ``closed_form_kernel``, whole rows in registers,
  a warp per 512 bytes of a row (up to 4), 2048 elements a warp a step.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

SMALL_N = 64  # groups up to this size take the group kernels (whole groups a program)
PAIRS_MAX_N = 4  # the rows pairs_kernel spells out
PAIRS_PROGRAM_BYTES = 4096
DOT_MIN_ROWS = 16  # the smallest tile the tensor cores take
CLOSED_FORM_MIN_N = 8  # padded rows from which the mean takes the closed form
STEP_ELEMENTS_PER_WARP = 2048
MAX_GROUPS = 16  # groups a program at most
CLOSED_FORM_MAX_D = 8192  # a whole row held in registers at most (longer: the large-set kernels)


class GroupConfig(NamedTuple):
    """One launch of a group kernel: which kernel (``variant``), groups a program, chunk of D
    (the whole row for "closed"), warps, pipeline stages (Triton's if None), and for "closed"
    the rows of each group a step."""

    variant: Literal["pairs", "dot", "closed"]
    groups: int
    block_d: int
    num_warps: int
    num_stages: int | None = None
    step_rows: int = 1


@functools.lru_cache(maxsize=1024)
def group_config(
    block_n: int, d: int, batch: int, itemsize: int, *, ragged: bool = False, matrix: bool = False
) -> GroupConfig:
    """The launch of the nearest (or, with ``matrix``, the distance matrix) of ``batch`` groups
    padded to ``block_n`` rows of ``d`` elements of ``itemsize`` bytes; ``ragged``: counts given
    (16-bit chunks of 64, which read faster past the holes than 128)."""
    vec = 16 // itemsize  # elements per 16-byte load
    if block_n <= PAIRS_MAX_N and not matrix:  # "pairs" writes no matrix
        block_d = min(max(16, next_power_of_2(d)), 32 * vec)
        groups = _groups(PAIRS_PROGRAM_BYTES // (block_n * d * itemsize), batch)
        warps = max(1, min(4, groups * block_d // (32 * vec)))
        return GroupConfig("pairs", groups, block_d, warps)
    rows = max(DOT_MIN_ROWS, block_n)
    warps = 1 if rows == 32 and itemsize == 2 else rows // DOT_MIN_ROWS
    if itemsize == 4:  # float32 stages both TF32 halves of a chunk: small chunks, no pipeline
        block_d, stages = (32 if d <= 512 else 64), (1 if rows == 64 else None)
    else:
        block_d, stages = (64 if ragged or d < 1024 else 128), None
    return GroupConfig("dot", rows // block_n, block_d, warps, num_stages=stages)


@functools.lru_cache(maxsize=1024)
def mean_config(
    block_n: int, d: int, batch: int, itemsize: int, *, ragged: bool = False
) -> GroupConfig:
    """The launch of the mean: the closed form from :data:`CLOSED_FORM_MIN_N` padded rows (with
    counts, at most 8 rows of a group a step, so the steps stop near the largest count), else
    :func:`group_config`'s."""
    if block_n < CLOSED_FORM_MIN_N:
        return group_config(block_n, d, batch, itemsize, ragged=ragged)
    block_d = max(16, next_power_of_2(d))
    warps = max(1, min(4, block_d * itemsize // 512))
    step = STEP_ELEMENTS_PER_WARP * warps
    rows = max(1, min(block_n, step // block_d, 8 if ragged else block_n))
    groups = _groups(step // (rows * block_d), batch)
    return GroupConfig("closed", groups, block_d, warps, step_rows=rows)


def group_kernel_takes_mean(n: int, d: int) -> bool:
    """Whether the group kernels take the mean of groups of ``n`` rows of ``d`` elements (else
    the large-set closed form, which splits a group's rows over programs)."""
    return n <= PAIRS_MAX_N or (n <= SMALL_N and next_power_of_2(d) <= CLOSED_FORM_MAX_D)


def _groups(fit: int, batch: int) -> int:
    """The largest power of 2 up to ``fit`` (at least 1), :data:`MAX_GROUPS` and the batch."""
    fit = max(1, min(fit, MAX_GROUPS, next_power_of_2(batch)))
    return 1 << (fit.bit_length() - 1)


def block_rows(n: int) -> int:
    """BLOCK_N of groups of ``n`` rows: the next power of 2, at least 2."""
    return max(2, next_power_of_2(n))


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` (the smallest power of 2 >= n; 0 for 0), without Triton."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
