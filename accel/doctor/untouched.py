"""The proof that examining a step left the user's objects as they were: :class:`Untouched`
records every model, optimizer and tensor requiring grad of the process (by the garbage
collector, reached or not), and what the step reaches besides (tensors, containers, user
objects, generators, assigned globals, open files, the batch); :meth:`Untouched.changed` names
what differs since. A tensor is compared by its version counter and two float64 sums (a write
through ``.data`` escapes the counter).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import itertools
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from accel.doctor.parts import StepParts, is_a_copy
from accel.doctor.reach import LARGE, attributes_of, instance_dict, kind, stored_globals

__all__ = ["Untouched"]


class Untouched:
    """What the doctor must leave as it was, recorded now (see the module's doc)."""

    def __init__(self, parts: StepParts, batch: Any = None):
        self._alive: list[Any] = []  # what a record names by id: kept, so no id is reused
        self._tensors: list[tuple[str, torch.Tensor]] = []
        self._probes: list[tuple[str, Callable[[], Any]]] = []
        with _collector_paused():
            self._process_wide(parts)
            if parts.reach is not None:
                self._reached(parts)
            leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
            self._tensors += [("the batch", t) for t in leaves]
            self._tensor_states = _states([t for _, t in self._tensors], self._alive)
            self._values = [probe() for _, probe in self._probes]

    def changed(self) -> list[str]:
        """Where a change happened since this was made (``"closure 'model': 0.weight"``,
        ``"closure 'model': 0.weight.grad"``, ``"global 'losses'"``)."""
        found = []
        with _collector_paused():
            after = _states([t for _, t in self._tensors], self._alive)
        for (label, _), before, now in zip(self._tensors, self._tensor_states, after, strict=True):
            if before[0] != now[0]:
                found.append(label)
            if before[1] != now[1]:
                found.append(f"{label}.grad")
        for (label, probe), before in zip(self._probes, self._values, strict=True):
            if probe() != before:
                found.append(label)
        return list(dict.fromkeys(found))

    def report(self) -> list[str]:
        """:meth:`changed`, grouped by owner, in words for the report's first line."""
        owners: dict[str, list[str]] = {}
        for label in self.changed():
            owner, _, name = label.partition(": ")
            owners.setdefault(owner, []).extend([name] if name else [])
        return [f"changed {owner}" + _listed(names) for owner, names in owners.items()]

    # ---- what is recorded ---------------------------------------------------------------------
    def _process_wide(self, parts: StepParts) -> None:
        modules, optimizers, grads = _alive_in_process()
        main = {id(v): k for k, v in vars(sys.modules.get("__main__", sys)).items()}
        seen: set[int] = set()
        inner = {id(m) for module in modules for m in _submodules(module)}
        for module in dict.fromkeys([*parts.models, *(m for m in modules if id(m) not in inner)]):
            owner = _owner(parts, module, main)
            for name, t in _tensors_of(module):
                if id(t) not in seen:
                    seen.add(id(t))
                    self._tensors.append((f"{owner}: {name}", t))
        for opt in dict.fromkeys([*parts.optimizers, *optimizers]):
            if isinstance((instance_dict(opt) or {}).get("state"), dict):  # one made whole
                self._optimizer(_owner(parts, opt, main), opt)
        for t in dict.fromkeys([*parts.tensors, *grads]):
            if id(t) not in seen:
                self._tensors.append((_owner(parts, t, main), t))

    def _optimizer(self, owner: str, opt: torch.optim.Optimizer) -> None:
        # the state's tensors, and a learning rate kept as a tensor, say
        for table, entries in (("state", opt.state.values()), ("param_groups", opt.param_groups)):
            for i, entry in enumerate(entries):
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor):
                        self._tensors.append((f"{owner}: {table}[{i}][{key!r}]", value))
        alive = self._alive
        self._probes.append((f"{owner}: state", lambda: _plain(list(opt.state.items()), alive)))
        self._probes.append((f"{owner}: param_groups", lambda: _plain(opt.param_groups, alive)))

    def _reached(self, parts: StepParts) -> None:
        reach = parts.reach
        for key, value in reach.objects.items():
            where = reach.where[key] or "the step"
            what = kind(value)
            if what == "tensor":
                self._tensors.append((where, value))
            elif what in _SUMMARIES:
                summary = functools.partial(_SUMMARIES[what], value, self._alive)
                self._probes.append((where + _written_through(value) * (what == "file"), summary))
            elif what == "writes":
                scope, home = value.__globals__, value.__globals__ is reach.home
                for name in sorted(stored_globals(value.__code__)):
                    label = f"global '{name}'" if home else f"{scope.get('__name__', '?')}.{name}"
                    probe = functools.partial(_binding, scope, name, self._alive)
                    self._probes.append((label, probe))


def _written_through(handle: Any) -> str:
    """What a changed file handle or database connection opened before the step says."""
    name = getattr(handle, "name", None)  # a file's path (a descriptor's is a number)
    if isinstance(name, str):
        return f" (the open file {name}, written through, not put back)"
    return " (an open file or database written through, not put back)"


# ---- summaries that compare ---------------------------------------------------------------------
@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The garbage collector paused (its passes would cost more than the records)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _alive_in_process() -> tuple[list[nn.Module], list[torch.optim.Optimizer], list[torch.Tensor]]:
    """Every module, optimizer and tensor requiring grad of its own the garbage collector knows
    (sorted by type, in C loops: ``isinstance`` would run a Python loop over every object, and
    may run an object's ``__class__``)."""
    everything = gc.get_objects()
    kinds = set(map(type, everything))
    wanted = {cls for cls in kinds if issubclass(cls, _KINDS)}
    found = list(itertools.compress(everything, map(wanted.__contains__, map(type, everything))))
    del everything
    found = list(itertools.filterfalse(is_a_copy, found))  # an earlier run's, kept by a cache
    modules = [o for o in found if issubclass(type(o), nn.Module)]
    optimizers = [o for o in found if issubclass(type(o), torch.optim.Optimizer)]
    tensors = [o for o in found if issubclass(type(o), torch.Tensor) and _leaf_with_grad(o)]
    return modules, optimizers, tensors


_KINDS = (nn.Module, torch.optim.Optimizer, torch.Tensor)


def _submodules(module: nn.Module) -> list[nn.Module]:
    held = (instance_dict(module) or {}).get("_modules") or {}  # none in one half made
    return [m for m in held.values() if m is not None]


def _tensors_of(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    try:
        return [*module.named_parameters(), *module.named_buffers()]
    except AttributeError:  # half made (a copy that failed): nobody can use it
        return []


def _leaf_with_grad(t: torch.Tensor) -> bool:
    try:
        return t.requires_grad and t.is_leaf
    except Exception:  # a tensor subclass that cannot say
        return False


def _owner(parts: StepParts, value: Any, main: dict[int, str]) -> str:
    """Where the step reaches ``value``, else its name in ``__main__`` if it has one."""
    if id(value) in parts.where:
        return parts.where[id(value)]
    key = id(value)
    what = f"'{main[key]}'" if key in main else f"a {type(value).__name__} at {key:#x}"
    return f"{what}, not found in the step"


def _states(tensors: list[torch.Tensor], alive: list[Any]) -> list[tuple[Any, Any]]:
    """Per tensor: (its version and values, its gradient's identity, version and values)."""
    grads = [t.grad if _leaf_with_grad(t) else None for t in tensors]
    alive.extend(g for g in grads if g is not None)
    prints = _fingerprints([*tensors, *(g for g in grads if g is not None)])
    values = iter(prints[len(tensors) :])
    found = []
    for t, grad, printed in zip(tensors, grads, prints[: len(tensors)], strict=True):
        grad_state = None if grad is None else (id(grad), _version(grad), next(values))
        found.append(((_version(t), printed), grad_state))
    return found


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except Exception:  # inference tensors count no versions
        return -1


def _fingerprints(tensors: list[torch.Tensor]) -> list[tuple | None]:
    """(sum of magnitudes, norm) of each tensor in float64: for floating tensors in one launch
    per device and dtype, read from the device once per group."""
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    found: list[tuple | None] = [None] * len(tensors)
    for i, t in enumerate(tensors):
        plain = type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided
        if not plain or t.device.type == "meta":
            continue  # a subclass's sum may communicate (a DTensor's); its version is compared
        x = t.detach()
        x = torch.view_as_real(x) if x.is_complex() else x
        if x.is_floating_point():
            groups.setdefault((x.device, x.dtype), []).append((i, x))
        else:  # an integer or boolean buffer (a count): few and small
            x = x.to(torch.float64)
            found[i] = tuple(torch.stack([x.abs().sum(), x.norm()]).tolist())
    for members in groups.values():
        try:
            printed = _sums_and_norms([x for _, x in members])
        except RuntimeError as error:  # one of them unreadable: each alone
            if not _overwritten(error):
                raise
            printed = [_readable_sums_and_norms(x) for _, x in members]
        for (i, _), value in zip(members, printed, strict=True):
            found[i] = value
    return [None if f is None else tuple("nan" if math.isnan(v) else v for v in f) for f in found]


def _sums_and_norms(group: list[torch.Tensor]) -> list[tuple[float, float]]:
    sums = torch._foreach_norm(group, 1, dtype=torch.float64)
    norms = torch._foreach_norm(group, 2, dtype=torch.float64)
    values = torch.stack([*sums, *norms]).tolist()  # sync: once per group
    return list(zip(values[: len(group)], values[len(group) :], strict=True))


def _readable_sums_and_norms(x: torch.Tensor) -> tuple[float, float] | None:
    """None for a tensor that can no longer be read: compared by its version alone."""
    try:
        return _sums_and_norms([x])[0]
    except RuntimeError as error:
        if not _overwritten(error):
            raise
        return None


def _overwritten(error: RuntimeError) -> bool:
    """A CUDA graph's output its graph has run over since (a model compiled with
    ``mode="reduce-overhead"`` that a later replay left behind): torch refuses to read it."""
    return "overwritten by a subsequent run" in str(error)


def _plain(value: Any, alive: list[Any]) -> Any:
    """``value`` comparable with ``==``: tensors and other objects by identity (a tensor's values
    are recorded on their own)."""
    if isinstance(value, torch.Tensor):
        alive.append(value)
        return ("tensor", id(value))
    if isinstance(value, dict):
        return tuple((_plain(k, alive), _plain(v, alive)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v, alive) for v in value)
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    alive.append(value)
    return ("object", id(value))


def _items(value: Any, alive: list[Any]) -> Any:
    """A container's items or an object's attributes as the objects they are (identity, not
    equality); of a long container, its length and its ends."""
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, set, collections.deque)):
        pairs = list(enumerate(value))
    else:
        pairs = list(attributes_of(value))
    if len(pairs) > LARGE:
        pairs = [("length", len(pairs)), *pairs[:100], *pairs[-100:]]
    alive.extend(v for _, v in pairs)
    return tuple((k if isinstance(k, (str, int)) else id(k), id(v)) for k, v in pairs)


def _rng_state(value: Any, alive: list[Any]) -> Any:
    if isinstance(value, torch.Generator):
        return bytes(value.get_state().numpy())
    getter = getattr(value, "getstate", None) or getattr(value, "get_state", None)
    if getter is not None:
        return repr(getter())
    return repr(getattr(getattr(value, "bit_generator", value), "state", None))


def _position(value: Any, alive: list[Any]) -> Any:
    """Where a file open for writing stands, or how many rows a database connection changed."""
    try:
        if hasattr(value, "total_changes"):  # a sqlite3 connection
            return value.total_changes
        return None if value.closed or not value.writable() else value.tell()
    except Exception:  # not seekable, or closed: nothing to compare
        return None


def _binding(scope: dict[str, Any], name: str, alive: list[Any]) -> int | None:
    if name not in scope:
        return None
    alive.append(scope[name])
    return id(scope[name])


_SUMMARIES: dict[str, Callable[[Any, list[Any]], Any]] = {
    "state": _items, "rng": _rng_state, "file": _position,
}  # fmt: skip


def _listed(names: list[str]) -> str:
    names = list(dict.fromkeys(names))
    if not names:
        return ""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f" ({shown})"
