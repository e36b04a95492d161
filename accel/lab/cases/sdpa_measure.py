"""The sdpa phase's ground, shared by its parts: one attention case (:class:`AttnCase`), its cost
model, its inputs and how a call of it is timed, peak memory. FLOPs follow the FlashAttention
papers: a forward is two products of 2 Sq Sk D each, a backward five (recomputation not
counted); causal halves both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from accel import memory

PHASE = "sdpa"


# ---- cost model --------------------------------------------------------------------------------
def attention_flops(batch, heads, seq_q, seq_k, head_dim, *, causal=False, backward=False) -> float:
    """Matrix-product FLOPs of attention (forward, or forward + backward)."""
    flops = 4.0 * batch * heads * seq_q * seq_k * head_dim
    flops = flops / 2 if causal else flops
    return flops * 3.5 if backward else flops


def attention_bytes(batch, heads, seq_q, seq_k, head_dim, *, elem_bytes, manual=False) -> float:
    """Bytes a forward moves through memory at least. Fused: read q, k, v, write the output.
    Manual adds the (B, H, Sq, Sk) scores six times: written by q k^T, read and written by the
    scale, read and written by the softmax, read by the product with v."""
    moved = batch * heads * (2 * seq_q + 2 * seq_k) * head_dim * elem_bytes
    if manual:
        moved += 6 * batch * heads * seq_q * seq_k * elem_bytes
    return float(moved)


# ---- one attention case ------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnCase:
    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool = False
    backward: bool = False
    dtype: torch.dtype = torch.bfloat16

    @property
    def flops(self) -> float:
        shape = (self.batch, self.heads, self.seq, self.seq, self.head_dim)
        return attention_flops(*shape, causal=self.causal, backward=self.backward)

    @property
    def direction(self) -> str:
        return "fwd+bwd" if self.backward else "fwd"

    @property
    def name(self) -> str:
        return (
            f"B={self.batch} H={self.heads} S={self.seq} D={self.head_dim} "
            f"{'causal' if self.causal else 'full'} {self.direction}"
        )


def make_inputs(case: AttnCase, device: torch.device, seed: int = 0):
    """Random q, k, v (B, H, S, D) and, for a backward, a random incoming gradient."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (case.batch, case.heads, case.seq, case.head_dim)
    q, k, v, grad = (
        torch.randn(shape, generator=gen, device=device, dtype=case.dtype) for _ in range(4)
    )
    return *(t.requires_grad_(case.backward) for t in (q, k, v)), grad


def as_timed(forward: Callable[[], torch.Tensor], case: AttnCase, inputs, grad) -> Callable:
    """``forward`` as a case times it: without autograd, or with the backward to ``inputs``."""
    if case.backward:
        return lambda: torch.autograd.grad(forward(), inputs, grad)

    def no_grad_forward():
        with torch.no_grad():
            return forward()

    return no_grad_forward


def first_call_s(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call (a compile among them) to the device's end."""
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Most bytes allocated during one call above what was allocated before it."""
    fn()  # warm-up: cuDNN builds its plan, the allocator settles
    return memory.peak_memory(fn, device=device)
