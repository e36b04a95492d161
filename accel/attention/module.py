""":class:`SelfAttention` from the parts of this package, the manual path as its "before"."""

from __future__ import annotations

import torch
from torch import nn

from accel.attention.qkv import QKVProjection, RotaryEmbedding
from accel.attention.reference import attention_reference
from accel.attention.sdpa import check_backend, sdpa

__all__ = ["SelfAttention"]


class SelfAttention(nn.Module):
    """Multi-head self-attention over x (B, S, dim), with optional rotary embeddings.

    ``use_sdpa=False`` is the manual "before" (:func:`attention_reference`); ``True`` calls
    :func:`accel.attention.sdpa` with ``backend`` (``"default"``: PyTorch's pick).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        use_sdpa: bool = True,
        backend: str = "default",
        fused_qkv: bool = True,
        rope: RotaryEmbedding | None = None,
        bias: bool = True,
    ):
        super().__init__()
        if heads <= 0 or dim % heads:
            raise ValueError(f"dim {dim} is not divisible into {heads} heads")
        check_backend(backend)
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.use_sdpa, self.backend = use_sdpa, backend
        self.qkv = QKVProjection(dim, fused=fused_qkv, bias=bias)
        self.out = nn.Linear(dim, dim, bias=bias)
        self.rope = rope

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(
                f"SelfAttention takes x of shape (batch, seq, {self.dim}), got {tuple(x.shape)}"
            )
        batch, seq, _ = x.shape
        # (B, S, dim) -> (B, H, S, head_dim) each
        q, k, v = (
            t.view(batch, seq, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x)
        )
        if self.rope is not None:
            q, k = self.rope(q, k)
        if self.use_sdpa:
            out = sdpa(q, k, v, mask=mask, causal=causal, backend=self.backend)
        else:
            out = attention_reference(q, k, v, mask=mask, causal=causal)
        return self.out(out.transpose(1, 2).reshape(batch, seq, self.dim))
