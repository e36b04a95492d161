"""Bench phase ``overhead``: every public component as a user calls it, beside the plain PyTorch
they would otherwise write, timed interleaved with it: host time per call (the ``"host"`` clock,
on inputs too small to keep the GPU busy: what a profiler's kernel table leaves out) and one
call's latency from an idle GPU (the ``"latency"`` clock). The shape sweeps are
``overhead_diversity`` and ``overhead_adamw``; ``--only`` picks among the parts."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from accel import attention, diversity
from accel.graphs import GraphedStep
from accel.lab.bench import BenchContext, Row
from accel.lab.cases.overhead_timing import (
    PHASE,
    host_rows,
    host_times,
    latencies,
    latency_row,
)

SDPA_ADDED_US = 1.0
DIVERSITY_HOST_US = 20.0
GRAPHED_ADDED_US = 10.0
# A model's parameters as a few hundred small tensors of odd sizes (a few layers' weights,
# biases and norms): where per-tensor host work shows.
SMALL_TENSORS = [(96, 97), (97,), (13, 96), (96,)] * 75


def parts() -> list[str]:
    """The parts ``--only`` can pick."""
    return list(_PARTS)


def run(ctx: BenchContext) -> list[Row]:
    return [row for part, rows in _PARTS.items() if ctx.selected(part) for row in rows(ctx)]


def _sweep(module: str) -> Callable[[BenchContext], list[Row]]:
    """A sweep's rows, its module imported when the part runs."""
    return lambda ctx: importlib.import_module(f"accel.lab.cases.{module}").rows(ctx)


_PARTS: dict[str, Callable[[BenchContext], list[Row]]] = {
    "components": lambda ctx: [*sdpa_rows(ctx), *diversity_rows(ctx), *graphed_rows(ctx)],
    "diversity sweep": _sweep("overhead_diversity"),
    "adamw sweep": _sweep("overhead_adamw"),
}


def sdpa_rows(ctx: BenchContext) -> list[Row]:
    """``sdpa`` (PyTorch's pick, called as it is) against ``F.scaled_dot_product_attention`` on a
    small input, full and causal."""
    device = ctx.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 64, 64, device=device, dtype=dtype, generator=gen).unbind(0)
    rows = []
    for label, causal in (("full", False), ("causal", True)):
        fns = {
            "F.sdpa": lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c),
            "sdpa": lambda c=causal: attention.sdpa(q, k, v, causal=c),
        }
        with torch.no_grad():
            timing = host_times(fns, device)
        note = f"; {tuple(q.shape)} {dtype}"
        rows += host_rows(ctx, f"sdpa {label}", timing, "sdpa", added_us=SDPA_ADDED_US, note=note)
    return rows


def diversity_rows(ctx: BenchContext) -> list[Row]:
    """``mean_diversity`` and ``nearest_diversity`` beside the compiled closed form and the
    compiled naive form, at small batches."""
    from accel.lab.cases.overhead_diversity import compiled_baselines

    device, rows = ctx.device, []
    mean_cf, nearest_naive = compiled_baselines(device)
    pairs = (("mean", diversity.mean_diversity, "compiled closed form", mean_cf),
             ("nearest", diversity.nearest_diversity, "compiled naive", nearest_naive))  # fmt: skip
    for shape in ((64, 4, 384), (64, 8, 768), (64, 16, 256)):
        x = torch.randn(shape, device=device, generator=torch.Generator(device).manual_seed(0))
        for name, fn, plain_name, plain in pairs:
            fns = {plain_name: lambda p=plain, x=x: p(x), name: lambda f=fn, x=x: f(x)}
            case = f"diversity {name} B={shape[0]} N={shape[1]} D={shape[2]}"
            note = f"; float32; path {diversity.backend(x)[0]}"
            rows += host_rows(ctx, case, host_times(fns, device), name,
                              most_us=DIVERSITY_HOST_US, note=note)  # fmt: skip
    return rows


def graphed_rows(ctx: BenchContext) -> list[Row]:
    """``GraphedStep`` beside a bare ``CUDAGraph.replay`` of the same captured step (both copy
    the new input into the graph's static one first, as a user's replay loop must)."""
    device = ctx.device
    if device.type != "cuda":
        return [Row(PHASE, "GraphedStep call", "host time per call", "us", float("nan"),
                    note=f"{ctx.where}; CUDA graphs need a CUDA GPU")]  # fmt: skip
    weight = torch.randn(64, 64, device=device)

    def step(x):
        return (x @ weight).relu_().sum(0)

    x = torch.randn(32, 64, device=device)
    graphed = GraphedStep(step)
    for _ in range(graphed.warmup + 2):
        graphed(x)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    step(static_x)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_out = step(static_x)

    def bare(x=x):
        static_x.copy_(x)
        graph.replay()
        return static_out

    fns = {"CUDAGraph.replay": bare, "GraphedStep": lambda: graphed(x)}
    note = "; a 3-kernel step, one input tensor"
    return [
        *host_rows(ctx, "GraphedStep call", host_times(fns, device), "GraphedStep",
                   added_us=GRAPHED_ADDED_US, note=note),
        latency_row(ctx, "GraphedStep call", latencies(fns, device), "GraphedStep", note=note),
    ]  # fmt: skip
