"""Gradient accumulation: one batch's gradients from k micro-batches, each forward and backward
holding only one micro-batch's activations.

    micro = accumulate.split_batch(batch, 8)
    loss = accumulate.accumulate(loss_fn, micro, model=model)  # the gradients are in .grad
    optimizer.step()
    optimizer.zero_grad()

The reference is :func:`large_batch`: the same ``loss_fn`` on the whole batch, one backward; the
two agree wherever ``loss_fn`` is a mean over independent samples (not with BatchNorm in
training mode). Micro-batch ``i`` of ``n_i`` samples out of ``N`` has its mean loss scaled by
``n_i / N`` (``counts`` gives token counts instead, as ints or device tensors;
``reduction="sum"`` divides summed losses by the total count). Under DDP the gradients'
all-reduce runs only on the last micro-batch (the others inside ``model.no_sync()``); an FSDP2
module gets ``set_requires_gradient_sync(False)`` on all but the last. Nothing is read on the
host, so a step that calls it can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections import UserDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from accel.errors import checked_callable, checked_count, checked_instance

REDUCTIONS = ("mean", "sum")
# the lazy variants subclass these
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class BatchStatisticsWarning(UserWarning):
    """A model normalizes by batch statistics, so micro-batches cannot give the large batch's
    gradients."""


def split_batch(batch: Any, micro_batches: int, *, uneven: bool = False) -> list[Any]:
    """``batch`` (a tensor, or a tuple, list or dict of tensors sharing their first dimension)
    as ``micro_batches`` views along the first dimension. A batch ``micro_batches`` does not
    divide is refused unless ``uneven=True`` (sizes differing by at most one)."""
    k = checked_count(micro_batches, "split_batch(micro_batches)", at_least=1)
    size = batch_size(batch)
    if k > size:
        raise ValueError(
            f"split_batch: micro_batches={k} is more than the batch's {size} samples; "
            f"expected at most {size}"
        )
    if size % k and not uneven:
        raise ValueError(
            f"split_batch: a batch of {size} samples does not split into {k} equal "
            f"micro-batches; pick micro_batches among {_divisors(size)}, or pass uneven=True "
            "(sizes differing by one, each weighted by its size)"
        )
    return [_index(batch, part) for part in _ranges(size, k)]


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first dimension its tensors share (an error if they differ)."""
    tensors = _tensors(batch)
    if not tensors:
        raise TypeError(
            "expected a batch: a tensor, or a tuple, list or dict of tensors; got "
            f"{type(batch).__name__} without a tensor"
        )
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if None in sizes or len(sizes) > 1:
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(
            f"a batch's tensors must share their first (sample) dimension, got shapes {shapes}"
        )
    return sizes.pop()


def _tensors(batch: Any) -> list[torch.Tensor]:
    # any Mapping, not only dict (a tokenizer's BatchEncoding), which pytree would take as a leaf
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in _tensors(v)]
    return []


def _index(batch: Any, part: slice) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[part]
    if isinstance(batch, Mapping):
        return _like(batch, {k: _index(v, part) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple: fields by position
        return type(batch)(*(_index(v, part) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_index(v, part) for v in batch)
    return batch  # a constant travels with every micro-batch


def _like(batch: Mapping, items: dict) -> Mapping:
    """``items`` in ``batch``'s own type where a shallow copy owns its items (a dict subclass, a
    UserDict such as a tokenizer's BatchEncoding), so ``batch.input_ids`` still reads; else a
    dict. ``batch`` itself is left as it was."""
    if not isinstance(batch, (dict, UserDict)):
        return items
    out = copy.copy(batch)
    out.update(items)
    return out


def _ranges(size: int, k: int) -> list[slice]:
    base, extra = divmod(size, k)
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def accumulate(
    loss_fn: Callable[[Any], torch.Tensor],
    micro_batches: Sequence[Any],
    *,
    model: nn.Module | None = None,
    counts: Sequence[int | torch.Tensor] | None = None,
    reduction: Literal["mean", "sum"] = "mean",
) -> torch.Tensor:
    """Forward and backward of ``loss_fn`` on each micro-batch in turn, each loss scaled so that
    the gradients added into ``.grad`` are the whole batch's; returns the whole batch's loss,
    detached, on the device.

    ``loss_fn(micro_batch)`` returns a 0-dim loss: the mean over its micro-batch (scaled by
    ``counts[i] / sum(counts)``), or with ``reduction="sum"`` the sum (scaled by
    ``1 / sum(counts)``). ``counts`` default to the micro-batches' sizes. ``model``, the module
    ``loss_fn`` runs, is needed under DDP or FSDP2 and to be warned of BatchNorm."""
    checked_callable(loss_fn, "accumulate(loss_fn)")
    micro = _checked_micro_batches(micro_batches)
    if reduction not in REDUCTIONS:
        raise ValueError(f"accumulate: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if model is not None:
        checked_instance(model, nn.Module, "accumulate(model)", "torch.nn.Module")
        if len(micro) > 1:
            _warn_batch_statistics(model)
    scales = _scales(micro, counts, reduction)
    total = None
    for i, (batch, scale) in enumerate(zip(micro, scales, strict=True)):
        with _gradient_sync(model, last=i == len(micro) - 1):
            loss = _checked_loss(loss_fn(batch), i, len(micro))
            (loss * scale).backward()
        part = loss.detach() * scale
        total = part if total is None else total + part
    return total


def large_batch(loss_fn: Callable[[Any], torch.Tensor], batch: Any) -> torch.Tensor:
    """The reference: ``loss_fn`` on the whole batch, one backward; the loss, detached."""
    loss = _checked_loss(checked_callable(loss_fn, "large_batch(loss_fn)")(batch), None)
    loss.backward()
    return loss.detach()


def _checked_micro_batches(micro_batches: Sequence[Any]) -> list[Any]:
    if isinstance(micro_batches, torch.Tensor) or not isinstance(micro_batches, (list, tuple)):
        raise TypeError(
            "accumulate(micro_batches) must be a list or tuple of micro-batches (from "
            f"split_batch(batch, k)), got {type(micro_batches).__name__}"
        )
    if not micro_batches:
        raise ValueError("accumulate(micro_batches) is empty; expected at least one micro-batch")
    return list(micro_batches)


def _scales(
    micro: list[Any], counts: Sequence[int | torch.Tensor] | None, reduction: str
) -> list[float | torch.Tensor]:
    """Each micro-batch's loss scale: Python floats from Python counts, device tensors from
    device counts (computed there: no host read)."""
    if counts is None:
        counts = [batch_size(b) for b in micro]
    counts = list(counts)
    if len(counts) != len(micro):
        raise ValueError(
            f"accumulate: {len(counts)} counts for {len(micro)} micro-batches; expected one "
            "count per micro-batch"
        )
    if all(isinstance(c, torch.Tensor) for c in counts):
        weights = torch.stack([c.float() for c in counts])
        total = weights.sum()
        scaled = weights / total if reduction == "mean" else (1 / total).expand(len(micro))
        return list(scaled.unbind())
    ints = [checked_count(c, f"accumulate(counts[{i}])", at_least=0) for i, c in enumerate(counts)]
    total = sum(ints)
    if total == 0:
        raise ValueError("accumulate: counts sum to 0; expected at least one counted sample")
    return [c / total if reduction == "mean" else 1 / total for c in ints]


def _checked_loss(loss: Any, index: int | None, of: int = 1) -> torch.Tensor:
    where = "loss_fn" if index is None else f"loss_fn(micro_batches[{index}])"
    # the micro-batches before this one have added their share to .grad already
    held = f"; .grad holds micro-batches 0-{index - 1} of {of}" if index else ""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"{where} must return a 0-dim loss tensor, got {shape}{held}")
    if not loss.requires_grad:
        raise ValueError(
            f"{where} returned a loss that does not require grad (computed under no_grad, or "
            f"from parameters with requires_grad=False); expected one backward can run through{held}"
        )
    return loss


def _gradient_sync(model: nn.Module | None, *, last: bool) -> contextlib.AbstractContextManager:
    """DDP: ``no_sync()`` except on the last micro-batch. FSDP2: the sync switched off except
    on the last (where it is switched back on, its default)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if last else model.no_sync()
    if model is not None and hasattr(model, "set_requires_gradient_sync"):  # FSDPModule
        model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def _warn_batch_statistics(model: nn.Module) -> None:
    norms = [name for name, m in model.named_modules() if isinstance(m, BATCH_NORMS) and m.training]
    if norms:
        warnings.warn(
            f"accumulate: {len(norms)} BatchNorm layer(s) in training mode ({norms[0]}, ...) "
            "normalize each micro-batch by its own mean and variance, so the gradients are not "
            "the large batch's, and their running statistics are updated once per micro-batch; "
            "for the large batch's update use a norm without batch statistics (LayerNorm, "
            "GroupNorm), or keep BatchNorm and accept micro-batch statistics",
            BatchStatisticsWarning,
            stacklevel=3,
        )
