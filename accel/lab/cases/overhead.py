"""Bench phase ``overhead``: every public component as a user calls it, beside the plain PyTorch
they would otherwise write.

Two measures per component, each timed interleaved with its plain counterpart:

- **host time per call**: the Python call to its return, each sample started from an idle GPU
  on inputs small enough that the GPU is never the bottleneck (``accel.measure.timer``'s ``"host"``
  clock). It is the part of a step that a profiler's kernel table does not show, and what a
  launch-bound model pays on every layer. The time one adds is taken within each round, as the
  host's pace drifts between rounds, and from run to run: the components open with that pace, a
  small ``torch.add``'s host time (:func:`host_pace_row`), which every host time moves with;
- **single-call latency**: one call from an idle GPU, CUDA events around it, host time included
  (the ``"latency"`` clock), judged round by round.

``sdpa`` with a mask kind (``masked_sdpa``) stands beside the FlexAttention a user would compile
themselves, without a target.

Targets (a CUDA GPU at the gpu preset): ``sdpa`` (PyTorch's pick, called as it is) adds at most
1 µs of host time to ``F.scaled_dot_product_attention`` without a mask; diversity at most 20 µs
of host time per call; ``GraphedStep`` at most 10 µs over the bare graph replay. The shape
sweeps, where the other targets live, are ``overhead_diversity`` and ``overhead_adamw``;
``--only`` runs some of the three parts (:func:`parts`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from accel import attention, diversity, fusion
from accel.graphs import GraphedStep
from accel.lab.bench import BenchContext, Row
from accel.lab.cases.overhead_timing import (
    HOST_CALLS,
    PHASE,
    host_rows,
    host_times,
    latencies,
    latency_row,
)
from accel.optim import MultiTensorAdamW

SDPA_ADDED_US = 1.0
DIVERSITY_HOST_US = 20.0
GRAPHED_ADDED_US = 10.0
# A model's parameters as a few hundred small tensors of odd sizes (a few layers' weights,
# biases and norms): where per-tensor host work shows.
SMALL_TENSORS = [(96, 97), (97,), (13, 96), (96,)] * 75
MASK_WINDOW = 64  # keys a query sees in the masked row: a quarter of its 256


def parts() -> list[str]:
    """The parts ``--only`` can pick: the components called one at a time, and each sweep."""
    return list(_PARTS)


def run(ctx: BenchContext) -> list[Row]:
    return [row for part, rows in _PARTS.items() if ctx.selected(part) for row in rows(ctx)]


def _components(ctx: BenchContext) -> list[Row]:
    rows = [host_pace_row(ctx), *sdpa_rows(ctx), *diversity_rows(ctx), *clip_rows(ctx)]
    rows += adamw_rows(ctx)
    # last: compiling FlexAttention leaves compile workers busy on the host for a while
    return rows + graphed_rows(ctx) + masked_rows(ctx)


def _sweep(module: str) -> Callable[[BenchContext], list[Row]]:
    """A sweep's rows, its module imported when the part runs."""
    return lambda ctx: importlib.import_module(f"accel.lab.cases.{module}").rows(ctx)


_PARTS: dict[str, Callable[[BenchContext], list[Row]]] = {
    "components": _components,
    "diversity sweep": _sweep("overhead_diversity"),
    "adamw sweep": _sweep("overhead_adamw"),
}


# ---- the components ----------------------------------------------------------------------------
def host_pace_row(ctx: BenchContext) -> Row:
    """The host's pace in this run: the host time per call of one small ``torch.add``, the least
    a PyTorch op costs the host. Every host time of a run moves with it, so a run on a slower
    host (or the same one at a busier moment) is read against it."""
    gen = torch.Generator(ctx.device).manual_seed(0)
    a, b = torch.randn(2, 64, device=ctx.device, generator=gen).unbind(0)
    out = torch.empty_like(a)
    timing = host_times({"torch.add": lambda: torch.add(a, b, out=out)}, ctx.device)
    return Row(
        PHASE, "host pace: torch.add of 64 elements", "host time per call", "us",
        timing.timings["torch.add"].median_ms * 1e3,
        note=f"{ctx.where}; {HOST_CALLS} calls a sample from an idle GPU; every host time of "
        "this run moves with it",
    )  # fmt: skip


def sdpa_rows(ctx: BenchContext) -> list[Row]:
    """``sdpa`` against ``F.scaled_dot_product_attention`` on a small input, full and causal
    (judged: PyTorch's pick called as it is), and with a key-padding mask (whose queries without
    keys ``sdpa`` gives 0 where the kernel does not: no target)."""
    device = ctx.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 64, 64, device=device, dtype=dtype, generator=gen).unbind(0)
    mask = torch.rand(2, 1, 1, 64, device=device, generator=gen) < 0.9
    rows = []
    for label, causal, m in [("full", False, None), ("causal", True, None),
                             ("key-padding mask", False, mask)]:  # fmt: skip
        fns = {
            "F.sdpa": lambda m=m, causal=causal: F.scaled_dot_product_attention(
                q, k, v, attn_mask=m, is_causal=causal
            ),
            "sdpa": lambda m=m, causal=causal: attention.sdpa(q, k, v, mask=m, causal=causal),
        }
        with torch.no_grad():
            timing = host_times(fns, device)
        note = f"; {tuple(q.shape)} {dtype}"
        target = SDPA_ADDED_US if m is None else None
        rows += host_rows(ctx, f"sdpa {label}", timing, "sdpa", added_us=target, note=note)
    return rows


def masked_rows(ctx: BenchContext) -> list[Row]:
    """``sdpa`` with a mask kind (``SlidingWindow``: FlexAttention) beside the FlexAttention a
    user would write: ``flex_attention`` compiled once, its block mask made once by
    ``create_block_mask``. Host time per call on a small input (both run the same kernel: the
    rest is the dispatcher), and one call's latency. No target: reported beside its plain
    counterpart."""
    device = ctx.device
    case = f"sdpa SlidingWindow({MASK_WINDOW})"
    if device.type != "cuda":
        return [Row(PHASE, case, "host time per call", "us", float("nan"),
                    note=f"{ctx.where}; FlexAttention compiles for CUDA only here")]  # fmt: skip
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    gen = torch.Generator(device).manual_seed(0)
    shape = (2, 4, 256, 64)
    q, k, v = torch.randn(3, *shape, device=device, dtype=torch.bfloat16, generator=gen).unbind(0)
    window = attention.SlidingWindow(MASK_WINDOW)
    blocks = create_block_mask(window.mask_mod(shape[2], shape[2], device), None, None, shape[2],
                               shape[2], device=device)  # fmt: skip
    flex = torch.compile(flex_attention)
    fns = {
        "compiled flex_attention": lambda: flex(q, k, v, block_mask=blocks),
        "sdpa": lambda: attention.sdpa(q, k, v, mask=window),
    }
    attention.clear_masked_cache()
    with torch.no_grad():
        for fn in fns.values():  # compiled once, outside the timing
            fn()
        host, alone = host_times(fns, device), latencies(fns, device)
    note = f"; {shape} bfloat16"
    return [*host_rows(ctx, case, host, "sdpa", note=note),
            latency_row(ctx, case, alone, "sdpa", note=note)]  # fmt: skip


def diversity_rows(ctx: BenchContext) -> list[Row]:
    """``mean_diversity`` and ``nearest_diversity`` beside the compiled closed form and the
    compiled naive form: host time per call (the target) at small batches, where the GPU is not
    the bottleneck, and one call's latency at the polychromic trainer's shape, whose 18 µs
    kernel is as long as a call's host time."""
    from accel.lab.cases.overhead_diversity import compiled_baselines

    device, rows = ctx.device, []
    mean_cf, nearest_naive = compiled_baselines(device)
    pairs = (("mean", diversity.mean_diversity, "compiled closed form", mean_cf),
             ("nearest", diversity.nearest_diversity, "compiled naive", nearest_naive))  # fmt: skip
    for shape in ((64, 4, 384), (64, 8, 768), (64, 16, 256), (8192, 4, 384)):
        x = torch.randn(shape, device=device, generator=torch.Generator(device).manual_seed(0))
        case = f"diversity {{}} B={shape[0]} N={shape[1]} D={shape[2]}"
        for name, fn, plain_name, plain in pairs:
            fns = {
                plain_name: lambda p=plain, x=x: p(x),
                f"{name}_diversity": lambda f=fn, x=x: f(x),
            }
            note = f"; float32; path {diversity.backend(x)[0]}"
            if shape[0] > 64:
                rows.append(latency_row(ctx, case.format(name), latencies(fns, device),
                                        f"{name}_diversity", note=note))  # fmt: skip
            else:
                rows += host_rows(ctx, case.format(name), host_times(fns, device),
                                  f"{name}_diversity", most_us=DIVERSITY_HOST_US, note=note)  # fmt: skip
    return rows


def _small_params(device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen).requires_grad_() for s in SMALL_TENSORS]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen)
    return params


def clip_rows(ctx: BenchContext) -> list[Row]:
    """``fusion.clip_grad_norm_`` beside ``torch.nn.utils.clip_grad_norm_(foreach=True)`` on a
    few hundred small gradients (max_norm small: both rescale on every call)."""
    params, device = _small_params(ctx.device), ctx.device
    fns = {
        "torch clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(params, 1e-3, foreach=True),
        "fusion.clip_grad_norm_": lambda: fusion.clip_grad_norm_(params, 1e-3),
    }
    case, note = f"clip_grad_norm_ {len(params)} tensors", "; max_norm 1e-3"
    return [
        *host_rows(ctx, case, host_times(fns, device), "fusion.clip_grad_norm_", note=note),
        latency_row(ctx, case, latencies(fns, device), "fusion.clip_grad_norm_", note=note),
    ]


def adamw_rows(ctx: BenchContext) -> list[Row]:
    """``MultiTensorAdamW.step`` beside ``torch.optim.AdamW(fused=True).step`` on a few hundred
    small tensors, each on its own copy of the parameters and gradients."""
    device = ctx.device
    if device.type != "cuda":
        return [Row(PHASE, "adamw step small tensors", "host time per call", "us", float("nan"),
                    note=f"{ctx.where}; fused AdamW and the one-launch kernel need CUDA")]  # fmt: skip
    ours, theirs = _small_params(device), _small_params(device)
    fns = {
        "AdamW(fused=True)": torch.optim.AdamW(theirs, lr=1e-4, fused=True).step,
        "MultiTensorAdamW": MultiTensorAdamW(ours, lr=1e-4).step,
    }
    case = f"adamw step {len(ours)} small tensors"
    return [
        *host_rows(ctx, case, host_times(fns, device), "MultiTensorAdamW"),
        latency_row(ctx, case, latencies(fns, device), "MultiTensorAdamW", at_least=1.0),
    ]


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
