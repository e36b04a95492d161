"""The group kernel's variants kept for the bench sweep, and the sweep's launcher.

``accel.lab.cases.diversity.group_kernel_sweep`` times every variant of the group kernel side by
side; production takes "vecsum", "pairs" or "dot" (``pairwise_cosine``). The two kept here
differ from the production ``group_kernel`` only in where the sum over D happens, i.e. what the
accumulator holds per thread; the prologue and epilogue are the production kernel's own helpers:

- "tile": every product, (N, N, GROUPS, BLOCK_D / VEC, VEC), summed after the loop: the first
  kernel, the sweep's "before";
- "gram": each chunk summed over D at once, also across the lanes: an (N, N, GROUPS) Gram.

Their rows are in results/*.csv, phase=diversity, cases "sweep group kernel ...".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pairwise_cosine import (
    MODE_MATRIX,
    MODE_MEAN,
    MODE_NEAREST,
    check_runnable,
    group_outputs,
    run_group,
)
from .pairwise_cosine_config import SMALL_N, SWEEP_VARIANTS, GroupConfig, block_rows
from .pairwise_cosine_groups import chunk_products, group_epilogue, group_rows


@triton.jit
def _group_variant_kernel(
    X_ptr, counts_ptr, out_ptr, items_ptr, matrix_ptr, B, N, D, stride_xb, stride_xn, stride_xd,
    eps, MODE: tl.constexpr, HAS_COUNTS: tl.constexpr, VARIANT: tl.constexpr,
    GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr,
    UNROLL: tl.constexpr,
):  # fmt: skip
    # VARIANT 0 is "tile", 1 is "gram" (the module docstring says what each accumulates).
    b, live, rows, n, valid, x_rows = group_rows(
        X_ptr, counts_ptr, B, N, stride_xb, stride_xn, HAS_COUNTS, GROUPS, BLOCK_N
    )
    if VARIANT == 0:
        acc = tl.zeros([BLOCK_N, BLOCK_N, GROUPS, BLOCK_D // VEC, VEC], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_N, GROUPS], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D * UNROLL):
        for k in tl.static_range(UNROLL):
            products = chunk_products(x_rows, valid, d0 + k * BLOCK_D, D, stride_xd, BLOCK_D, VEC)
            if VARIANT == 0:
                acc += products
            else:
                acc += tl.sum(tl.sum(products, axis=4), axis=3)
    if VARIANT == 0:  # noqa: SIM108 (a constexpr branch: only the taken one is compiled)
        gram = tl.sum(tl.sum(acc, axis=4), axis=3)  # (BLOCK_N, BLOCK_N, GROUPS)
    else:
        gram = acc
    group_epilogue(gram, b, live, rows, n, valid, N, eps, out_ptr, items_ptr, matrix_ptr, MODE)


# True when this module's kernels were decorated under TRITON_INTERPRET=1 (triton.jit reads it
# as it decorates); accel.triton_support.kernel_module keeps one set of modules per mode.
INTERPRETED: bool = type(_group_variant_kernel).__name__ == "InterpretedFunction"


def run_variant(
    x: torch.Tensor,
    counts: torch.Tensor | None,
    mode: int,
    config: GroupConfig | None,
    *,
    eps: float,
):
    """(out (B,), items (B, N), matrix (B, N, N)) of the group kernel launched as ``config``
    says, whatever its variant (None: the production one); only the mode's outputs are filled."""
    if config is None or config.variant not in SWEEP_VARIANTS:
        return run_group(x, counts, mode, config, eps=eps)
    B, N, D = x.shape
    out, items, matrix = group_outputs(x, mode)
    args = (x, counts if counts is not None else out, out, items, matrix, B, N, D, *x.stride(), eps)
    _group_variant_kernel[(triton.cdiv(B, config.groups),)](
        *args,
        MODE=mode,
        HAS_COUNTS=counts is not None,
        VARIANT=SWEEP_VARIANTS.index(config.variant),
        BLOCK_N=block_rows(N),
        **config.meta(D, x.element_size()),
    )
    return out, items, matrix


def run_group_kernel(
    x: torch.Tensor, reduction: str, config: GroupConfig | None = None, *, eps: float
) -> torch.Tensor:
    """The group kernel alone on groups ``x`` (B, N <= SMALL_N, D) of a dtype diversity takes:
    ``reduction`` "mean" or "nearest" gives (B,) diversities, "matrix" the (B, N, N) distances.
    For sweeps: no dispatch; ``config`` picks the launch (default: production's)."""
    modes = {"mean": MODE_MEAN, "nearest": MODE_NEAREST, "matrix": MODE_MATRIX}
    if reduction not in modes:
        raise ValueError(f"reduction must be one of {', '.join(modes)}, got {reduction!r}")
    check_runnable(x)
    if x.dim() != 3 or not 2 <= x.shape[1] <= SMALL_N:
        raise ValueError(
            f"the group kernel takes (B, N, D) with 2 <= N <= {SMALL_N}, got {tuple(x.shape)}"
        )
    mode = modes[reduction]
    return run_variant(x, None, mode, config, eps=eps)[2 if mode == MODE_MATRIX else 0]
