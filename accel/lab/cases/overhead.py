"""Bench phase ``overhead``: every public component as a user calls it, beside the plain PyTorch
they would otherwise write, timed interleaved with it: host time per call (the ``"host"`` clock,
on inputs too small to keep the GPU busy: what a profiler's kernel table leaves out). Part
``adamw sweep``: ``MultiTensorAdamW`` beside ``torch.optim.AdamW(fused=True)`` from a few hundred
small tensors to over a billion parameters in tensors of odd sizes, back to back and one call
alone from an idle GPU (the ``"latency"`` clock), and against the step's bytes over the copy
bandwidth; ``--only`` picks among the parts."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from accel import attention, diversity
from accel.graphs import GraphedStep
from accel.lab.bench import BenchContext, Row, release_memory
from accel.measure.timer import Comparison, compare, round_differences
from accel.optim import MultiTensorAdamW

PHASE = "overhead"
HOST_CALLS = 50  # calls per host-clock sample
HOST_ROUNDS = 41  # a host's pace drifts: the median of many rounds outlasts a slow spell
SDPA_ADDED_US = 1.0
DIVERSITY_HOST_US = 20.0
GRAPHED_ADDED_US = 10.0
# A model's parameters as a few hundred small tensors of odd sizes (a few layers' weights,
# biases and norms): where per-tensor host work shows.
SMALL_TENSORS = [(96, 97), (97,), (13, 96), (96,)] * 75
BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v (float32)
TARGET_LARGE = 1.1
TARGET_FLOOR = 0.9
LARGE_PARAMS = 10**9


def parts() -> list[str]:
    """The parts ``--only`` can pick."""
    return list(_PARTS)


def run(ctx: BenchContext) -> list[Row]:
    return [row for part, rows in _PARTS.items() if ctx.selected(part) for row in rows(ctx)]


def host_times(fns: dict, device: torch.device, repeats: int = HOST_ROUNDS) -> Comparison:
    """Host time per call of each of ``fns`` (the first is the baseline), interleaved."""
    return compare(fns, repeats=repeats, warmup=10, calls_per_sample=HOST_CALLS, device=device,
                   clock="host")  # fmt: skip


def host_rows(ctx: BenchContext, case: str, timing: Comparison, ours: str, *, added_us=None,
              most_us=None, note: str = "") -> list[Row]:  # fmt: skip
    """Host µs per call of ``ours`` beside the baseline's, judged on its own µs against
    ``most_us``; with ``added_us``, a second row of the µs it adds, taken within each round (the
    host's pace drifts between rounds) and judged against ``added_us``: its note gives the middle
    half of the rounds."""
    mine = timing.timings[ours].median_ms * 1e3
    plain = timing.timings[timing.baseline].median_ms * 1e3
    sampled = f"{HOST_CALLS} calls a sample from an idle GPU"
    rows = [Row(
        PHASE, case, "host time per call", "us", mine, baseline=plain,
        target=f"<= {most_us:g} us" if most_us is not None else "",
        met=mine <= most_us if ctx.judged and most_us is not None else None,
        note=f"{ctx.where}; {sampled}{note}",
    )]  # fmt: skip
    if added_us is None:
        return rows
    added = [ms * 1e3 for ms in round_differences(timing.samples, ours, timing.baseline)]
    typical = statistics.median(added)
    low, _, high = statistics.quantiles(added, n=4) if len(added) > 1 else (typical,) * 3
    rows.append(Row(
        PHASE, case, "host time added per call", "us", typical,
        target=f"<= {added_us:g} us over {timing.baseline}",
        met=typical <= added_us if ctx.judged else None,
        note=f"{ctx.where}; {ours} over {timing.baseline}'s {plain:.1f} us "
        f"({typical / plain:.0%} of it), round by round (middle half of rounds {low:+.1f} to "
        f"{high:+.1f} us); {sampled}{note}",
    ))  # fmt: skip
    return rows


@functools.cache
def compiled_baselines(device: torch.device):
    """(the closed-form mean, the naive nearest), compiled once for any shape (as a user's loop
    over shapes turns dynamic after the first recompile)."""
    if device.type != "cuda":  # nothing to compile for on a CPU in a few seconds: eager
        return diversity.mean_diversity_closed_form, diversity.nearest_diversity_reference
    return (
        torch.compile(diversity.mean_diversity_closed_form, dynamic=True),
        torch.compile(diversity.nearest_diversity_reference, dynamic=True),
    )


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
    return host_rows(ctx, "GraphedStep call", host_times(fns, device), "GraphedStep",
                     added_us=GRAPHED_ADDED_US, note="; a 3-kernel step, one input tensor")


@dataclass(frozen=True)
class Point:
    name: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


POINTS = (
    Point("a few hundred small tensors", tuple(SMALL_TENSORS)),
    Point("50 mid-size tensors", ((1021, 997), (997,)) * 25),
    Point("a GPT-like mix", ((4099, 1027), (1027, 4099), (1027, 3081), (1027,), (1027,)) * 12),
    Point("over 1B parameters", ((3301, 3307), (3307,)) * 92),
)


def _copies(point: Point, device: torch.device):
    """Two identical sets of parameters with gradients (random, never zeros)."""
    gen = torch.Generator(device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen) for s in point.shapes]
    grads = [torch.randn(s, device=device, generator=gen) for s in point.shapes]
    sets = []
    for _ in range(2):
        ps = [p.clone().requires_grad_() for p in params]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        sets.append(ps)
    return sets


def measure_adamw(point: Point, device: torch.device):
    """(back to back, alone) comparisons of fused AdamW and MultiTensorAdamW, after one step
    each from the same values has given the same parameters."""
    theirs, ours = _copies(point, device)
    fused = torch.optim.AdamW(theirs, lr=1e-3, fused=True)
    mine = MultiTensorAdamW(ours, lr=1e-3)
    fused.step()
    mine.step()
    for a, b in zip(theirs, ours, strict=True):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=2e-5)
    fns = {"AdamW(fused=True)": fused.step, "MultiTensorAdamW": mine.step}
    queued = compare(fns, repeats=10, warmup=2, device=device)
    alone = compare(fns, repeats=10, warmup=3, device=device, clock="latency")
    return queued, alone


def adamw_rows(ctx: BenchContext) -> list[Row]:
    if ctx.device.type != "cuda":
        return [Row(PHASE, "adamw sweep", "step", "ms", math.nan,
                    note=f"{ctx.where}; fused AdamW and the one-launch kernel need CUDA")]  # fmt: skip
    out = []
    for point in POINTS:
        queued, alone = measure_adamw(point, ctx.device)
        release_memory(ctx.device)
        large = point.params >= LARGE_PARAMS
        floor_ms = ctx.ceilings.floor_ms(bytes_moved=BYTES_PER_PARAM * point.params)
        case = f"adamw {point.name} ({len(point.shapes)} tensors, {point.params / 1e6:.0f}M)"
        for metric, timing in (("step back to back", queued), ("single-call latency", alone)):
            ratio = timing.paired_ratio("AdamW(fused=True)", "MultiTensorAdamW")
            target = TARGET_LARGE if large and metric == "step back to back" else 1.0
            out.append(Row(
                PHASE, case, metric, "ms", timing.timings["MultiTensorAdamW"].median_ms,
                baseline=timing.timings["AdamW(fused=True)"].median_ms, target=f">= {target}x",
                met=ratio >= target if ctx.judged else None,
                note=f"{ctx.where}; fused / ours round by round {ratio:.3f}x; the bytes floor "
                f"{floor_ms:.3f} ms",
            ))  # fmt: skip
        if large:
            fraction = floor_ms / queued.timings["MultiTensorAdamW"].median_ms
            out.append(Row(
                PHASE, case, "bandwidth", "fraction of the floor", fraction,
                target=f">= {TARGET_FLOOR}", higher_is_better=True,
                met=fraction >= TARGET_FLOOR if ctx.judged else None,
                note=f"{ctx.where}; {BYTES_PER_PARAM} bytes a parameter over "
                f"{ctx.ceilings.copy_gb_s:.0f} GB/s; fused AdamW at "
                f"{floor_ms / queued.timings['AdamW(fused=True)'].median_ms:.2f}",
            ))  # fmt: skip
    return out


_PARTS: dict[str, Callable[[BenchContext], list[Row]]] = {
    "components": lambda ctx: [*sdpa_rows(ctx), *diversity_rows(ctx), *graphed_rows(ctx)],
    "adamw sweep": adamw_rows,
}
