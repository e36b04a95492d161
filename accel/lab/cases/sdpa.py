"""Bench phase ``sdpa``: fused attention against the manual path and the matrix-product ceiling,
masked attention with FlexAttention, and the ViT training step with every flag against its
baseline. Shared with ``notebooks/05_sdpa.ipynb`` (the names it uses are re-exported here).

The phase runs in four parts (``bench --only``):

- ``headline``: every variant's TFLOP/s at the headline shape against the manual path, which
  kernel ran, peak memory, and causal attention forward + backward; on the ground of
  ``sdpa_measure`` (targets, sizes, one attention case, its cost model, timing, which backend
  ran, peak memory, errors, every kernel at a shape);
- ``flex`` (``sdpa_flex``): FlexAttention against SDPA on the dense mask (cases ``flex ...``),
  the mask's memory and block sparsity;
- ``masked sweep`` (``sdpa_masked_sweep``): ``sdpa(mask=...)`` against the user's own compiled
  ``flex_attention`` over kinds, lengths, head dims and directions;
- ``vit``: the ViT training step, every flag but compile and all, checked equal first.

TFLOP/s are compared with the measured dense matrix-product rate (``ctx.ceilings``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from accel.lab.bench import BenchContext, Row
from accel.lab.cases import sdpa_masked_sweep
from accel.lab.cases.sdpa_flex import (
    TARGET_MASK_MEMORY,
    MaskFlags,
    document_lengths,
    flex_frame,
    flex_rows,
    mask_costs,
    masked_step,
    measure_masked,
    tile_states,
)
from accel.lab.cases.sdpa_measure import (
    BENCH_SIZES,
    PHASE,
    TARGET_CAUSAL_TRAIN_TFLOP_S,
    TARGET_TFLOP_S,
    TARGET_VIT,
    TARGET_VS_MANUAL,
    AttnCase,
    BenchSizes,
    attention_bytes,
    attention_flops,
    backend_frame,
    check_backends,
    make_inputs,
    measure_point,
    peak_memory_bytes,
    release_memory,
    tflop_s,
    variant_fn,
    which_backend,
)
from accel.lab.timing import compare
from accel.workloads import vit
from accel.workloads.flags import all_on, label

__all__ = [
    "BENCH_SIZES",
    "TARGET_MASK_MEMORY",
    "AttnCase",
    "BenchSizes",
    "MaskFlags",
    "attention_bytes",
    "attention_flops",
    "backend_frame",
    "check_backends",
    "document_lengths",
    "flex_frame",
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


# ---- the ViT training step ---------------------------------------------------------------------
def vit_configs(device: torch.device) -> dict[str, vit.Flags]:
    """The baseline, every flag but compile (notebook 05's panel ends there), all."""
    everything = all_on(vit.Flags, device)
    configs = {"baseline": vit.Flags()}
    no_compile = dataclasses.replace(everything, compile=False)
    configs["all but compile"] = no_compile
    if everything != no_compile:
        configs["all flags"] = everything
    return configs


def vit_rows(ctx: BenchContext, sizes: BenchSizes, judged: bool, check_steps: int = 3) -> list[Row]:
    vit_sizes = vit.Sizes.preset(ctx.preset)
    steps, checks = {}, {}
    reference = None
    for name, flags in vit_configs(ctx.device).items():
        step = vit.build(flags, vit_sizes, device=ctx.device, seed=0)
        for _ in range(check_steps):  # correctness before timing
            step()
        result = step.result()
        if reference is None:
            reference = result
        checks[name] = _equal(result, reference, flags, vit_sizes, check_steps)
        steps[name] = step
    timing = compare(
        steps, baseline="baseline", warmup=3, repeats=sizes.vit_repeats, device=ctx.device
    )
    top = "all flags" if "all flags" in steps else "all but compile"
    ran = which_backend(steps[top], ctx.device)["backend"]
    rows = []
    for name, step in steps.items():
        speedup = timing.speedup(name)
        ok, how = checks[name]
        target = met = None
        if name == "all flags" or (name == top and not judged):
            target, met = f">= {TARGET_VIT}x and equal", (speedup >= TARGET_VIT and ok)
        note = f"{label(step.flags)}; result {'equal' if ok else 'DIFFERS'} ({how})"
        if name == top:
            note += f"; attention ran {ran}"
        rows.append(
            Row(
                PHASE,
                f"vit step: {name}",
                "time per training step",
                "ms",
                timing.timings[name].median_ms,
                baseline=timing.timings["baseline"].median_ms,
                target=target or "",
                met=met if judged and target else None,
                note=note,
            )
        )
    compiled = steps.get("all flags")
    if compiled is not None and compiled.flags.compile:
        rows.append(
            Row(
                PHASE,
                "vit compile: all flags",
                "first forward + backward (compile), outside every step time",
                "s",
                compiled.compile_seconds,
                note="torch.compile default mode",
            )
        )
    del steps
    release_memory(ctx.device)
    return rows


def _equal(
    result: dict, reference: dict, flags: vit.Flags, sizes: vit.Sizes, steps: int
) -> tuple[bool, str]:
    """Whether ``result`` is within ``vit.tolerance``, and the largest difference or what failed."""
    try:
        errors = vit.compare_results(result, reference, flags, sizes=sizes, steps=steps)
    except AssertionError as failed:
        return False, str(failed).splitlines()[0]
    return True, f"largest difference {max(errors.values()):.2g} of the entry's largest value"


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
