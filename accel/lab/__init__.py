"""The lab: measure honestly, show it live.

A notebook starts with ``from accel import lab`` and ``here = lab.setup()`` (device, preset,
whether targets are judged), then reaches ``lab.compare``, ``lab.plots``, ``lab.FeaturePanel``
... Each name is imported on first use, so ``lab.compare`` costs no plotly and no ipywidgets.
Behind it: the measuring library ``accel.measure`` (which the doctor uses too) and the bench on
top of it (``bench``, ``plots``, ``live_figure``, ``panel``, ``recorded``, ``cases.<phase>``).
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_PUBLIC = {
    "setup": "accel.measure.device",
    "Setup": "accel.measure.device",
    "default_device": "accel.measure.device",
    "preset": "accel.measure.device",
    "versions": "accel.measure.device",
    "compare": "accel.measure.timer",
    "time_fn": "accel.measure.timer",
    "measure_ceilings": "accel.measure.ceilings",
    "measure_costs": "accel.measure.costs",
    "profile_step": "accel.measure.profile",
    "sdpa_backends": "accel.measure.attention",
    "LiveFigure": "accel.lab.live_figure",
    "FeaturePanel": "accel.lab.panel",
    "recorded_results": "accel.lab.bench",
    "beside_recorded": "accel.lab.recorded",
    "result_sentence": "accel.lab.recorded",
    "ceilings_frame": "accel.lab.bench",
    "run_bench": "accel.lab.bench",
    "ladder_table": "accel.lab.cases.doctor_ladder",
    "ladder_summary": "accel.lab.cases.doctor_ladder",
}
# submodule name -> the module (the measuring library's keep their short names here)
_SUBMODULES = {
    "device": "accel.measure.device",
    "timing": "accel.measure.timer",
    "ceilings": "accel.measure.ceilings",
    "costs": "accel.measure.costs",
    "profile": "accel.measure.profile",
    "plots": "accel.lab.plots",
    "live_figure": "accel.lab.live_figure",
    "panel": "accel.lab.panel",
    "bench": "accel.lab.bench",
    "recorded": "accel.lab.recorded",
    "cases": "accel.lab.cases",
}

__all__ = [*_PUBLIC, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
