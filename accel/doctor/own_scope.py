"""The copies' code over copies of its module's names. Dynamo installs a graph break's resume
functions and the compiled graphs as globals of the code that broke: where a copy's code runs
over names of its own, they land there, not in the user's module."""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from accel.doctor.isolation import watch_as_step
from accel.doctor.reach import is_library

__all__ = ["copies_of", "over_own_names", "own_code", "own_names"]

# each function of the user's -> the copies made of it (of its copies too) still alive
_COPIES: weakref.WeakKeyDictionary[types.FunctionType, weakref.WeakSet] = (
    weakref.WeakKeyDictionary()
)
_ORIGINAL: weakref.WeakKeyDictionary[types.FunctionType, types.FunctionType] = (
    weakref.WeakKeyDictionary()
)


def own_names(model: torch.nn.Module) -> None:
    """Each method of the user's in the copied ``model`` (its classes' and those bound on a
    layer itself, a rewritten forward) bound over :func:`over_own_names`."""
    scopes: dict[int, dict[str, Any]] = {}
    for layer in model.modules():
        methods = {
            name: value
            for cls in reversed(type(layer).__mro__)
            if not is_library(cls)
            for name, value in vars(cls).items()
            if isinstance(value, types.FunctionType) and not name.startswith("__")
            and not is_library(value)  # a decorator's wrapper (torch.no_grad's): not the user's
        }  # fmt: skip
        methods |= {
            name: value.__func__
            for name, value in vars(layer).items()
            if isinstance(value, types.MethodType) and value.__self__ is layer
            and isinstance(value.__func__, types.FunctionType) and not is_library(value.__func__)
        }  # fmt: skip
        for name, function in methods.items():
            setattr(layer, name, types.MethodType(over_own_names(function, scopes), layer))


def own_code(method: Callable) -> Callable:
    """The bound method over :func:`over_own_names`. Dynamo keeps compiled code on the code
    object: copies compiled from one class (torch's too) would pile every trial's variant into
    one cache, past its limit (a later copy then runs uncompiled), and leave it behind."""
    function = getattr(method, "__func__", None)
    if not isinstance(function, types.FunctionType):
        return method  # not a Python method: nothing of the class's to share
    return types.MethodType(over_own_names(function), method.__self__)


def over_own_names(function: types.FunctionType,
                   scopes: dict[int, dict[str, Any]] | None = None) -> types.FunctionType:  # fmt: skip
    """``function`` over a copy of its code and of its module's names, in which that module's own
    functions are copies over the same names (``scopes``: the copy of each module's, made once)."""
    scopes = {} if scopes is None else scopes
    module = function.__globals__
    scope = scopes.get(id(module))
    if scope is None:
        scope = scopes[id(module)] = dict(module)
        for name, value in module.items():
            if isinstance(value, types.FunctionType) and value.__globals__ is module:
                scope[name] = _copied(value, scope)
    return _copied(function, scope)


def copies_of(function: types.FunctionType) -> list[types.FunctionType]:
    """The copies made of ``function`` still alive (a rewrite of it reaches them too)."""
    return list(_COPIES.get(function, ()))


def _copied(function: types.FunctionType, scope: dict[str, Any]) -> types.FunctionType:
    own = types.FunctionType(function.__code__.replace(), scope, function.__name__,
                             function.__defaults__, function.__closure__)  # fmt: skip
    own.__kwdefaults__ = function.__kwdefaults__
    watch_as_step(own.__code__, function.__code__)
    original = _ORIGINAL.get(function, function)
    _ORIGINAL[own] = original
    _COPIES.setdefault(original, weakref.WeakSet()).add(own)
    return functools.update_wrapper(own, function)
