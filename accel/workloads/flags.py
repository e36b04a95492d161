"""Optimization flags: dataclass fields that carry their phase, help text and requirements."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from accel import triton_support
from accel.phases import WORKBOOK, checked_phase

Requirement = Literal["cuda", "triton", "torchao"]  # torchao: a CUDA GPU and torchao


def flag(help: str, phase: str, *, requires=None, adopted=True) -> Any:
    """A boolean optimization switch: off is the "before", on applies one optimization.

    ``adopted=False`` marks an alternative the phase explores but does not keep (another route to
    the same gain, or one that changes numerics): later phases start from the adopted flags only.
    ``phase``: one of ``accel.phases.PHASES``; ``requires``: a :data:`Requirement` or None.
    """
    return _switch(help, phase, False, requires, adopted=adopted)


def option(help: str, phase: str, *, default: Any, choices: tuple, requires=None) -> Any:
    """A switch with several settings (a backend, an interval); ``default`` is the "before"."""
    if default not in choices:
        raise ValueError(f"default {default!r} is not among the choices {choices}")
    return _switch(help, phase, default, requires, choices=tuple(choices))


def _switch(help: str, phase: str, default: Any, requires: Requirement | None, **more: Any) -> Any:
    metadata = {"help": help, "phase": checked_phase(phase), "requires": requires, **more}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class FlagInfo:
    name: str
    default: Any
    help: str
    phase: str
    requires: Requirement | None
    choices: tuple[Any, ...] | None
    adopted: bool

    @property
    def is_bool(self) -> bool:
        return self.choices is None


def describe(flags_type: type) -> list[FlagInfo]:
    """The flags of a ``Flags`` dataclass, in declaration order; checks the contract."""
    if not (dataclasses.is_dataclass(flags_type) and isinstance(flags_type, type)):
        raise TypeError(f"expected a Flags dataclass type, got {flags_type!r}")
    if not flags_type.__dataclass_params__.frozen:  # a panel keys its built steps by the flags
        raise TypeError(
            f"{flags_type.__name__} must be a frozen dataclass (@dataclass(frozen=True)): "
            "a flag set is a key, one built step kept per set"
        )
    fields = dataclasses.fields(flags_type)
    for f in fields:
        if "phase" not in f.metadata:
            raise TypeError(
                f"{flags_type.__name__}.{f.name} was not declared with flag() or option(): "
                "every flag needs a phase and a help text"
            )
    return [
        FlagInfo(f.name, f.default, **{"choices": None, "adopted": False, **f.metadata})
        for f in fields
    ]


def unavailable(flags_type: type, device: torch.device | str) -> dict[str, str]:
    """Flags that cannot run on ``device``, each with the reason (shown beside its checkbox)."""
    import importlib.util

    device = torch.device(device)
    reasons = {}
    for info in describe(flags_type):
        if info.requires == "cuda" and device.type != "cuda":
            reasons[info.name] = f"needs a CUDA GPU; this run is on {device.type}"
        elif info.requires == "triton" and triton_support.unavailable(device) is not None:
            reasons[info.name] = triton_support.unavailable(device)  # not installed, or no GPU
        elif info.requires == "torchao" and device.type != "cuda":
            reasons[info.name] = f"needs a CUDA GPU and torchao; this run is on {device.type}"
        elif info.requires == "torchao" and importlib.util.find_spec("torchao") is None:
            reasons[info.name] = "needs torchao (pip install torchao), which is not installed"
    return reasons


def label(flags: Any) -> str:
    """'baseline' for the defaults, else the changed flags joined by '+': 'fused_adamw+x=2'."""
    values = [(i.name, getattr(flags, i.name), i.default) for i in describe(type(flags))]
    changed = [n if v is True else f"{n}={v}" for n, v, default in values if v != default]
    return "+".join(changed) or "baseline"


def all_on(flags_type: type, device: torch.device | str | None = None) -> Any:
    """Every boolean flag on (those that can run on ``device``), options at their defaults."""
    skip = unavailable(flags_type, device) if device is not None else {}
    return flags_type(
        **{i.name: True for i in describe(flags_type) if i.is_bool and i.name not in skip}
    )


def through_phase(flags_type: type, phase: str) -> Any:
    """The flags a workbook phase starts the next one from: every adopted boolean flag of
    ``phase`` and of the phases before it (``accel.phases.WORKBOOK`` order) on, everything else at
    its default."""
    before = WORKBOOK[: WORKBOOK.index(checked_phase(phase, WORKBOOK)) + 1]
    on = [i.name for i in describe(flags_type) if i.is_bool and i.adopted and i.phase in before]
    return flags_type(**dict.fromkeys(on, True))


class Presets:
    """A workload's ``Sizes`` by preset name: ``Sizes.preset("gpu")``. The module sets
    ``Sizes.PRESETS`` once the sizes it names exist."""

    PRESETS: ClassVar[dict[str, Any]] = {}

    @classmethod
    def preset(cls, name: str) -> Any:
        """``PRESETS[name]``, or a ValueError listing the valid names."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(cls.PRESETS)}")
        return cls.PRESETS[name]


def check_int(name: str, value: Any, lo: int = 1, hi: int | None = None, why: str = "") -> None:
    """A ValueError naming ``Sizes.<name>`` unless ``value`` is an int in ``lo..hi``."""
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        valid = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(
            f"Sizes.{name} must be an int {valid}{' ' + why if why else ''}, got {value!r}"
        )


def check_sizes(sizes: Any, ints: tuple[str, ...] = (), positive: tuple[str, ...] = ()) -> None:
    """A workload's ``Sizes`` checked on creation: each of ``ints`` an int >= 1, each of
    ``positive`` > 0; a ValueError names the first field that is not."""
    for name in ints:
        check_int(name, getattr(sizes, name))
    for name in positive:
        if not getattr(sizes, name) > 0:
            raise ValueError(f"Sizes.{name} must be > 0, got {getattr(sizes, name)!r}")
