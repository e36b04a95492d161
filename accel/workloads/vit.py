"""A ViT classifier with rotary embeddings, trained on generated images of shapes.

The Vision-BDH guide's workload: patch embedding (a strided convolution), pre-norm transformer
blocks whose attention rotates queries and keys by position (RoPE), mean-pooled tokens, a linear
head, AdamW. The images are drawn here, no downloads: each shows one of up to eight shapes (disk,
square, ring, diamond, bars, cross, triangle) at a random place, size and colour on a random
background with noise; the class is the shape, so a model has to learn shape, not colour.
``Flags()`` is the step as first written; each flag switches one optimization on.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from accel.attention import BACKENDS, RotaryEmbedding, SelfAttention
from accel.workloads.compare import (
    BF16_UNIT_ROUNDOFF,
    Tolerance,
    adamw_drift_bound,
    make_compare_results,
)
from accel.workloads.flags import Presets, check_sizes, flag, option

# Every flag but bf16_autocast only sums in other orders: the held-out logits stay this close.
FP32_LOGITS_TOLERANCE = dict(rtol=1e-4, atol=1e-4)
LEARNING_RATE = 1e-3
# Each class's shape: the pixels inside it at offset (dx, dy) from its centre (ax, ay: their
# absolute values), size r, all in fractions of the side.
SHAPE_MASKS = {
    "disk": lambda dx, dy, ax, ay, r: dx**2 + dy**2 < r**2,
    "square": lambda dx, dy, ax, ay, r: torch.maximum(ax, ay) < 0.85 * r,
    "ring": lambda dx, dy, ax, ay, r: ((dx**2 + dy**2).sqrt() - r).abs() < 0.25 * r,
    "diamond": lambda dx, dy, ax, ay, r: ax + ay < 1.2 * r,
    "horizontal bar": lambda dx, dy, ax, ay, r: (ay < 0.3 * r) & (ax < 1.2 * r),
    "vertical bar": lambda dx, dy, ax, ay, r: (ax < 0.3 * r) & (ay < 1.2 * r),
    "cross": lambda dx, dy, ax, ay, r: ((ax < 0.25 * r) & (ay < r)) | ((ay < 0.25 * r) & (ax < r)),
    "triangle": lambda dx, dy, ax, ay, r: (dy > -r) & (dy < r) & (ax < (dy + r) / 2),  # apex up
}
SHAPES = tuple(SHAPE_MASKS)  # the class names


@dataclass(frozen=True)
class Flags:
    sdpa: bool = flag(
        "scaled_dot_product_attention (one fused kernel) instead of matmul, scale, softmax, "
        "matmul with the S x S scores in memory",
        "sdpa",
    )
    backend: str = option(
        "SDPA backend when sdpa is on: default is PyTorch's own pick; the others force one "
        "kernel (lab.sdpa_backends measures them at a shape)",
        "sdpa",
        default="default",
        choices=BACKENDS,
    )
    cached_rope: bool = flag(
        "rotary cos/sin computed once and kept as buffers, not recomputed every forward", "sdpa"
    )
    fused_qkv: bool = flag("one (dim -> 3 dim) projection for q, k, v instead of three", "fusion")
    bf16_autocast: bool = flag(
        "bf16 autocast: matrix products and attention on bf16 tensor cores "
        "(changes numerics: see tolerance())",
        "sdpa",
    )
    fused_adamw: bool = flag("AdamW(fused=True): one kernel for all parameters", "fusion")
    channels_last: bool = flag(
        "channels_last images and patch embedding: the convolution then writes (B, h, w, dim), "
        "already the token layout, so no transpose copy follows",
        "memory",
    )
    compile: bool = flag(
        "torch.compile the model (compile time is reported apart, never inside a step time)",
        "fusion",
        requires="cuda",
    )


@dataclass(frozen=True)
class Sizes(Presets):
    image: int = 28  # pixels per side
    patch: int = 4  # 7 x 7 = 49 tokens: an odd sequence length
    dim: int = 48
    heads: int = 3
    depth: int = 2
    mlp_ratio: int = 4
    classes: int = 8
    batch: int = 16
    batches: int = 4  # distinct training batches, cycled through

    def __post_init__(self):
        if self.image % self.patch:
            raise ValueError(f"image {self.image} is not a multiple of patch {self.patch}")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(
                f"dim {self.dim} must split into {self.heads} heads of even size (for RoPE)"
            )
        if not 2 <= self.classes <= len(SHAPES):
            raise ValueError(f"classes must be between 2 and {len(SHAPES)}, got {self.classes}")
        check_sizes(self, ("depth", "batch", "batches", "mlp_ratio"))

    @property
    def tokens(self) -> int:
        return (self.image // self.patch) ** 2


Sizes.PRESETS = {
    "cpu": Sizes(),
    # ViT-S/16 at 224 px: 196 tokens, 6 heads of 64, 12 blocks, 22M parameters
    "gpu": Sizes(image=224, patch=16, dim=384, heads=6, depth=12, batch=128, batches=4),
}


def make_images(n: int, image: int, classes: int, *, generator, device="cpu") -> tuple:
    """``n`` images (n, 3, image, image), standardized, and their labels (n,). Random numbers
    come from the CPU ``generator`` (the same images on every device); drawn on ``device``."""
    labels = torch.randint(classes, (n,), generator=generator)
    centre = 0.3 + 0.4 * torch.rand(n, 2, generator=generator)
    radius = 0.15 + 0.13 * torch.rand(n, generator=generator)
    fg = 0.55 + 0.45 * torch.rand(n, 3, generator=generator)
    bg = 0.4 * torch.rand(n, 3, generator=generator)
    noise = 0.08 * torch.randn(n, 3, image, image, generator=generator)
    dev = torch.device(device)
    labels, centre, radius, fg, bg, noise = (
        t.to(dev) for t in (labels, centre, radius, fg, bg, noise)
    )
    grid = (torch.arange(image, device=dev, dtype=torch.float32) + 0.5) / image
    dx = grid.view(1, 1, -1) - centre[:, 0].view(-1, 1, 1)  # (n, 1, image): varies along x
    dy = grid.view(1, -1, 1) - centre[:, 1].view(-1, 1, 1)  # (n, image, 1)
    dx, dy = torch.broadcast_tensors(dx, dy)
    inside = torch.zeros(n, image, image, dtype=torch.bool, device=dev)
    for kind, shape in enumerate(list(SHAPE_MASKS.values())[:classes]):
        pick = labels == kind
        x, y = dx[pick], dy[pick]
        inside[pick] = shape(x, y, x.abs(), y.abs(), radius[pick].view(-1, 1, 1))
    colour = torch.where(inside[:, None], fg[:, :, None, None], bg[:, :, None, None])
    return (colour + noise - 0.45) / 0.3, labels


class Block(nn.Module):
    def __init__(self, sizes: Sizes, flags: Flags, rope: RotaryEmbedding):
        super().__init__()
        self.norm1 = nn.LayerNorm(sizes.dim)
        self.attn = SelfAttention(
            sizes.dim,
            sizes.heads,
            use_sdpa=flags.sdpa,
            backend=flags.backend,
            fused_qkv=flags.fused_qkv,
            rope=rope,
        )
        self.norm2 = nn.LayerNorm(sizes.dim)
        hidden = sizes.mlp_ratio * sizes.dim
        self.mlp = nn.Sequential(
            nn.Linear(sizes.dim, hidden), nn.GELU(), nn.Linear(hidden, sizes.dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Images (B, 3, image, image) -> class logits (B, classes)."""

    def __init__(self, sizes: Sizes, flags: Flags):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, sizes.dim, sizes.patch, stride=sizes.patch)
        # one rotary table shared by every block: positions are the same in each
        rope = RotaryEmbedding(sizes.dim // sizes.heads, sizes.tokens, cached=flags.cached_rope)
        self.blocks = nn.ModuleList(Block(sizes, flags, rope) for _ in range(sizes.depth))
        self.norm = nn.LayerNorm(sizes.dim)
        self.head = nn.Linear(sizes.dim, sizes.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, dim, h, w) -> (B, h*w, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))

    def canonical_parameters(self) -> dict[str, torch.Tensor]:
        """Parameters named as with separate q/k/v projections, whichever form is used."""
        attention = {
            f"{name}.qkv.{sub}": tensor
            for name, module in self.named_modules()
            if isinstance(module, SelfAttention)
            for sub, tensor in module.qkv.separate_parameters().items()
        }
        return attention | {n: t for n, t in self.named_parameters() if ".qkv." not in n}


class Step:
    """One training step per call. Losses stay on the device (one host read in ``mean_loss``)."""

    def __init__(self, flags: Flags = Flags(), sizes: Sizes = Sizes(), *, device="cpu", seed=0,
                 compile_mode: str = "default"):  # fmt: skip
        """``compile_mode``: torch.compile's mode where ``flags.compile`` is on (``"max-autotune"``
        times each product's candidate kernels in the first call)."""
        device = torch.device(device)
        if flags.backend != "default" and not flags.sdpa:
            raise ValueError(f"backend={flags.backend!r} needs sdpa=True: the manual path has none")
        self.flags, self.sizes, self.device = flags, sizes, device
        gen = torch.Generator(device="cpu").manual_seed(seed)
        n = sizes.batch * (sizes.batches + 1)  # the last batch is held out for result()
        images, labels = make_images(n, sizes.image, sizes.classes, generator=gen, device=device)
        fmt = torch.channels_last if flags.channels_last else torch.contiguous_format
        images = images.contiguous(memory_format=fmt)
        self.images = list(images.split(sizes.batch))
        self.labels = labels.view(-1, sizes.batch)
        self.held_out = (self.images.pop(), self.labels[-1])
        with torch.random.fork_rng(devices=[]):  # the same weights on every device and flag
            torch.manual_seed(seed)
            self.model = ViT(sizes, flags)
        self.model.to(device)
        if flags.channels_last:
            self.model.patch_embed.to(memory_format=torch.channels_last)
        # Before: AdamW's default implementation (foreach on CUDA, a few kernels per tensor list)
        fused = True if flags.fused_adamw else None
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LEARNING_RATE, weight_decay=0.05, fused=fused
        )
        self.losses: list[torch.Tensor] = []  # device scalars: no sync per step
        self.count = 0
        self.compile_seconds = 0.0
        self.forward = self.model
        if flags.compile:
            self.forward = torch.compile(self.model, mode=compile_mode)
            self.compile_seconds = self._untimed_pass()

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, torch.bfloat16, enabled=self.flags.bf16_autocast)

    def _loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.forward(images)
        return F.cross_entropy(logits.float(), labels)

    def _untimed_pass(self) -> float:
        """One forward and backward on the first batch, gradients dropped: the weights, the
        optimizer and every random generator are left as they were. Seconds it took."""
        t0 = time.perf_counter()
        self._loss(self.images[0], self.labels[0]).backward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # sync: setup, outside any timed step
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def __call__(self) -> None:
        i = self.count % len(self.images)
        loss = self._loss(self.images[i], self.labels[i])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.detach())
        self.count += 1

    def mean_loss(self, last: int | None = None) -> float:
        """Mean training loss over all steps (or the ``last`` few): one host read."""
        picked = self.losses[-last:] if last else self.losses
        return torch.stack(picked).mean().item() if picked else float("nan")  # sync: on request

    @torch.no_grad()
    def accuracy(self) -> float:
        """Accuracy on the held-out batch (one host read)."""
        images, labels = self.held_out
        with self._autocast():
            logits = self.model(images)
        return (logits.argmax(dim=1) == labels).float().mean().item()  # sync: on request

    @torch.no_grad()
    def result(self) -> dict[str, torch.Tensor]:
        """What every flag must leave (near) unchanged: held-out logits (eager, in the step's own
        precision) and the weights, named as with separate q/k/v."""
        with self._autocast():
            logits = self.model(self.held_out[0]).float()
        params = {
            k: p.detach().float().clone() for k, p in self.model.canonical_parameters().items()
        }
        return {"logits": logits, **params}


build = Step  # build(flags, sizes, *, device, seed): the contract's name for the step


def tolerance(flags: Flags, sizes: Sizes, steps: int) -> dict[str, Tolerance]:
    """Per entry of ``step.result()`` after ``steps`` steps. Weights: AdamW's drift bound, as a
    weight whose gradient is at rounding level (a key bias) may step either way each time.
    Logits: float32 flags only reorder sums; bf16 rounds the inputs of every matrix product, and
    relative errors ``u = 2^-8`` over ``n`` products in series add to ``sqrt(n) u`` in norm, the
    same again through AdamW's normalized updates: ``sqrt(2 n) u`` in all."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    weights = dict(rtol=1e-6, atol=adamw_drift_bound(steps, LEARNING_RATE))
    if flags.bf16_autocast:
        # products in series: the patch embedding, six per block (q/k/v, scores, probabilities x
        # values, output projection, the two MLP layers) and the head
        n = 2 + 6 * sizes.depth
        logits = dict(rel_norm=math.sqrt(2 * n) * BF16_UNIT_ROUNDOFF)
    else:
        logits = FP32_LOGITS_TOLERANCE
    return defaultdict(lambda: weights, logits=logits)


compare_results = make_compare_results(tolerance)
