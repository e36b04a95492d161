"""Bench phase ``sdpa``: fused attention against the manual path and the matrix-product ceiling,
masked attention with FlexAttention, and the ViT training step with every flag against its
baseline.

The phase runs in four parts (``bench --only``), each in its own module (the names
``notebooks/05_sdpa.ipynb`` and the tests use are re-exported here):

- ``headline`` (``sdpa_headline``): the headline shape's rows and the causal training row, on
  the ground of ``sdpa_measure`` (targets, sizes, one attention case, its cost model, timing,
  which backend ran, peak memory, errors, every kernel at a shape);
- ``flex`` (``sdpa_flex``): masked attention (cases ``flex ...``): FlexAttention against SDPA on
  the dense mask and against SDPA's causal kernel, the mask's memory and block sparsity;
- ``masked sweep`` (``sdpa_masked_sweep``): ``sdpa(mask=...)`` against the user's own compiled
  ``flex_attention`` over kinds, lengths, head dims and directions;
- ``vit`` (``sdpa_vit``): the ViT training step, every flag but compile and all.

TFLOP/s are compared with the measured dense matrix-product rate (``ctx.ceilings``).
"""

from __future__ import annotations

from collections.abc import Callable

from accel.lab.bench import BenchContext, Row
from accel.lab.cases import sdpa_masked_sweep
from accel.lab.cases.sdpa_flex import (
    FLEX_SIZES,
    TARGET_MASK_MEMORY,
    FlexSizes,
    MaskFlags,
    check_masked,
    document_lengths,
    flex_frame,
    flex_rows,
    mask_costs,
    masked_step,
    measure_masked,
    tile_states,
)
from accel.lab.cases.sdpa_headline import causal_training_row, headline_rows
from accel.lab.cases.sdpa_masked_sweep import MASKED_SWEEP, MaskedSweepSizes
from accel.lab.cases.sdpa_measure import (
    BENCH_SIZES,
    AttnCase,
    BenchSizes,
    attention_bytes,
    attention_flops,
    backend_frame,
    check_backends,
    make_inputs,
    measure_point,
    peak_memory_bytes,
    variant_fn,
    which_backend,
)
from accel.lab.cases.sdpa_vit import vit_rows

# what notebooks/05_sdpa.ipynb and the tests reach through this module
__all__ = [
    "BENCH_SIZES",
    "FLEX_SIZES",
    "MASKED_SWEEP",
    "TARGET_MASK_MEMORY",
    "AttnCase",
    "BenchSizes",
    "FlexSizes",
    "MaskFlags",
    "MaskedSweepSizes",
    "attention_bytes",
    "attention_flops",
    "backend_frame",
    "check_backends",
    "check_masked",
    "document_lengths",
    "flex_frame",
    "flex_rows",
    "make_inputs",
    "mask_costs",
    "masked_step",
    "measure_masked",
    "measure_point",
    "parts",
    "peak_memory_bytes",
    "run",
    "tile_states",
    "variant_fn",
    "which_backend",
]


def _headline(ctx: BenchContext) -> list[Row]:
    sizes = BENCH_SIZES[ctx.preset]
    return [*headline_rows(ctx, sizes, ctx.judged), causal_training_row(ctx, sizes, ctx.judged)]


_PARTS: dict[str, Callable[[BenchContext], list[Row]]] = {
    "headline": _headline,
    "flex": lambda ctx: flex_rows(ctx, ctx.judged),
    "masked sweep": sdpa_masked_sweep.rows,
    "vit": lambda ctx: vit_rows(ctx, BENCH_SIZES[ctx.preset], ctx.judged),
}


def parts() -> list[str]:
    """The parts ``--only`` can pick."""
    return list(_PARTS)


def run(ctx: BenchContext) -> list[Row]:
    rows = [row for part, rows in _PARTS.items() if ctx.selected(part) for row in rows(ctx)]
    return ctx.judge(rows)
