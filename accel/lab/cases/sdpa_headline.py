"""The sdpa phase's headline rows: at the headline shape every variant's TFLOP/s against the
manual path, which kernels ran, peak memory; and the causal training row (forward + backward).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from accel.lab.bench import BenchContext, Row
from accel.lab.cases.sdpa_measure import (
    PHASE,
    TARGET_CAUSAL_TRAIN_TFLOP_S,
    TARGET_TFLOP_S,
    TARGET_VS_MANUAL,
    AttnCase,
    BenchSizes,
    make_inputs,
    measure_point,
    peak_memory_bytes,
    release_memory,
    tflop_s,
    variant_fn,
    which_backend,
)

# "default" is sdpa as a user calls it: PyTorch's pick
VARIANTS = ("manual", "math", "efficient", "flash", "cudnn", "default")


def headline_rows(ctx: BenchContext, sizes: BenchSizes, judged: bool) -> list[Row]:
    """The headline shape (``sizes.headline``; B=4 H=16 S=4096 D=128 bf16 on a GPU): every
    variant's TFLOP/s against the manual path, which kernel ran, peak memory."""
    case, device = sizes.headline, ctx.device
    point = measure_point(case, device, VARIANTS, repeats=sizes.repeats, math_bytes=16 << 30)
    times, skipped = point.times, point.skipped
    rate = {name: tflop_s(case.flops, ms) for name, ms in times.items()}
    q, k, v, grad = make_inputs(case, device)
    ran = which_backend(variant_fn("default", case, q, k, v, grad), device) if rate else {}
    rows = _rate_rows(ctx, case, times, rate, skipped, ran, judged)
    rows.append(_memory_row(case, q, k, v, grad, device))
    del q, k, v, grad
    release_memory(device)
    return rows


def _rate_rows(
    ctx: BenchContext,
    case: AttnCase,
    times: dict[str, float],
    rate: dict[str, float],
    skipped: dict[str, str],
    ran: dict[str, str],
    judged: bool,
) -> list[Row]:
    """Every variant's TFLOP/s against the manual path; PyTorch's pick judged on its targets."""
    manual, default = rate.get("manual", math.nan), rate.get("default", math.nan)
    rows = []
    for name in VARIANTS:
        if name not in rate:
            rows.append(
                Row(PHASE, f"{case.name} {name}", "rate", "TFLOP/s", math.nan, note=skipped[name])
            )
            continue
        note = f"speedup is x manual; {str(case.dtype).removeprefix('torch.')}"
        is_default = name == "default"
        if is_default and ran:
            note += f"; profiler: {ran['backend']} ran ({ran['kernel'][:70]})"
        rows.append(
            Row(
                PHASE,
                f"{case.name} {name}",
                "rate",
                "TFLOP/s",
                rate[name],
                baseline=manual,
                higher_is_better=True,
                fraction_of_ceiling=ctx.ceilings.compute_fraction(case.flops, times[name]),
                target=f">= {TARGET_TFLOP_S:g} TFLOP/s and >= {TARGET_VS_MANUAL:g}x"
                if is_default
                else "",
                met=(default >= TARGET_TFLOP_S and default >= TARGET_VS_MANUAL * manual)
                if judged and is_default
                else None,
                note=note,
            )
        )
    return rows


def _memory_row(case: AttnCase, q, k, v, grad, device: torch.device) -> Row:
    """Peak memory of SDPA against the manual path, which keeps (B, H, S, S) scores; SDPA never
    writes them."""
    peaks = {
        name: peak_memory_bytes(variant_fn(name, case, q, k, v, grad), device) / 2**20
        for name in ("manual", "default")
    }
    scores_mib = case.batch * case.heads * case.seq**2 * q.element_size() / 2**20
    return Row(
        PHASE,
        f"{case.name} peak memory",
        "peak memory above the inputs",
        "MiB",
        peaks["default"],
        baseline=peaks["manual"],
        note=f"baseline = manual, optimized = sdpa; speedup = how many times less memory; "
        f"one (B, H, S, S) score tensor is {scores_mib:,.0f} MiB",
    )


def causal_training_row(ctx: BenchContext, sizes: BenchSizes, judged: bool) -> Row:
    """Forward and backward of causal attention at the headline shape, as a user calls it."""
    case = dataclasses.replace(sizes.headline, causal=True, backward=True)
    point = measure_point(case, ctx.device, ("default",), repeats=sizes.repeats)
    ms = point.times.get("default", math.nan)
    rate = tflop_s(case.flops, ms)
    note = "FLOPs counted as 3.5x a causal forward"
    if "default" in point.times:  # which forward kernel ran (the backward follows it)
        q, k, v, grad = make_inputs(case, ctx.device)
        ran = which_backend(variant_fn("default", case, q, k, v, grad), ctx.device)["backend"]
        note += f"; profiler: {ran} ran"
        del q, k, v, grad
    else:
        note += f"; skipped: {point.skipped.get('default', '')[:80]}"
    return Row(
        PHASE,
        f"{case.name} default",
        "rate",
        "TFLOP/s",
        rate,
        higher_is_better=True,
        fraction_of_ceiling=ctx.ceilings.compute_fraction(case.flops, ms)
        if not math.isnan(ms)
        else math.nan,
        target=f">= {TARGET_CAUSAL_TRAIN_TFLOP_S:g} TFLOP/s",
        met=rate >= TARGET_CAUSAL_TRAIN_TFLOP_S if judged else None,
        note=note,
    )
