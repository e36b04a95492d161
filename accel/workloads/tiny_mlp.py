"""A tiny MLP regression trainer: the tour's demonstration workload.

Small enough to be launch-bound on any GPU, so its three flags show in the step time: a loss read
back with ``.item()`` every step (a host-device sync), AdamW's per-parameter loop (a few kernels
per tensor), and gradients zeroed by memset instead of dropped. It learns a fixed random "teacher"
MLP from inputs generated on the device.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from accel.workloads.compare import make_compare_results
from accel.workloads.flags import Presets, flag

# Fused AdamW rounds differently from the per-parameter loop; the other flags change no arithmetic.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@dataclass(frozen=True)
class Flags:
    loss_on_device: bool = flag(
        "keep the running loss on the device instead of .item() every step", "sync"
    )
    fused_adamw: bool = flag("AdamW(fused=True): one kernel for all parameters", "fusion")
    set_to_none: bool = flag("drop gradients (set_to_none) instead of zeroing them", "memory")


@dataclass(frozen=True)
class Sizes(Presets):
    batch: int = 64
    width: int = 128
    depth: int = 4
    batches: int = 8  # distinct input batches cycled through


Sizes.PRESETS = {"cpu": Sizes(), "gpu": Sizes(batch=256, width=512, depth=8)}


def make_mlp(width: int, depth: int) -> nn.Sequential:
    hidden = [m for _ in range(depth - 1) for m in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*hidden, nn.Linear(width, 1))


class Step:
    """One training step per call; the running loss stays where the flags say."""

    def __init__(self, flags: Flags = Flags(), sizes: Sizes = Sizes(), *, device="cpu", seed=0):
        self.flags, device = flags, torch.device(device)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            teacher = make_mlp(sizes.width, 2).to(device)
            self.model = make_mlp(sizes.width, sizes.depth).to(device)
        self.inputs = torch.randn(sizes.batches, sizes.batch, sizes.width, generator=gen).to(device)
        with torch.no_grad():
            self.targets = teacher(self.inputs)
        # Before: AdamW's per-parameter loop (several small kernels per tensor).
        impl = {"fused": True} if flags.fused_adamw else {"foreach": False}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, **impl)
        self.loss_sum = torch.zeros((), device=device)
        self.host_losses: list[float] = []
        self.count = 0

    def __call__(self) -> None:
        i = self.count % len(self.inputs)
        self.optimizer.zero_grad(set_to_none=self.flags.set_to_none)
        loss = nn.functional.mse_loss(self.model(self.inputs[i]), self.targets[i])
        loss.backward()
        self.optimizer.step()
        if self.flags.loss_on_device:
            self.loss_sum += loss.detach()
        else:
            self.host_losses.append(loss.item())  # sync: the "before" logs every step
        self.count += 1

    def mean_loss(self) -> float:
        """Mean loss over the steps so far (one host read)."""
        total = self.loss_sum.item() if self.flags.loss_on_device else sum(self.host_losses)
        return total / max(self.count, 1)

    def result(self) -> dict[str, torch.Tensor]:
        """What every flag must leave unchanged (up to AdamW's fused rounding)."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


build = Step  # build(flags, sizes, *, device, seed): the contract's name for the step


def tolerance(flags: Flags, sizes: Sizes, steps: int) -> dict[str, dict[str, float]]:
    """:data:`TOLERANCE` for every parameter, whatever the flags, size and steps."""
    return defaultdict(lambda: TOLERANCE)


compare_results = make_compare_results(tolerance)
