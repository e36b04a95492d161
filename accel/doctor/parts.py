"""What a user's training step is made of (:func:`find_parts`: the modules, optimizers,
schedulers, scalers and tensors requiring grad that :mod:`accel.doctor.reach` finds), and
:func:`copy_step`: the parts deep-copied together (one memo, so a copied optimizer holds the copied
model's parameters) and every object on a path from the step to something it could change rebuilt
around the copies. What cannot be rebuilt on the way to a part is refused (a TypeError naming
it); on the way to anything else it stays shared, and :class:`~.untouched.Untouched` names it if
it changed.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import functools
import inspect
import itertools
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from accel.doctor.drawn import Copied, Drawn, Reading, loop_source
from accel.doctor.isolation import record
from accel.doctor.reach import (
    Reach,
    attributes_of,
    counts_on_class,
    global_names,
    is_array,
    is_cached_function,
    is_library,
    kind,
    skipped_attributes,
    walk,
)

__all__ = ["StepParts", "copy_step", "find_parts", "is_a_copy", "loader_copies_ended",
           "without_kept_iterator"]

# built-in iterators a shallow copy makes independent
_COPYABLE_ITERATORS = frozenset(type(iter(x)) for x in (
    [], (), range(0), range(2**64), "", "é", b"", bytearray(), {}, set(), {}.values(), {}.items(),
    reversed([]),
)) | {itertools.count}  # fmt: skip
# rebuilt, with their holders
_TARGETS = ("part", "grad", "computed", "tensor", "rng", "state", "iterator", "writes")
# the bytes of plain tensors copied with a step, at most: past them (a data set held in memory,
# say) a tensor is shared, and a step that writes into it in place is named in the report's first line
COPIED_TENSOR_BYTES = 1 << 30


@dataclass
class StepParts:
    """The parts found, each with where the step's code reaches it (``"closure 'model'"``)."""

    models: list[nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    others: list[Any] = field(default_factory=list)  # schedulers, gradient scalers
    tensors: list[torch.Tensor] = field(default_factory=list)  # requiring grad, of no model
    where: dict[int, str] = field(default_factory=dict)
    blocked: list[str] = field(default_factory=list)  # what trains and cannot be copied
    reach: Reach | None = field(default=None, repr=False)  # what the step reaches (originals)
    needs: set[int] = field(default_factory=set, repr=False)  # ids rebuilt by copy_step
    carries: set[int] = field(default_factory=set, repr=False)  # ids that lead to a part

    def add(self, value: Any, where: str) -> None:
        if id(value) in self.where:
            return
        if isinstance(value, nn.Module):
            self.models.append(value)
        elif isinstance(value, torch.optim.Optimizer):
            self.optimizers.append(value)
        elif isinstance(value, torch.Tensor):
            self.tensors.append(value)
        else:
            self.others.append(value)
        self.where[id(value)] = where

    @property
    def all(self) -> list[Any]:
        return [*self.models, *self.optimizers, *self.others, *self.tensors]

    def parameters(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for m in self.models:
            seen.update((id(p), p) for p in m.parameters())
        for opt in self.optimizers:
            for group in opt.param_groups:
                seen.update((id(p), p) for p in group["params"])
        seen.update((id(t), t) for t in self.tensors)
        return list(seen.values())

    def describe(self) -> str:
        """One line: what was found and where, for the report."""
        if not self.all:
            return "no model or optimizer found in what the step reaches"
        return "; ".join(f"{_class_name(v)} ({self.where[id(v)]})" for v in self.all)


def _class_name(value: Any) -> str:
    """The user's class, also behind ``torch.compile``'s wrapper."""
    inner = getattr(value, "_orig_mod", None)
    return f"{type(inner).__name__}, compiled" if isinstance(inner, nn.Module) else type(value).__name__


def without_kept_iterator(made: Any) -> Any:
    """``made``, a shallow copy; a DataLoader's without the iterator a persistent one keeps
    (``iter()`` on it resets that iterator: the copy starts its own, never the user's), and
    noted where :func:`loader_copies_ended` is open."""
    if isinstance(made, torch.utils.data.DataLoader):
        made._iterator = None
        if (noted := _LOADER_COPIES.get()) is not None:
            _note(made, *noted)
    return made


# the loader copies made, and the iterators they made (weakly), while loader_copies_ended is open
_LOADER_COPIES: contextvars.ContextVar[tuple[list[Any], weakref.WeakSet] | None] = (
    contextvars.ContextVar("accel_doctor_loader_copies", default=None)
)


def _note(loader: Any, loaders: list[Any], iterators: weakref.WeakSet) -> None:
    """``loader`` noted, and each iterator it makes: the one a persistent loader keeps, or a
    pass the copies' step holds."""
    make = type(loader)._get_iterator

    def made_and_noted() -> Any:
        made = make(loader)
        iterators.add(made)
        return made

    loader._get_iterator = made_and_noted  # taken off again when the doctor is done
    loaders.append(loader)


@contextlib.contextmanager
def loader_copies_ended() -> Iterator[None]:
    """While open, the DataLoader copies made are noted; on closing, the workers of each
    iterator they made are shut down: left to its collection, they would outlive the doctor
    where a reference cycle holds the copy (and its threads would be said left running)."""
    loaders: list[Any] = []
    iterators: weakref.WeakSet = weakref.WeakSet()
    token = _LOADER_COPIES.set((loaders, iterators))
    try:
        yield
    finally:
        _LOADER_COPIES.reset(token)
        for loader in loaders:
            vars(loader).pop("_get_iterator", None)
            loader._iterator = None
        for made in list(iterators):
            if hasattr(made, "_shutdown_workers"):  # one of workers (not read in the process)
                made._shutdown_workers()


# ---- finding -------------------------------------------------------------------------------------
def find_parts(step: Callable[..., Any]) -> StepParts:
    """What ``step`` reaches that trains; ``blocked``: what trains and cannot be copied."""
    reach = walk(step)
    kinds = {key: "state" if counts_on_class(reach, value) else kind(value)
             for key, value in reach.objects.items()}  # fmt: skip
    inside = {id(e.child) for edges in reach.edges.values() for e in edges if e.kind == "module"}
    parts = StepParts(reach=reach)
    for key, value in reach.objects.items():
        where = "the step itself" if value is step else reach.where[key]
        if kinds[key] == "part" and key not in inside:
            parts.add(value, where)
    owned = {id(p) for m in parts.models for p in m.parameters()}
    for key, value in reach.objects.items():
        if kinds[key] == "grad" and key not in owned:
            parts.add(value, reach.where[key])
    owned |= {id(t) for t in parts.tensors}
    for opt in parts.optimizers:
        if any(id(p) not in owned for group in opt.param_groups for p in group["params"]):
            parts.blocked.append(
                f"the model whose parameters {type(opt).__name__} ({parts.where[id(opt)]}) "
                "updates: the step reaches it where the doctor cannot follow"
            )
    parts.needs = reach.ancestors({k for k, what in kinds.items() if what in _TARGETS})
    parts.carries = reach.ancestors({k for k, what in kinds.items() if what in ("part", "grad")})
    return parts


# ---- copying ---------------------------------------------------------------------------------
_COPIES: dict[int, weakref.ref] = {}  # id -> each module, optimizer and tensor a copy is made of


def _remember_copies(memo: dict[int, Any]) -> None:
    """torch.compile's caches can keep a copy's tensors alive after its run, and a later CUDA
    graph replay writes over their gradients: a later run's record leaves them out."""
    for original, made in list(memo.items()):
        key = id(made)
        if key != original and isinstance(made, (torch.Tensor, nn.Module, torch.optim.Optimizer)):
            _COPIES[key] = weakref.ref(made, lambda _, key=key: _COPIES.pop(key, None))


def is_a_copy(value: Any) -> bool:
    """Whether ``value`` is part of a copy :func:`copy_step` made (and still alive)."""
    ref = _COPIES.get(id(value))
    return ref is not None and ref() is value


def copy_step(step: Callable[..., Any], parts: StepParts) -> tuple[Callable[..., Any], StepParts]:
    """``step`` rebuilt around deep copies of ``parts`` (copied together, so shared tensors stay
    shared), and the copied parts in the same order. Raises TypeError naming what trains and
    cannot be copied."""
    if parts.blocked:
        raise TypeError("the step trains what cannot be copied: " + "; ".join(parts.blocked))
    originals = parts.all
    memo: dict[int, Any] = _recomputed_weights(parts.models)
    try:
        copies = _deep_copies(originals, memo)
    except Exception as error:  # deepcopy raises whatever the object's own methods raise
        memo = _recomputed_weights(parts.models)  # the failed copy's halves left out
        shared = _uncopyable_held(parts, memo)
        try:
            copies = _deep_copies(originals, memo)
        except Exception:
            raise TypeError(
                f"the step's parts cannot be deep-copied ({type(error).__name__}: {error}); "
                f"found: {parts.describe()}"
            ) from error
        for key, where in shared.items():
            if kind(memo.pop(key)) in _TARGETS:
                continue  # rebuilt below as any the step reaches (a generator's reading)
            record(f"shared {where} with its copies, as it cannot be copied: what they do with "
                   "it is done to yours")  # fmt: skip
    for original, new in zip(originals, copies, strict=True):
        if isinstance(new, torch.optim.Optimizer):
            _rewrap_scheduler_patch(original, new)
        if isinstance(new, torch.nn.Module):  # deepcopy leaves a parameter's gradient behind
            _copy_grads(original, new)
    # the memo keeps deepcopy's list of what it kept alive: no id in it is reused meanwhile
    runner = step
    if parts.reach is not None:
        if not _same_callable(step, parts.reach.root):
            raise ValueError("copy_step needs the step whose parts these are")
        runner = _Rebuild(parts, memo).new(parts.reach.root)
    _remember_copies(memo)
    copied = StepParts()
    for original, new in zip(originals, copies, strict=True):
        copied.add(new, parts.where[id(original)])
    return runner, copied


def _deep_copies(originals: list[Any], memo: dict[int, Any]) -> list[Any]:
    """``originals`` deep-copied together, an optimizer with what its deepcopy drops."""
    copies = copy.deepcopy(originals, memo)
    for original, new in zip(originals, copies, strict=True):
        if isinstance(new, torch.optim.Optimizer):
            _copy_dropped_attributes(original, new, memo)
    return copies


def _uncopyable_held(parts: StepParts, memo: dict[int, Any]) -> dict[int, str]:
    """What the models hold beside their layers that deepcopy refuses (a lock, an open log, a
    generator), put in ``memo`` as itself so that their copies share it: id -> where it is."""
    shared = {}
    for model in parts.models:
        for prefix, module in model.named_modules():
            for name, value in attributes_of(module):
                if name in _MODULE_TABLES or isinstance(value, (torch.Tensor, nn.Module)) or id(value) in shared:
                    continue
                try:
                    copy.deepcopy(value)
                except Exception:
                    memo[id(value)] = value
                    shared[id(value)] = ".".join([parts.where[id(model)], *[prefix] * bool(prefix), name])
    return shared


_MODULE_TABLES = ("_modules", "_parameters", "_buffers")


def _recomputed_weights(models: list[torch.nn.Module]) -> dict[int, Any]:
    """A deepcopy memo giving each non-leaf tensor a module holds as a plain attribute a detached
    copy: the weight legacy ``weight_norm`` and ``spectral_norm`` compute from their parameters
    (deepcopy refuses a non-leaf tensor), computed again by their hooks before each forward."""
    weights = [value for model in models for module in model.modules()
               for value in vars(module).values()
               if isinstance(value, torch.Tensor) and value.grad_fn is not None]  # fmt: skip
    memo: dict[int, Any] = {id(w): w.detach().clone() for w in weights}
    memo[id(memo)] = weights  # deepcopy's own list of what it keeps alive: no id reused
    return memo


def _copy_grads(original: torch.nn.Module, copy: torch.nn.Module) -> None:
    """The gradients ``original``'s parameters hold, cloned onto ``copy``'s: a step that
    accumulates starts from them."""
    mine, theirs = list(original.parameters()), list(copy.parameters())
    if len(mine) != len(theirs):  # a weight recomputed by a hook, say: no pairs to trust
        return
    with torch.no_grad():
        for p, q in zip(mine, theirs, strict=True):
            if p.grad is not None and q.grad is None and p.shape == q.shape:
                q.grad = p.grad.detach().clone()


def _same_callable(a: Any, b: Any) -> bool:
    """``a is b``, or two bound methods of one function and object (``obj.step`` makes a new
    one at each access)."""
    if isinstance(a, types.MethodType) and isinstance(b, types.MethodType):
        return a.__func__ is b.__func__ and a.__self__ is b.__self__
    return a is b


def _copy_dropped_attributes(original: Any, new: Any, memo: dict[int, Any]) -> None:
    """What ``Optimizer.__getstate__`` leaves out of a deep copy (all but its state, groups and
    defaults: LBFGS's ``_params``, a subclass's own attributes), copied in the parts' memo."""
    for name, value in vars(original).items():
        if name not in vars(new):
            setattr(new, name, copy.deepcopy(value, memo))


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


class _Uncopyable(TypeError):
    """Something on the way from the step to a part cannot be rebuilt."""


class _ModuleView(types.ModuleType):
    """A module as the copies see it: its attributes read from (and written to) the copy of its
    namespace that the copies' functions use as globals."""

    def __init__(self, module: types.ModuleType, scope: dict[str, Any]):
        super().__init__(module.__name__, module.__doc__)
        object.__setattr__(self, "_accel_scope", scope)

    def __getattribute__(self, name: str) -> Any:
        scope = object.__getattribute__(self, "_accel_scope")
        return scope[name] if name in scope else object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__getattribute__(self, "_accel_scope")[name] = value


class _Rebuild:
    """Each object on a path from the step to something it could change, copied once and
    pointed at the copies (``memo`` starts with the deep copies of the parts, by original id)."""

    def __init__(self, parts: StepParts, memo: dict[int, Any]):
        self.reach, self.memo = parts.reach, memo
        self.needs, self.carries = parts.needs, parts.carries
        self.unpatched = {key for key in memo if key in self.needs}  # deep copies to point
        self.scopes: dict[int, dict[str, Any]] = {}  # id of a module's globals: the copies'
        self.busy: set[int] = set()
        self.tensor_bytes = 0  # plain tensors copied so far

    def new(self, value: Any) -> Any:
        key = id(value)
        if key in self.memo:
            made = self.memo[key]
            if key in self.unpatched:  # a deep copy holding a function, say, to rebuild
                self.unpatched.discard(key)
                self._point(value, made)
            return made
        if key not in self.needs or key in self.busy:
            return value
        self.busy.add(key)
        try:
            made = self._make(value)
        except _Uncopyable:
            raise
        except Exception as error:
            if key in self.carries:
                where = self.reach.where.get(key) or "the step"
                raise _Uncopyable(
                    f"{where} ({type(value).__name__}) cannot be copied ({type(error).__name__}: "
                    f"{error}), and the step reaches a part it trains through it"
                ) from error
            made = value  # shared; Untouched names it if it changes
        finally:
            self.busy.discard(key)
        self.memo[key] = made
        return made

    def _within_budget(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit the tensors' copy budget; counted if they do."""
        if self.tensor_bytes + nbytes > COPIED_TENSOR_BYTES:
            return False
        self.tensor_bytes += nbytes
        return True

    def _make(self, value: Any) -> Any:
        what = kind(value)
        if what == "computed":  # a state carried from step to step (an RNN's hidden state): the
            # copy starts from its values without the graph that made it, which a step reading it
            # again detaches first (backpropagating into it twice fails on the user's objects too)
            return value.detach().clone()
        if what == "tensor":  # written in place, perhaps (an average of the weights, a count)
            if not self._within_budget(value.untyped_storage().nbytes()):
                return value
            made = copy.deepcopy(value, self.memo)
            return made.pin_memory() if value.is_pinned() else made  # a staging buffer stays one
        if what == "rng":
            return copy.deepcopy(value)
        if is_array(value):  # written in place, as a tensor is: within the tensors' budget
            return value.copy() if self._within_budget(value.nbytes) else value
        if what == "iterator":
            return self._iterator(value, self.reach.where.get(id(value)) or "the step")
        if isinstance(value, types.FunctionType):
            return self._function(value)
        if isinstance(value, types.MethodType):
            return types.MethodType(self.new(value.__func__), self.new(value.__self__))
        if isinstance(value, types.BuiltinMethodType):
            return getattr(self.new(value.__self__), value.__name__)
        if isinstance(value, functools.partial):
            keywords = {k: self.new(v) for k, v in value.keywords.items()}
            return type(value)(self.new(value.func), *map(self.new, value.args), **keywords)
        if isinstance(value, (staticmethod, classmethod)):
            return type(value)(self.new(value.__func__))
        if isinstance(value, property):
            accessors = (value.fget, value.fset, value.fdel)
            return type(value)(*(self.new(f) if f else None for f in accessors), value.__doc__)
        if isinstance(value, types.ModuleType):
            return self._module(value)
        if isinstance(value, type):
            return self._class(value)
        if isinstance(value, (tuple, frozenset)):
            items = [self.new(v) for v in value]
            if all(a is b for a, b in zip(items, value, strict=True)):
                return value
            return type(value)._make(items) if hasattr(value, "_make") else type(value)(items)
        if is_cached_function(value):  # an empty cache of its own around the same function
            return functools.lru_cache(**value.cache_parameters())(self.new(value.__wrapped__))
        made = copy.copy(value)
        if made is value:
            raise TypeError("copy.copy returned the object itself")
        self.memo[id(value)] = made  # before its items: they may lead back to it
        self._point(value, made)
        return without_kept_iterator(made)

    def _point(self, original: Any, made: Any) -> None:
        """Point ``made`` (a shallow or deep copy of ``original``) at the copies of what
        ``original`` holds, where they were rebuilt (what was not stays as the copy has it)."""
        if isinstance(original, (list, collections.deque)):
            for i, item in enumerate(list(original)):
                if (new := self.new(item)) is not item and i < len(made):
                    made[i] = new
        elif isinstance(original, dict):
            items = [(self.new(key), self.new(item)) for key, item in list(original.items())]
            if any(new is not key for (new, _), key in zip(items, original, strict=True)):
                made.clear()  # keyed by the copies, in the same order
            made.update(items)
        elif isinstance(original, set):
            for item in list(original):
                if (new := self.new(item)) is not item and item in made:
                    made.discard(item)
                    made.add(new)
        elif not isinstance(original, (bytearray, torch.Tensor)):
            self._point_attributes(original, made)

    def _point_attributes(self, original: Any, made: Any) -> None:
        if isinstance(original, nn.Module):
            for name, sub in original._modules.items():
                if sub is not None and (new := self.new(sub)) is not sub:
                    made._modules[name] = new
        skipped = skipped_attributes(original)
        for name, item in attributes_of(original):
            if name not in skipped and (new := self.new(item)) is not item:
                object.__setattr__(made, name, new)
        cls = type(original)
        if (new_class := self.new(cls)) is not cls:
            made.__class__ = new_class

    def _iterator(self, value: Any, where: str) -> Any:
        if type(value) in _COPYABLE_ITERATORS:
            return Copied(value, where)
        if (made_again := self._made_again(value)) is not None:
            started = inspect.getgeneratorstate(value) != inspect.GEN_CREATED
            return Copied(value, where, made_again, started=started)
        source = loop_source(value)
        if source is None:
            return Drawn(value, where)
        globals_ = value.gi_frame.f_globals
        scope = globals_ if is_library(value.gi_code) else self._scope(globals_)
        return Reading(value, self._iterator(source, f"what {where} reads"), scope)

    def _made_again(self, generator: Any) -> Callable[[], Any] | None:
        """What makes a generator again for the copies: its function and
        arguments as the walk found them (``generator_call``), each the copies' own. None where
        its code reaches an open file, which the copies would share with yours and read through."""
        edges = self.reach.edges.get(id(generator), ())
        fn = next((e.child for e in edges if e.kind == "func"), None)
        if fn is None or any(kind(v) == "file" for v in self.reach.descendants(generator)):
            return None
        args = [self.new(e.child) for e in edges if e.kind == "arg"]
        keywords = {e.key: self.new(e.child) for e in edges if e.kind == "keyword"}
        return functools.partial(self.new(fn), *args, **keywords)

    def _scope(self, globals_: dict[str, Any]) -> dict[str, Any]:
        """The copies' globals of a module: its namespace copied once, shared by the copies of
        all its functions (so one that assigns a global is seen by the others, not by yours)."""
        key = id(globals_)
        if key not in self.scopes:
            self.scopes[key] = dict(globals_)
        return self.scopes[key]

    def _function(self, fn: types.FunctionType) -> types.FunctionType:
        library = is_library(fn)
        scope = fn.__globals__ if library else self._scope(fn.__globals__)
        old_cells = fn.__closure__ or ()
        cells = tuple(types.CellType() for _ in old_cells)
        made = types.FunctionType(fn.__code__, scope, fn.__name__, None, cells)
        self.memo[id(fn)] = made  # before its cells and globals: they may lead back to it
        for name, old, cell in zip(fn.__code__.co_freevars, old_cells, cells, strict=True):
            try:
                value = old.cell_contents
            except ValueError:  # an empty cell
                continue
            cell.cell_contents = value if name == "__class__" else self.new(value)
        made.__defaults__ = tuple(map(self.new, fn.__defaults__)) if fn.__defaults__ else None
        kwdefaults = fn.__kwdefaults__
        made.__kwdefaults__ = kwdefaults and {k: self.new(v) for k, v in kwdefaults.items()}
        made.__dict__.update(fn.__dict__)
        for name in ("__qualname__", "__doc__", "__module__", "__annotations__"):
            setattr(made, name, getattr(fn, name))
        if not library:
            for name in global_names(fn.__code__):
                if name in fn.__globals__:
                    scope[name] = self.new(fn.__globals__[name])
        return made

    def _module(self, module: types.ModuleType) -> types.ModuleType:
        scope = self._scope(vars(module))
        made = self.memo[id(module)] = _ModuleView(module, scope)
        for edge in self.reach.edges.get(id(module), ()):
            if edge.kind == "mattr" and edge.key in vars(module):
                scope[edge.key] = self.new(vars(module)[edge.key])
        return made

    def _class(self, cls: type) -> type:
        """A subclass with the same name whose class attributes and methods are the copies'
        (an instance's class is switched to it, so ``isinstance`` holds)."""
        namespace = {"__slots__": (), "__module__": cls.__module__,
                     "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}  # fmt: skip
        made = self.memo[id(cls)] = type(cls)(cls.__name__, (cls,), namespace)
        for edge in self.reach.edges.get(id(cls), ()):
            if edge.kind == "cattr" and (new := self.new(edge.child)) is not edge.child:
                setattr(made, edge.key, new)
        return made
