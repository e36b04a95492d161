"""The memory phase's offload part: torchao's CPU-offload AdamW (the optimizer's states and its
step on the host) against fused AdamW on the GPU, on stacks of MLP blocks at two widths under
bf16 autocast: the device bytes a parameter costs (the line through the two widths' peaks), the
largest model that line fits in this GPU's memory, and the time a step costs at the wider one."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable

import torch
from torch import nn

from accel.lab.bench import BenchContext, Row
from accel.measure.timer import compare
from accel.workloads.advection.settings import offload_optimizer_class

PHASE = "memory"
WIDTHS = {"gpu": (1024, 2048), "cpu": (32, 64)}
TOKENS = {"gpu": 8192, "cpu": 16}
BLOCKS = 4
REPEATS = {"gpu": 6, "cpu": 2}
OPTIMIZERS = {"AdamW on the GPU": False, "CPU-offload AdamW": True}  # name: offloaded


def line_through(params: tuple[int, int], peaks: tuple[int, int]) -> tuple[float, float]:
    """(bytes per parameter, bytes besides) of the line through two models' peaks."""
    per_param = (peaks[1] - peaks[0]) / (params[1] - params[0])
    return per_param, peaks[0] - per_param * params[0]


def largest_fitting(capacity: int, per_param: float, besides: float) -> float:
    """The parameters the line fits in ``capacity`` bytes (activations grow with the width, so an
    estimate from two widths)."""
    return (capacity - besides) / per_param if per_param > 0 else math.nan


def _mlp_step(width: int, offload: bool, device: torch.device, tokens: int) -> tuple[Callable, int]:
    model = nn.Sequential(*(
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        for _ in range(BLOCKS)
    )).to(device)  # fmt: skip
    if offload:
        optimizer = offload_optimizer_class()[0](model.parameters(), torch.optim.AdamW, lr=1e-4,
                                                 fused=True)  # fmt: skip
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(tokens, width, device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters())


def _peak(width: int, offload: bool, device: torch.device, tokens: int) -> tuple[int, int]:
    """(parameters, the device bytes the model, its optimizer and three steps held at most)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step, params = _mlp_step(width, offload, device, tokens)
    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del step
    gc.collect()  # the offload optimizer's gradient hooks hold the model in a cycle
    torch.cuda.empty_cache()
    return params, peak


def rows(ctx: BenchContext) -> list[Row]:
    why = "" if ctx.device.type == "cuda" else "needs a CUDA GPU"
    why = why or offload_optimizer_class()[1]
    if why:
        return [Row(PHASE, "offload: device bytes per parameter", "peak device bytes per "
                    "parameter, AdamW vs CPU-offload AdamW", "B", math.nan,
                    note=f"{ctx.where}; not run: {why}")]  # fmt: skip
    widths, tokens = WIDTHS[ctx.preset], TOKENS[ctx.preset]
    capacity = torch.cuda.get_device_properties(ctx.device).total_memory
    fits, per_param = {}, {}
    for name, offload in OPTIMIZERS.items():
        measured = [_peak(w, offload, ctx.device, tokens) for w in widths]
        params, peaks = zip(*measured, strict=True)
        per_param[name], besides = line_through(params, peaks)
        fits[name] = largest_fitting(capacity, per_param[name], besides)
    steps = {name: _mlp_step(widths[-1], offload, ctx.device, tokens)[0]
             for name, offload in OPTIMIZERS.items()}  # fmt: skip
    timing = compare(steps, warmup=3, repeats=REPEATS[ctx.preset], device=ctx.device)
    on_gpu, offloaded = OPTIMIZERS
    shape = f"{BLOCKS} MLP blocks, {tokens} tokens, bf16 autocast, widths {widths}"
    return [
        Row(PHASE, "offload: device bytes per parameter", "peak device bytes per parameter, "
            "AdamW vs CPU-offload AdamW (the line through two widths' peaks)", "B",
            per_param[offloaded], baseline=per_param[on_gpu], note=f"{ctx.where}; {shape}"),
        Row(PHASE, "offload: largest model that fits", "parameters the line fits in the GPU's "
            f"{capacity / 2**30:.0f} GiB, AdamW vs CPU-offload AdamW (estimated)", "params",
            fits[offloaded], baseline=fits[on_gpu], higher_is_better=True,
            note=f"{ctx.where}; {shape}; activations grow with the width, so an estimate"),
        Row(PHASE, "offload: time per step", f"time per training step at width {widths[-1]}, "
            "AdamW vs CPU-offload AdamW", "ms", timing.timings[offloaded].median_ms,
            baseline=timing.timings[on_gpu].median_ms,
            note=f"{ctx.where}; {shape}; offload's speedup "
                 f"{timing.paired_ratio(on_gpu, offloaded):.3f}x (paired rounds)"),
    ]  # fmt: skip
