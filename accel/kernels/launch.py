"""What a launch tells a kernel that Triton cannot see for itself: how its rows are aligned.

Triton marks an integer argument 16-aligned only when it is a multiple of 16, and sizes its loads
from that, so rows of 100 float32 (16-byte aligned) or 300 float16 (8) would load one element at
a time. The diversity kernels take :func:`row_alignment` as their ``ALIGN`` and round D and the
strides to multiples of it where the compiler sees them.
"""

from __future__ import annotations

import torch


def row_alignment(x: torch.Tensor) -> int:
    """Elements of each row of ``x`` (..., D) a kernel may load at once that Triton cannot see
    for itself: the largest power of 2, up to 16 bytes, dividing D, every other stride and the
    start; 1 where Triton sees 16 elements already, or the rows are strided."""
    if x.dim() == 0 or x.stride(-1) != 1 or x.data_ptr() % 16:
        return 1  # a start off 16 bytes: Triton assumes no alignment at all
    values = (x.shape[-1], *x.stride()[:-1])  # all of them: the kernel rounds each it is given
    if all(v % 16 == 0 for v in values):
        return 1
    align = 16 // x.element_size()
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


__all__ = ["row_alignment"]
