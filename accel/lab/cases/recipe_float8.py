"""Bench phase ``recipe``, part ``float8``: where float8 training pays against bf16 autocast.
torchao's ``convert_to_float8_training`` (dynamic tensorwise scaling) on a stack of MLP blocks
over a fixed number of tokens, compiled, fused AdamW, at widths from products too small to pay
for their casts to products large enough to: per width the time per training step of both
(paired rounds) and their losses over the same steps from the same start, side by side."""

from __future__ import annotations

import copy
import importlib.util
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from accel.doctor.timeline import profile_timeline
from accel.lab.bench import BenchContext, Row
from accel.measure.timer import compare

PHASE = "recipe"


@dataclass(frozen=True)
class Float8Sizes:
    widths: tuple[int, ...]
    tokens: int
    blocks: int
    loss_steps: int  # training steps whose losses are compared
    repeats: int
    compile: bool


SIZES = {
    "gpu": Float8Sizes(widths=(1024, 2048, 4096), tokens=8192, blocks=8, loss_steps=50,
                       repeats=10, compile=True),
    "cpu": Float8Sizes(widths=(32, 64), tokens=64, blocks=2, loss_steps=4, repeats=2,
                       compile=False),
}  # fmt: skip


class MLPStack(nn.Module):
    """Pre-norm MLP blocks with residuals: the products of a transformer's feed-forward."""

    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Linear(4 * width, width))
            for _ in range(blocks)
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def available() -> str | None:
    """Why the part cannot run here, or None."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    return None


def rows(ctx: BenchContext, sizes: Float8Sizes | None = None) -> list[Row]:
    why = available()
    if why is not None:
        warnings.warn(f"recipe part float8 left out: {why}", RuntimeWarning, stacklevel=2)
        return []
    sizes = sizes or SIZES[ctx.preset]
    out = []
    for width in sizes.widths:
        out += _width_rows(width, sizes, ctx.device)
    return out


def _width_rows(width: int, sizes: Float8Sizes, device: torch.device) -> list[Row]:
    from torchao.float8 import convert_to_float8_training

    gen = torch.Generator().manual_seed(width)
    x = torch.randn(sizes.tokens, width, generator=gen).to(device)
    target = torch.tanh(x @ torch.randn(width, width, generator=gen).to(device) / width**0.5)
    torch.manual_seed(0)
    bf16 = MLPStack(width, sizes.blocks).to(device)
    fp8 = convert_to_float8_training(copy.deepcopy(bf16))
    steps = {name: _step(model, x, target, device, sizes.compile)
             for name, model in (("bf16", bf16), ("float8", fp8))}  # fmt: skip
    losses = {name: [step().item() for _ in range(sizes.loss_steps)] for name, step in steps.items()}
    timing = compare(steps, warmup=2, repeats=sizes.repeats, device=device)
    low, high = timing.median_ratio_interval("bf16", "float8")
    profiled = {name: profile_timeline(step, device, steps=3) for name, step in steps.items()}
    last = {name: curve[-1] for name, curve in losses.items()}
    pairs = zip(losses["float8"], losses["bf16"], strict=True)
    apart = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    case = f"float8 width {width}"
    return [
        Row(PHASE, f"{case}: time per step", f"time per training step, float8 (torchao) vs bf16 "
            f"autocast, {sizes.blocks} MLP blocks over {sizes.tokens} tokens", "ms",
            timing.timings["float8"].median_ms, baseline=timing.timings["bf16"].median_ms,
            note=f"paired ratio {timing.paired_ratio('bf16', 'float8'):.2f}x (95% interval "
            f"{low:.2f}-{high:.2f}); {'compiled' if sizes.compile else 'eager'}, fused AdamW; "
            + _where_time_goes(profiled)),
        Row(PHASE, f"{case}: loss", f"training loss after {sizes.loss_steps} steps from the same "
            "start, float8 vs bf16 autocast (speedup: bf16's over float8's)", "", last["float8"],
            baseline=last["bf16"], note=f"the curves at most {apart:.1%} apart step by step"),
    ]  # fmt: skip


def _step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, device: torch.device,
          compiled: bool):  # fmt: skip
    # at 1e-3 the residual stack trains unstably in either precision from width 2048 on
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    forward = torch.compile(model) if compiled else model

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.mse_loss(forward(x).float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _where_time_goes(profiled: dict) -> str:
    """The kernels' time per step by kind, bf16's beside float8's (the products first): what
    float8 saves in its products against what its casts and scales add."""
    bf16, fp8 = (profiled[k].by_category for k in ("bf16", "float8"))
    kinds = sorted(set(bf16) | set(fp8), key=lambda k: (k != "matmul", -fp8.get(k, 0.0)))
    return "profiled time per step, bf16 / float8: " + ", ".join(
        f"{kind} {bf16.get(kind, 0.0) / 1e3:.3g} / {fp8.get(kind, 0.0) / 1e3:.3g} ms"
        for kind in kinds
    )
