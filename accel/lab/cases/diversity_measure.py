"""The diversity phase's ground: its targets, its cases, inputs that do not fit in L2 and how a
candidate is timed over them, the candidates a kernel is compared with, and the notebook's sweeps
over B and N."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from accel import diversity as dv
from accel.measure.ceilings import Ceilings
from accel.measure.timer import compare

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
