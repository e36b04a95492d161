"""An iterator of the user's as the copied step reads it. One that can be copied (a list's, a
count) is read from copies, and a source of batches starts again from a fresh copy when one runs
out; so is a generator made again from its function and arguments (not yet started, or, as a
source of batches, started by code that never assigns its arguments). A generator expression of
one loop is made again over the copies' reading of its own iterator. One that cannot be copied
(another generator started, a data loader's): a source of batches gives one item, again on every
call; any other (a count, a schedule) is read through, and what was taken is counted for the
report. Either way one that runs out on the copies is named."""

from __future__ import annotations

import ast
import copy
import dis
import functools
import itertools
import re
import types
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from accel.doctor.isolation import record
from accel.doctor.reach import is_array

__all__ = ["Copied", "Drawn", "Reading", "loop_source", "serve_batch"]


def serve_batch(iterator: Any, batch: Any) -> None:
    """Give the copies of ``iterator`` ``batch`` on every call, so that none is taken from it (a
    batch of the loader it came from, drawn from a copy of that loader)."""
    kept = _shared_batch(iterator)  # None: not weakly referable, its copies take from it
    if kept is not None and not kept:
        kept.append(batch)


def loop_source(iterator: Any) -> Any | None:
    """The iterator that ``iterator`` reads where it is a generator expression of one loop (its
    state between two items is where that iterator is, so it can be made again over a copy of
    it); None for any other."""
    frame = iterator.gi_frame if isinstance(iterator, types.GeneratorType) else None
    if frame is None or iterator.gi_running or iterator.gi_code.co_name != "<genexpr>":
        return None
    code, names = iterator.gi_code, frame.f_locals
    loops = sum(i.opname == "FOR_ITER" for i in dis.get_instructions(code))
    if loops != 1 or not all(name in names for name in code.co_freevars):
        return None
    return names.get(".0")


class Reading:
    """A generator expression (one :func:`loop_source` reads) made again over ``source``, the
    copies' reading of its iterator; where it ends as that ran out, what ran out is said."""

    ran_out = ""

    def __init__(self, generator: Any, source: Any, globals_: dict[str, Any]):
        code, names = generator.gi_code, generator.gi_frame.f_locals
        cells = tuple(types.CellType(names[name]) for name in code.co_freevars)
        self._made = types.FunctionType(code, globals_, closure=cells or None)(source)
        self._source = source

    def __iter__(self) -> Reading:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._made)
        except StopIteration:  # the generator's loop ends quietly where its source ran out
            self.ran_out = getattr(self._source, "ran_out", "")
            raise StopIteration(self.ran_out) from None

    def __getattr__(self, name: str) -> Any:  # send, close: the copy's generator
        return getattr(self._made, name)


def _shared_batch(iterator: Any) -> list[Any] | None:
    """The one list every copy of ``iterator`` keeps its batch in; None where it cannot be a key."""
    try:
        return Drawn._batches.setdefault(iterator, [])
    except TypeError:
        return None


class Drawn:
    """``iterator`` as the copies read it. An item that holds a tensor or array is a batch: the
    first one any copy takes is kept and given again on every later call, so a data source
    loses one item however often the step runs (a finite one does not run out) and the time
    leaves out its loading. Any other item (a step count) is one of a sequence the step's code
    may depend on, so items are taken from the user's iterator as the step asks."""

    _batches: ClassVar[weakref.WeakKeyDictionary[Any, list[Any]]] = weakref.WeakKeyDictionary()

    def __init__(self, iterator: Any, where: str):
        self._iterator = iterator
        self._said = f"{where} (a {type(iterator).__name__}, which cannot be copied)"
        shared = _shared_batch(iterator)  # not weakly referable: one batch per copy
        self._kept = shared if shared is not None else []
        self._taken = 0

    def __iter__(self) -> Drawn:
        return self

    def __next__(self) -> Any:
        if self._kept:
            return self._kept[0]
        item = self._take()
        if _holds_data(item):
            self._kept.append(item)
            record(f"took 1 item from {self._said} and gave the step that item on every "
                   "call, so the time leaves out its loading")  # fmt: skip
        else:
            record(f"took items from {self._said}")
        return item

    def _take(self) -> Any:
        try:
            item = next(self._iterator)
        except StopIteration:
            self.ran_out = _ran_out(self._said, self._taken)
            if not self._taken:  # a step that goes on starts its own pass on every copy
                record(f"found {self._said} at its end, and a step that goes on past it starts "
                       "a new pass on each of the doctor's copies, its loading (a loader's "
                       "workers started again) in the time: give the loader as loader=, whose "
                       "batch the copies then get")  # fmt: skip
            raise StopIteration(self.ran_out) from None
        self._taken += 1
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


def _ran_out(said: str, taken: int) -> str:
    if not taken:
        return f"{said} is empty: it ran out on the step's first call"
    return f"{said} ran out after a copy of the doctor's took {taken} items from it"


def _holds_data(item: Any) -> bool:
    """A batch: a tensor or array, or a tuple, list or dict holding one."""
    if isinstance(item, torch.Tensor) or is_array(item):
        return True
    if isinstance(item, dict):
        item = list(item.values())
    return isinstance(item, (tuple, list)) and any(_holds_data(x) for x in item)


class Copied:
    """``iterator`` (one a copy makes independent, or a generator that ``made_again`` makes anew)
    read from copies: the user's is never advanced. A source of batches that runs out starts
    again from a fresh copy. A generator already started is made again from its start only as a
    source of batches: where its first item is not one (a step count, a schedule), the step's code
    may depend on its place, and it is read as :class:`Drawn` reads it."""

    def __init__(self, iterator: Any, where: str, made_again: Callable[[], Any] | None = None,
                 *, started: bool = False):  # fmt: skip
        self._iterator, self._where = iterator, where
        self._said = f"{where} (a {type(iterator).__name__})"
        self._again = made_again or functools.partial(_copied, iterator)
        self._copy, self._taken, self._batches = self._again(), 0, False
        self._started, self._drawn = started, None

    def __iter__(self) -> Copied:
        return self

    def __next__(self) -> Any:
        if self._drawn is not None:
            return next(self._drawn)
        try:
            item = next(self._copy)
        except StopIteration:
            if self._started and not self._taken:
                return self._read_through()
            if not self._batches:
                self.ran_out = _ran_out(self._said, self._taken)
                raise StopIteration(self.ran_out) from None
            self._copy = self._again()
            item = next(self._copy)
        if self._started and not self._taken and not _holds_data(item):
            return self._read_through()
        self._taken += 1
        self._batches = self._batches or _holds_data(item)
        return item

    def _read_through(self) -> Any:
        self._drawn = Drawn(self._iterator, self._where)
        return next(self._drawn)

    def __getattr__(self, name: str) -> Any:  # ran_out, read where the copies' code ends
        if name == "ran_out" and self.__dict__.get("_drawn") is not None:
            return self._drawn.ran_out
        raise AttributeError(name)


def _copied(iterator: Any) -> Any:
    """An independent copy of a built-in iterator; a count rebuilt from what it shows, as Python
    3.14 no longer copies one."""
    if isinstance(iterator, itertools.count):
        start, *step = ast.literal_eval(re.fullmatch(r"count\((.*)\)", repr(iterator))[1] + ",")
        return itertools.count(start, *step)
    return copy.copy(iterator)
