"""A GPT-style byte-level language model and its text, which needs no download: the Python
standard library's own source files, read as bytes (vocabulary 256). ``sizes`` here is a
``nested_optimizer.Sizes``: its ``context``, ``heads``, ``layers``, ``text_bytes`` and ``width``."""

from __future__ import annotations

import functools
import inspect
import math
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes


@functools.lru_cache(maxsize=4)
def load_text(nbytes: int) -> torch.Tensor:
    """Up to ``nbytes`` of this Python's standard-library source files (``*.py`` in the stdlib
    directory, in name order) as a uint8 tensor. Same Python, same bytes."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(inspect.getfile(inspect)).parent]
    files = next((sorted(r.glob("*.py")) for r in roots if r.is_dir() and any(r.glob("*.py"))), [])
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data[: nbytes - total])
        total += len(chunks[-1])
        if total >= nbytes:
            break
    if total < 1024:
        raise RuntimeError(
            f"found only {total} bytes of standard-library source under {roots}; this workload "
            "trains on them (a Python without its .py sources?)"
        )
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def text_batches(sizes: Any, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Sequences of ``context + 1`` bytes of the text from starts drawn with ``seed``:
    (*shape, T + 1), int64, on the CPU."""
    text = load_text(sizes.text_bytes)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - sizes.context - 1, shape, generator=gen)
    return text[starts[..., None] + torch.arange(sizes.context + 1)].long()


class Block(nn.Module):
    """Pre-norm transformer block: self-attention (causal unless told, over an external KV cache
    where given) and a 4x MLP (12 parameter tensors). ``gelu``: its ``approximate``."""

    def __init__(self, width: int, heads: int, gelu: str = "tanh"):
        super().__init__()
        self.heads, self.gelu = heads, gelu
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, cache=None, pos: int = 0, causal: bool = True):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if cache is not None:  # write this step's keys and values in place, attend to all so far
            cache_k, cache_v = cache  # (B, heads, max_len, head_dim)
            cache_k[:, :, pos : pos + T] = k
            cache_v[:, :, pos : pos + T] = v
            k, v = cache_k[:, :, : pos + T], cache_v[:, :, : pos + T]
        # one new token attends to every cached one; a prompt (pos = 0) attends causally
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal and T > 1)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate=self.gelu))


class GPT(nn.Module):
    def __init__(self, sizes: Any):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, sizes.width)
        self.wpe = nn.Embedding(sizes.context, sizes.width)
        self.blocks = nn.ModuleList(Block(sizes.width, sizes.heads) for _ in range(sizes.layers))
        self.ln_f = nn.LayerNorm(sizes.width)
        self.head = nn.Linear(sizes.width, VOCAB, bias=False)
        residual = 0.02 / math.sqrt(2 * sizes.layers)  # GPT-2's init: scaled by depth
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = residual if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)

    def param_groups(self) -> list[tuple[str, list[nn.Parameter]]]:
        """(name, parameters): the embeddings, each block, the head."""
        groups = [("embed", [self.wte.weight, self.wpe.weight])]
        groups += [(f"blocks.{i}", list(b.parameters())) for i, b in enumerate(self.blocks)]
        groups.append(("head", [*self.ln_f.parameters(), self.head.weight]))
        return groups
