"""``.item()`` of a CUDA tensor read later (notebook 01's change, applied to the doctor's copy of
a step): inside :func:`deferred_item_reads` it returns a :class:`DeferredScalar`, copied to pinned
memory without waiting, which behaves as the number and waits only when something asks for its
value. A step that logs its loss no longer syncs; one whose Python branches on it still does.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
from collections.abc import Iterator

import torch

__all__ = ["DeferredScalar", "deferred_item_reads"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep  # a compiler reading a number needs it now


class DeferredScalar:
    """The value of a one-element CUDA tensor, copied to the host without waiting for it."""

    __slots__ = ("_event", "_host", "_value")

    def __init__(self, tensor: torch.Tensor):
        self._host = torch.empty((), dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor.detach().reshape(()), non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        self._value = None

    def value(self) -> float | int | bool:
        """The number (waits for the copy the first time)."""
        if self._value is None:
            self._event.synchronize()  # sync: here, where the value is used
            self._value = self._host.item()
        return self._value


def _unary(fn):
    def method(self: DeferredScalar, *args):  # round(x, digits), format(x, spec)
        return fn(self.value(), *args)

    return method


def _binary(op, reflected: bool = False):
    def method(self: DeferredScalar, other):
        other = other.value() if isinstance(other, DeferredScalar) else other
        return op(other, self.value()) if reflected else op(self.value(), other)

    return method


for _name, _op in {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
}.items():  # fmt: skip
    setattr(DeferredScalar, f"__{_name}__", _binary(_op))
    setattr(DeferredScalar, f"__r{_name}__", _binary(_op, reflected=True))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(DeferredScalar, f"__{_name}__", _binary(getattr(operator, _name)))
for _name, _fn in {
    "float": float, "int": int, "index": operator.index, "bool": bool, "hash": hash,
    "round": round, "format": format, "repr": repr, "str": repr, "neg": operator.neg, "abs": abs,
}.items():  # fmt: skip
    setattr(DeferredScalar, f"__{_name}__", _unary(_fn))


@contextlib.contextmanager
def deferred_item_reads(deferred: list[None] | None = None) -> Iterator[None]:
    """While inside, ``.item()`` of a one-element CUDA tensor called from the user's code returns
    a :class:`DeferredScalar` (torch's own calls, a CUDA graph capture and torch.compile's tracing
    keep the number); each one deferred is counted in ``deferred``."""
    original = torch.Tensor.item

    def item(self: torch.Tensor):
        if (
            not sys._getframe(1).f_code.co_filename.startswith(_TORCH_DIR)  # torch's own reads
            and self.is_cuda
            and self.numel() == 1
            and not torch.cuda.is_current_stream_capturing()
            and not torch.compiler.is_compiling()
        ):
            if deferred is not None:
                deferred.append(None)
            return DeferredScalar(self)
        return original(self)

    torch.Tensor.item = item
    try:
        yield
    finally:
        torch.Tensor.item = original
