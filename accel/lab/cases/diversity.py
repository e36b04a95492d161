"""Bench phase ``diversity`` (notebook 06): the Triton diversity kernels against PyTorch (grouped
``mean`` and ``nearest``; ``nearest`` over one large set against cuBLAS's ``X @ X.T`` and in
extra memory) and the polychromic step. Every candidate is timed over input buffers that
together exceed the L2 cache, taken in turn; on CUDA as CUDA-graph replays (device time, no
Python launch overhead). On a CPU the sizes are tiny and nothing is compiled. Host time per call
is the ``overhead`` phase's."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from accel import diversity as dv
from accel import memory
from accel.lab.bench import BenchContext, Row, speedup_row
from accel.measure.ceilings import Ceilings
from accel.measure.timer import compare
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
    repeats: int = 20,
) -> dict[str, float]:
    """Median milliseconds per call of each candidate, interleaved, rotating over ``buffers``;
    on CUDA each candidate's pass over the buffers is one CUDA-graph replay."""
    runs = {k: _over_buffers(fn, buffers) for k, fn in candidates.items()}
    if device.type == "cuda":
        runs = {k: _graphed(r) for k, r in runs.items()}
    result = compare(runs, warmup=2, repeats=repeats, calls_per_sample=None, device=device)
    return {k: t.median_ms / len(buffers) for k, t in result.timings.items()}


def extra_memory_mb(fn: Callable[[], object], device: torch.device) -> float:
    """Peak device memory a call allocates beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return math.nan
    fn()  # warm: autotuning and caches are not the call's own memory
    return memory.peak_memory(fn, device=device) / 1e6


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


# ---- sweeps over B and N, for the notebook (plots.diversity_sweep draws them) --------------------
def group_sweep(
    device: torch.device, ceilings: Ceilings, batches: tuple[int, ...], *, n: int = 4,
    dim: int = 384, dtype: torch.dtype = torch.float32,
) -> list[dict]:  # fmt: skip
    """Effective bandwidth of each mean formulation over B (one record per B and candidate)."""
    records = []
    for batch in batches:
        case = GroupCase(batch, n, dim, dtype)
        times = _sweep_times(group_candidates("mean", device), case.shape, dtype, device)
        records += [{"B": batch, "candidate": name, "ms": t,
                     "gb_s": case.bytes_read / (t * 1e-3) / 1e9,
                     "fraction_of_copy": ceilings.bandwidth_fraction(case.bytes_read, t)}
                    for name, t in times.items()]  # fmt: skip
    return records


def large_sweep(
    device: torch.device, ceilings: Ceilings, sizes: tuple[int, ...], *, dim: int = 384,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:  # fmt: skip
    """Time and matmul-rate fraction of the fused nearest and of X @ X.T over N."""
    candidates = {"triton nearest": dv.nearest_diversity, "X @ X.T": lambda x: x @ x.T}
    records = []
    for n in sizes:
        flops = LargeCase(n, dim, dtype).flops
        times = _sweep_times(candidates, (n, dim), dtype, device)
        records += [{"N": n, "candidate": name, "ms": t, "tflop_s": flops / (t * 1e-3) / 1e12,
                     "fraction_of_matmul": ceilings.compute_fraction(flops, t)}
                    for name, t in times.items()]  # fmt: skip
    return records


def _sweep_times(candidates: dict[str, Callable], shape, dtype, device) -> dict[str, float]:
    """Milliseconds per call of each candidate on rotating inputs of ``shape``."""
    return time_per_call(candidates, rotating_inputs(shape, dtype, device), device, repeats=10)


# ---- the rows -----------------------------------------------------------------------------------
def group_rows(case: GroupCase, reduction: str, ctx: BenchContext) -> list[Row]:
    device, ceilings = ctx.device, ctx.ceilings
    buffers = rotating_inputs(case.shape, case.dtype, device)
    candidates = group_candidates(reduction, device)
    path, why = dv.backend(buffers[0])
    ms = time_per_call(candidates, buffers, device)
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
        return Row(
            PHASE, label, metric, "ms", ms["triton"], baseline=base_ms,
            fraction_of_ceiling=fraction, target=target,
            met=met(base_ms / ms["triton"] >= goal) if target and base in ms else None,
            note=note if base in ms else f"{note}; {base} skipped (compiled on CUDA only)",
        )  # fmt: skip

    rows = [
        Row(PHASE, label, "bandwidth (bytes read)", "GB/s", gb_s, higher_is_better=True,
            fraction_of_ceiling=fraction, target=f">= {BANDWIDTH_TARGET:.0%} of copy",
            met=met(fraction >= BANDWIDTH_TARGET), note=note),
        timed("time vs naive eager", "naive eager", f">= {NAIVE_TARGET:g}x", NAIVE_TARGET),
        timed(f"time vs {compiled}", compiled, f">= {COMPILED_TARGET:g}x", COMPILED_TARGET),
    ]  # fmt: skip
    if reduction == "mean":
        rows.append(timed("time vs closed form eager", "closed form eager"))
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
    ratio, name = ms["X @ X.T"] / ms["triton"], case.label()
    return [
        Row(PHASE, name, "time vs X @ X.T (cuBLAS)", "ms", ms["triton"], baseline=ms["X @ X.T"],
            fraction_of_ceiling=fraction, note=note,
            target=f">= {1 / MATMUL_SLOWDOWN_LIMIT:.2f}x (within {MATMUL_SLOWDOWN_LIMIT:g}x)",
            met=ratio >= 1 / MATMUL_SLOWDOWN_LIMIT if judged else None),
        Row(PHASE, name, "time vs naive eager", "ms", ms["triton"], baseline=ms["naive eager"],
            fraction_of_ceiling=fraction, note=note),
        Row(PHASE, name, "extra device memory", "MB", fused_mb, baseline=naive_mb,
            target=f"<= {MEMORY_LIMIT_MB:g} MB", met=fused_mb <= MEMORY_LIMIT_MB if judged else None,
            note=note if device.type == "cuda" else f"{note}; memory measured on CUDA only"),
    ]  # fmt: skip


def step_rows(ctx: BenchContext) -> list[Row]:
    device = ctx.device
    sizes = polychromic.Sizes.preset(ctx.preset)
    flags = all_on(polychromic.Flags, device)
    steps = {
        "baseline": polychromic.build(polychromic.Flags(), sizes, device=device),
        "all flags": polychromic.build(flags, sizes, device=device),
    }
    timing = compare(steps, warmup=1, repeats=5, device=device)
    note = f"flags: {label(flags)}"
    return [
        speedup_row(
            ctx, PHASE, "polychromic step", "step time", timing, "all flags", STEP_TARGET, note
        )
    ]


def run(ctx: BenchContext) -> list[Row]:
    """Every case of the phase at the context's preset (tiny on a CPU)."""
    group, large = CASES[ctx.preset]
    rows: list[Row] = []
    for reduction in ("mean", "nearest"):
        rows += group_rows(group, reduction, ctx)
    rows += large_rows(large, ctx)
    return rows + step_rows(ctx)
