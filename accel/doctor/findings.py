"""A finding: what the doctor saw in a step, the evidence, the predicted gain and its cost model,
the notebook that teaches the fix, and the change to make. The checks that produce findings read
one :class:`Evidence` of the step; :func:`accel.doctor.examine.detect` runs them all.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from accel.doctor.parts import StepParts
from accel.doctor.recorder import OpRecord, Recording, Site
from accel.doctor.timeline import Timeline

__all__ = ["CHECKS", "Evidence", "Finding", "check"]


@dataclass
class Finding:
    """One problem found in a step. ``saved_us``: the predicted time saved per step by the
    change, from ``cost_model`` (None where this machine cannot predict it, a CPU say).
    ``fixes`` name the automatic fixes :meth:`Report.try_fixes` can apply for it."""

    kind: str
    title: str
    evidence: str
    cost_model: str
    notebook: str
    change: str
    saved_us: float | None = None
    sites: list[Site] = field(default_factory=list)
    fixes: tuple[str, ...] = ()
    saved_by_fix: dict[str, float] = field(default_factory=dict)  # where its fixes differ
    detail: Any = None  # what the check found, for the fixes that act on it (a chain's lines)
    measured_us: float | None = None  # the saving its best fix measured, once tried
    kernels_us: float | None = None  # the kernels' own saving, where the step keeps less of it

    def speedup(self, step_us: float) -> float:
        """The iteration's speedup if ``saved_us`` is saved (NaN where not predicted)."""
        if self.saved_us is None or step_us <= 0:
            return math.nan
        return step_us / (step_us - min(self.saved_us, step_us * 0.999))

    def row(self, step_us: float) -> dict[str, Any]:
        return {
            "finding": self.title,
            "kind": self.kind,
            "evidence": self.evidence,
            "where": "; ".join(dict.fromkeys(str(s) for s in self.sites)),
            "predicted saving (ms/step)":
                math.nan if self.saved_us is None else self.saved_us / 1e3,
            "predicted speedup": self.speedup(step_us),
            "cost model": self.cost_model,
            "notebook": self.notebook,
            "change": self.change,
            "automatic fixes": ", ".join(self.fixes),
        }


@dataclass
class Evidence:
    """Everything measured about one step, shared by the checks. Rates and per-event costs of
    this machine are measured on first use (:attr:`ceilings`, :attr:`costs`)."""

    device: torch.device
    parts: StepParts
    recording: Recording
    timeline: Timeline
    batch: Any
    memory: dict[str, float] = field(default_factory=dict)
    loader: dict[str, Any] | None = None
    graph_breaks: list[tuple[str, Site | None]] | None = None
    more_calls: list[Recording] = field(default_factory=list)  # recorded again, untimed
    measure: dict[str, Callable[[], Any]] = field(default_factory=dict, repr=False)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def step_us(self) -> float:
        return self.timeline.step_us

    @property
    def iteration_us(self) -> float:
        """The step and, when a loader feeds it, its wait for the next batch."""
        return self.step_us + (self.loader["wait_us"] if self.loader else 0.0)

    @functools.cached_property
    def ceilings(self):
        """The copy bandwidth and bf16 (or float32 on a CPU) matrix-product rate measured here."""
        from accel.measure.ceilings import measure_ceilings

        default = lambda: _once("ceilings", self.device, measure_ceilings)  # noqa: E731
        return self.measure.get("ceilings", default)()

    @functools.cached_property
    def costs(self):
        """What one launch and one host-device sync cost here (``accel.measure.costs``)."""
        from accel.measure.costs import measure_costs

        return self.measure.get("costs", lambda: _once("costs", self.device, measure_costs))()

    def copy_in_gb_s(self, nbytes: int, pinned: bool) -> float:
        """The rate of a copy of ``nbytes`` in to this CUDA device from pinned (non-blocking) or
        pageable memory, measured once per device, kind and probe size in this process."""
        from accel.measure.ceilings import copy_in_probe_bytes, measure_copy_in_gb_s

        if "copy_in" in self.measure:
            return self.measure["copy_in"](nbytes, pinned)
        size = copy_in_probe_bytes(nbytes)
        measure = functools.partial(measure_copy_in_gb_s, nbytes=size, pinned=pinned)
        kind = "pinned" if pinned else "pageable"
        return _once(f"{kind} copy of {size} bytes", self.device, measure)

    @property
    def recordings(self) -> list[Recording]:
        """The timed call's recording, then the calls recorded after it."""
        return [self.recording, *self.more_calls]

    def forward_ops(self) -> list[OpRecord]:
        return [op for op in self.recording.ops if not op.backward]


_MACHINE: dict[tuple[str, str], Any] = {}  # the machine's rates, measured once per process


def _once(what: str, device: torch.device, measure: Callable[[torch.device], Any]) -> Any:
    key = (what, str(device))
    if key not in _MACHINE:
        _MACHINE[key] = measure(device)
    return _MACHINE[key]


Check = Callable[[Evidence], list[Finding]]
CHECKS: dict[str, Check] = {}


def check(name: str) -> Callable[[Check], Check]:
    """Register a check under ``name``; the checks run in the order they were registered."""

    def register(fn: Check) -> Check:
        CHECKS[name] = fn
        return fn

    return register
