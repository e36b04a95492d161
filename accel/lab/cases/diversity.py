"""Bench phase ``diversity``: the Triton diversity kernels against PyTorch, and the polychromic step.

Cases (targets for an H100 or H200):

- groups B=8192, N=4, D=384, float32, ``mean`` and ``nearest``: bytes read over time at
  >= 80% of the measured copy bandwidth, >= 5x the naive PyTorch reference, >= 3x
  ``torch.compile`` of the best PyTorch formulation (the closed form for ``mean``);
- one large set N=32768, D=384, bfloat16, ``nearest``: within 1.5x of the cuBLAS product
  ``X @ X.T`` alone, with <= 64 MB of extra device memory (no N x N buffer);
- the polychromic step with every flag on: >= 3x its baseline.

Every candidate is timed over several input buffers that together exceed the L2 cache, taken in
turn, so each call reads from device memory. On CUDA the kernels' times are CUDA-graph replays
of each candidate over those buffers: device time without Python's launch overhead, the same
for every candidate; one row per grouped case gives the host-launched call beside it. On a CPU
the sizes are tiny, the kernels run in Triton's interpreter or fall back to the reference, and
nothing is compiled: the rows only show that the bench runs (``met`` is None).

On CUDA the phase also runs :func:`group_kernel_sweep`: every variant and tile of the group kernel
at the grouped case, timed interleaved, as rows named ``sweep group kernel ...`` (kept out of the
README table). Run it alone with
``python -c "from accel.lab.cases.diversity import group_kernel_sweep; group_kernel_sweep()"``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from accel import diversity as dv
from accel import triton_support
from accel.lab.bench import BenchContext, Row
from accel.lab.ceilings import Ceilings, measure_ceilings
from accel.lab.device import default_device
from accel.lab.timing import compare
from accel.workloads import polychromic
from accel.workloads.flags import all_on, label

PHASE = "diversity"
BANDWIDTH_TARGET = 0.8
NAIVE_TARGET, COMPILED_TARGET = 5.0, 3.0
MATMUL_SLOWDOWN_LIMIT = 1.5  # the fused nearest may take at most 1.5x the bare X @ X.T
MEMORY_LIMIT_MB = 64.0
STEP_TARGET = 3.0
MAX_BUFFERS = 32


@dataclass(frozen=True)
class GroupCase:
    batch: int
    n: int
    dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.batch, self.n, self.dim)

    @property
    def bytes_read(self) -> int:
        return self.batch * self.n * self.dim * self.dtype.itemsize

    def label(self, reduction: str) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{reduction} B={self.batch} N={self.n} D={self.dim} {dtype}"


@dataclass(frozen=True)
class LargeCase:
    n: int
    dim: int
    dtype: torch.dtype

    @property
    def flops(self) -> float:
        return 2.0 * self.n * self.n * self.dim  # every dot product, as X @ X.T does

    def label(self) -> str:
        return f"nearest large N={self.n} D={self.dim} {str(self.dtype).removeprefix('torch.')}"


CASES = {
    "gpu": (GroupCase(8192, 4, 384, torch.float32), LargeCase(32768, 384, torch.bfloat16)),
    "cpu": (GroupCase(64, 4, 48, torch.float32), LargeCase(256, 32, torch.bfloat16)),
}


# ---- inputs and timing -----------------------------------------------------------------------


def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache size (50 MB on an H100/H200); 0 elsewhere."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    return 0


def rotating_inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, seed: int = 0
) -> list[torch.Tensor]:
    """Random buffers that together hold 4x the GPU's L2 cache: 2 to ``MAX_BUFFERS`` of them.

    Small cases hit the cap and partly stay in cache (B=1024, N=4, D=384 float32: 32 buffers
    of 6.3 MB is the 4x exactly); a CPU gets 2.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    count = min(MAX_BUFFERS, max(2, math.ceil(4 * l2_bytes(device) / max(nbytes, 1))))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(count)]


def _over_buffers(fn: Callable[[torch.Tensor], object], buffers: list[torch.Tensor]):
    """One call of ``fn`` on each buffer in turn: a sample covers them all."""

    def run() -> None:
        for x in buffers:
            fn(x)

    return run


def _graphed(run: Callable[[], None]) -> Callable[[], None]:
    """``run`` captured in a CUDA graph (warmed up first on a side stream, as torch asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # autotuning and compilation happen here, not under capture
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def time_per_call(
    candidates: dict[str, Callable[[torch.Tensor], object]],
    buffers: list[torch.Tensor],
    device: torch.device,
    *,
    graphs: bool = True,
    repeats: int = 20,
) -> dict[str, float]:
    """Median milliseconds per call of each candidate, interleaved, rotating over ``buffers``.

    With ``graphs`` on CUDA, each candidate's pass over the buffers is one CUDA-graph replay.
    """
    runs = {k: _over_buffers(fn, buffers) for k, fn in candidates.items()}
    if graphs and device.type == "cuda":
        runs = {k: _graphed(r) for k, r in runs.items()}
    result = compare(runs, warmup=2, repeats=repeats, calls_per_sample=None, device=device)
    return {k: t.median_ms / len(buffers) for k, t in result.timings.items()}


def extra_memory_mb(fn: Callable[[], object], device: torch.device) -> float:
    """Peak device memory a call allocates beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return math.nan
    fn()  # warm: autotuning and caches are not the call's own memory
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    del out
    return (torch.cuda.max_memory_allocated(device) - before) / 1e6


# ---- cases -----------------------------------------------------------------------------------


def group_candidates(reduction: str, device: torch.device) -> dict[str, Callable]:
    """Kernel and PyTorch formulations of one grouped reduction (compiled ones on CUDA only)."""
    if reduction == "mean":
        eager = {
            "triton": dv.mean_diversity,
            "naive eager": dv.mean_diversity_reference,
            "closed form eager": dv.mean_diversity_closed_form,
        }
        compiled = {
            "naive compiled": dv.mean_diversity_reference,
            "closed form compiled": dv.mean_diversity_closed_form,
        }
    else:
        eager = {"triton": dv.nearest_diversity, "naive eager": dv.nearest_diversity_reference}
        compiled = {"naive compiled": dv.nearest_diversity_reference}
    if device.type != "cuda":  # compiling on a 2-core CPU takes longer than the whole bench
        return eager
    return eager | {name: _compiled(fn) for name, fn in compiled.items()}


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """One compiled wrapper per function, so a sweep over B reuses its compilations."""
    return torch.compile(fn)


def group_rows(case: GroupCase, reduction: str, ctx: BenchContext) -> list[Row]:
    device, ceilings = ctx.device, ctx.ceilings
    buffers = rotating_inputs(case.shape, case.dtype, device)
    candidates = group_candidates(reduction, device)
    path, why = dv.backend(buffers[0])
    ms = time_per_call(candidates, buffers, device)
    host = time_per_call(
        {"triton": candidates["triton"], "naive eager": candidates["naive eager"]},
        buffers,
        device,
        graphs=False,
    )
    fraction = ceilings.bandwidth_fraction(case.bytes_read, ms["triton"])
    gb_s = case.bytes_read / (ms["triton"] * 1e-3) / 1e9
    note = f"{ctx.where}; {path}: {why}; {len(buffers)} rotating input buffers"
    if device.type == "cuda":
        note += "; times are CUDA-graph replays (device time)"
    label = case.label(reduction)
    compiled = "closed form compiled" if reduction == "mean" else "naive compiled"

    def met(ok: bool) -> bool | None:
        return ok if ctx.judged else None

    def timed(metric: str, base: str, target: str = "", goal: float = math.nan) -> Row:
        base_ms = ms.get(base, math.nan)
        speedup = base_ms / ms["triton"]
        return Row(
            PHASE,
            label,
            metric,
            "ms",
            ms["triton"],
            baseline=base_ms,
            fraction_of_ceiling=fraction,
            target=target,
            met=met(speedup >= goal) if target and not math.isnan(base_ms) else None,
            note=note if base in ms else f"{note}; {base} skipped (compiled on CUDA only)",
        )

    rows = [
        Row(
            PHASE,
            label,
            "bandwidth (bytes read)",
            "GB/s",
            gb_s,
            higher_is_better=True,
            fraction_of_ceiling=fraction,
            target=f">= {BANDWIDTH_TARGET:.0%} of copy",
            met=met(fraction >= BANDWIDTH_TARGET),
            note=note,
        ),
        timed("time vs naive eager", "naive eager", f">= {NAIVE_TARGET:g}x", NAIVE_TARGET),
        timed(f"time vs {compiled}", compiled, f">= {COMPILED_TARGET:g}x", COMPILED_TARGET),
    ]
    if reduction == "mean":
        rows.append(timed("time vs closed form eager", "closed form eager"))
    rows.append(
        Row(
            PHASE,
            label,
            "host-launched call vs naive eager",
            "ms",
            host["triton"],
            baseline=host["naive eager"],
            fraction_of_ceiling=ceilings.bandwidth_fraction(case.bytes_read, host["triton"]),
            note=f"{note}; eager calls one after another, Python launch overhead included",
        )
    )
    return rows


def large_rows(case: LargeCase, ctx: BenchContext) -> list[Row]:
    device, judged = ctx.device, ctx.judged
    buffers = rotating_inputs((case.n, case.dim), case.dtype, device)
    path, why = dv.backend(buffers[0])
    candidates = {
        "triton": dv.nearest_diversity,
        "X @ X.T": lambda x: x @ x.T,
        "naive eager": dv.nearest_diversity_reference,
    }
    ms = time_per_call(candidates, buffers, device, repeats=10)
    fraction = ctx.ceilings.compute_fraction(case.flops, ms["triton"])
    x = buffers[0]
    fused_mb = extra_memory_mb(lambda: dv.nearest_diversity(x), device)
    naive_mb = extra_memory_mb(lambda: dv.nearest_diversity_reference(x), device)
    note = f"{ctx.where}; {path}: {why}; fraction_of_ceiling: 2 N^2 D FLOPs over the matmul rate"
    ratio = ms["X @ X.T"] / ms["triton"]
    return [
        Row(
            PHASE,
            case.label(),
            "time vs X @ X.T (cuBLAS)",
            "ms",
            ms["triton"],
            baseline=ms["X @ X.T"],
            fraction_of_ceiling=fraction,
            target=f">= {1 / MATMUL_SLOWDOWN_LIMIT:.2f}x (within {MATMUL_SLOWDOWN_LIMIT:g}x)",
            met=ratio >= 1 / MATMUL_SLOWDOWN_LIMIT if judged else None,
            note=note,
        ),
        Row(
            PHASE,
            case.label(),
            "time vs naive eager",
            "ms",
            ms["triton"],
            baseline=ms["naive eager"],
            fraction_of_ceiling=fraction,
            note=note,
        ),
        Row(
            PHASE,
            case.label(),
            "extra device memory",
            "MB",
            fused_mb,
            baseline=naive_mb,
            target=f"<= {MEMORY_LIMIT_MB:g} MB",
            met=fused_mb <= MEMORY_LIMIT_MB if judged else None,
            note=note if device.type == "cuda" else f"{note}; memory measured on CUDA only",
        ),
    ]


def step_rows(ctx: BenchContext) -> list[Row]:
    device = ctx.device
    sizes = polychromic.Sizes.preset(ctx.preset)
    flags = all_on(polychromic.Flags, device)
    steps = {
        "baseline": polychromic.build(polychromic.Flags(), sizes, device=device),
        "all flags": polychromic.build(flags, sizes, device=device),
    }
    timing = compare(steps, warmup=1, repeats=5, device=device)
    speedup = timing.speedup("all flags")
    return [
        Row(
            PHASE,
            "polychromic step",
            "step time",
            "ms",
            timing.timings["all flags"].median_ms,
            baseline=timing.timings["baseline"].median_ms,
            target=f">= {STEP_TARGET:g}x",
            met=speedup >= STEP_TARGET if ctx.judged else None,
            note=f"{ctx.where}; flags: {label(flags)}",
        )
    ]


def run(ctx: BenchContext) -> list[Row]:
    """Every case of the phase at the context's preset (tiny on a CPU)."""
    group, large = CASES[ctx.preset]
    rows: list[Row] = []
    for reduction in ("mean", "nearest"):
        rows += group_rows(group, reduction, ctx)
    rows += large_rows(large, ctx)
    rows += step_rows(ctx)
    if ctx.device.type == "cuda":  # interpreted, a sweep would time NumPy: skipped on a CPU
        rows += group_kernel_sweep(ctx.device, ctx.ceilings, show=False)
    return rows


# ---- the group kernel's variants and tiles, side by side -----------------------------------------

# (variant, groups, block_d, unroll, num_warps) per bytes per element, for N = 4, D = 384 (the
# grouped case), around the fastest of the sweeps recorded in results/*.csv (phase=diversity,
# cases "sweep group kernel ..."). Warps = groups * block_d / (32 * elements per 16-byte load)
# keeps each group in one warp. The first of each list, "tile G=4 BD=128 U=3", is the kernel
# before the variants ("before" in the rows); the production configuration (GROUP_TABLE's, else
# the rule's) is always added.
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
        buffers = rotating_inputs(case.shape, dtype, device)
        ms = time_per_call(group_candidates("mean", device), buffers, device, repeats=10)
        for name, t in ms.items():
            records.append(
                {
                    "B": batch,
                    "candidate": name,
                    "ms": t,
                    "gb_s": case.bytes_read / (t * 1e-3) / 1e9,
                    "fraction_of_copy": ceilings.bandwidth_fraction(case.bytes_read, t),
                }
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
    records = []
    for n in sizes:
        case = LargeCase(n, dim, dtype)
        buffers = rotating_inputs((n, dim), dtype, device)
        candidates = {"triton nearest": dv.nearest_diversity, "X @ X.T": lambda x: x @ x.T}
        for name, t in time_per_call(candidates, buffers, device, repeats=10).items():
            records.append(
                {
                    "N": n,
                    "candidate": name,
                    "ms": t,
                    "tflop_s": case.flops / (t * 1e-3) / 1e12,
                    "fraction_of_matmul": ceilings.compute_fraction(case.flops, t),
                }
            )
    return records
