"""The byte cost model: what each rank sends per step and holds, under DDP and FSDP2."""

from __future__ import annotations


def allreduce_bytes(grad_bytes: float, world: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``grad_bytes``: a
    reduce-scatter then an all-gather, each moving (N-1)/N of the buffer."""
    return 2 * (world - 1) / world * grad_bytes


def fsdp_bytes(param_bytes: float, world: int, *, reshard_after_forward: bool = True) -> float:
    """Bytes each rank sends per FSDP step: all-gather the parameters for the forward (and again
    for the backward if they were resharded), reduce-scatter the gradients; (N-1)/N each."""
    passes = (2 if reshard_after_forward else 1) + 1
    return passes * (world - 1) / world * param_bytes


def state_bytes_per_rank(
    param_count: int, world: int, wrapper: str, *, grads: bool = False
) -> float:
    """fp32 parameters + AdamW's two moments [+ gradients] held by each rank: all of it under
    DDP, 1/N of it under FSDP2."""
    total = param_count * 4 * (3 + int(grads))
    return total / world if wrapper == "fsdp2" else total
