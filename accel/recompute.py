"""Activation checkpointing: recompute the named blocks' activations in backward instead of
storing them, all of a block's or all but the costly ones (selective). Re-exported by
:mod:`accel.memory`, which measures what it saves.
"""

from __future__ import annotations

import difflib
import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from accel.errors import checked_instance, collection_of


class CheckpointedBlocks:
    """Handle returned by :func:`checkpoint_blocks`; :meth:`remove` restores the blocks."""

    def __init__(self, model: nn.Module, names: list[str]):
        self.model, self.names = model, names

    def remove(self) -> None:
        for name in self.names:
            module = self.model.get_submodule(name)
            if "forward" in vars(module):
                del module.forward  # back to the class's forward
        self.names = []

    def __enter__(self) -> CheckpointedBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"CheckpointedBlocks({self.names})"


def _selective_save_ops() -> frozenset:
    """ATen ops whose outputs selective checkpointing keeps: matrix products and fused
    attention (costly to recompute). Ops this torch lacks are left out."""
    attention = (
        "efficient_attention",
        "flash_attention",
        "flash_attention_for_cpu",
        "cudnn_attention",
    )
    names = ["mm", "addmm", "bmm", *(f"_scaled_dot_product_{kind}" for kind in attention)]
    aten = torch.ops.aten
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def save_ops_policy(save_ops: Iterable[Any]) -> Callable[[], Any]:
    """A ``context_fn`` for ``torch.utils.checkpoint``: outputs of ``save_ops`` (ATen
    overloads, e.g. ``torch.ops.aten.mm.default``) are stored, every other op is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = frozenset(collection_of(save_ops, "ATen ops", strings=False))

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


SELECTIVE_SAVE = _selective_save_ops()


def checkpoint_blocks(
    model: nn.Module, names: Iterable[str], *, save_ops: Iterable[Any] | None = None
) -> CheckpointedBlocks:
    """Recompute the activations of the named submodules in backward instead of storing them.

    Each named block keeps only its inputs during forward (``torch.utils.checkpoint``,
    ``use_reentrant=False``) and runs its forward again in backward: one more forward of the
    block for most of its activations. ``save_ops`` makes it selective: the outputs of those
    ATen ops are stored (``SELECTIVE_SAVE``: matrix products and attention), the rest recomputed.

    ``names`` are paths as in ``model.named_modules()`` (``"blocks.3"``); an unknown or already
    checkpointed name raises ValueError. Returns a handle whose ``remove()`` (or ``with``-exit)
    undoes it.
    """
    checked_instance(model, nn.Module, "checkpoint_blocks: model", "torch.nn.Module")
    names = list(dict.fromkeys(collection_of(names, "submodule names", strings=False)))
    known = dict(model.named_modules())
    for name in names:
        if not isinstance(name, str) or name not in known or name == "":
            close = difflib.get_close_matches(str(name), [k for k in known if k], n=5)
            hint = f"; close: {close}" if close else ""
            blocks = [k for k in known if k and "." not in k]
            raise ValueError(
                f"checkpoint_blocks: {model.__class__.__name__} has no submodule {name!r}{hint} "
                f"(top-level modules: {blocks[:8]})"
            )
        if "forward" in vars(known[name]):
            raise ValueError(
                f"checkpoint_blocks: {name!r} is already checkpointed (or its forward was replaced)"
            )
    context = {} if save_ops is None else {"context_fn": save_ops_policy(save_ops)}
    for name in names:
        module = known[name]
        module.forward = _checkpointed(module, context)
    return CheckpointedBlocks(model, names)


def _checkpointed(module: nn.Module, context: dict[str, Any]) -> Callable[..., Any]:
    """The class's forward, checkpointed, bound to ``module`` as a method: a deep copy of the
    model binds it to the copied module (a closure over the bound forward would run the
    original's weights)."""
    forward = type(module).forward

    def run(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(self, *args, **kwargs)
        return checkpoint(forward, self, *args, use_reentrant=False, **context, **kwargs)

    run.__wrapped__ = forward  # type: ignore[attr-defined]
    return types.MethodType(run, module)
