"""An iterator of the user's that cannot be copied (a generator, a data loader's), as the copied
step reads it: a data source gives one item, again on every call; any other (a count, a
schedule) is read through. Either way what was taken is counted for the report."""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch

from accel.doctor.isolation import record
from accel.doctor.reach import is_array

__all__ = ["Drawn"]


class Drawn:
    """``iterator`` as the copies read it. The first item any copy takes decides: one that holds
    a tensor or array is a batch, kept and given again on every later call, so a data source
    loses one item however often the step runs (a finite one does not run out) and the time
    leaves out its loading; any other item (a step count) is one of a sequence the step's code
    may depend on, so later items are taken from the user's iterator as the step asks."""

    _first: ClassVar[weakref.WeakKeyDictionary[Any, list[Any]]] = weakref.WeakKeyDictionary()

    def __init__(self, iterator: Any, where: str):
        self._iterator, self._where = iterator, where
        self._said = f"{where} (a {type(iterator).__name__}, which cannot be copied)"
        self._own_first: list[Any] = []
        self._taken = 0

    def __iter__(self) -> Drawn:
        return self

    def __next__(self) -> Any:
        first = self._first_item()
        if first and _holds_data(first[0]):
            return first[0]
        item = first.pop() if first else self._take()
        record(f"took items from {self._said}")
        return item

    def _first_item(self) -> list[Any]:
        """The shared first item (one list per user iterator), taken now if no copy has."""
        try:
            first = Drawn._first.setdefault(self._iterator, [])
        except TypeError:  # not weakly referable: one first item per copy
            first = self._own_first
        if not first and not self._taken:
            first.append(self._take())
            if _holds_data(first[0]):
                record(f"took 1 item from {self._said} and gave the step that item on every "
                       "call, so the time leaves out its loading")  # fmt: skip
        return first

    def _take(self) -> Any:
        try:
            item = next(self._iterator)
        except StopIteration:
            raise StopIteration(f"{self._said} ran out after a copy of the doctor's took "
                                f"{self._taken} items from it") from None  # fmt: skip
        self._taken += 1
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


def _holds_data(item: Any) -> bool:
    """A batch: a tensor or array, or a tuple, list or dict holding one."""
    if isinstance(item, torch.Tensor) or is_array(item):
        return True
    if isinstance(item, dict):
        item = list(item.values())
    return isinstance(item, (tuple, list)) and any(_holds_data(x) for x in item)
