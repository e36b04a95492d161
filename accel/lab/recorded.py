"""A notebook's quick figure beside the bench's recorded one for the same machine and case.

A notebook measures briefly, at interactive speed; ``python -m accel bench`` measures the same
case for longer and records it under ``results/``. :func:`beside_recorded` puts the two side by
side and says whether they agree within the quick run's own spread (the 10th to 90th percentile
of its round-by-round ratios), so a notebook that disagrees with the record says so instead of
leaving the reader to notice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from accel.lab.bench import recorded_results
from accel.measure.device import device_name
from accel.measure.show import readable


@dataclass(frozen=True)
class Agreement:
    """One quick figure against the recorded row of this machine (``recorded`` None: none)."""

    what: str  # "sync / field_trainer_window, speedup"
    measured: float
    band: tuple[float, float] | None  # the quick run's spread; None where it has none
    device: str
    recorded: float | None = None
    date: str | None = None
    elsewhere: dict[str, float] = field(default_factory=dict)  # other machines' records

    @property
    def agrees(self) -> bool | None:
        """Whether the record lies within the quick run's spread; None without both."""
        if self.recorded is None or self.band is None:
            return None
        low, high = self.band
        return low <= self.recorded <= high

    def __str__(self) -> str:
        quick = f"this run {self.measured:.3g}" + (
            f" (10-90% of its rounds {self.band[0]:.3g}-{self.band[1]:.3g})" if self.band else ""
        )
        if self.recorded is None:
            others = "; ".join(f"{d}: {v:.3g}" for d, v in self.elsewhere.items())
            return f"{self.what}: {quick}; no bench row recorded for {self.device}" + (
                f" (recorded on {others})" if others else ""
            )
        record = f"the bench recorded {self.recorded:.3g} on this machine ({self.date})"
        if self.agrees is None:
            verdict = "no spread measured here to judge them by"
        elif self.agrees:
            verdict = "they agree within this run's spread"
        else:
            verdict = (
                "they disagree beyond this run's spread: the bench's longer measurement is the "
                "figure to quote; the difference is this run's length, this machine's state, or "
                "a change since the record"
            )
        return f"{self.what}: {quick}; {record}: {verdict}"


def beside_recorded(
    phase: str, case: str, measured: float, band: tuple[float, float] | None, *,
    device: torch.device | str, metric: str = "speedup", results_dir: str | Path | None = None,
) -> Agreement:  # fmt: skip
    """``measured`` (with its spread ``band``) against the latest recorded ``metric`` column
    (``speedup``, ``optimized``, ...) of ``phase``/``case`` on this machine's device."""
    rows = recorded_results(phase, results_dir)
    if metric not in rows.columns:
        raise ValueError(
            f"metric must be a results column ({', '.join(rows.columns)}), got {metric!r}"
        )
    rows = rows[rows["case"] == case]
    here = device_name(device)
    mine = rows[rows["device"] == here].sort_values("date")
    elsewhere = {
        str(d): float(part.sort_values("date")[metric].iloc[-1])
        for d, part in rows[rows["device"] != here].groupby("device")
    }
    agreement = Agreement(f"{phase} / {case}, {metric}", measured, band, here, elsewhere=elsewhere)
    if mine.empty:
        return agreement
    last = mine.iloc[-1]
    if last[metric] is None or pd.isna(last[metric]):  # a row without that figure: none
        return agreement
    return dataclasses.replace(agreement, recorded=float(last[metric]), date=str(last["date"]))


def result_sentence(
    phase: str, case: str, *, metric: str | None = None, figure: str = "speedup",
    results_dir: str | Path | None = None,
) -> str:  # fmt: skip
    """What the bench recorded for ``phase``/``case`` on every GPU, as one sentence a notebook
    prints, so that its prose cannot disagree with the rows: "on the <GPU> (<date>): <speedup>x
    (<figure> <unit>), target <target> met; on the <other GPU> ...".

    ``metric`` picks one of the case's measured quantities (the rows' ``metric`` column) where it
    has several; ``figure`` is the column shown first (``speedup`` or ``optimized``; a row without
    a speedup shows the other). Each GPU's latest row with a figure counts (a row recorded as not
    run does not hide an earlier measurement). Raises where no GPU recorded the case: a notebook
    must not quote a missing row."""
    rows = recorded_results(phase, results_dir)
    rows = rows[(rows["case"] == case) & rows["optimized"].notna()]
    if metric is not None:
        rows = rows[rows["metric"] == metric]
    if rows.empty:
        raise LookupError(
            f"no row {phase!r} / {case!r}" + (f" / {metric!r}" if metric else "")
            + " with a figure recorded under results/"
        )  # fmt: skip
    if metric is None and rows["metric"].nunique() > 1:
        raise ValueError(
            f"{phase!r} / {case!r} has rows of several metrics; pass metric= one of "
            + ", ".join(map(repr, sorted(rows["metric"].unique())))
        )
    parts = []
    for device, part in rows.groupby("device", sort=True):
        last = part.sort_values("date", kind="stable").iloc[-1]  # the last written of a date
        parts.append(f"on the {device} ({last['date']}): {_figure(last, figure)}{_verdict(last)}")
    return "; ".join(parts)


def _figure(row: pd.Series, figure: str) -> str:
    unit = "" if pd.isna(row["unit"]) else row["unit"]
    optimized = f"{readable(row['optimized'])} {unit}".strip()
    if figure == "speedup" and not pd.isna(row["speedup"]):
        return f"{readable(row['speedup'])}x ({optimized})"
    return optimized


def _verdict(row: pd.Series) -> str:
    if pd.isna(row["target"]) or not str(row["target"]).strip():
        return ""
    judged = "not judged" if pd.isna(row["met"]) else "met" if row["met"] else "missed"
    return f", target {row['target']} {judged}"
