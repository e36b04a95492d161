"""A transformer neural operator for 1-D advection, trained on data generated on the fly.

The physics-transformer recipe's workload [training-speed write-up]. Each sample is one solution
of ``u_t + c u_x = 0`` on the periodic interval [0, 1): a random smooth initial condition
``u0(x) = sum_k (a_k sin 2 pi k x + b_k cos 2 pi k x) / k`` (a few modes, a and b standard
normal) and a random speed ``c`` in [-1, 1]; the exact solution is ``u(x, t) = u0(x - c t)``.
The model sees ``u0`` on a grid of ``grid`` points (with the coordinates and ``c``) and is asked
for ``u`` at ``queries`` random points ``(x, t)``, t in [0, 1]:

- an encoder (``depth`` self-attention blocks over the grid tokens);
- a decoder (``decoder_depth`` blocks whose query tokens cross-attend into the encoded grid);
  a query token carries Fourier features of x and of the characteristic coordinate x - c t;
- the auxiliary "inverse" loss: a second transformer (``inverse_depth`` self-attention blocks)
  reads the *predicted* field at a subsample of the query points and recovers ``c`` and the
  Fourier coefficients of ``u0`` from it. Its attention is quadratic in the queries it sees,
  which makes it 30-50% of a step at the presets, as the write-up says of its inverse losses.

The data come through a real ``torch.utils.data.DataLoader`` over :class:`AdvectionDataset`,
whose samples are computed on the CPU when asked for (tens of microseconds each): a function
of ``(seed, index)`` only, so every loader setting and every rank sees the same samples.

``Flags()`` is the write-up's "before": eager, every activation stored, the inverse loss on
every step over every query, the batches generated in the training loop and copied with a
blocking copy, float32, AdamW's default (foreach) step with its state on the device.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from accel import memory
from accel.workloads import flags as flags_module
from accel.workloads.compare import compare_results as check
from accel.workloads.flags import flag, option, pick_preset

COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
PRECISIONS = ("fp32", "bf16", "fp16+scaler")
# Inputs pack grid and query tokens into one tensor, 3 channels each (one tensor in, so the
# distributed wrappers call the model as model(inputs)):
#   grid rows:  (u0(x_i), x_i, c)       query rows: (x_q, t_q, c)
CHANNELS = 3
# The gradient scaler's first scale. PyTorch's 2**16 overflows this model's fp16 backward (its
# gradients are O(1)): the scaler skips those steps and halves the scale (seen at the cpu
# preset: the first 3 of 5 steps skipped). 2**10 leaves fp16 5 bits of headroom above O(1).
GRAD_SCALER_INIT = 2.0**10

# fp32 flags (compile, checkpointing, the loader settings, fused AdamW, CPU offload) leave the
# result equal to the baseline's within float32 rounding after a few steps: they sum in other
# orders or not at all (checkpointing recomputes with the same kernels; the loader settings
# deliver bitwise the same batches). Adam normalizes each update by its gradient's size, so a
# rounding difference in a near-zero gradient moves a weight by a visible fraction of the
# learning rate (1e-3): hence the absolute part.
FP32_TOLERANCE = {
    "losses": {"rtol": 1e-4, "atol": 1e-5},
    "params": {"rtol": 1e-4, "atol": 1e-4},
    "predictions": {"rtol": 1e-4, "atol": 1e-4},
}
# All tolerances are for results after a few steps (the tests take 3, at lr 1e-3).
# Reduced precision rounds matrix-product inputs to 8 (bf16) or 11 (fp16) bits of mantissa; after
# a few AdamW steps weights may differ by a few learning rates where gradients are near zero
# (seen over 12 seeds, 3 steps: 2.8e-3 in the weights, 1.9e-2 in the predicted field).
LOW_PRECISION_TOLERANCE = {
    "losses": {"rtol": 2e-2, "atol": 1e-2},
    "params": {"rtol": 0.0, "atol": 1e-2},
    "predictions": {"rtol": 5e-2, "atol": 4e-2},
}
# aux_loss_every and query_subsample change the training on purpose (no inverse loss on some
# steps, or on fewer queries): each weight may move up to ~2 learning rates apart per step,
# the losses differ by the inverse term (seen: 0.14 of ~1.5). The quality that matters is the
# validation error after equal steps: the recipe bench compares that.
CHANGED_TRAINING_TOLERANCE = {
    "losses": {"rtol": 0.5, "atol": 0.25},
    "params": {"rtol": 0.0, "atol": 1e-2},
    "predictions": {"rtol": 0.2, "atol": 0.1},
}
# batch_multiplier trains on other samples (the next ones of the stream too): its losses are
# another batch's, not comparable (None: not compared); the weights stay within ~2 learning
# rates per step (seen 5.8e-3 after 3) and the field within 0.28 at the tiny test batch.
LARGER_BATCH_TOLERANCE = {
    "losses": None,
    "params": {"rtol": 0.0, "atol": 1e-2},
    "predictions": {"rtol": 0.0, "atol": 0.5},
}


@dataclass(frozen=True)
class Flags:
    compile: str = option(
        "torch.compile the step's forward and losses, one graph with the inverse loss and one "
        "without; reduce-overhead and max-autotune add CUDA graphs (compile time is reported "
        "apart, never inside a step time)",
        "compile",
        default="none",
        choices=COMPILE_MODES,
        requires="cuda",
    )
    activation_checkpointing: bool = flag(
        "recompute every transformer block's activations in backward instead of storing them "
        "(about one more forward per step; frees the memory for a larger batch)",
        "memory",
    )
    batch_multiplier: int = option(
        "train on N x the batch per step: what checkpointing's freed memory allows (more "
        "samples per step: changes the training on purpose)",
        "memory",
        default=1,
        choices=(1, 2, 4),
    )
    aux_loss_every: int = option(
        "compute the inverse (auxiliary) loss on every k-th step only (changes the training "
        "on purpose)",
        "loss",
        default=1,
        choices=(1, 2, 4, 8),
    )
    query_subsample: int = option(
        "the inverse loss reads 1/s of the query points: its attention costs s^2 less "
        "(changes the training on purpose)",
        "loss",
        default=1,
        choices=(1, 2, 4),
    )
    loader_workers: int = option(
        "DataLoader worker processes that generate batches beside the training loop "
        "(0: generated inside the step, the GPU waits)",
        "data",
        default=0,
        choices=(0, 2, 4, 8),
    )
    pin_memory: bool = flag(
        "the loader puts batches in page-locked memory: the copy to the GPU runs by DMA and "
        "can overlap compute",
        "data",
        requires="cuda",
    )
    persistent_workers: bool = flag(
        "keep the loader's workers alive across epochs instead of starting them anew "
        "(needs loader_workers > 0)",
        "data",
    )
    prefetch: int = option(
        "batches each worker prepares ahead (prefetch_factor; needs loader_workers > 0 "
        "unless 2, PyTorch's default)",
        "data",
        default=2,
        choices=(2, 4),
    )
    non_blocking: bool = flag(
        "copy batches to the device with non_blocking=True: the host does not wait for the "
        "copy (a real overlap only from pinned memory)",
        "data",
    )
    precision: str = option(
        "fp32; bf16 autocast; or fp16 autocast with a gradient scaler (the write-up's "
        "before-phase-6): both change numerics on purpose (LOW_PRECISION_TOLERANCE)",
        "precision",
        default="fp32",
        choices=PRECISIONS,
    )
    fused_adamw: bool = flag("AdamW(fused=True): one kernel for all parameters", "optimizer")
    cpu_offload_optimizer: bool = flag(
        "optimizer state and step in CPU memory (torchao's CPUOffloadOptimizer): frees "
        "8 bytes per parameter on the GPU, costs two copies per step and a sync",
        "optimizer",
        requires="torchao",
    )


@dataclass(frozen=True)
class Sizes:
    """Problem, model, batch and optimizer settings. Validated on creation."""

    grid: int = 32  # points where u0 is given
    queries: int = 64  # (x, t) points per sample where u is asked for
    modes: int = 4  # Fourier modes of u0
    dim: int = 32
    heads: int = 2
    depth: int = 2  # encoder blocks
    decoder_depth: int = 1
    inverse_depth: int = 1
    mlp_ratio: int = 2
    batch: int = 8
    epoch_batches: int = 4  # batches per loader epoch (then a new iterator: workers restart)
    validation_samples: int = 64
    lr: float = 1e-3
    aux_weight: float = 0.1

    def __post_init__(self):
        names = (
            "grid",
            "queries",
            "modes",
            "dim",
            "heads",
            "depth",
            "decoder_depth",
            "inverse_depth",
            "mlp_ratio",
            "batch",
            "epoch_batches",
            "validation_samples",
        )
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Sizes.{name} must be an int >= 1, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"Sizes.dim {self.dim} does not split into {self.heads} heads")
        if 2 * self.modes >= self.grid:
            raise ValueError(
                f"Sizes.grid {self.grid} cannot resolve {self.modes} modes: needs more than "
                f"{2 * self.modes} points (Nyquist)"
            )
        if not (self.lr > 0 and self.aux_weight >= 0):
            raise ValueError(
                f"Sizes.lr must be > 0 and aux_weight >= 0, got {self.lr}, {self.aux_weight}"
            )

    @property
    def inverse_targets(self) -> int:
        """What the inverse net recovers: c and the 2 x modes coefficients of u0."""
        return 1 + 2 * self.modes

    @classmethod
    def preset(cls, name: str) -> Sizes:
        return pick_preset(_PRESETS, name)


_PRESETS = {
    "cpu": Sizes(),
    # ~8.0M parameters; float32 step of ~1 TFLOP (about half of it the inverse loss), counted
    "gpu": Sizes(
        grid=256,
        queries=1024,
        modes=6,
        dim=256,
        heads=4,
        depth=6,
        decoder_depth=2,
        inverse_depth=2,
        mlp_ratio=4,
        batch=32,
        epoch_batches=16,
        validation_samples=512,
    ),
}


def unavailable(device: torch.device | str) -> dict[str, str]:
    """Flags that cannot run on ``device``, with the reason: those of
    :func:`accel.workloads.flags.unavailable`, and the CPU offload optimizer without torchao."""
    reasons = flags_module.unavailable(Flags, device)
    if "cpu_offload_optimizer" not in reasons:
        missing = _offload_optimizer_class()[1]
        if missing:
            reasons["cpu_offload_optimizer"] = missing
    return reasons


def _offload_optimizer_class() -> tuple[type | None, str]:
    """torchao's CPUOffloadOptimizer (``torchao.optim``; older releases: ``torchao.prototype
    .low_bit_optim``), or None and why not."""
    for module in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            return importlib.import_module(module).CPUOffloadOptimizer, ""
        except (ImportError, AttributeError):
            continue
    return None, "needs torchao's CPUOffloadOptimizer (pip install torchao); not importable here"


# ---- data ----------------------------------------------------------------------------------------
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
    workers = flags.loader_workers
    extra: dict[str, Any] = {}
    if workers:
        extra = {"prefetch_factor": flags.prefetch, "persistent_workers": flags.persistent_workers}
    return DataLoader(
        AdvectionDataset(sizes, seed),
        batch_size=batch,
        sampler=EpochSampler(batch * sizes.epoch_batches),
        num_workers=workers,
        pin_memory=flags.pin_memory,
        drop_last=True,
        **extra,
    )


def batch_of(seed: int, indices: range, sizes: Sizes, stream: int = 0) -> dict[str, torch.Tensor]:
    """Samples ``indices`` stacked, as the loader collates them."""
    samples = [make_sample(seed, i, sizes, stream) for i in indices]
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


# ---- model ---------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head attention of ``x`` (B, S, dim) over ``context`` (B, T, dim), or over itself."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        # no bias: a key bias shifts every score of a row alike (softmax ignores it, its gradient
        # is zero, Adam would amplify rounding noise); a value bias is the output bias again
        self.kv = nn.Linear(dim, 2 * dim, bias=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)  # (B, H, S, d/H)
        k, v = self.kv(context).view(b, context.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, H, S, d/H)
        return self.out(out.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention (self, or cross into ``context``), then an MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, cross: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(dim) if cross else None
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        if self.norm_context is not None:
            x = x + self.attn(self.norm1(x), self.norm_context(context))
        else:
            x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def fourier_features(x: torch.Tensor, modes: int) -> torch.Tensor:
    """(sin 2 pi k x, cos 2 pi k x) for k = 1..modes: (..., ) -> (..., 2 modes)."""
    k = torch.arange(1, modes + 1, dtype=x.dtype, device=x.device)
    phase = 2 * math.pi * x.unsqueeze(-1) * k
    return torch.cat([torch.sin(phase), torch.cos(phase)], dim=-1)


class OperatorNet(nn.Module):
    """inputs (B, grid + queries, 3) -> u at the queries (B, queries)."""

    def __init__(self, sizes: Sizes):
        super().__init__()
        self.grid, self.modes = sizes.grid, sizes.modes
        d = sizes.dim
        self.grid_embed = nn.Linear(2 + 2 * sizes.modes, d)  # u0, c, (sin, cos) 2 pi k x
        # (sin, cos) 2 pi k x and of x - c t, t, c. x - c t is the characteristic through (x, t):
        # with it the operator learns to read u0 there in hundreds of steps (without, with
        # c t instead, thousands: seen 0.61 relative error after 600 steps at the cpu preset)
        self.query_embed = nn.Sequential(
            nn.Linear(4 * sizes.modes + 2, d), nn.GELU(), nn.Linear(d, d)
        )
        self.encoder = nn.ModuleList(
            Block(d, sizes.heads, sizes.mlp_ratio) for _ in range(sizes.depth)
        )
        self.decoder = nn.ModuleList(
            Block(d, sizes.heads, sizes.mlp_ratio, cross=True) for _ in range(sizes.decoder_depth)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        g, q = inputs[:, : self.grid], inputs[:, self.grid :]  # (B, G, 3), (B, Q, 3)
        u0, x, c = g.unbind(-1)
        tokens = self.grid_embed(
            torch.cat([u0[..., None], c[..., None], fourier_features(x, self.modes)], -1)
        )
        for block in self.encoder:
            tokens = block(tokens)
        xq, tq, cq = q.unbind(-1)
        features = [fourier_features(xq, self.modes), fourier_features(xq - cq * tq, self.modes)]
        queries = self.query_embed(torch.cat([*features, tq[..., None], cq[..., None]], -1))
        for block in self.decoder:
            queries = block(queries, tokens)
        return self.head(self.norm(queries)).squeeze(-1)


class InverseNet(nn.Module):
    """The inverse pass: the predicted field at some queries -> (c, coefficients of u0).

    predictions (B, n) and those queries' rows of the inputs (B, n, 3) -> (B, 1 + 2 modes)."""

    def __init__(self, sizes: Sizes):
        super().__init__()
        d = sizes.dim
        self.embed = nn.Linear(1 + 2 + 1, d)  # u, (sin, cos) 2 pi x, t
        self.blocks = nn.ModuleList(
            Block(d, sizes.heads, sizes.mlp_ratio) for _ in range(sizes.inverse_depth)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, sizes.inverse_targets)

    def forward(self, predictions: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        x, t = queries[..., 0], queries[..., 1]
        tokens = self.embed(
            torch.cat([predictions[..., None], fourier_features(x, 1), t[..., None]], -1)
        )
        for block in self.blocks:
            tokens = block(tokens)
        return self.head(self.norm(tokens).mean(dim=1))


class AdvectionModel(nn.Module):
    """The operator and its inverse net. ``forward`` (the distributed task's model) runs both,
    the inverse on the first ``aux_queries`` queries: (B, queries + 1 + 2 modes)."""

    def __init__(self, sizes: Sizes, aux_queries: int | None = None):
        super().__init__()
        self.grid = sizes.grid
        self.aux_queries = sizes.queries if aux_queries is None else aux_queries
        self.operator = OperatorNet(sizes)
        self.inverse = InverseNet(sizes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        predictions = self.operator(inputs)
        n = self.aux_queries
        estimate = self.inverse(predictions[:, :n], inputs[:, self.grid : self.grid + n])
        return torch.cat([predictions, estimate], dim=1)

    def block_names(self) -> list[str]:
        """Every transformer block, as named for :func:`accel.memory.checkpoint_blocks`."""
        return [n for n, m in self.named_modules() if isinstance(m, Block)]


def init_model(sizes: Sizes, seed: int) -> AdvectionModel:
    """The model with ``seed``'s weights, on the CPU: the same on every device, flag and rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AdvectionModel(sizes)


def relative_error(predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample ||prediction - target|| / ||target|| (B,): the validation metric."""
    return (predictions - targets).norm(dim=-1) / targets.norm(dim=-1).clamp_min(1e-12)


def combined_loss(output: torch.Tensor, targets: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    """MSE of the field plus ``aux_weight`` x MSE of the inverse estimate, from the packed
    ``AdvectionModel`` output and targets (B, queries + 1 + 2 modes)."""
    q = sizes.queries
    field = F.mse_loss(output[:, :q].float(), targets[:, :q])
    inverse = F.mse_loss(output[:, q:].float(), targets[:, q:])
    return field + sizes.aux_weight * inverse


# ---- the training step ---------------------------------------------------------------------------
class Step:
    """One training step per call. Losses stay on the device (one host read in ``mean_loss``).

    Sync-free except where noted: ``fp16+scaler`` without fused AdamW reads the scaler's
    inf check on the host (``GradScaler.step``); the CPU offload optimizer waits for its
    copies (torchao's ``step`` synchronizes its stream); loading a batch in the step
    (``loader_workers=0``) is host work the GPU waits for.

    With ``compile``, :meth:`forward_loss` (operator, inverse net when due, losses) is compiled
    as one function: a graph per variant (with and without the inverse loss), each with its
    backward. Under CUDA graphs (reduce-overhead, max-autotune) every output of a graph (the
    loss, the gradients) lives in memory the next step's replay overwrites: a step marks its
    start, keeps a clone of its loss, and drops the gradients after the optimizer step.
    """

    def __init__(self, flags: Flags, sizes: Sizes, device: torch.device, seed: int):
        _check(flags, device)
        self.flags, self.sizes, self.device, self.seed = flags, sizes, device, seed
        self.batch_size = sizes.batch * flags.batch_multiplier
        self.aux_queries = max(1, sizes.queries // flags.query_subsample)
        self.loader = make_loader(flags, sizes, seed, self.batch_size)
        self._batches: Iterator | None = None
        self.epochs = 0

        self.model = init_model(sizes, seed).to(device)
        self.checkpointed = (
            memory.checkpoint_blocks(self.model, self.model.block_names())
            if flags.activation_checkpointing
            else None
        )
        self.optimizer = self._optimizer()
        self.scaler = (
            torch.amp.GradScaler(device.type, init_scale=GRAD_SCALER_INIT)
            if flags.precision == "fp16+scaler"
            else None
        )
        held_out = batch_of(seed, range(sizes.validation_samples), sizes, stream=1)
        self.validation = {k: v.to(device) for k, v in held_out.items()}
        self.losses: list[torch.Tensor] = []  # device scalars: no sync per step
        self.count = self.aux_calls = 0
        self.compile_seconds = 0.0
        self.cudagraphs = flags.compile in ("reduce-overhead", "max-autotune")
        # a function called with self, not a bound method: no reference cycle, so a dropped
        # Step (and its loader's workers) goes at once, not at some later garbage collection
        self._forward_loss = Step.forward_loss
        if flags.compile != "none":
            mode = None if flags.compile == "default" else flags.compile
            # dynamic=False: one batch shape per Step, never made dynamic because another Step
            # compiled another batch size
            self._forward_loss = torch.compile(
                _own_code(Step.forward_loss), mode=mode, dynamic=False
            )
            self.compile_seconds = self._untimed_passes(3 if self.cudagraphs else 1)

    def _optimizer(self) -> torch.optim.Optimizer:
        kwargs = {"lr": self.sizes.lr, "weight_decay": 0.01}
        if self.flags.fused_adamw:
            kwargs["fused"] = True
        if self.flags.cpu_offload_optimizer:
            offload, _ = _offload_optimizer_class()
            # small tensors (norms, biases) stay on the GPU with the on-device AdamW
            return offload(self.model.parameters(), torch.optim.AdamW, **kwargs)
        # Before: AdamW's default implementation (foreach on CUDA)
        return torch.optim.AdamW(self.model.parameters(), **kwargs)

    def _autocast(self):
        if self.flags.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.flags.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            k: v.to(self.device, non_blocking=self.flags.non_blocking) for k, v in batch.items()
        }

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next training batch on the device (a new loader epoch when one ends)."""
        if self._batches is None:
            self._batches = iter(self.loader)
        try:
            batch = next(self._batches)
        except StopIteration:
            self.epochs += 1
            self._batches = iter(self.loader)  # without persistent workers: new processes
            batch = next(self._batches)
        return self._to_device(batch)

    def forward_loss(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        inverse_targets: torch.Tensor,
        aux: bool,
    ) -> torch.Tensor:
        """The training loss: MSE of the field, plus ``aux_weight`` x MSE of the inverse net's
        estimate from the predicted field at the first ``aux_queries`` queries when ``aux``."""
        predictions = self.model.operator(inputs)
        loss = F.mse_loss(predictions.float(), targets)
        if aux:
            n, g = self.aux_queries, self.sizes.grid
            estimate = self.model.inverse(predictions[:, :n], inputs[:, g : g + n])
            inverse = F.mse_loss(estimate.float(), inverse_targets)
            loss = loss + self.sizes.aux_weight * inverse
        return loss

    def _loss(self, batch: dict[str, torch.Tensor], aux: bool) -> torch.Tensor:
        """The loss (compiled when asked) in the step's precision. Under CUDA graphs: a graph
        output, valid until the next step's mark."""
        with self._autocast():
            return self._forward_loss(
                self, batch["inputs"], batch["targets"], batch["inverse_targets"], aux
            )

    def _variants(self) -> tuple[bool, ...]:
        """The ``aux`` settings the training steps use: each one compiles its own graphs."""
        return (True,) if self.flags.aux_loss_every == 1 else (True, False)

    def _untimed_passes(self, passes: int) -> float:
        """``passes`` forwards and backwards of each variant on a warm-up batch, gradients
        dropped: weights, optimizer, data stream and random generators are left as they were.
        Seconds (compile, and under CUDA graphs their warm-up and recording)."""
        warm = batch_of(self.seed, range(self.batch_size), self.sizes, stream=2)
        warm = self._to_device(warm)
        t0 = time.perf_counter()
        # CUDA graph trees: the 1st call of a graph warms up, the 2nd records, the 3rd replays
        # (a replay right after the recording: pytorch/pytorch#122192)
        for aux in self._variants():
            for _ in range(passes):
                self._begin_step()
                self._loss(warm, aux).backward()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # sync: setup, outside any timed step
        return time.perf_counter() - t0

    def _begin_step(self) -> None:
        """Drop the gradients (no step adds to the last one's: under CUDA graphs those are
        outputs that are overwritten) and, under CUDA graphs, mark a new iteration."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()

    def __call__(self) -> None:
        batch = self.next_batch()
        aux = self.count % self.flags.aux_loss_every == 0  # host counter: no sync
        self._begin_step()
        loss = self._loss(batch, aux)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)  # sync: unless fused AdamW takes the inf check
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        if self.cudagraphs:  # graph outputs: the next replay overwrites them
            self.losses.append(loss.detach().clone())
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.losses.append(loss.detach())
        self.aux_calls += aux
        self.count += 1

    @property
    def samples_per_step(self) -> int:
        return self.batch_size

    def mean_loss(self, last: int | None = None) -> float:
        """Mean training loss over all steps (or the ``last`` few): one host read."""
        picked = self.losses[-last:] if last else self.losses
        return torch.stack(picked).mean().item() if picked else float("nan")  # sync: on request

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """The field at the queries, eager (not the compiled graphs), in the step's precision."""
        with self._autocast():
            return self.model.operator(inputs).float()

    def validation_error(self) -> float:
        """Mean relative L2 error of the field on the held-out samples (one host read)."""
        errors = []
        inputs, targets = self.validation["inputs"], self.validation["targets"]
        for start in range(0, len(inputs), self.sizes.batch):
            chunk = slice(start, start + self.sizes.batch)
            errors.append(relative_error(self.predict(inputs[chunk]), targets[chunk]))
        return torch.cat(errors).mean().item()  # sync: on request

    @torch.no_grad()
    def result(self) -> dict[str, torch.Tensor]:
        """What every flag must leave (near) unchanged: the losses, all parameters (flattened)
        and the predicted field on the first held-out batch."""
        params = torch.cat([p.detach().float().flatten().cpu() for p in self.model.parameters()])
        inputs = self.validation["inputs"][: self.sizes.batch]
        return {
            "losses": torch.stack(self.losses).float().cpu() if self.losses else torch.zeros(0),
            "params": params,
            "predictions": self.predict(inputs).cpu(),
        }

    def resident_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state held on the step's device."""
        tensors = list(self.model.parameters())
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for state in _optimizer_states(self.optimizer):
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type == self.device.type]
        return memory.tensor_bytes(on_device)

    def close(self) -> None:
        """Stop the loader's workers now (they also stop when the step is garbage collected)."""
        self._batches = None


def _own_code(function: types.FunctionType) -> types.FunctionType:
    """A copy of ``function`` with a code object of its own. torch.compile keeps its graphs per
    code object, at most ``recompile_limit`` (8) before it runs the code eager: shared by every
    Step, a bench of a dozen compiled configurations would run its last ones eager. With its
    own code object each Step has its own 1 or 2 graphs."""
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__, copy.__qualname__ = function.__kwdefaults__, function.__qualname__
    return copy


def _optimizer_states(optimizer: Any) -> list[dict]:
    inner = [optimizer]
    if hasattr(optimizer, "optim_dict"):  # torchao's offload optimizer: one per large tensor
        inner = [*optimizer.optim_dict.values(), getattr(optimizer, "d_opt", None)]
    return [s for opt in inner if opt is not None for s in opt.state.values()]


def _check(flags: Flags, device: torch.device) -> None:
    """Combinations that cannot run, as clear errors before anything is built."""
    if flags.loader_workers == 0:
        if flags.persistent_workers:
            raise ValueError("persistent_workers=True needs loader_workers > 0, got 0")
        if flags.prefetch != 2:
            raise ValueError(f"prefetch={flags.prefetch} needs loader_workers > 0, got 0")
    if flags.cpu_offload_optimizer and flags.precision == "fp16+scaler":
        raise ValueError(
            "cpu_offload_optimizer cannot take precision='fp16+scaler': the scaler unscales "
            "the optimizer's CPU copies, not the GPU gradients; use 'bf16' (no scaler)"
        )
    blocked = {k: v for k, v in unavailable(device).items() if getattr(flags, k) != flag_default(k)}
    if blocked:
        raise ValueError(
            f"flags {sorted(blocked)} cannot run on {device}: " + "; ".join(blocked.values())
        )


def flag_default(name: str) -> Any:
    """The "before" setting of flag ``name``."""
    return Flags.__dataclass_fields__[name].default


def tolerance(flags: Flags) -> dict[str, dict[str, float] | None]:
    """Per result entry, the tolerance within which ``flags`` must match the baseline after a
    few steps (None: the entry is not comparable)."""
    if flags.batch_multiplier != 1:
        return LARGER_BATCH_TOLERANCE
    if (flags.aux_loss_every, flags.query_subsample) != (1, 1):
        return CHANGED_TRAINING_TOLERANCE
    if flags.precision != "fp32":
        return LOW_PRECISION_TOLERANCE
    return FP32_TOLERANCE


def compare_results(
    result: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], flags: Flags
) -> dict[str, float]:
    """Check two :meth:`Step.result` dicts agree within :func:`tolerance` of ``flags`` (an
    AssertionError names the entry) and return each entry's largest absolute difference."""
    return check(result, reference, tolerance(flags), relative=False)


def build(
    flags: Flags = Flags(),
    sizes: Sizes = Sizes(),
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Step:
    return Step(flags, sizes, torch.device(device), seed)


# ---- the distributed task ------------------------------------------------------------------------
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
        errors = []
        for start in range(0, len(inputs), sizes.batch):
            chunk = slice(start, start + sizes.batch)
            output = model(inputs[chunk])[:, : sizes.queries].float()
            errors.append(relative_error(output, targets[chunk]))
        return torch.cat(errors).mean().item()  # sync: on request

    return Task(model=init_model(sizes, seed), batch=batch, loss=loss, validate=validate)
