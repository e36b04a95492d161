"""The lab: measure honestly, show it live.

A notebook starts with ``from accel import lab`` and ``here = lab.setup()`` (device, preset,
whether targets are judged), then reaches what it needs as ``lab.compare``, ``lab.plots``,
``lab.FeaturePanel`` ... Each name is imported on first use, so ``import accel.lab.timing`` costs
no plotly and ``lab.compare`` no ipywidgets.

Submodules, lightest first: ``device`` (presets, versions), ``timing``, ``ceilings``, ``costs``,
``profile`` (pandas), ``attention`` (SDPA's kernels at a shape), ``plots`` (plotly), ``live_figure`` and ``panel`` (ipywidgets), ``bench``,
``recorded`` (a quick figure beside the bench's), ``cases.<phase>``.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the submodule that defines it
_PUBLIC = {
    "setup": "device",
    "Setup": "device",
    "default_device": "device",
    "preset": "device",
    "versions": "device",
    "compare": "timing",
    "time_fn": "timing",
    "measure_ceilings": "ceilings",
    "measure_costs": "costs",
    "profile_step": "profile",
    "sdpa_backends": "attention",
    "LiveFigure": "live_figure",
    "FeaturePanel": "panel",
    "recorded_results": "bench",
    "beside_recorded": "recorded",
    "result_sentence": "recorded",
    "ceilings_frame": "bench",
    "run_bench": "bench",
    "ladder_table": "cases.doctor_ladder",
}
_SUBMODULES = (
    "device",
    "timing",
    "ceilings",
    "costs",
    "profile",
    "plots",
    "live_figure",
    "panel",
    "bench",
    "recorded",
    "cases",
)

__all__ = [*_PUBLIC, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
