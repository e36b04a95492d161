"""Pairwise-cosine diversity of groups of embeddings, as a polychromic trainer rewards it.

For embeddings ``x`` of shape ``(B, N, D)`` (B groups of N, e.g. N replies to each of B prompts)
or ``(N, D)`` (one set), in float32, bfloat16 or float16:

- :func:`mean_diversity`: 1 - mean over pairs i != j of cos(x_i, x_j), per group;
- :func:`nearest_distances`: each member's cosine distance to its nearest other member;
  :func:`nearest_diversity`: the group mean of those;
- :func:`pairwise_distances`: the matrix 1 - cos(x_i, x_j) itself (for small N).

``counts`` (integer, shape ``(B,)``; for one set also a scalar) makes groups ragged: group b is
its first ``counts[b]`` rows (clamped to [0, N]; the rest are ignored, never read by the
kernels). Results are float32. A group with fewer than two members has no pairs: its diversity
and its distances are 0 (and so are matrix entries and distances outside a group's count).
Vectors are normalized as ``F.normalize`` does, x / max(||x||, eps), so a zero vector has
cosine 0 with everything: its distance to every other member is 1, never NaN. Non-contiguous
inputs are fine: the kernels read them through their strides, without a copy. Each load takes
as many elements as D, the strides and the start allow, up to 16 bytes
(``accel.kernels.pairwise_cosine.row_alignment``): rows whose width and strides are multiples
of 16 bytes read fastest, and rows strided along D, or of an odd width, one element at a time.

Each function checks its inputs, then dispatches: the Triton kernels
(``accel.kernels.pairwise_cosine``) on CUDA tensors, or on any tensors through Triton's
interpreter when ``TRITON_INTERPRET=1`` (:mod:`accel.triton_support` says which; Triton reads it
as the kernels are imported, at the first kernel call, so set it before that); otherwise the
PyTorch reference, after one warning that says why. The references are here too: the naive
N x N matrix (the seed's "before") and, for the mean, the O(N D) closed form
sum_{i != j} cos_ij = ||sum_i x̂_i||^2 - sum_i ||x̂_i||^2 (= ||sum_i x̂_i||^2 - N without zero rows).

Gradients: every function is differentiable in ``x``. The kernels have no backward, so on their
path the result is the kernel's and the gradient the reference's, recomputed from ``x`` in the
backward (the reference's forward and backward, once).

Host cost per call on CUDA: the input checks, the launch rule (cached per shape) and Triton's
own launch of one kernel for groups of up to 64 (two or three, and a few PyTorch operations, for
larger groups); the first call of a shape compiles. Measured beside the compiled closed form in
``results/`` (rows ``phase=overhead``, ``host time per call``).
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F

from accel import triton_support
from accel.errors import warn_once

EPS = 1e-12  # as F.normalize's default
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Backend = Literal["triton", "interpreter", "reference"]


# ---- input checks (on every path: the kernels take checked inputs) --------------------------


def check_embeddings(
    x: torch.Tensor, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """``x`` as ``(B, N, D)`` (a view), ``counts`` checked, and whether ``x`` was one ``(N, D)`` set.

    Raises TypeError for a wrong dtype and ValueError for a wrong shape or device.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"embeddings must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(
            f"embeddings must have shape (N, D) or (B, N, D), got {x.dim()} dimensions "
            f"{tuple(x.shape)}"
        )
    if x.dtype not in DTYPES:
        raise TypeError(f"embeddings must be float32, bfloat16 or float16, got {x.dtype}")
    if x.shape[-1] == 0:
        raise ValueError(f"embeddings need at least one feature (D >= 1), got {tuple(x.shape)}")
    single = x.dim() == 2
    x3 = x.unsqueeze(0) if single else x
    if counts is not None:
        if not isinstance(counts, torch.Tensor):
            raise TypeError(f"counts must be a tensor, got {type(counts).__name__}")
        if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
            raise TypeError(f"counts must be an integer tensor, got {counts.dtype}")
        if single and counts.dim() == 0:  # one set's count, as a scalar
            counts = counts.reshape(1)
        if counts.shape != (x3.shape[0],):
            raise ValueError(
                f"counts must have shape ({x3.shape[0]},), one per group, got {tuple(counts.shape)}"
            )
        if counts.device != x.device:
            raise ValueError(f"counts are on {counts.device}, embeddings on {x.device}")
    return x3, counts, single


def _members(counts: torch.Tensor | None, B: int, N: int, device) -> torch.Tensor:
    """Boolean (B, N): row i of group b is a member."""
    if counts is None:
        return torch.ones(B, N, dtype=torch.bool, device=device)
    return torch.arange(N, device=device) < counts.clamp(0, N)[:, None]


# ---- references: the naive N x N matrix, and the closed form for the mean ------------------


def cosine_matrix_reference(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The seed's "before": normalize, then every pair's cosine as an N x N matrix (float32)."""
    x3, counts, single = check_embeddings(x, counts)
    xn = F.normalize(x3.float(), dim=-1, eps=EPS)  # reads B N D, writes B N D
    cos = xn @ xn.transpose(-1, -2)  # writes B N N
    return cos[0] if single else cos


def _pairs(x3: torch.Tensor, counts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, N) mask of the ordered pairs i != j inside each group, and (B,) member counts."""
    B, N, _ = x3.shape
    member = _members(counts, B, N, x3.device)
    eye = torch.eye(N, dtype=torch.bool, device=x3.device)
    return member[:, :, None] & member[:, None, :] & ~eye, member.sum(-1)


def pairwise_distances_reference(
    x: torch.Tensor, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """1 - cos as an N x N matrix per group; zero outside each group's count."""
    x3, counts, single = check_embeddings(x, counts)
    dist = 1.0 - cosine_matrix_reference(x3, counts)
    member = _members(counts, *x3.shape[:2], x3.device)
    dist = dist.masked_fill(~(member[:, :, None] & member[:, None, :]), 0.0)
    return dist[0] if single else dist


def mean_diversity_reference(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """1 - mean cosine over pairs i != j, from the full N x N matrix."""
    x3, counts, single = check_embeddings(x, counts)
    cos = cosine_matrix_reference(x3, counts)
    pair, n = _pairs(x3, counts)
    mean_cos = torch.where(pair, cos, 0.0).sum((-2, -1)) / (n * (n - 1)).clamp(min=1)
    out = torch.where(n >= 2, 1.0 - mean_cos, 0.0)
    return out[0] if single else out


def mean_diversity_closed_form(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """1 - mean cosine over pairs, in O(N D): (||sum x̂||^2 - sum ||x̂||^2) / (n (n - 1))."""
    x3, counts, single = check_embeddings(x, counts)
    B, N, _ = x3.shape
    member = _members(counts, B, N, x3.device)
    xn = torch.where(member[..., None], F.normalize(x3.float(), dim=-1, eps=EPS), 0.0)
    n = member.sum(-1)
    total = xn.sum(1).square().sum(-1) - xn.square().sum((-2, -1))
    out = torch.where(n >= 2, 1.0 - total / (n * (n - 1)).clamp(min=1), 0.0)
    return out[0] if single else out


def nearest_distances_reference(
    x: torch.Tensor, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Each member's distance to its nearest other member, from the full N x N matrix."""
    x3, counts, single = check_embeddings(x, counts)
    if x3.shape[1] == 0:  # no members: nothing to reduce over
        out = torch.zeros(x3.shape[:2], device=x3.device)
    else:
        cos = cosine_matrix_reference(x3, counts)
        pair, _ = _pairs(x3, counts)
        best = cos.masked_fill(~pair, float("-inf")).amax(-1)
        out = torch.where(pair.any(-1), 1.0 - best, 0.0)
    return out[0] if single else out


def nearest_diversity_reference(
    x: torch.Tensor, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Group mean of the nearest-other distances (0 for groups of fewer than two)."""
    x3, counts, single = check_embeddings(x, counts)
    dist = nearest_distances_reference(x3, counts)
    n = _members(counts, *x3.shape[:2], x3.device).sum(-1)
    out = torch.where(n >= 2, dist.sum(-1) / n.clamp(min=1), 0.0)
    return out[0] if single else out


# ---- dispatch ------------------------------------------------------------------------------

def backend(x: torch.Tensor) -> tuple[Backend, str]:
    """Which path a call on ``x`` takes now, and why."""
    why = triton_support.unavailable(x.device)
    if why is not None:
        return "reference", why
    if triton_support.interpreting():
        return "interpreter", "TRITON_INTERPRET=1: the kernels run in Triton's interpreter"
    return "triton", "CUDA tensor: the compiled Triton kernels"


def _dispatch(x: torch.Tensor, counts: torch.Tensor | None, reference, kernel):
    """``kernel(kernel module)`` (the module's function) on ``x`` when Triton can run on it,
    else ``reference``."""
    x3, counts, single = check_embeddings(x, counts)  # bad input fails the same way on every path
    # a CUDA tensor with Triton installed is the common case: decided without building a reason
    why = None if x.is_cuda and triton_support.installed() else triton_support.unavailable(x.device)
    if why is not None:
        warn_once(
            f"diversity: {why}",
            f"accel.diversity: using the PyTorch reference, not the Triton kernel: {why}",
            RuntimeWarning,
            stacklevel=3,
        )
        return reference(x, counts)
    run = partial(_kernel, x3, counts, kernel, single)
    if x.requires_grad and torch.is_grad_enabled():
        return _ReferenceBackward.apply(x, counts, reference, run)
    return run()


def _kernel(x3: torch.Tensor, counts: torch.Tensor | None, kernel, single: bool):
    """The kernel on checked ``(B, N, D)`` inputs; one set's result as one set's."""
    if counts is not None:  # the kernels read counts[b] at counts_ptr + b
        counts = counts.contiguous()
    from accel.kernels import pairwise_cosine  # Triton: imported only when a kernel runs

    out = kernel(pairwise_cosine)(x3, counts, eps=EPS)
    return out[0] if single else out


class _ReferenceBackward(torch.autograd.Function):
    """The kernel's result forward; backward, the reference's gradient, recomputed from the
    saved input (the kernels have no backward of their own)."""

    @staticmethod
    def forward(ctx, x, counts, reference, kernel):
        ctx.save_for_backward(x, counts)
        ctx.reference = reference
        return kernel()

    @staticmethod
    def backward(ctx, grad):
        x, counts = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (grad_x,) = torch.autograd.grad(ctx.reference(x, counts), x, grad)
        return grad_x, None, None, None


def mean_diversity(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """1 - mean cosine over pairs i != j of each group: ``(B,)``, or ``()`` for one set.
    ``x``: (B, N, D), or (N, D); ``counts`` (B,), optional: group b is its first ``counts[b]``
    rows, the rest are not read (a group of fewer than 2 gives 0)."""
    return _dispatch(x, counts, mean_diversity_reference, lambda kernels: kernels.mean_diversity)


def nearest_distances(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Each member's cosine distance to its nearest other member: ``(B, N)``, or ``(N,)``."""
    return _dispatch(
        x, counts, nearest_distances_reference, lambda kernels: kernels.nearest_distances
    )


def nearest_diversity(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Group mean of :func:`nearest_distances`: ``(B,)``, or ``()`` for one set."""
    return _dispatch(
        x, counts, nearest_diversity_reference, lambda kernels: kernels.nearest_diversity
    )


def pairwise_distances(x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The matrix 1 - cos(x_i, x_j): ``(B, N, N)``, or ``(N, N)``; for small N.

    The diagonal is 1 - ||x̂_i||^2: 0 up to rounding, 1 for a zero vector.
    """
    return _dispatch(
        x, counts, pairwise_distances_reference, lambda kernels: kernels.pairwise_distances
    )


__all__ = [
    "EPS",
    "backend",
    "check_embeddings",
    "cosine_matrix_reference",
    "mean_diversity",
    "mean_diversity_closed_form",
    "mean_diversity_reference",
    "nearest_distances",
    "nearest_distances_reference",
    "nearest_diversity",
    "nearest_diversity_reference",
    "pairwise_distances",
    "pairwise_distances_reference",
]
