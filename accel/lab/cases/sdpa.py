"""Bench phase ``sdpa``, in five parts (``bench --only``): ``headline`` (every kernel's TFLOP/s
against the manual path at the headline shape), ``flex`` (masked attention, ``sdpa_flex``),
``masked sweep`` (``sdpa(mask=...)`` against a user's own compiled ``flex_attention``,
``sdpa_masked_sweep``), ``vit`` (the ViT training step, every flag against the baseline) and
``max-autotune vit`` (compile's max-autotune against its default mode); here too how a case is
measured: variants timed interleaved, every kernel at a shape (:func:`backend_frame`), which
backend really ran (the profiler), errors against float64. The ground the parts share is
``sdpa_measure``; the names notebook 05 uses are re-exported here. TFLOP/s are compared with the
measured matrix-product rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import pandas as pd
import torch

from accel import attention
from accel.errors import collection_of
from accel.lab.bench import BenchContext, Row, release_memory
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
    PHASE,
    AttnCase,
    as_timed,
    attention_bytes,
    attention_flops,
    make_inputs,
    peak_memory_bytes,
)
from accel.measure.attention import sdpa_backends
from accel.measure.profile import profile_step
from accel.measure.timer import compare, interleaved
from accel.workloads import vit
from accel.workloads.flags import all_on, label

# what notebooks/05_sdpa.ipynb reaches through this module
__all__ = [
    "TARGET_MASK_MEMORY", "AttnCase", "MaskFlags", "attention_bytes", "attention_flops",
    "backend_frame", "check_backends", "document_lengths", "flex_frame", "make_inputs",
    "mask_costs", "masked_step", "measure_masked", "parts", "peak_memory_bytes", "run",
    "tile_states", "variant_fn", "which_backend",
]  # fmt: skip

# Targets, judged on a CUDA GPU with the gpu preset only.
TARGET_TFLOP_S = 640.0  # sdpa as a user calls it (PyTorch's pick), B=4 H=16 S=4096 D=128 bf16 fwd
TARGET_VS_MANUAL = 6.0
TARGET_VIT = 2.5
# The ATen op each backend dispatches to: what the profiler shows for "which one really ran".
SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
# "default" is sdpa as a user calls it: PyTorch's pick
VARIANTS = ("manual", "math", "efficient", "flash", "cudnn", "default")


@dataclass(frozen=True)
class BenchSizes:
    headline: AttnCase
    repeats: int
    vit_repeats: int


BENCH_SIZES = {
    "gpu": BenchSizes(headline=AttnCase(4, 16, 4096, 128), repeats=20, vit_repeats=10),
    "cpu": BenchSizes(
        headline=AttnCase(1, 2, 255, 32, dtype=torch.float32), repeats=7, vit_repeats=5
    ),
}


def variant_fn(variant: str, case: AttnCase, q, k, v, grad) -> Callable[[], object]:
    """One timed call of ``variant``: "manual", or an ``accel.attention.sdpa`` backend."""

    def forward():
        if variant == "manual":
            return attention.attention_reference(q, k, v, causal=case.causal)
        return attention.sdpa(q, k, v, causal=case.causal, backend=variant)

    return as_timed(forward, case, (q, k, v), grad)


@dataclass(frozen=True)
class PointTimes:
    """One case measured: median ms per variant, the reason of each one skipped."""

    times: dict[str, float]
    skipped: dict[str, str]


def measure_point(case: AttnCase, device, variants: Sequence[str], *, repeats=10, warmup=2, seed=0):
    """Median ms of each variant that can run ``case`` and the reason of each one skipped, in one
    interleaved measurement."""
    variants = collection_of(variants, "variant names")
    q, k, v, grad = make_inputs(case, device, seed)
    fns, skipped = {}, {}
    for variant in variants:
        fn = variant_fn(variant, case, q, k, v, grad)
        try:
            fn()  # the first call finds out whether the backend can run (and warms it)
        except (attention.BackendUnavailableError, RuntimeError) as error:
            skipped[variant] = getattr(error, "reason", str(error))
            continue
        fns[variant] = fn
    times = {}
    if fns:
        timed = interleaved(fns, device, warmup=warmup, repeats=repeats, name_errors=True)
        times = timed.medians()
    del q, k, v, grad, fns
    release_memory(device)
    return PointTimes(times, skipped)


def backend_frame(device, cases: Iterable[AttnCase], *, repeats: int = 10) -> pd.DataFrame:
    """``lab.sdpa_backends`` at each of ``cases``: a row per (case, backend), with ``tflop_s``."""
    frames = []
    for case in cases:
        q, k, v, _ = make_inputs(case, device)
        rows = sdpa_backends(q, k, v, causal=case.causal, backward=case.backward, repeats=repeats)
        frames.append(rows.assign(
            S=case.seq, D=case.head_dim, B=case.batch, H=case.heads, causal=case.causal,
            direction=case.direction, tflop_s=tflop_s(case.flops, rows["ms"]),
        ))  # fmt: skip
        del q, k, v
        release_memory(device)
    return pd.concat(frames, ignore_index=True)


def tflop_s(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def which_backend(fn: Callable[[], object], device: torch.device) -> dict[str, str]:
    """The SDPA backend a call really ran, from the profiler's ATen ops, and its largest kernel."""
    report = profile_step(fn, steps=1, warmup=1, device=device)
    ops = [name for name in report.ops["name"] if name in SDPA_OPS]
    backend = ",".join(sorted({SDPA_OPS[name] for name in ops})) or "none (manual)"
    kernel = str(report.kernels["name"].iloc[0]) if len(report.kernels) else ""
    return {"backend": backend, "op": ",".join(sorted(set(ops))), "kernel": kernel}


def check_backends(q, k, v, *, mask: torch.Tensor | None = None, causal=False) -> pd.DataFrame:
    """Every backend on the same inputs against attention in float64: ran or why not, the
    largest error and whether it is within the dtype's tolerance."""
    exact_mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    with torch.no_grad():
        exact = attention.attention_reference(
            q.double(), k.double(), v.double(), mask=exact_mask, causal=causal
        )
        tol = attention.TOLERANCES[q.dtype]
        rows = []
        for name in ("manual", *attention.BACKENDS):
            try:
                if name == "manual":
                    out = attention.attention_reference(q, k, v, mask=mask, causal=causal)
                else:
                    out = attention.sdpa(q, k, v, mask=mask, causal=causal, backend=name)
            except attention.BackendUnavailableError as error:
                rows.append({"backend": name, "ran": False, "reason": error.reason})
                continue
            err = (out.double() - exact).abs()
            within = bool((err <= tol["atol"] + tol["rtol"] * exact.abs()).all())
            rows.append({"backend": name, "ran": True, "max_abs_error": err.max().item(),
                         "within_tolerance": within, "reason": ""})  # fmt: skip
    return pd.DataFrame(rows)


# ---- headline ----------------------------------------------------------------------------------
def headline_rows(ctx: BenchContext, sizes: BenchSizes) -> list[Row]:
    """At the headline shape (B=4 H=16 S=4096 D=128 bf16 on a GPU): every variant's TFLOP/s
    against the manual path, which kernel PyTorch's pick ran."""
    case, device = sizes.headline, ctx.device
    point = measure_point(case, device, VARIANTS, repeats=sizes.repeats)
    rate = {name: tflop_s(case.flops, ms) for name, ms in point.times.items()}
    q, k, v, grad = make_inputs(case, device)
    ran = which_backend(variant_fn("default", case, q, k, v, grad), device) if rate else {}
    manual, default = rate.get("manual", math.nan), rate.get("default", math.nan)
    rows = []
    for name in VARIANTS:
        if name not in rate:
            rows.append(Row(PHASE, f"{case.name} {name}", "rate", "TFLOP/s", math.nan,
                            note=point.skipped[name]))  # fmt: skip
            continue
        note = f"speedup is x manual; {str(case.dtype).removeprefix('torch.')}"
        is_default = name == "default"
        if is_default and ran:
            note += f"; profiler: {ran['backend']} ran ({ran['kernel'][:70]})"
        target = f">= {TARGET_TFLOP_S:g} TFLOP/s and >= {TARGET_VS_MANUAL:g}x"
        met = default >= TARGET_TFLOP_S and default >= TARGET_VS_MANUAL * manual
        rows.append(Row(
            PHASE, f"{case.name} {name}", "rate", "TFLOP/s", rate[name], baseline=manual,
            higher_is_better=True,
            fraction_of_ceiling=ctx.ceilings.compute_fraction(case.flops, point.times[name]),
            target=target if is_default else "", met=met if ctx.judged and is_default else None,
            note=note,
        ))  # fmt: skip
    del q, k, v, grad
    release_memory(device)
    return rows


# ---- vit ---------------------------------------------------------------------------------------
AUTOTUNED = "all flags, compile max-autotune"
# a group of its own: run alone, its part replaces only its row, not the vit part's
AUTOTUNED_CASE = "vit max-autotune: all flags"


def vit_rows(ctx: BenchContext, sizes: BenchSizes, check_steps: int = 3, *,
             autotuned: bool = False) -> list[Row]:  # fmt: skip
    """The ViT step at the baseline, every flag but compile (notebook 05's panel ends there) and
    all, each checked equal to the baseline, then timed interleaved against it; ``autotuned``:
    instead, all with compile's max-autotune beside its default mode (compile time apart)."""
    vit_sizes = vit.Sizes.preset(ctx.preset)
    everything = all_on(vit.Flags, ctx.device)
    configs = {"baseline": vit.Flags(), "all but compile": replace(everything, compile=False)}
    if everything != configs["all but compile"]:
        configs["all flags"] = everything
    if autotuned:  # minutes of autotuning: a part of its own
        if not everything.compile:
            return []
        configs = {"baseline": vit.Flags(), "all flags": everything, AUTOTUNED: everything}
    steps, checks, reference = {}, {}, None
    for name, flags in configs.items():
        mode = "max-autotune" if name == AUTOTUNED else "default"
        step = vit.build(flags, vit_sizes, device=ctx.device, seed=0, compile_mode=mode)
        for _ in range(check_steps):  # correctness before timing
            step()
        result = step.result()
        reference = result if reference is None else reference
        checks[name] = _equal(result, reference, flags, vit_sizes, check_steps)
        steps[name] = step
    timing = compare(
        steps, baseline="baseline", warmup=3, repeats=sizes.vit_repeats, device=ctx.device
    )
    top = "all flags" if "all flags" in steps else "all but compile"
    ran = which_backend(steps[top], ctx.device)["backend"]
    rows = []
    for name, step in steps.items():
        if autotuned and name != AUTOTUNED:
            continue
        ok, how = checks[name]
        judged_here = name == "all flags" or (name == top and not ctx.judged)
        met = timing.speedup(name) >= TARGET_VIT and ok
        note = f"{label(step.flags)}; result {'equal' if ok else 'DIFFERS'} ({how})"
        if step.flags.compile:
            note += f"; compiled in {step.compile_seconds:.0f} s, apart from the step"
        if name == AUTOTUNED:
            note += f"; {timing.speedup(name) / timing.speedup('all flags'):.2f}x the default mode's"
        rows.append(Row(
            PHASE, AUTOTUNED_CASE if name == AUTOTUNED else f"vit step: {name}",
            "time per training step", "ms",
            timing.timings[name].median_ms, baseline=timing.timings["baseline"].median_ms,
            target=f">= {TARGET_VIT}x and equal" if judged_here else "",
            met=met if ctx.judged and judged_here else None,
            note=note + (f"; attention ran {ran}" if name == top else ""),
        ))  # fmt: skip
    del steps
    release_memory(ctx.device)
    return rows


def _equal(result: dict, reference: dict, flags, sizes, steps: int) -> tuple[bool, str]:
    """Whether ``result`` is within ``vit.tolerance``, and the largest difference or what failed."""
    try:
        errors = vit.compare_results(result, reference, flags, sizes=sizes, steps=steps)
    except AssertionError as failed:
        return False, str(failed).splitlines()[0]
    return True, f"largest difference {max(errors.values()):.2g} of the entry's largest value"


# ---- the phase ---------------------------------------------------------------------------------
_PARTS: dict[str, Callable[[BenchContext], list[Row]]] = {
    "headline": lambda ctx: headline_rows(ctx, BENCH_SIZES[ctx.preset]),
    "flex": lambda ctx: flex_rows(ctx, ctx.judged),
    "masked sweep": sdpa_masked_sweep.rows,
    "vit": lambda ctx: vit_rows(ctx, BENCH_SIZES[ctx.preset]),
    "max-autotune vit": lambda ctx: vit_rows(ctx, BENCH_SIZES[ctx.preset], autotuned=True),
}


def parts() -> list[str]:
    """The parts ``--only`` can pick."""
    return list(_PARTS)


def run(ctx: BenchContext) -> list[Row]:
    rows = [row for part, rows in _PARTS.items() if ctx.selected(part) for row in rows(ctx)]
    return ctx.judge(rows)
