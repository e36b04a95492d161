"""The advection workload's switches and sizes: ``Flags`` (one per optimization of the recipe),
``Sizes`` with its presets, and which flags or combinations cannot run where."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from accel.workloads import flags as flags_module
from accel.workloads.flags import Presets, check_sizes, flag, option


@dataclass(frozen=True)
class Flags:
    compile: str = option(
        "torch.compile the forward and losses (a graph with the inverse loss, one without) to "
        "fuse kernels; reduce-overhead and max-autotune replay them as CUDA graphs",
        "compile",
        default="none",
        choices=("none", "default", "reduce-overhead", "max-autotune"),
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
    grad_accumulation: int = option(
        "train on k micro-batches per step, their gradients accumulated before one optimizer "
        "step (accel.accumulate): an effective batch k x the batch at one batch's activation "
        "memory (more samples per step: changes the training on purpose)",
        "memory",
        default=1,
        choices=(1, 2, 4, 8),
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
    non_blocking: bool = flag(
        "copy batches to the device with non_blocking=True: the host does not wait for the "
        "copy (a real overlap only from pinned memory)",
        "data",
    )
    precision: str = option(
        "bf16 autocast, or fp16 autocast with a gradient scaler: tensor-core matmuls on half "
        "the bytes (both change numerics on purpose)",
        "precision",
        default="fp32",
        choices=("fp32", "bf16", "fp16+scaler"),
    )
    fused_adamw: bool = flag("AdamW(fused=True): one kernel for all parameters", "optimizer")
    cpu_offload_optimizer: bool = flag(
        "optimizer state and step in CPU memory (torchao's CPUOffloadOptimizer): frees "
        "8 bytes per parameter on the GPU, costs two copies per step and a sync",
        "optimizer",
        requires="torchao",
    )


@dataclass(frozen=True)
class Sizes(Presets):
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
        ints = ("grid", "queries", "modes", "dim", "heads", "depth", "decoder_depth")
        ints += ("inverse_depth", "mlp_ratio", "batch", "epoch_batches", "validation_samples")
        check_sizes(self, ints, positive=("lr",))
        if self.dim % self.heads:
            raise ValueError(f"Sizes.dim {self.dim} does not split into {self.heads} heads")
        if 2 * self.modes >= self.grid:
            raise ValueError(
                f"Sizes.grid {self.grid} cannot resolve {self.modes} modes: needs more than "
                f"{2 * self.modes} points (Nyquist)"
            )
        if self.aux_weight < 0:
            raise ValueError(f"Sizes.aux_weight must be >= 0, got {self.aux_weight}")

    @property
    def inverse_targets(self) -> int:
        """What the inverse net recovers: c and the 2 x modes coefficients of u0."""
        return 1 + 2 * self.modes


Sizes.PRESETS = {
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
    if "cpu_offload_optimizer" not in reasons and (missing := offload_optimizer_class()[1]):
        reasons["cpu_offload_optimizer"] = missing
    return reasons


def offload_optimizer_class() -> tuple[type | None, str]:
    """torchao's CPUOffloadOptimizer (``torchao.optim``, the extra's torchao), or None and why
    not."""
    try:
        return importlib.import_module("torchao.optim").CPUOffloadOptimizer, ""
    except (ImportError, AttributeError):
        return None, "needs torchao's CPUOffloadOptimizer (pip install torchao); not importable here"


CUDA_GRAPHED = ("reduce-overhead", "max-autotune")  # compile modes that replay CUDA graphs


def check_flags(flags: Flags, device: torch.device) -> None:
    """Combinations that cannot run, as clear errors before anything is built."""
    if flags.loader_workers == 0 and flags.persistent_workers:
        raise ValueError("persistent_workers=True needs loader_workers > 0, got 0")
    if flags.cpu_offload_optimizer and flags.precision == "fp16+scaler":
        raise ValueError(
            "cpu_offload_optimizer cannot take precision='fp16+scaler': the scaler unscales "
            "the optimizer's CPU copies, not the GPU gradients; use 'bf16' (no scaler)"
        )
    if flags.grad_accumulation > 1 and flags.aux_loss_every > 1 and flags.compile in CUDA_GRAPHED:
        raise ValueError(
            f"grad_accumulation={flags.grad_accumulation} with aux_loss_every="
            f"{flags.aux_loss_every} under compile={flags.compile!r}: micro-batches replaying two "
            "alternating CUDA graphs drift from the large batch beyond float rounding "
            "(results/memory-notes.md); use aux_loss_every=1 or compile='default'"
        )
    blocked = {k: v for k, v in unavailable(device).items() if getattr(flags, k) != flag_default(k)}
    if blocked:
        raise ValueError(
            f"flags {sorted(blocked)} cannot run on {device}: " + "; ".join(blocked.values())
        )


def flag_default(name: str) -> Any:
    """The "before" setting of flag ``name``."""
    return Flags.__dataclass_fields__[name].default
