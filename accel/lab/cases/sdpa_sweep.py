"""The sdpa phase's sweep: every backend's TFLOP/s over sequence length, head dimension, causal
or full, forward or forward + backward, with ``auto`` judged at every point against PyTorch's
default and the best forced backend, round by round; its rows, and the recorded rows read back
for the figure (:func:`accel.lab.plots.sdpa_sweep`).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from accel import attention
from accel.lab.bench import BenchContext, Row
from accel.lab.cases.sdpa_measure import (
    PHASE,
    PICKED,
    TARGET_VS_BEST,
    AttnCase,
    measure_point,
    tflop_s,
)

SWEEP_VARIANTS = ("default", "auto", "flash", "efficient", "cudnn", "math")


@dataclass(frozen=True)
class SweepSizes:
    seqs: tuple[int, ...]
    head_dims: tuple[int, ...]
    heads: int
    tokens: int  # batch x seq at every point: the same work per token, S varies
    dtype: torch.dtype
    repeats: int

    def cases(self) -> list[AttnCase]:
        return [
            AttnCase(max(1, self.tokens // s), self.heads, s, d, causal, backward, dtype=self.dtype)
            for backward in (False, True)
            for causal in (False, True)
            for d in self.head_dims
            for s in self.seqs
        ]


def sweep(
    device: torch.device,
    sizes: SweepSizes,
    *,
    variants: Sequence[str] = SWEEP_VARIANTS,
    on_point: Callable[[AttnCase], None] | None = None,
) -> pd.DataFrame:
    """TFLOP/s of each variant at every sweep point; long format, one row per (point, variant),
    with ``skipped`` holding the reason where a variant could not run, and per point the
    backend ``auto`` picked (``picked``), the time of a second copy of that backend forced
    (``picked_ms``, see ``PICKED``), auto's own decision times (``decision``), each variant's
    time over auto's taken round by round (``versus_auto``, :func:`paired_ratio`) and the pick
    over its second copy, likewise (``control``)."""
    rows = []
    for case in sizes.cases():
        if on_point is not None:
            on_point(case)
        point = measure_point(case, device, variants, repeats=sizes.repeats)
        times, skipped = point.times, point.skipped
        for variant in variants:
            ms = times.get(variant, math.nan)
            rows.append(
                {
                    "S": case.seq,
                    "D": case.head_dim,
                    "B": case.batch,
                    "H": case.heads,
                    "causal": case.causal,
                    "direction": case.direction,
                    "backend": variant,
                    "ms": ms,
                    "flops": case.flops,
                    "tflop_s": tflop_s(case.flops, ms),
                    "skipped": skipped.get(variant, ""),
                    "picked": point.picked,
                    "picked_ms": times.get(PICKED, math.nan),
                    "decision": point.decision,
                    "versus_auto": point.versus_auto.get(variant, math.nan),
                    "control": point.control,
                }
            )
    return pd.DataFrame(rows)


def _versus_auto(part: pd.DataFrame) -> dict[str, float]:
    """At one sweep point, each backend's time over auto's: round by round (``versus_auto``)
    when the frame has them, else from the medians (frames read back from recorded rows)."""
    rows = part[part["skipped"] == ""] if "skipped" in part else part
    if "versus_auto" in rows and rows["versus_auto"].notna().any():
        return dict(zip(rows["backend"], rows["versus_auto"], strict=True))
    ms = dict(zip(rows["backend"], rows["ms"], strict=True))
    return {b: t / ms.get("auto", math.nan) for b, t in ms.items()}


def _paired(part: pd.DataFrame) -> tuple[float, float, str]:
    """At one sweep point: auto's speed over PyTorch's default and over the best forced backend,
    and that backend (:func:`_versus_auto`)."""
    versus = _versus_auto(part)
    forced = {b: r for b, r in versus.items() if b in attention.FORCED and not math.isnan(r)}
    best = min(forced, key=forced.__getitem__, default="")
    return versus.get("default", math.nan), forced.get(best, math.nan), best


def _pick_note(part: pd.DataFrame) -> tuple[str, float, float]:
    """What auto picked at one sweep point, as a note, with auto / its pick forced and the
    control (the pick's second copy / its first), both round by round where measured so."""
    first = part.iloc[0]
    picked = first.get("picked", "") if "picked" in part else ""
    if not isinstance(picked, str) or not picked:
        return "", math.nan, math.nan
    vs_forced = _versus_auto(part).get(picked, math.nan)
    control = first.get("control", math.nan)
    if math.isnan(control):
        control = part.set_index("backend")["ms"].get(picked, math.nan) / first["picked_ms"]
    return (
        f"; auto picked {picked} (its decision: {first['decision']}); "
        f"auto / {picked} forced = {vs_forced:.3f}; {picked} forced again / {picked} forced = "
        f"{control:.3f} (same kernel: the measurement's own spread)",
        vs_forced,
        control,
    )


def _spread_note(control: float) -> str:
    """Said where the same kernel timed twice differs by more than the target's margin: there
    the point's verdict lies inside the measurement's own spread."""
    margin = 1 - TARGET_VS_BEST
    if math.isnan(control) or abs(control - 1) <= margin:
        return ""
    return (
        f"; the same kernel twice differs by {abs(control - 1):.1%}, more than the target's "
        f"{margin:.0%} margin: this point's verdict is inside the measurement's spread"
    )


def _sweep_case(direction: str, causal: bool, d: int, s: int) -> str:
    return f"sweep {direction} {'causal' if causal else 'full'} D={d} S={s}"


_SWEEP_CASE = re.compile(
    r"sweep (?P<direction>\S+) (?P<mask>causal|full) D=(?P<D>\d+) S=(?P<S>\d+)"
)


def sweep_rows(frame: pd.DataFrame, ctx: BenchContext, judged: bool) -> list[Row]:
    """One row per sweep point: auto against PyTorch's default, every backend's TFLOP/s in the
    note (``name=value``; :func:`sweep_frame` reads them back)."""
    rows = []
    for (direction, causal, d, s), part in frame.groupby(
        ["direction", "causal", "D", "S"], sort=False
    ):
        rate = dict(zip(part["backend"], part["tflop_s"], strict=True))
        auto, default = rate.get("auto", math.nan), rate.get("default", math.nan)
        vs_default, vs_best, best = _paired(part)
        skipped = {b: r for b, r in zip(part["backend"], part["skipped"], strict=True) if r}
        note = " ".join(f"{b}={v:.4g}" for b, v in rate.items() if not math.isnan(v))
        if skipped:
            note += "; skipped: " + "; ".join(f"{b}: {r[:80]}" for b, r in skipped.items())
        note += (
            f"; judged round by round: auto / default = {vs_default:.3f}, "
            f"auto / best forced ({best}) = {vs_best:.3f}"
        )
        pick_note, _, control = _pick_note(part)
        note += pick_note + _spread_note(control)
        first = part.iloc[0]
        rows.append(
            Row(
                PHASE,
                _sweep_case(direction, bool(causal), int(d), int(s)),
                f"rate, B={first['B']} H={first['H']}",
                "TFLOP/s",
                auto,
                baseline=default,
                higher_is_better=True,
                fraction_of_ceiling=auto / ctx.ceilings.matmul_tflop_s,
                target=f">= {TARGET_VS_BEST}x default and best forced",
                met=(vs_default >= TARGET_VS_BEST and vs_best >= TARGET_VS_BEST)
                if judged
                else None,
                note=note,
            )
        )
    return rows


def sweep_frame(recorded: pd.DataFrame) -> pd.DataFrame:
    """Recorded sweep rows (``recorded_results("sdpa")``) back in the long format of
    :func:`sweep`: one row per (device, point, backend) with its TFLOP/s."""
    out = []
    for _, row in recorded.iterrows():
        match = _SWEEP_CASE.fullmatch(str(row["case"]))
        if not match:
            continue
        note = str(row.get("note", "")).split(";")[0]
        for pair in note.split():
            backend, _, value = pair.partition("=")
            out.append(
                {
                    "device": row.get("device", ""),
                    "S": int(match["S"]),
                    "D": int(match["D"]),
                    "causal": match["mask"] == "causal",
                    "direction": match["direction"],
                    "backend": backend,
                    "tflop_s": float(value),
                }
            )
    return pd.DataFrame(
        out, columns=["device", "S", "D", "causal", "direction", "backend", "tflop_s"]
    )


def sweep_summary_rows(frame: pd.DataFrame, judged: bool) -> list[Row]:
    points = [part for _, part in frame.groupby(["direction", "causal", "D", "S"], sort=False)]
    paired = [_paired(part) for part in points]
    vs_default = min(p[0] for p in paired)
    vs_best = min(p[1] for p in paired)
    explain = []
    if "picked" in frame:
        ratios = [
            _pick_note(part)[1:]
            for _, part in frame.groupby(["direction", "causal", "D", "S"], sort=False)
        ]
        for name, values, what in (
            ("auto / the same backend forced", [r[0] for r in ratios], "auto's own cost"),
            (
                "the pick forced again / forced",
                [r[1] for r in ratios],
                "same kernel twice: the spread of the measurement itself",
            ),
        ):
            values = [x for x in values if not math.isnan(x)]
            if values:
                explain.append(
                    Row(
                        PHASE,
                        f"sweep: worst {name}",
                        "ratio of TFLOP/s",
                        "x",
                        min(values),
                        note=f"no target; {what}; minimum over {len(values)} points, "
                        f"median {statistics.median(values):.3f}",
                    )
                )
    return explain + [
        Row(
            PHASE,
            f"sweep: worst auto / {name}",
            "ratio of TFLOP/s",
            "x",
            value,
            target=f">= {TARGET_VS_BEST}x",
            met=(value >= TARGET_VS_BEST) if judged else None,
            note=f"minimum over {len(points)} points, each the median of its rounds' ratios",
        )
        for name, value in (("default", vs_default), ("best forced backend", vs_best))
    ]
