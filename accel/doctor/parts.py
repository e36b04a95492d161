"""What a user's training step is made of, and a copy of the step that trains copies of it.

A step is any callable: a function that reads ``model`` and ``opt`` from its closure or its
module's globals, a bound method of a trainer object, a ``functools.partial``, or an object with
``__call__``. :func:`find_parts` looks where the step's code looks (closure cells, the global
names its code uses, the attributes of ``self``, one level into containers and same-module helper
functions) and collects the modules, optimizers, schedulers and gradient scalers it finds.

:func:`copy_step` deep-copies those parts together (one memo, so each copied optimizer holds the
copied model's parameters) and rebuilds the step around the copies: a new function object with the
same code, its closure and globals pointing at the copies. The user's objects are never trained:
:class:`Untouched` records every tensor's version counter and says which one changed.
"""

from __future__ import annotations

import copy
import dis
import functools
import inspect
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["StepParts", "Untouched", "copy_step", "find_parts"]

_HELPER_DEPTH = 2  # same-module functions called by the step, and the ones they call


def _is_part(value: Any) -> bool:
    from torch.optim.lr_scheduler import LRScheduler

    scaler = getattr(torch.amp, "GradScaler", None)
    kinds = (nn.Module, torch.optim.Optimizer, LRScheduler) + ((scaler,) if scaler else ())
    return isinstance(value, kinds)


@dataclass
class StepParts:
    """The parts found, each with where the step's code reaches it (``"closure 'model'"``)."""

    models: list[nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    others: list[Any] = field(default_factory=list)  # schedulers, gradient scalers
    where: dict[int, str] = field(default_factory=dict)

    def add(self, value: Any, where: str) -> None:
        if id(value) in self.where:
            return
        if isinstance(value, nn.Module):
            if any(value is m or _contains(m, value) for m in self.models):
                return
            self.models[:] = [m for m in self.models if not _contains(value, m)]
            self.models.append(value)
        elif isinstance(value, torch.optim.Optimizer):
            self.optimizers.append(value)
        else:
            self.others.append(value)
        self.where[id(value)] = where

    @property
    def all(self) -> list[Any]:
        return [*self.models, *self.optimizers, *self.others]

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for m in self.models:
            seen.update((id(p), p) for p in m.parameters())
        for opt in self.optimizers:
            for group in opt.param_groups:
                seen.update((id(p), p) for p in group["params"])
        return list(seen.values())

    def describe(self) -> str:
        """One line: what was found and where, for the report."""
        if not self.all:
            return "no model or optimizer found in the step's closure, globals or self"
        return "; ".join(f"{type(v).__name__} ({self.where[id(v)]})" for v in self.all)


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


# ---- finding -------------------------------------------------------------------------------------
def find_parts(step: Callable[..., Any]) -> StepParts:
    """The modules, optimizers, schedulers and scalers ``step`` reaches (see the module doc)."""
    parts = StepParts()
    for name, value in _references(step, _HELPER_DEPTH):
        _collect(parts, value, name)
    return parts


def _collect(parts: StepParts, value: Any, where: str) -> None:
    if _is_part(value):
        parts.add(value, where)
    elif _holds_parts(value):  # an EMA helper, a trainer: copied with what it holds
        parts.add(value, where)
        for attr, item in vars(value).items():
            if _is_part(item):
                parts.add(item, f"{where}.{attr}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value[:64]):
            if _is_part(item):
                parts.add(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in list(value.items())[:64]:
            if _is_part(item):
                parts.add(item, f"{where}[{key!r}]")


def _holds_parts(value: Any) -> bool:
    """An instance (not a class, function or module) with a part among its attributes."""
    if isinstance(value, (type, types.FunctionType, types.ModuleType, types.MethodType)):
        return False
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict):
        return False
    return any(
        _is_part(v) or (isinstance(v, (list, tuple)) and any(_is_part(i) for i in v[:64]))
        for v in attributes.values()
    )


def _references(step: Any, depth: int) -> Iterator[tuple[str, Any]]:
    """(where, value) of everything the step's code can reach by name."""
    if isinstance(step, functools.partial):
        yield from ((f"partial argument {i}", a) for i, a in enumerate(step.args))
        yield from ((f"partial argument {k!r}", a) for k, a in step.keywords.items())
        yield from _references(step.func, depth)
        return
    if isinstance(step, types.MethodType):
        yield from _attributes(step.__self__, "self")
        yield from _references(step.__func__, depth)
        return
    if isinstance(step, types.FunctionType):
        yield from _function_references(step, depth)
        return
    if callable(step):  # an object with __call__ (an nn.Module included)
        if _is_part(step):
            yield ("the step itself", step)
        yield from _attributes(step, "self")
        method = "forward" if isinstance(step, nn.Module) else "__call__"
        call = inspect.getattr_static(type(step), method, None)
        if isinstance(call, types.FunctionType):
            yield from _function_references(call, depth)


def _attributes(obj: Any, name: str) -> Iterator[tuple[str, Any]]:
    for attr, value in getattr(obj, "__dict__", {}).items():
        yield (f"{name}.{attr}", value)


def _function_references(fn: types.FunctionType, depth: int) -> Iterator[tuple[str, Any]]:
    cells = zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True)
    for name, cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield (f"closure '{name}'", value)
        if depth > 0 and _same_module_function(value, fn):  # a helper defined beside the step
            yield from _function_references(value, depth - 1)
    for name in _global_names(fn.__code__):
        if name in fn.__globals__:
            value = fn.__globals__[name]
            yield (f"global '{name}'", value)
            if depth > 0 and _same_module_function(value, fn):
                yield from _function_references(value, depth - 1)


def _global_names(code: types.CodeType) -> Iterator[str]:
    """The global names the code loads (``co_names`` also holds attribute names: ``model.train``
    must not reach a module-level ``train``)."""
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield instruction.argval
    for const in code.co_consts:  # comprehensions, lambdas and nested functions
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _same_module_function(value: Any, fn: types.FunctionType) -> bool:
    return isinstance(value, types.FunctionType) and value.__globals__ is fn.__globals__


# ---- copying ---------------------------------------------------------------------------------
def copy_step(step: Callable[..., Any], parts: StepParts) -> tuple[Callable[..., Any], StepParts]:
    """``step`` rebuilt around deep copies of ``parts`` (copied together, so shared tensors stay
    shared), and the copied parts in the same order. Raises TypeError naming the part that cannot
    be deep-copied."""
    originals = parts.all
    memo: dict[int, Any] = {}
    try:
        copies = copy.deepcopy(originals, memo)
    except Exception as error:  # deepcopy raises whatever the object's own methods raise
        raise TypeError(
            f"the step's parts cannot be deep-copied ({type(error).__name__}: {error}); "
            f"found: {parts.describe()}"
        ) from error
    for original, new in zip(originals, copies, strict=True):
        if isinstance(new, torch.optim.Optimizer):
            _rewrap_scheduler_patch(original, new)
    # everything the copy made, keyed by the original's id: a step that holds a parameter or a
    # list of them (``params = list(model.parameters())``) gets the copy's
    swap = {key: value for key, value in memo.items() if key != id(memo)}
    copied = StepParts()
    for original, new in zip(originals, copies, strict=True):
        copied.add(new, parts.where[id(original)])
    return _rebuilt(step, swap, _HELPER_DEPTH), copied


def _rewrap_scheduler_patch(original: torch.optim.Optimizer, opt: torch.optim.Optimizer) -> None:
    """An LR scheduler sets ``opt.step`` to a wrapper holding a weak reference to the optimizer it
    was made for: a deep copy keeps it, and would step the user's parameters. The copy gets its
    own wrapper (so its scheduler sees its steps, and warns about nothing the user's would not)."""
    vars(opt).pop("step", None)
    if not getattr(vars(original).get("step"), "_wrapped_by_lr_sched", False):
        return
    func, owner = type(opt).step, weakref.ref(opt)

    @functools.wraps(func)
    def step(*args: Any, **kwargs: Any) -> Any:
        this = owner()
        this._opt_called = True
        return func(this, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    opt.step = step


def _swapped(value: Any, swap: dict[int, Any]) -> Any:
    if id(value) in swap:
        return swap[id(value)]
    if isinstance(value, (list, tuple)) and any(id(v) in swap for v in value):
        items = [swap.get(id(v), v) for v in value]
        return type(value)._make(items) if hasattr(value, "_make") else type(value)(items)
    if isinstance(value, dict) and any(id(v) in swap for v in value.values()):
        return type(value)((k, swap.get(id(v), v)) for k, v in value.items())
    return value


def _rebuilt(step: Any, swap: dict[int, Any], depth: int) -> Any:
    if isinstance(step, functools.partial):
        args = tuple(_swapped(a, swap) for a in step.args)
        kwargs = {k: _swapped(v, swap) for k, v in step.keywords.items()}
        return functools.partial(_rebuilt(step.func, swap, depth), *args, **kwargs)
    if isinstance(step, types.MethodType):
        owner = _shallow_with(step.__self__, swap)
        return types.MethodType(_rebuilt(step.__func__, swap, depth), owner)
    if isinstance(step, types.FunctionType):
        return _rebuilt_function(step, swap, depth, {})
    if id(step) in swap:
        return swap[id(step)]
    return _shallow_with(step, swap)


def _shallow_with(obj: Any, swap: dict[int, Any]) -> Any:
    """A shallow copy of ``obj`` whose attributes that are parts point at their copies."""
    new = copy.copy(obj)
    for attr, value in getattr(obj, "__dict__", {}).items():
        swapped = _swapped(value, swap)
        if swapped is not value:
            object.__setattr__(new, attr, swapped)
    return new


def _rebuilt_function(
    fn: types.FunctionType, swap: dict[int, Any], depth: int, done: dict[int, Any]
) -> types.FunctionType:
    if id(fn) in done:
        return done[id(fn)]
    names = set(_global_names(fn.__code__))
    scope = dict(fn.__globals__)  # the module's namespace, copied: the user's stays as it was
    cells = tuple(types.CellType() for _ in fn.__closure__ or ())
    new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, cells)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    done[id(fn)] = new
    for cell, old in zip(cells, fn.__closure__ or (), strict=True):
        value = _cell(old)
        if depth > 0 and _same_module_function(value, fn):
            value = _rebuilt_function(value, swap, depth - 1, done)
        cell.cell_contents = _swapped(value, swap)
    for name in names & scope.keys():
        value = scope[name]
        if depth > 0 and _same_module_function(value, fn):
            scope[name] = _rebuilt_function(value, swap, depth - 1, done)
        else:
            scope[name] = _swapped(value, swap)
    return new


def _cell(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return None


# ---- proving the user's objects were not touched -------------------------------------------------
class Untouched:
    """The version counter of every tensor of the user's parts, recorded now; :meth:`changed`
    lists where an in-place write happened since (a parameter, a gradient, optimizer state)."""

    def __init__(self, parts: StepParts):
        self._tensors = dict(_named_tensors(parts))
        self._versions = {name: t._version for name, t in self._tensors.items()}

    def changed(self) -> list[str]:
        return [n for n, t in self._tensors.items() if t._version != self._versions[n]]


def _named_tensors(parts: StepParts) -> Iterator[tuple[str, torch.Tensor]]:
    for m in parts.models:
        label = parts.where[id(m)]
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            yield (f"{label}: {name}", t)
    for opt in parts.optimizers:
        label = parts.where[id(opt)]
        for i, state in enumerate(opt.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    yield (f"{label}: state[{i}][{key!r}]", value)
