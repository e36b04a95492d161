"""What a rank trains, :class:`Task`, from a factory named ``"module:function"``; the toy task."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from accel.distributed.config import RunConfig


@dataclass
class Task:
    """What a rank trains: built identically on every rank from (preset, seed)."""

    model: torch.nn.Module  # on CPU, seeded init (same on every rank)
    batch: Callable[[int, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]
    #       (step, rank, world_size, device) -> (inputs, targets) of this rank's share
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (model(inputs), targets) -> scalar
    validate: Callable[[torch.nn.Module, torch.device], float] | None = None  # held-out error


@dataclass(frozen=True)
class ToySizes:
    features: int
    width: int
    depth: int
    tokens: int
    batch: int  # global batch, split evenly over the ranks
    outputs: int


TOY_SIZES = {
    "cpu": ToySizes(features=16, width=32, depth=2, tokens=4, batch=8, outputs=4),
    # 67M parameters, 16k tokens per step: tens of milliseconds of bf16 work per GPU
    "gpu": ToySizes(features=256, width=1024, depth=8, tokens=512, batch=32, outputs=256),
}


class ToyBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class ToyModel(nn.Module):
    def __init__(self, sizes: ToySizes):
        super().__init__()
        self.embed = nn.Linear(sizes.features, sizes.width)
        self.blocks = nn.ModuleList(ToyBlock(sizes.width) for _ in range(sizes.depth))
        self.head = nn.Linear(sizes.width, sizes.outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, features) -> (B, T, outputs)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def toy_task(preset: str, seed: int) -> Task:
    """A small residual MLP fitting ``sin(x @ W)`` for a fixed random ``W``; data drawn from
    (seed, step)."""
    if preset not in TOY_SIZES:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(TOY_SIZES)}")
    sizes = TOY_SIZES[preset]
    torch.manual_seed(seed)
    model = ToyModel(sizes)
    # scaled so that x @ teacher has unit variance: a smooth function, learnable in tens of steps
    teacher = torch.randn(sizes.features, sizes.outputs, generator=_generator(seed, -1))
    teacher /= sizes.features**0.5

    def examples(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # drawn from (seed, step) on the given device: every rank draws the same global batch
        g = _generator(seed, step, device)
        x = torch.randn(sizes.batch, sizes.tokens, sizes.features, generator=g, device=device)
        return x, torch.sin(x @ teacher.to(device))

    def batch(step: int, rank: int, world: int, device: torch.device):
        if sizes.batch % world:
            raise ValueError(f"global batch {sizes.batch} does not split over {world} ranks: "
                             f"use a world size that divides {sizes.batch}")  # fmt: skip
        x, y = examples(step, device)
        share = sizes.batch // world
        return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]

    def validate(model: nn.Module, device: torch.device) -> float:
        x, y = examples(10**9, device)  # a step no run reaches: held out
        with torch.no_grad():
            error = torch.linalg.vector_norm(model(x).float() - y) / torch.linalg.vector_norm(y)
        return error.item()  # sync: once, after training

    return Task(model, batch, torch.nn.functional.mse_loss, validate)


def broken_toy_task(preset: str, seed: int) -> Task:
    """:func:`toy_task` whose rank 1 raises at step 1 (rank 0 then waits in a collective): shows
    how a failing rank surfaces."""
    task = toy_task(preset, seed)
    healthy = task.batch

    def batch(step: int, rank: int, world: int, device: torch.device):
        if rank == 1 and step == 1:
            raise ValueError("broken_toy_task: rank 1 fails on purpose at step 1")
        return healthy(step, rank, world, device)

    return dataclasses.replace(task, batch=batch)


def _generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + step + 1)


def load_task(name: str) -> Callable[[str, int], Task]:
    """The factory named ``"module:function"``."""
    module, sep, function = str(name).partition(":")
    if not (sep and module and function):
        raise ValueError(f"task must be named 'module:function', got {name!r}")
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        raise ValueError(f"task {name!r}: module {module!r} cannot be found")
    factory = getattr(importlib.import_module(module), function, None)
    if not callable(factory):
        raise ValueError(f"task {name!r}: module {module!r} has no function {function!r}")
    return factory


def build_task(config: RunConfig) -> Task:
    """The run's task, built from its factory, preset and seed."""
    task = load_task(config.task)(config.preset, config.seed)
    if not isinstance(task, Task):
        raise TypeError(
            f"task factory {config.task!r} must return accel.distributed.Task, "
            f"got {type(task).__name__}"
        )
    return task
