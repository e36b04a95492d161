"""The advection workload's data: exact solutions sampled on the fly, the dataset, its
epoch-by-epoch loader, and each rank's share of a global batch."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from accel.workloads.advection.settings import Flags, Sizes

# Inputs pack grid and query tokens into one tensor, 3 channels each (one tensor in, so the
# distributed wrappers call the model as model(inputs)):
#   grid rows:  (u0(x_i), x_i, c)       query rows: (x_q, t_q, c)
CHANNELS = 3


def sample_seed(seed: int, index: int, stream: int = 0) -> int:
    """A generator seed for sample ``index`` of ``seed``'s ``stream`` (0 training, 1 validation,
    2 warm-up): a mix of the three, so neighbouring samples draw unrelated numbers."""
    mixed = seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB
    return mixed % (1 << 63)


def grid_points(grid: int) -> torch.Tensor:
    """The ``grid`` equally spaced points of [0, 1) where u0 is given."""
    return torch.arange(grid, dtype=torch.float32) / grid


def initial_condition(coefficients: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """u0 at ``x`` (..., n) from ``coefficients`` (..., modes, 2): sum over k = 1..modes of
    (a_k sin 2 pi k x + b_k cos 2 pi k x) / k, periodic with period 1."""
    modes = coefficients.shape[-2]
    k = torch.arange(1, modes + 1, dtype=x.dtype, device=x.device)
    phase = 2 * math.pi * x.unsqueeze(-1) * k  # (..., n, modes)
    a, b = coefficients[..., 0], coefficients[..., 1]  # (..., modes)
    terms = (torch.sin(phase) * a.unsqueeze(-2) + torch.cos(phase) * b.unsqueeze(-2)) / k
    return terms.sum(-1)


def exact_solution(
    coefficients: torch.Tensor, speed: torch.Tensor, x: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """u(x, t) = u0(x - c t): the advection equation's solution, at points (x, t) (..., n)."""
    return initial_condition(coefficients, x - speed.unsqueeze(-1) * t)


def make_sample(seed: int, index: int, sizes: Sizes, stream: int = 0) -> dict[str, torch.Tensor]:
    """One sample, a function of ``(seed, index, stream)`` only: ``inputs`` (grid + queries, 3),
    ``targets`` u at the queries (queries,), ``inverse_targets`` (c, a_1, b_1, ..., a_K, b_K)."""
    gen = torch.Generator().manual_seed(sample_seed(seed, index, stream))
    coefficients = torch.randn(sizes.modes, 2, generator=gen)
    speed = torch.rand((), generator=gen) * 2 - 1
    xq, tq = torch.rand(2, sizes.queries, generator=gen)
    x = grid_points(sizes.grid)
    u0 = initial_condition(coefficients, x)
    u = exact_solution(coefficients, speed, xq, tq)
    c = speed.expand(sizes.grid + sizes.queries)
    inputs = torch.stack([torch.cat([u0, xq]), torch.cat([x, tq]), c], dim=-1)
    inverse = torch.cat([speed.view(1), coefficients.flatten()])
    return {"inputs": inputs, "targets": u, "inverse_targets": inverse}


class AdvectionDataset(Dataset):
    """Samples computed on the CPU when asked for (map-style: index -> sample)."""

    def __init__(self, sizes: Sizes, seed: int, stream: int = 0):
        self.sizes, self.seed, self.stream = sizes, seed, stream

    def __len__(self) -> int:
        return 1 << 62  # generated on demand: as many as asked for

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return make_sample(self.seed, index, self.sizes, self.stream)


class EpochSampler(Sampler[int]):
    """Sample indices epoch after epoch: ``samples_per_epoch`` fresh ones per iterator, so each
    epoch sees new samples and a loader without persistent workers restarts them per epoch."""

    def __init__(self, samples_per_epoch: int):
        self.samples_per_epoch = samples_per_epoch
        self.epoch = 0

    def __len__(self) -> int:
        return self.samples_per_epoch

    def __iter__(self) -> Iterator[int]:
        start = self.epoch * self.samples_per_epoch
        self.epoch += 1
        return iter(range(start, start + self.samples_per_epoch))


def make_loader(flags: Flags, sizes: Sizes, seed: int, batch: int) -> DataLoader:
    """The training DataLoader with ``flags``' settings; batches depend on ``seed`` only."""
    return DataLoader(
        AdvectionDataset(sizes, seed),
        batch_size=batch,
        sampler=EpochSampler(batch * sizes.epoch_batches),
        num_workers=flags.loader_workers,
        pin_memory=flags.pin_memory,
        persistent_workers=flags.persistent_workers,
        drop_last=True,
    )


def batch_of(seed: int, indices: range, sizes: Sizes, stream: int = 0) -> dict[str, torch.Tensor]:
    """Samples ``indices`` stacked, as the loader collates them."""
    samples = [make_sample(seed, i, sizes, stream) for i in indices]
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def rank_batch(
    seed: int, step: int, rank: int, world_size: int, sizes: Sizes
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s share of training step ``step``'s global batch (``sizes.batch`` samples,
    split evenly): samples ``step * batch + rank * share ...``. The shares of all ranks, in rank
    order, are the one-rank batch; no communication needed."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if sizes.batch % world_size:
        raise ValueError(
            f"the global batch {sizes.batch} does not split evenly over {world_size} ranks"
        )
    share = sizes.batch // world_size
    start = step * sizes.batch + rank * share
    return batch_of(seed, range(start, start + share), sizes)
