"""Bench phase ``sdpa``: fused attention against the manual path and the matrix-product ceiling,
and the ViT training step with every flag against its baseline.

The phase runs five groups of rows, each in its own module, all reachable from here (the names
``notebooks/05_sdpa.ipynb`` and the tests use are re-exported):

- ``sdpa_measure``: the targets, one attention case, its cost model (FLOPs and bytes), timing of
  every variant, which backend a call really ran (the profiler), peak memory, errors;
- ``sdpa_headline``: the headline shape's rows and the causal training row;
- ``sdpa_sweep``: the sweep of sequence length and head dimension per backend, and its rows;
- ``sdpa_vit``: the ViT training step, flag by flag;
- ``sdpa_flex``: masked attention (cases ``flex ...``): FlexAttention against SDPA on the dense
  mask and against SDPA's causal kernel, first calls, the mask's memory and block sparsity.

TFLOP/s are compared with the measured dense matrix-product rate (``ctx.ceilings``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from accel import attention
from accel.lab.bench import BenchContext, Row
from accel.lab.cases.sdpa_flex import (
    FLEX_SIZES,
    TARGET_CAUSAL_VS_SDPA,
    TARGET_DOCUMENT_VS_DENSE,
    TARGET_MASK_MEMORY,
    TARGET_WINDOW_VS_DENSE,
    FlexSizes,
    MaskedPoint,
    MaskFlags,
    block_mask_bytes,
    check_masked,
    document_lengths,
    flex_frame,
    flex_rows,
    mask_costs,
    masked_fn,
    masked_step,
    measure_masked,
    tile_states,
)
from accel.lab.cases.sdpa_headline import VARIANTS, causal_training_row, headline_rows
from accel.lab.cases.sdpa_measure import (
    MATH_SWEEP_BYTES,
    PHASE,
    PICKED,
    SDPA_OPS,
    TARGET_AUTO_TFLOP_S,
    TARGET_CAUSAL_TRAIN_TFLOP_S,
    TARGET_VIT,
    TARGET_VS_BEST,
    TARGET_VS_MANUAL,
    AttnCase,
    PointTimes,
    attention_bytes,
    attention_flops,
    auto_choice,
    check_backends,
    make_inputs,
    measure_point,
    paired_ratio,
    peak_memory_bytes,
    release_memory,
    tflop_s,
    variant_fn,
    which_backend,
)
from accel.lab.cases.sdpa_sweep import (
    SWEEP_VARIANTS,
    SweepSizes,
    sweep,
    sweep_frame,
    sweep_rows,
    sweep_summary_rows,
)
from accel.lab.cases.sdpa_vit import vit_configs, vit_rows

__all__ = [
    "BENCH_SIZES",
    "FLEX_SIZES",
    "MATH_SWEEP_BYTES",
    "NOTEBOOK_SWEEP",
    "PHASE",
    "PICKED",
    "SDPA_OPS",
    "SWEEP_VARIANTS",
    "TARGET_AUTO_TFLOP_S",
    "TARGET_CAUSAL_TRAIN_TFLOP_S",
    "TARGET_CAUSAL_VS_SDPA",
    "TARGET_DOCUMENT_VS_DENSE",
    "TARGET_MASK_MEMORY",
    "TARGET_VIT",
    "TARGET_VS_BEST",
    "TARGET_VS_MANUAL",
    "TARGET_WINDOW_VS_DENSE",
    "VARIANTS",
    "AttnCase",
    "BenchSizes",
    "FlexSizes",
    "MaskFlags",
    "MaskedPoint",
    "PointTimes",
    "SweepSizes",
    "attention_bytes",
    "attention_flops",
    "auto_choice",
    "block_mask_bytes",
    "causal_training_row",
    "check_backends",
    "check_masked",
    "document_lengths",
    "flex_frame",
    "flex_rows",
    "headline_rows",
    "make_inputs",
    "mask_costs",
    "masked_fn",
    "masked_step",
    "measure_masked",
    "measure_point",
    "paired_ratio",
    "peak_memory_bytes",
    "release_memory",
    "run",
    "sweep",
    "sweep_frame",
    "sweep_rows",
    "sweep_summary_rows",
    "tflop_s",
    "tile_states",
    "variant_fn",
    "vit_configs",
    "vit_rows",
    "which_backend",
]


@dataclass(frozen=True)
class BenchSizes:
    headline: AttnCase
    sweep: SweepSizes
    repeats: int
    vit_repeats: int


BENCH_SIZES = {
    # 64k tokens per point: even the smallest (S=256, D=64, causal) runs several times the host
    # time of one call, so the GPU never waits for Python (which would favour the plain call)
    "gpu": BenchSizes(
        headline=AttnCase(4, 16, 4096, 128),
        sweep=SweepSizes(
            seqs=(256, 1024, 4096, 16384),
            head_dims=(64, 128),
            heads=16,
            tokens=65536,
            dtype=torch.bfloat16,
            repeats=16,  # 8 rounds each way; fewer left the pick's two copies apart at S=16384
        ),
        repeats=20,
        vit_repeats=10,
    ),
    "cpu": BenchSizes(
        headline=AttnCase(1, 2, 255, 32, dtype=torch.float32),
        sweep=SweepSizes(
            seqs=(63, 255),
            head_dims=(16,),
            heads=2,
            tokens=256,
            dtype=torch.float32,
            repeats=5,
        ),
        repeats=7,
        vit_repeats=5,
    ),
}

# The notebook's sweep, per preset: a quarter of the bench's points (one head dimension, two
# lengths) at half its repeats, so that it answers in seconds; the bench's rows hold the rest.
# On a CPU, a tiny version.
NOTEBOOK_SWEEP = {
    "gpu": dataclasses.replace(
        BENCH_SIZES["gpu"].sweep, seqs=(1024, 4096), head_dims=(128,), repeats=8
    ),
    "cpu": dataclasses.replace(BENCH_SIZES["cpu"].sweep, tokens=255, repeats=3),
}


def run(ctx: BenchContext) -> list[Row]:
    judged = ctx.judged
    sizes = BENCH_SIZES[ctx.preset]
    attention.clear_auto_cache()  # auto measures afresh in this run
    rows = headline_rows(ctx, sizes, judged)
    rows.append(causal_training_row(ctx, sizes, judged))
    frame = sweep(ctx.device, sizes.sweep)
    rows += sweep_rows(frame, ctx, judged)
    rows += sweep_summary_rows(frame, judged)
    rows += flex_rows(ctx, judged)
    rows += vit_rows(ctx, sizes, judged)
    return ctx.judge(rows)
