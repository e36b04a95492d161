"""The diversity phase's sweeps: every variant and tile of the group kernel side by side (bench
rows ``sweep group kernel ...``), and the notebook's sweeps over B and N."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from accel import diversity as dv
from accel import triton_support
from accel.lab.bench import Row
from accel.lab.cases.diversity_measure import (
    PHASE,
    GroupCase,
    LargeCase,
    group_candidates,
    rotating_inputs,
    time_per_call,
)
from accel.measure.ceilings import Ceilings, measure_ceilings
from accel.measure.device import default_device

# ---- the group kernel's variants and tiles, side by side -----------------------------------------

# (variant, groups, block_d, unroll, num_warps) per bytes per element, for N = 4, D = 384 (the
# grouped case), around the fastest of the sweeps recorded in results/*.csv (phase=diversity,
# cases "sweep group kernel ..."). Warps = groups * block_d / (32 * elements per 16-byte load)
# keeps each group in one warp ("dot": 4 warps for a 64-row tile of groups). The first of each
# list, "tile G=4 BD=128 U=3", is the kernel before the variants ("before" in the rows); the
# production configuration (GROUP_TABLE's, else the rule's) is always added.
GROUP_SWEEP: dict[int, tuple[tuple[str, int, int, int, int], ...]] = {
    4: (
        ("tile", 4, 128, 3, 4),
        ("vecsum", 4, 128, 3, 4),
        ("vecsum", 1, 128, 1, 1),
        ("vecsum", 1, 128, 2, 1),
        ("vecsum", 1, 128, 3, 1),
        ("vecsum", 2, 64, 3, 1),
        ("vecsum", 1, 256, 2, 2),
        ("vecsum", 2, 128, 3, 2),
        ("gram", 1, 128, 1, 1),
        ("gram", 1, 128, 3, 1),
        ("pairs", 1, 512, 1, 1),
        ("pairs", 1, 512, 1, 2),
        ("pairs", 2, 512, 1, 2),
        ("pairs", 1, 128, 1, 1),
        ("pairs", 1, 64, 1, 1),
        ("pairs", 1, 256, 1, 1),
        ("pairs", 2, 128, 1, 1),
        ("dot", 4, 64, 1, 4),
        ("dot", 16, 64, 1, 4),
        ("dot", 32, 32, 1, 8),
    ),
    2: (
        ("tile", 4, 128, 3, 2),
        ("vecsum", 4, 128, 3, 2),
        ("vecsum", 2, 128, 3, 1),
        ("vecsum", 2, 128, 1, 1),
        ("vecsum", 1, 256, 1, 1),
        ("vecsum", 1, 256, 2, 1),
        ("gram", 4, 128, 3, 2),
        ("pairs", 1, 512, 1, 1),
        ("pairs", 2, 512, 1, 1),
        ("pairs", 1, 512, 1, 2),
        ("pairs", 1, 128, 1, 1),
        ("pairs", 1, 256, 1, 1),
        ("dot", 4, 64, 1, 4),
        ("dot", 16, 64, 1, 4),
        ("dot", 32, 64, 1, 8),
    ),
}
VARIANTS = "accel.kernels.pairwise_cosine_variants"  # the sweep's launcher, all variants
SWEEP_NEAREST_TOP = 3  # nearest is timed for the best few of mean, "before" and production


def _sweep_label(reduction: str, case: GroupCase) -> str:
    return "sweep group kernel " + case.label(reduction)


def group_kernel_sweep(
    device: torch.device | str | None = None,
    ceilings: Ceilings | None = None,
    *,
    batch: int = 8192,
    n: int = 4,
    dim: int = 384,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    configs: dict[int, tuple] | None = None,
    repeats: int = 20,
    show: bool = True,
) -> list[Row]:
    """Every group-kernel configuration of ``configs`` (default :data:`GROUP_SWEEP`) on groups
    (``batch``, ``n``, ``dim``), timed interleaved over inputs that exceed the L2 cache.

    Per dtype: ``mean`` for every configuration, then ``nearest`` for the kernel before, the
    production one and the :data:`SWEEP_NEAREST_TOP` fastest. Each configuration is checked
    against the reference before it is timed. One row per (reduction, configuration) in GB/s of
    bytes read, with the fraction of the copy bandwidth; ``show`` prints them as a table and the
    ``GROUP_TABLE`` line of the fastest. A configuration that fails to compile or to match gets
    a NaN row that says why. Most of its time is compiling.
    """
    device = torch.device(device) if device is not None else default_device()
    ceilings = ceilings if ceilings is not None else measure_ceilings(device)
    kernels = dv._kernels()  # compiled, or interpreted under TRITON_INTERPRET=1
    variants = triton_support.kernel_module(VARIANTS)
    rows: list[Row] = []
    for dtype in dtypes:
        case = GroupCase(batch, n, dim, dtype)
        itemsize = dtype.itemsize
        block_n = max(2, 1 << (n - 1).bit_length())
        production = kernels.group_config(block_n, dim, batch, itemsize)
        listed = [kernels.GroupConfig(*c) for c in (configs or GROUP_SWEEP).get(itemsize, ())]
        ordered = list(dict.fromkeys([*listed, production]))  # unique, in order
        buffers = rotating_inputs(case.shape, dtype, device)
        ms = _time_configs(variants, ordered, "mean", buffers, device, repeats)
        fastest = sorted((c for c in ordered if math.isfinite(ms[c][0])), key=lambda c: ms[c][0])
        nearest = list(dict.fromkeys([*ordered[:1], production, *fastest[:SWEEP_NEAREST_TOP]]))
        timed = {
            "mean": ms,
            "nearest": _time_configs(variants, nearest, "nearest", buffers, device, repeats),
        }
        for reduction, results in timed.items():
            first = results[ordered[0]][0]
            for config, (t, why) in results.items():
                fraction = ceilings.bandwidth_fraction(case.bytes_read, t)
                tags = ["production"] if config == production else []
                if config == ordered[0]:
                    tags.append("before")
                rows.append(
                    Row(
                        PHASE,
                        _sweep_label(reduction, case),
                        config.name + (f" [{', '.join(tags)}]" if tags else ""),
                        "GB/s",
                        case.bytes_read / (t * 1e-3) / 1e9,
                        higher_is_better=True,
                        fraction_of_ceiling=fraction,
                        note=why or f"{t * 1e3:.1f} us; {first / t:.2f}x the kernel before",
                    )
                )
        if show and fastest:
            best = fastest[0]
            print(
                f"fastest {str(dtype).removeprefix('torch.')} mean: {best.name}; table line: "
                f"GROUP_TABLE[({block_n}, {1 << (dim - 1).bit_length()}, {itemsize})] = "
                f"GroupConfig({best.variant!r}, groups={best.groups}, block_d={best.block_d}, "
                f"unroll={best.unroll}, num_warps={best.num_warps})"
            )
    if show:
        print(sweep_table(rows).to_string(index=False))
    return rows


def _time_configs(variants, configs, reduction, buffers, device, repeats):
    """{config: (ms per call, why it was not timed or "")}, every config checked first."""
    reference = {"mean": dv.mean_diversity_reference, "nearest": dv.nearest_diversity_reference}
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # a TF32 reference would be the inexact one
    try:
        expected = reference[reduction](buffers[0])
    finally:
        torch.set_float32_matmul_precision(precision)
    candidates, results = {}, {}
    for config in configs:

        def call(x, config=config):
            return variants.run_group_kernel(x, reduction, config, eps=dv.EPS)

        try:
            got = call(buffers[0])
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        except Exception as error:  # a failed compile or a wrong answer: a row says which
            results[config] = (math.nan, f"not timed: {type(error).__name__}: {error}"[:300])
            continue
        candidates[config.name] = call
    if candidates:
        ms = time_per_call(candidates, buffers, device, repeats=repeats)
        results |= {c: (ms[c.name], "") for c in configs if c.name in ms}
    return {c: results[c] for c in configs}


def sweep_table(rows: list[Row]):
    """Sweep rows as a DataFrame: per case, configurations fastest first, with % of copy."""
    import pandas as pd

    frame = pd.DataFrame([r.as_dict() for r in rows if r.case.startswith("sweep ")])
    if frame.empty:
        return frame
    frame = frame.sort_values(["case", "optimized"], ascending=[True, False], na_position="last")
    return pd.DataFrame(
        {
            "case": frame["case"].str.removeprefix("sweep group kernel "),
            "configuration": frame["metric"],
            "GB/s": frame["optimized"].round(0),
            "% of copy": (100 * frame["fraction_of_ceiling"]).round(1),
            "note": frame["note"],
        }
    )


# ---- sweeps over B and N, for the notebook (plots.diversity_sweep draws them) --------------------


def group_sweep(
    device: torch.device,
    ceilings: Ceilings,
    batches: tuple[int, ...],
    *,
    n: int = 4,
    dim: int = 384,
    dtype: torch.dtype = torch.float32,
) -> list[dict]:
    """Effective bandwidth of each mean formulation over B (one record per B and candidate)."""
    records = []
    for batch in batches:
        case = GroupCase(batch, n, dim, dtype)
        records += _sweep_point(
            {"B": batch},
            group_candidates("mean", device),
            case.shape,
            dtype,
            device,
            lambda t, read=case.bytes_read: {
                "gb_s": read / (t * 1e-3) / 1e9,
                "fraction_of_copy": ceilings.bandwidth_fraction(read, t),
            },
        )
    return records


def large_sweep(
    device: torch.device,
    ceilings: Ceilings,
    sizes: tuple[int, ...],
    *,
    dim: int = 384,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """Time and matmul-rate fraction of the fused nearest and of X @ X.T over N."""
    candidates = {"triton nearest": dv.nearest_diversity, "X @ X.T": lambda x: x @ x.T}
    records = []
    for n in sizes:
        flops = LargeCase(n, dim, dtype).flops
        records += _sweep_point(
            {"N": n},
            candidates,
            (n, dim),
            dtype,
            device,
            lambda t, flops=flops: {
                "tflop_s": flops / (t * 1e-3) / 1e12,
                "fraction_of_matmul": ceilings.compute_fraction(flops, t),
            },
        )
    return records


def _sweep_point(
    where: dict,
    candidates: dict[str, Callable],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    rates: Callable[[float], dict],
) -> list[dict]:
    """One record per candidate timed on inputs of ``shape``: ``where``, its ms and its rates."""
    buffers = rotating_inputs(shape, dtype, device)
    times = time_per_call(candidates, buffers, device, repeats=10)
    return [where | {"candidate": name, "ms": t} | rates(t) for name, t in times.items()]
