""":class:`SelfAttention` and its parts, each beside its "before": q, k and v from one fused
projection (:class:`QKVProjection`, ``fused=False`` is three), rotary embeddings with cos/sin
cached as buffers (:class:`RotaryEmbedding`, ``cached=False`` recomputes them every forward), and
SDPA (the manual path when ``use_sdpa=False``).
"""

from __future__ import annotations

import torch
from torch import nn

from accel.attention.reference import attention_reference
from accel.attention.sdpa import check_backend, sdpa
from accel.errors import checked_count

__all__ = ["QKVProjection", "RotaryEmbedding", "SelfAttention", "apply_rope", "rope_cos_sin"]


# ---- rotary position embeddings ----------------------------------------------------------------
def rope_cos_sin(
    seq_len: int, head_dim: int, *, base: float = 10_000.0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (seq_len, head_dim), float32.

    Pair i of the head dimension turns by position * base^(-2i / head_dim); the halves layout
    (dims i and i + head_dim/2 form a pair) matches :func:`apply_rope`.
    """
    seq_len = checked_count(seq_len, "seq_len")
    _check_head_dim(head_dim)
    inv_freq = 1.0 / base ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) of x (..., S, D) by the angles whose cos/sin are (S, D)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # keep bf16 activations bf16 under autocast
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _check_head_dim(head_dim: int) -> None:
    if checked_count(head_dim, "head_dim", at_least=1) % 2:
        raise ValueError(f"rotary embeddings need an even head_dim > 0, got {head_dim}")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of queries and keys (B, H, S, head_dim).

    ``cached=True`` (the "after") computes cos/sin once for ``max_seq_len`` positions and keeps
    them as buffers, which follow the module to its device; ``cached=False`` (the "before")
    recomputes them on every forward: six small kernels per call, every layer, every step.
    """

    def __init__(
        self, head_dim: int, max_seq_len: int, *, base: float = 10_000.0, cached: bool = True
    ):
        super().__init__()
        _check_head_dim(head_dim)
        checked_count(max_seq_len, "max_seq_len", at_least=1)
        self.head_dim, self.max_seq_len = head_dim, max_seq_len
        self.base, self.cached = base, cached
        if cached:
            cos, sin = rope_cos_sin(max_seq_len, head_dim, base=base)
            self.register_buffer("cos_cached", cos, persistent=False)
            self.register_buffer("sin_cached", sin, persistent=False)

    def cos_sin(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.max_seq_len}")
        if self.cached:
            return self.cos_cached[:seq_len], self.sin_cached[:seq_len]
        return rope_cos_sin(seq_len, self.head_dim, base=self.base, device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"expected head_dim {self.head_dim}, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        cos, sin = self.cos_sin(max(q.shape[-2], k.shape[-2]), q.device)
        return (
            apply_rope(q, cos[: q.shape[-2]], sin[: q.shape[-2]]),
            apply_rope(k, cos[: k.shape[-2]], sin[: k.shape[-2]]),
        )


# ---- q, k, v projections -------------------------------------------------------------------------
class QKVProjection(nn.Module):
    """q, k, v = proj(x) for x (..., dim): one (dim -> 3 dim) matrix product when ``fused``,
    three (dim -> dim) products when not (the "before": three launches, x read three times).

    Both forms start from the same weights for the same random state, so switching ``fused``
    changes speed, not results.
    """

    def __init__(self, dim: int, *, fused: bool = True, bias: bool = True):
        super().__init__()
        self.dim, self.fused = dim, fused
        separate = [nn.Linear(dim, dim, bias=bias) for _ in range(3)]  # same draws either way
        if not fused:
            self.q, self.k, self.v = separate
            return
        # skip_init: the fused layer draws nothing, so later layers' weights do not shift
        self.qkv = nn.utils.skip_init(nn.Linear, dim, 3 * dim, bias=bias)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([layer.weight for layer in separate]))
            if bias:
                self.qkv.bias.copy_(torch.cat([layer.bias for layer in separate]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if x.shape[-1] != self.dim:
            raise ValueError(f"expected inputs (..., {self.dim}), got {tuple(x.shape)}")
        if self.fused:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return q, k, v
        return self.q(x), self.k(x), self.v(x)

    def separate_parameters(self) -> dict[str, torch.Tensor]:
        """Parameters named as in the separate form (``q.weight``, ``k.bias`` ...), either form."""
        if not self.fused:
            return dict(self.named_parameters())
        out = {}
        for kind, tensor in (("weight", self.qkv.weight), ("bias", self.qkv.bias)):
            if tensor is not None:
                for name, part in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                    out[f"{name}.{kind}"] = part
        return out


# ---- the layer ----------------------------------------------------------------------------------
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
        if dim % checked_count(heads, "heads", at_least=1):
            raise ValueError(f"dim {dim} is not divisible into {heads} heads")
        if rope is not None and rope.head_dim != dim // heads:
            raise ValueError(
                f"rotary embeddings of head_dim {rope.head_dim} for heads of {dim // heads} "
                f"(dim {dim} / {heads} heads): expected RotaryEmbedding({dim // heads}, ...)"
            )
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
