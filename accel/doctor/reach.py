"""Everything a training step can reach, found where its code looks: closure cells, the globals
its code reads (of any module its helpers come from), defaults, a bound method's ``self``, a
partial's arguments, attributes of objects and of their (user) classes, module attributes its
code reads, container items; followed to any depth. Library code is not followed into its
globals. Values read through a computed ``getattr``, ``sys.modules`` or ``globals()[...]`` are
not seen; ``Untouched`` checks every model and optimizer of the process, found here or not.

:func:`kind` sorts what was found: ``part`` (a module, optimizer, scheduler or gradient scaler),
``grad`` (a leaf tensor requiring grad), ``computed`` (a non-leaf one), ``tensor``, ``rng``,
``state`` (a mutable container or NumPy array, an instance of a user class or a cached
function of the user's), ``iterator``, ``file``,
``writes`` (a user function that assigns a global), or None.
"""

from __future__ import annotations

import collections
import dis
import functools
import inspect
import io
import logging
import os
import random
import sys
import sysconfig
import traceback
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Edge", "Reach", "attributes_of", "counts_on_class", "generator_call", "global_names",
           "instance_dict", "is_array", "is_cached_function", "is_library", "kind", "skipped_attributes",
           "slot_names", "stored_attributes", "stored_globals", "walk", "where_raised"]  # fmt: skip

LARGE = 10_000  # a container longer than this (a data set, say) is searched for parts only

_ATOMIC = (
    type(None), bool, int, float, complex, str, bytes, range, slice, type(Ellipsis),
    type(NotImplemented), torch.dtype, torch.device, torch.Size, torch.layout,
    torch.memory_format, types.CodeType, weakref.ReferenceType, types.MemberDescriptorType,
    types.GetSetDescriptorType, types.WrapperDescriptorType, types.MethodWrapperType,
    types.MethodDescriptorType,
)  # fmt: skip
_STATE = (list, dict, set, bytearray, collections.deque)
# copied with their owner, and not followed (a model's parameters are its; a logger's level
# cache and manager are the logging module's, changed by any getLogger in the process)
SKIPPED = {nn.Module: ("_parameters", "_buffers", "_modules"),
           torch.optim.Optimizer: ("param_groups", "state", "defaults"),
           logging.Logger: ("_cache", "manager")}  # fmt: skip


@dataclass(frozen=True)
class Edge:
    """How a parent holds ``child``. ``kind``: cell (``key`` its index), global, default (an
    index), kwdefault, attr, module (a submodule), class (the instance's class), cattr (a class
    attribute), mattr (a module attribute), item (a dict's), key (a dict's), element (a sequence's
    index), member (a set's), self (a bound method's), func (a wrapper's function, or the one a generator is made
    again by), arg, keyword, bself (the object behind a built-in bound method such
    as ``losses.append``)."""

    kind: str
    key: Any
    child: Any


@dataclass
class Reach:
    """What :func:`walk` found (nearest first), where the step reaches each, their edges."""

    root: Any
    home: dict | None = None  # the globals of the step's own code: named "global 'x'"
    objects: dict[int, Any] = field(default_factory=dict)
    where: dict[int, str] = field(default_factory=dict)
    edges: dict[int, list[Edge]] = field(default_factory=dict)
    stored: set[str] = field(default_factory=set)  # attribute names the user's code assigns

    def ancestors(self, keys: set[int]) -> set[int]:
        """The objects from which one of ``keys`` can be reached (``keys`` included)."""
        parents: dict[int, list[int]] = collections.defaultdict(list)
        for parent, edges in self.edges.items():
            for edge in edges:
                parents[id(edge.child)].append(parent)
        found, todo = set(keys), list(keys)
        while todo:
            for parent in parents.get(todo.pop(), ()):
                if parent not in found:
                    found.add(parent)
                    todo.append(parent)
        return found

    def descendants(self, value: Any) -> list[Any]:
        """The objects reached from ``value`` (itself left out)."""
        found: dict[int, Any] = {}
        todo = [value]
        while todo:
            for edge in self.edges.get(id(todo.pop()), ()):
                if id(edge.child) not in found:
                    found[id(edge.child)] = edge.child
                    todo.append(edge.child)
        return list(found.values())


def walk(step: Any) -> Reach:
    """Everything ``step`` can reach (see the module's doc)."""
    reach = Reach(step, home=_home(step))
    names: set[str] = set()  # attribute names the user's code reads
    modules: dict[int, types.ModuleType] = {}
    queue: collections.deque[Any] = collections.deque()

    def see(value: Any, where: str) -> None:
        if isinstance(value, _ATOMIC) or id(value) in reach.objects:
            return
        reach.objects[id(value)] = value
        reach.where[id(value)] = where
        queue.append(value)

    see(step, "" if _transparent(step) else "self")
    while queue:
        while queue:
            value = queue.popleft()
            if isinstance(value, types.ModuleType) and not is_library(value):
                modules[id(value)] = value
            edges = reach.edges.setdefault(id(value), [])
            edges.extend(_edges(value, names))
            if isinstance(value, types.FunctionType) and not is_library(value):
                reach.stored.update(stored_attributes(value.__code__))
            for edge in edges:
                see(edge.child, _label(reach, value, edge))
        for module in modules.values():  # the attributes read by code found since
            edges = reach.edges[id(module)]
            known = {edge.key for edge in edges}
            for name in sorted(names & vars(module).keys() - known):
                edges.append(Edge("mattr", name, vars(module)[name]))
                see(vars(module)[name], f"{module.__name__}.{name}")
    return reach


def _transparent(step: Any) -> bool:
    return isinstance(step, (types.FunctionType, types.MethodType, functools.partial))


def _home(step: Any) -> dict | None:
    while isinstance(step, functools.partial):
        step = step.func
    if isinstance(step, types.MethodType):
        step = step.__func__
    if not isinstance(step, types.FunctionType):
        for name in ("forward", "__call__"):
            method = inspect.getattr_static(type(step), name, None)
            if isinstance(method, types.FunctionType):
                step = method
                break
    return step.__globals__ if isinstance(step, types.FunctionType) else None


# ---- what an object holds --------------------------------------------------------------------
def _edges(value: Any, names: set[str]) -> Iterator[Edge]:
    if isinstance(value, torch.Tensor) or kind(value) in ("rng", "iterator", "file"):
        if (call := generator_call(value)) is not None:  # what the copies make it again with
            fn, args, keywords = call
            yield Edge("func", None, fn)
            yield from (Edge("arg", i, a) for i, a in enumerate(args))
            yield from (Edge("keyword", k, a) for k, a in keywords.items())
        return
    if isinstance(value, types.FunctionType):
        yield from _function_edges(value, names)
    elif isinstance(value, types.MethodType):
        yield Edge("self", None, value.__self__)
        yield Edge("func", None, value.__func__)
    elif isinstance(value, types.BuiltinMethodType):
        owner = getattr(value, "__self__", None)
        if owner is not None and not isinstance(owner, (types.ModuleType, type)):
            yield Edge("bself", value.__name__, owner)
    elif isinstance(value, functools.partial):
        yield Edge("func", None, value.func)
        yield from (Edge("arg", i, a) for i, a in enumerate(value.args))
        yield from (Edge("keyword", k, a) for k, a in value.keywords.items())
    elif isinstance(value, (staticmethod, classmethod)):
        yield Edge("func", None, value.__func__)
    elif isinstance(value, property):
        yield from (
            Edge("func", n, f) for n in ("fget", "fset", "fdel") if (f := getattr(value, n))
        )
    elif isinstance(value, type):
        if not is_library(value):
            yield from _class_edges(value)
    elif isinstance(value, types.ModuleType):
        return  # its attributes: those the code reads (walk's loop)
    else:
        yield from _held(value)


def generator_call(value: Any) -> tuple[types.FunctionType, list[Any], dict[str, Any]] | None:
    """The function and arguments that make ``value`` again from its start where it is a
    generator function's generator not yet started, or started by code that never assigns its
    arguments (they still say how it was made); None for any other (a generator expression is
    read apart)."""
    if not isinstance(value, types.GeneratorType) or value.gi_code.co_name == "<genexpr>":
        return None
    state = inspect.getgeneratorstate(value)
    if state != inspect.GEN_CREATED and (state != inspect.GEN_SUSPENDED
                                         or _assigns_arguments(value.gi_code)):  # fmt: skip
        return None
    code, names = value.gi_code, value.gi_frame.f_locals
    positional, keyword, star, stars = _arguments(code)
    args = [names[n] for n in positional] + [*(names[star] if star else ())]
    keywords = {n: names[n] for n in keyword} | (names[stars] if stars else {})
    cells = tuple(types.CellType(names[n]) if n in names else types.CellType()
                  for n in code.co_freevars)  # fmt: skip
    fn = types.FunctionType(code, value.gi_frame.f_globals, code.co_name, None, cells or None)
    fn.__qualname__ = value.__qualname__
    return fn, args, keywords


def _arguments(code: types.CodeType) -> tuple[tuple[str, ...], tuple[str, ...], str | None, str | None]:
    """The names of ``code``'s positional and keyword-only arguments, its ``*args`` and its
    ``**kwargs`` (None where it takes none)."""
    names, given = code.co_varnames, code.co_argcount + code.co_kwonlyargcount
    star = names[given] if code.co_flags & inspect.CO_VARARGS else None
    stars = names[given + bool(star)] if code.co_flags & inspect.CO_VARKEYWORDS else None
    return names[: code.co_argcount], names[code.co_argcount : given], star, stars


def _assigns_arguments(code: types.CodeType) -> bool:
    """Whether ``code`` binds or deletes one of its arguments' names."""
    positional, keyword, star, stars = _arguments(code)
    arguments = {*positional, *keyword, star, stars} - {None}
    for instruction in dis.get_instructions(code):
        if instruction.opname.startswith(("STORE_FAST", "DELETE_FAST", "STORE_DEREF", "DELETE_DEREF")):
            names = instruction.argval if isinstance(instruction.argval, tuple) else (instruction.argval,)
            if arguments.intersection(names):
                return True
    return False


def _held(value: Any) -> Iterator[Edge]:
    """The items of a container, the attributes of an instance."""
    if isinstance(value, (dict, list, tuple, collections.deque)):
        mapping = isinstance(value, dict)
        items = list(value.items() if mapping else enumerate(value))
        if len(items) > LARGE:
            items = [(k, v) for k, v in items if kind(v) in ("part", "grad", "computed")]
        yield from (Edge("item" if mapping else "element", k, v) for k, v in items)
        if mapping:  # a parameter or a module as a key (a per-parameter scale, a name map)
            yield from (Edge("key", None, k) for k, _ in items if not isinstance(k, _ATOMIC))
    elif isinstance(value, (set, frozenset)):
        yield from (Edge("member", None, v) for v in value if not isinstance(v, _ATOMIC))
    else:
        if isinstance(value, nn.Module):
            yield from (Edge("module", n, m) for n, m in value._modules.items() if m is not None)
        if isinstance(value, torch.jit.ScriptModule):  # compiled: its code reaches no Python
            return
        skipped = skipped_attributes(value)
        for name, item in attributes_of(value):
            # a part's empty hook tables: copied with it, and holding nothing to follow
            empty = skipped and isinstance(item, (dict, list, set)) and not item
            if name not in skipped and not empty:
                yield Edge("attr", name, item)
        if not is_library(type(value)):
            yield Edge("class", None, type(value))


def skipped_attributes(value: Any) -> tuple[str, ...]:
    """The attributes of ``value`` that are copied with it and not followed."""
    return next((names for cls, names in SKIPPED.items() if isinstance(value, cls)), ())


def instance_dict(value: Any) -> dict | None:
    """``value.__dict__`` without running its class's ``__getattr__``, or None."""
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return None
    return attributes if isinstance(attributes, dict) else None


def attributes_of(value: Any) -> Iterator[tuple[str, Any]]:
    attributes = instance_dict(value)
    if attributes is not None:
        yield from list(attributes.items())
    for name in slot_names(type(value)):
        try:
            yield (name, object.__getattribute__(value, name))
        except AttributeError:  # a slot never set
            continue


@functools.lru_cache(maxsize=4096)
def slot_names(cls: type) -> tuple[str, ...]:
    """The attribute names the ``__slots__`` of ``cls`` and its bases declare (mangled)."""
    found = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            private = name.startswith("__") and not name.endswith("__")
            found.append(f"_{klass.__name__.lstrip('_')}{name}" if private else name)
    return tuple(dict.fromkeys(found))


def _function_edges(fn: types.FunctionType, names: set[str]) -> Iterator[Edge]:
    for i, (name, cell) in enumerate(
        zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True)
    ):
        if name == "__class__":  # zero-argument super(): the class it was defined in, kept
            continue
        try:
            yield Edge("cell", i, cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    yield from (Edge("default", i, v) for i, v in enumerate(fn.__defaults__ or ()))
    yield from (Edge("kwdefault", k, v) for k, v in (fn.__kwdefaults__ or {}).items())
    if is_library(fn):
        return
    names.update(_code_names(fn.__code__))
    for name in global_names(fn.__code__):
        if name in fn.__globals__:
            yield Edge("global", name, fn.__globals__[name])


# what runs when an object is made, shown or pickled, not when a step runs it
_NOT_STEP_CODE = frozenset((
    "__init__", "__new__", "__init_subclass__", "__post_init__", "__class_getitem__",
    "__set_name__", "__repr__", "__str__", "__format__", "__getstate__", "__setstate__",
    "__reduce__", "__reduce_ex__", "__copy__", "__deepcopy__", "__del__",
))  # fmt: skip


def _class_edges(cls: type) -> Iterator[Edge]:
    """The class attributes and methods ``cls`` and its bases of the user's code define, each
    name once (the first along the method resolution order)."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if is_library(klass):
            continue
        for name, value in list(vars(klass).items()):
            dunder = name.startswith("__") and name.endswith("__")
            code = isinstance(value, (types.FunctionType, staticmethod, classmethod, property))
            if name in seen or (dunder and not code) or name in _NOT_STEP_CODE:
                continue
            seen.add(name)
            yield Edge("cattr", name, value)


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code of the functions and comprehensions inside it, at any depth."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _operands(code: types.CodeType, *opnames: str) -> Iterator[str]:
    return (i.argval for c in _nested(code) for i in dis.get_instructions(c) if i.opname in opnames)


def global_names(code: types.CodeType) -> Iterator[str]:
    """The global names the code loads (``co_names`` also holds attribute names: ``model.train``
    must not reach a module-level ``train``), nested functions and comprehensions included."""
    return _operands(code, "LOAD_GLOBAL", "LOAD_NAME")


@functools.lru_cache(maxsize=4096)
def stored_globals(code: types.CodeType) -> frozenset[str]:
    """The global names the code assigns or deletes (``global n; n += 1``)."""
    return frozenset(_operands(code, "STORE_GLOBAL", "DELETE_GLOBAL"))


@functools.lru_cache(maxsize=4096)
def stored_attributes(code: types.CodeType) -> frozenset[str]:
    """The attribute names the code assigns or deletes (``Counter.n += 1``)."""
    return frozenset(_operands(code, "STORE_ATTR", "DELETE_ATTR"))


def counts_on_class(reach: Reach, value: Any) -> bool:
    """Whether ``value`` is a user's class with a plain value (an int, a string) as an attribute
    that the step's code may assign: a count kept on the class is state, rebound not mutated."""
    if not isinstance(value, type) or is_library(value):
        return False
    return any(edge.kind == "cattr" and edge.key in reach.stored and isinstance(edge.child, _ATOMIC)
               for edge in reach.edges.get(id(value), ()))  # fmt: skip


def _code_names(code: types.CodeType) -> set[str]:
    return {name for c in _nested(code) for name in c.co_names}


# ---- where, in words ---------------------------------------------------------------------------
def _label(reach: Reach, parent: Any, edge: Edge) -> str:
    base = reach.where[id(parent)]
    key = edge.key
    if edge.kind == "global":
        if parent.__globals__ is reach.home:
            return f"global '{key}'"
        return f"{parent.__globals__.get('__name__', '?')}.{key}"
    if edge.kind in ("cell", "default", "kwdefault"):
        name = key
        if edge.kind == "cell":
            name = parent.__code__.co_freevars[key]
        elif edge.kind == "default":
            code = parent.__code__
            name = code.co_varnames[code.co_argcount - len(parent.__defaults__) + key]
        what = "closure" if edge.kind == "cell" else "default"
        return f"{what} '{name}'" + (f" of {parent.__qualname__}" if base else "")
    labels = {
        "func": base,
        "self": f"{base}.__self__" if base else "self",
        "bself": f"{base}.__self__",
        "arg": f"{base or 'partial'} argument {key}",
        "keyword": f"{base or 'partial'} argument {key!r}",
        "attr": f"{base}.{key}",
        "module": f"{base}.{key}",
        "class": getattr(edge.child, "__qualname__", "a class"),
        "cattr": f"{getattr(parent, '__qualname__', '?')}.{key}",
        "item": f"{base}[{key!r}]",
        "element": f"{base}[{key}]",
        "member": f"{base} (a member)",
        "key": f"{base} (a key)",
    }
    return labels[edge.kind]


# ---- what a found object is ----------------------------------------------------------------------
def _database_connection(value: Any) -> bool:
    sqlite3 = sys.modules.get("sqlite3")
    return sqlite3 is not None and isinstance(value, sqlite3.Connection)


def kind(value: Any) -> str | None:
    """What ``value`` is to the doctor (see the module's doc)."""
    if isinstance(value, _ATOMIC):
        return None
    if isinstance(value, torch.Tensor):
        if not value.requires_grad:
            return "tensor"
        return "grad" if value.is_leaf else "computed"
    if isinstance(value, _part_types()):
        return "part"
    if isinstance(value, _rng_types()):
        return "rng"
    if isinstance(value, io.IOBase) or _database_connection(value):  # written from C, unseen
        return "file"
    if isinstance(value, _STATE) or is_array(value):  # an array is written in place as a list is
        return "state"
    if is_cached_function(value):
        return "state"
    if isinstance(value, (type, types.ModuleType, types.MethodType, functools.partial)):
        return None
    if isinstance(value, types.FunctionType):
        user = not is_library(value)
        return "writes" if user and stored_globals(value.__code__) else None
    user_instance = not is_library(type(value)) and (
        instance_dict(value) is not None or slot_names(type(value))
    )
    if user_instance:
        return "state"
    return "iterator" if isinstance(value, Iterator) else None


def is_array(value: Any) -> bool:
    """A NumPy array (NumPy not imported for it)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def is_cached_function(value: Any) -> bool:
    """A function of the user's under ``functools.lru_cache`` or ``cache``: its entries are state
    the step fills."""
    wrapped = getattr(value, "__wrapped__", None)
    return hasattr(value, "cache_parameters") and not is_library(wrapped)


@functools.cache
def _part_types() -> tuple[type, ...]:
    from torch.optim.lr_scheduler import LRScheduler

    scaler = getattr(torch.amp, "GradScaler", None)
    return (nn.Module, torch.optim.Optimizer, LRScheduler) + ((scaler,) if scaler else ())


def _rng_types() -> tuple[type, ...]:
    found: tuple[type, ...] = (random.Random, torch.Generator)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        found += (numpy.random.Generator, numpy.random.RandomState, numpy.random.BitGenerator)
    return found


# ---- the user's code or a library's ----------------------------------------------------------------
@functools.cache
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(os.path.join(os.path.realpath(p), "") for p in roots)


@functools.lru_cache(maxsize=4096)
def _library_file(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return True
    return os.path.realpath(filename).startswith(_library_roots())


def _library_module(name: str | None) -> bool:
    if not name:
        return False
    if name == "builtins" or name.split(".")[0] in sys.stdlib_module_names:
        return True
    file = getattr(sys.modules.get(name), "__file__", None)
    return bool(file) and _library_file(file)


def is_library(value: Any) -> bool:
    """Whether it is the standard library's or an installed package's (not followed)."""
    if isinstance(value, types.FunctionType):
        return _library_file(value.__code__.co_filename)
    if isinstance(value, types.CodeType):
        return _library_file(value.co_filename)
    if isinstance(value, types.ModuleType):
        return _library_module(value.__name__)
    if isinstance(value, type):
        return _library_module(value.__module__)
    return True


_ACCEL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def where_raised(error: BaseException) -> str:
    """The user's line that raised ``error``, and what it said."""
    frames = [f"{frame.f_code.co_filename}:{line}"
              for frame, line in traceback.walk_tb(error.__traceback__)
              if not is_library(frame.f_code)
              and not frame.f_code.co_filename.startswith(_ACCEL_DIR)]  # fmt: skip
    message = f"sys.exit({error.code!r})" if isinstance(error, SystemExit) else str(error)
    return f"({frames[-1] if frames else 'in a library'}): {type(error).__name__}: " + message.rstrip(".")
