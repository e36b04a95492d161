"""The advection workload's networks: the operator (an encoder over the grid, a decoder whose
queries cross-attend into it), the inverse net, and the losses and metric they are trained on."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from accel.workloads.advection.settings import Sizes


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
        context = None if self.norm_context is None else self.norm_context(context)
        x = x + self.attn(self.norm1(x), context)  # over itself without a context
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
        # (sin, cos) 2 pi k x and of x - c t, t, c: x - c t, the characteristic through (x, t),
        # lets the operator learn to read u0 there in hundreds of steps instead of thousands
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
    the inverse on every query: (B, queries + 1 + 2 modes)."""

    def __init__(self, sizes: Sizes):
        super().__init__()
        self.grid = sizes.grid
        self.operator = OperatorNet(sizes)
        self.inverse = InverseNet(sizes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        predictions = self.operator(inputs)
        estimate = self.inverse(predictions, inputs[:, self.grid :])
        return torch.cat([predictions, estimate], dim=1)

    def block_names(self) -> list[str]:
        """Every transformer block, as named for :func:`accel.memory.checkpoint_blocks`."""
        return [n for n, m in self.named_modules() if isinstance(m, Block)]


def init_model(sizes: Sizes, seed: int) -> AdvectionModel:
    """The model with ``seed``'s weights, on the CPU: the same on every device, flag and rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AdvectionModel(sizes)


def validation_error(predict, inputs: torch.Tensor, targets: torch.Tensor, batch: int) -> float:
    """The validation metric: the mean over samples of ||prediction - target|| / ||target||,
    ``predict`` called on ``batch`` samples at a time (one host read)."""
    errors = []
    for start in range(0, len(inputs), batch):
        got, want = predict(inputs[start : start + batch]), targets[start : start + batch]
        errors.append((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12))
    return torch.cat(errors).mean().item()  # sync: on request


def combined_loss(output: torch.Tensor, targets: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    """MSE of the field plus ``aux_weight`` x MSE of the inverse estimate, from the packed
    ``AdvectionModel`` output and targets (B, queries + 1 + 2 modes)."""
    q = sizes.queries
    field = F.mse_loss(output[:, :q].float(), targets[:, :q])
    inverse = F.mse_loss(output[:, q:].float(), targets[:, q:])
    return field + sizes.aux_weight * inverse
