"""Gradient clipping one tensor at a time (``for p in params: clip_grad_norm_([p], max_norm)``),
done for all of them at once in the doctor's copy of a step: inside :func:`batched_clipping`, a
single-tensor clip records its gradient and returns a 0-d tensor that will hold its norm; the
recorded clips run together (one foreach norm, one foreach multiply) before the next
``optimizer.step()``, at the end, or when a returned norm is used (read, logged, summed) first.
A clip of several tensors, or one that raises on a non-finite norm, runs at once as written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.nn.utils import clip_grad
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

__all__ = ["CLIP_EPS", "batched_clipping"]

CLIP_EPS = 1e-6  # clip_grad_norm_'s own, added to the norm before dividing


@dataclass
class _Pending:
    grads: list[torch.Tensor] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)  # what each call returned
    max_norms: list[float] = field(default_factory=list)
    norm_type: float = 2.0

    def flush(self) -> None:
        if not self.grads:
            return
        norms = torch._foreach_norm(self.grads, self.norm_type)
        with torch._C.DisableTorchFunctionSubclass():  # the norms are _PendingNorm
            torch._foreach_copy_(self.norms, norms)
        coefs = _limits(self.max_norms, self.grads[0].device) / (torch.stack(norms).float() + CLIP_EPS)
        coefs = coefs.clamp(max=1.0)
        scales = [c.to(g.dtype) for c, g in zip(coefs.unbind(), self.grads, strict=True)]
        torch._foreach_mul_(self.grads, scales)
        self.grads, self.norms, self.max_norms = [], [], []


class _PendingNorm(torch.Tensor):
    """A recorded clip's norm: any use of it runs the clips recorded so far first."""

    flush: Callable[[], None]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, _PendingNorm):
                t.flush()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _limits(max_norms: list[float], device: torch.device) -> float | torch.Tensor:
    """The clips' limits without a wait for the device: one number where they agree (the usual
    loop), else copied in without blocking (``torch.tensor(..., device=...)`` waits for the
    stream)."""
    if len(set(max_norms)) == 1:
        return max_norms[0]
    return torch.tensor(max_norms, dtype=torch.float32).to(device, non_blocking=True)


@contextlib.contextmanager
def batched_clipping() -> Iterator[None]:
    """While inside, single-tensor ``clip_grad_norm_`` calls are recorded and run together."""
    total_norm, clip_with_norm = clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_
    pending: dict[tuple, _Pending] = {}
    placeholders: dict[int, tuple[tuple, torch.Tensor]] = {}

    def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if len(grads) != 1 or error_if_nonfinite or torch.compiler.is_compiling():
            return total_norm(grads, norm_type, error_if_nonfinite, foreach)
        grad = grads[0]
        key = (grad.device, float(norm_type))
        out = torch.empty((), device=grad.device, dtype=grad.dtype).as_subclass(_PendingNorm)
        out.flush = flush
        placeholders[id(out)] = (key, grad)
        return out

    def clip_grads_with_norm(parameters, max_norm, total, foreach=None):
        known = placeholders.pop(id(total), None)
        if known is None:
            return clip_with_norm(parameters, max_norm, total, foreach)
        key, grad = known
        batch = pending.setdefault(key, _Pending(norm_type=key[1]))
        batch.grads.append(grad)
        batch.norms.append(total)
        batch.max_norms.append(float(max_norm))
        return None

    def flush(*_: object) -> None:
        for batch in pending.values():
            batch.flush()

    clip_grad._get_total_norm = get_total_norm
    clip_grad._clip_grads_with_norm_ = clip_grads_with_norm
    hook = register_optimizer_step_pre_hook(lambda *a: flush())
    try:
        yield
        flush()
    finally:
        hook.remove()
        clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_ = total_norm, clip_with_norm
