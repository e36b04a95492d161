"""The advection workload as a distributed task: the model, each rank's batch, the loss and
the validation that :mod:`accel.distributed` runs under one wrapper or another."""

from __future__ import annotations

import torch
from torch import nn

from accel.workloads.advection.data import batch_of, rank_batch
from accel.workloads.advection.model import combined_loss, init_model, validation_error
from accel.workloads.advection.settings import Sizes


def distributed_task(preset: str, seed: int):
    """The operator with its inverse loss on every step, as an :class:`accel.distributed.Task`:
    ``model(inputs)`` gives the field and the inverse estimate packed (B, queries + 1 + 2 modes),
    ``targets`` the same layout; ``validate`` is the held-out relative error of the field."""
    from accel.distributed import Task  # the dataclass only: a light import

    sizes = Sizes.preset(preset)

    def batch(step: int, rank: int, world_size: int, device: torch.device):
        b = rank_batch(seed, step, rank, world_size, sizes)
        targets = torch.cat([b["targets"], b["inverse_targets"]], dim=1)
        return b["inputs"].to(device), targets.to(device)

    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return combined_loss(output, targets, sizes)

    held_out = batch_of(seed, range(sizes.validation_samples), sizes, stream=1)

    @torch.no_grad()
    def validate(model: nn.Module, device: torch.device) -> float:
        inputs, targets = held_out["inputs"].to(device), held_out["targets"].to(device)
        return validation_error(
            lambda x: model(x)[:, : sizes.queries].float(), inputs, targets, sizes.batch
        )

    return Task(model=init_model(sizes, seed), batch=batch, loss=loss, validate=validate)
