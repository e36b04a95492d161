"""Activation checkpointing: recompute the named blocks' activations in backward instead of
storing them, all of a block's or all but the costly ones (selective). Re-exported by
:mod:`accel.memory`, which measures what it saves.
"""

from __future__ import annotations

import difflib
import functools
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
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    policy = _SavePolicy(frozenset(collection_of(save_ops, "ATen ops", strings=False)))
    return functools.partial(create_selective_checkpoint_contexts, policy)


class _SavePolicy:
    """Which ops' outputs selective checkpointing stores; pickled by the ops' names (an ATen
    overload itself cannot be), so a checkpointed model can be saved whole."""

    def __init__(self, ops: frozenset):
        self.ops = ops

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        return CheckpointPolicy.MUST_SAVE if op in self.ops else CheckpointPolicy.PREFER_RECOMPUTE

    def __reduce__(self) -> tuple:
        return _policy_of, (tuple(str(op) for op in self.ops),)


def _policy_of(names: tuple[str, ...]) -> _SavePolicy:
    """The policy of ops named as ``str(torch.ops.aten.mm.default)`` names them."""
    return _SavePolicy(frozenset(functools.reduce(getattr, n.split("."), torch.ops) for n in names))


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
        module.forward = _Checkpointed(module, context)
    return CheckpointedBlocks(model, names)


class _Checkpointed:
    """A module's own forward, checkpointed: an object, not a closure, so that a deep copy of
    the model runs the copy's weights and a pickled model (``torch.save(model)``) loads."""

    def __init__(self, module: nn.Module, context: dict[str, Any]):
        self.module, self.context = module, context

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward
        if not torch.is_grad_enabled():
            return forward(self.module, *args, **kwargs)
        return checkpoint(
            forward, self.module, *args, use_reentrant=False, **self.context, **kwargs
        )
