"""FeaturePanel: a checkbox per optimization flag, a run button, and plots that update live.

    panel = FeaturePanel(tiny_mlp.Flags, lambda f: tiny_mlp.build(f, sizes, device=device))
    panel                                   # shows it in a notebook
    panel.controls["fused_adamw"].value = True
    panel.run_button.click()                # or panel.run(); works without a browser
    panel.run(tiny_mlp.Flags(fused_adamw=True))   # a flag set from code, shown on the controls
    panel.results                           # every configuration run so far, against the baseline

Each run times the baseline (all flags off) and the chosen configuration interleaved, so their
ratio is free of drift, then profiles the configuration for the kernel breakdown. One built step is
kept per flag combination: compiled or graphed steps are expensive to rebuild.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import math
import traceback
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from accel.lab import plots
from accel.lab.live_figure import LiveFigure
from accel.measure.device import default_device
from accel.measure.profile import profile_step
from accel.measure.show import readable
from accel.measure.timer import Comparison, compare
from accel.workloads.flags import FlagInfo, describe, label, unavailable

BASELINE = "baseline"
LIVE_DRAW_INTERVAL_S = 0.25  # while timing: a redraw of the whole figure at most this often


class FeaturePanel:
    """A checkbox (or dropdown) per field of a frozen ``Flags`` dataclass declared with
    ``flag()``/``option()``, a Run button, live plots of each run against the baseline (every
    flag at its default) and a table of every configuration run so far (:attr:`results`).

    ``build(flags)`` returns a step: a callable of no arguments, timed as it is (built once per
    flag set and kept). In a notebook, display the panel and click; in code, ``run(flags)``
    times that flag set (the controls then show it), ``run()`` the one the controls show.
    ``around()``, where given, is the context each run happens in (``report.isolated`` for the
    doctor's fixed steps: what they change is put back after each run).
    """

    def __init__(
        self,
        flags_type: type,
        build: Callable[[Any], Callable[[], object]],
        *,
        device: torch.device | str | None = None,
        warmup: int = 3,
        repeats: int = 20,
        profile: bool = True,
        profile_steps: int = 3,
        title: str | None = None,
        around: Callable[[], contextlib.AbstractContextManager] | None = None,
    ):
        self.flags_type = flags_type
        self.build = build
        self.around = around or contextlib.nullcontext
        self.device = torch.device(device) if device is not None else default_device()
        self.warmup, self.repeats = warmup, repeats
        self.profile, self.profile_steps = profile, profile_steps
        self.infos: list[FlagInfo] = describe(flags_type)
        self.disabled = unavailable(flags_type, self.device)
        self._steps: dict[Any, Callable[[], object]] = {}
        self._rows: dict[str, dict[str, Any]] = {}
        # the last run's timings, round by round: the spread of its speedup (ratio_band)
        self.comparison: Comparison | None = None

        self.controls = {info.name: self._control(info) for info in self.infos}
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.run_button.on_click(lambda _: self._run_from_widget())
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="idle")
        self.status = widgets.HTML()
        self.notes = widgets.HTML()  # what a reader should know before the next run (note())
        self.live = LiveFigure(_timings_figure())
        self.kernels_live = LiveFigure(
            plots.kernel_breakdown(pd.DataFrame(columns=["name", "count", "total_us", "share"]))
        )
        self.table = widgets.HTML()

        header = f"<b>{html.escape(title)}</b>" if title else ""
        children = [widgets.HTML(header)] if header else []
        children += self._control_rows()
        children += [self.notes, widgets.HBox([self.run_button, self.progress]), self.status]
        children += [self.live.widget]
        children += [self.kernels_live.widget] if profile else []
        children += [self.table]
        self.widget = widgets.VBox(children)

    # ---- flags <-> widgets -------------------------------------------------------------------
    def _control(self, info: FlagInfo) -> widgets.ValueWidget:
        reason = self.disabled.get(info.name)
        common = dict(value=info.default, description=info.name, disabled=bool(reason),
                      tooltip=info.help + (f" (disabled: {reason})" if reason else ""))  # fmt: skip
        if info.is_bool:
            return widgets.Checkbox(**common, indent=False)
        return widgets.Dropdown(
            options=list(info.choices), **common, layout=widgets.Layout(width="auto"),
            style={"description_width": "initial"},  # the whole name, not "controller..."
        )  # fmt: skip

    def _control_rows(self) -> list[widgets.Widget]:
        rows = []
        for phase in dict.fromkeys(i.phase for i in self.infos):
            boxes = [self.controls[i.name] for i in self.infos if i.phase == phase]
            rows.append(widgets.HBox([widgets.HTML(f"<i>{html.escape(phase)}</i>:"), *boxes]))
        notes = [f"{html.escape(k)}: {html.escape(v)}" for k, v in self.disabled.items()]
        if notes:
            rows.append(widgets.HTML("<small>disabled here: " + "; ".join(notes) + "</small>"))
        return rows

    def note(self, text: str) -> None:
        """Show ``text`` in the panel above its Run button, beside the notes before it: what to
        expect of a run here before it is made (a flag that loses on this device, say)."""
        self.notes.value += f"<div><i>{html.escape(text)}</i></div>"

    def flags(self) -> Any:
        """The flags the controls show now."""
        return self.flags_type(**{name: c.value for name, c in self.controls.items()})

    def show(self, flags: Any) -> None:
        """Set the controls to ``flags`` (a ``Flags`` instance)."""
        if not isinstance(flags, self.flags_type):
            same_name = type(flags).__name__ == self.flags_type.__name__
            raise TypeError(
                f"expected a {self.flags_type.__name__} instance, got {type(flags).__name__}"
                + (" of another class of that name: make the flags with panel.flags_type"
                   if same_name else "")
            )
        for name, control in self.controls.items():
            control.value = getattr(flags, name)

    def step_for(self, flags: Any) -> Callable[[], object]:
        """The built step for ``flags``, built once and kept."""
        if flags not in self._steps:
            self._steps[flags] = self.build(flags)
        return self._steps[flags]

    # ---- running -----------------------------------------------------------------------------
    def run(self, flags: Any = None) -> dict[str, Any]:
        """Time ``flags`` (by default the shown configuration) against the baseline, profile
        it, update the plots; returns its row of :attr:`results`."""
        with self.around():
            return self._run(flags)

    def _run(self, flags: Any) -> dict[str, Any]:
        if flags is not None:
            self.show(flags)
        flags, baseline = self.flags(), self.flags_type()
        blocked = [f.name for f in self.infos
                   if f.name in self.disabled and getattr(flags, f.name) != f.default]  # fmt: skip
        if blocked:
            raise ValueError(
                f"flags {blocked} cannot run on {self.device}: "
                + "; ".join(self.disabled[b] for b in blocked)
            )
        name = label(flags)
        candidates = {BASELINE: self.step_for(baseline)}
        if name != BASELINE:
            candidates[name] = self.step_for(flags)

        samples = {k: [] for k in candidates}
        with self.live.batch_update() as figure:
            figure.data[0].y, figure.data[1].y = [], []
            figure.data[0].name, figure.data[1].name = BASELINE, name
            # whole rounds on the axis: a tick every round for a short run, fewer for a long one
            figure.layout.xaxis.dtick = max(1, math.ceil(self.repeats / 10))
        self.progress.max, self.progress.value = self.repeats * len(candidates), 0
        self.progress.description = "timing"

        def on_sample(who: str, _round: int, ms: float) -> None:
            samples[who].append(ms)
            self.figure.data[0 if who == BASELINE else 1].y = samples[who]
            self.live.draw(at_most_every_s=LIVE_DRAW_INTERVAL_S)  # the summary draws the last
            self.progress.value += 1

        result = self.comparison = compare(candidates, baseline=BASELINE, warmup=self.warmup,
                                           repeats=self.repeats, device=self.device,
                                           on_sample=on_sample)  # fmt: skip
        for key, timing in result.timings.items():
            key_flags = baseline if key == BASELINE else flags
            # the middle half of its speedups over the baseline, round by round
            band = (BASELINE, key, 0.25, 0.75)
            low, high = (1.0, 1.0) if key == BASELINE else result.ratio_band(*band)
            self._rows[key] = self._rows.get(key, {}) | {
                "label": key,
                **dataclasses.asdict(key_flags),
                **timing.summary(),
                "baseline_ms": result.timings[BASELINE].median_ms,  # of the run that timed it
                "speedup": result.speedup(key),
                "speedup_q25": low,
                "speedup_q75": high,
            }
        if self.profile:
            self.progress.description = "profiling"
            kept = ("kernels_per_step", "launches_per_step", "syncs_per_step", "idle_fraction")
            # the baseline's counts once, to read each configuration's against
            unprofiled = [k for k in candidates if k == name or kept[0] not in self._rows[k]]
            for key in sorted(unprofiled, key=lambda k: k == name):  # this run's last: drawn
                report = profile_step(candidates[key], steps=self.profile_steps, warmup=0,
                                      device=self.device)  # fmt: skip
                self._rows[key] |= {k: v for k, v in report.summary().items() if k in kept}
            title = f"Where the time goes:<br>{plots.wrap_label(name, 70)}"
            fresh = plots.kernel_breakdown(report.kernels, title=title)
            with self.kernels_live.batch_update() as kernels:
                kernels.data[0].update(fresh.data[0])
                kernels.layout.title = fresh.layout.title
                kernels.layout.margin.t = 30 + 22 * (1 + title.count("<br>"))
        self._refresh_summary()
        self.progress.description = "done"
        return self._rows[name]

    def _run_from_widget(self) -> None:
        self.run_button.disabled = True
        self.status.value = ""
        try:
            self.run()
        except Exception as exc:  # shown in the panel: a button callback has nowhere else to raise
            self.status.value = (
                f"<pre style='color:#b00'>{html.escape(type(exc).__name__)}: "
                f"{html.escape(str(exc))}\n{html.escape(traceback.format_exc(limit=3))}</pre>"
            )
            self.progress.description = "failed"
        finally:
            self.run_button.disabled = False

    def _refresh_summary(self) -> None:
        frame = self.results
        with self.live.batch_update() as figure:
            bars = figure.data[2]
            bars.y = [plots.wrap_label(x) for x in frame["label"]]
            bars.x = list(frame["speedup"])
            bars.text = [
                f"{s:.2f}x: {ms:.3g} ms (last run)" if label == BASELINE
                else f"{s:.2f}x: {ms:.3g} vs {base:.3g} ms"
                for label, s, ms, base in zip(
                    frame["label"], frame["speedup"], frame["median_ms"], frame["baseline_ms"],
                    strict=True,
                )
            ]  # fmt: skip
            bars.error_x = dict(
                type="data", symmetric=False,
                array=list((frame["speedup_q75"] - frame["speedup"]).clip(lower=0)),
                arrayminus=list((frame["speedup"] - frame["speedup_q25"]).clip(lower=0)),
            )  # fmt: skip
            # the bars get under half the figure: twice their own height, on top of the lines
            figure.layout.height = max(520, 300 + 2 * plots.bars_height(list(frame["label"]), 0))
        self.table.value = results_table(frame)

    @property
    def results(self) -> pd.DataFrame:
        """One row per configuration run so far (latest run wins), baseline first."""
        return pd.DataFrame(list(self._rows.values()))

    @property
    def figure(self) -> go.Figure:
        """The timings figure: this run's samples (top), every configuration's speedup (bars)."""
        return self.live.figure

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def _timings_figure() -> go.Figure:
    """This run's samples (top) and every configuration's speedup (bars), empty."""
    # Stacked, the bars horizontal: configuration labels are long ("a+b+c") and stay readable.
    figure = make_subplots(rows=2, cols=1, vertical_spacing=0.15)
    figure.add_scatter(y=[], mode="lines+markers", name=BASELINE, row=1, col=1)
    figure.add_scatter(y=[], mode="lines+markers", name="this configuration", row=1, col=1)
    figure.add_bar(
        x=[], y=[], orientation="h", textposition="inside", insidetextanchor="start",
        constraintext="none",  # full size, past a short bar's end, never shrunk unreadable
        showlegend=False, row=2, col=1,
    )  # fmt: skip
    figure.update_yaxes(title_text="ms per step, this run", row=1, col=1)
    figure.update_xaxes(title_text="round", rangemode="tozero", row=1, col=1)
    figure.update_xaxes(
        title_text="speedup over the baseline timed beside it in the same run<br>"
        "(text: that run's ms vs its baseline's; bars: middle half of rounds)", row=2, col=1,
    )  # fmt: skip
    figure.add_vline(x=1, line_dash="dot", line_color="gray", row=2, col=1)
    figure.update_yaxes(autorange="reversed", automargin=True, row=2, col=1)
    figure.update_layout(template="plotly_white", height=520, margin=dict(t=40, b=40),
                         legend=dict(orientation="h", x=0, y=1.02, yanchor="bottom"))  # fmt: skip
    return figure


# the table's columns and their headings: short words that wrap, so it fits a notebook's width
TABLE = {
    "label": "configuration", "median_ms": "median ms", "iqr_ms": "IQR ms",
    "baseline_ms": "its baseline ms", "speedup": "speedup", "kernels_per_step": "kernels a step",
    "launches_per_step": "launches a step", "syncs_per_step": "syncs a step",
    "idle_fraction": "device idle",
}  # fmt: skip
TABLE_STYLE = (
    "<style>.accel-results td, .accel-results th {padding: 2px 8px; text-align: right;}"
    " .accel-results :is(td, th):first-child {text-align: left; overflow-wrap: anywhere;}</style>"
)


def results_table(frame: pd.DataFrame) -> str:
    """Every configuration run so far as a narrow HTML table: numbers as the bench's, a long
    configuration label breaking after each "+"."""
    shown = frame[[c for c in TABLE if c in frame]]
    formats = {c: readable for c in shown.columns if c != "label"}
    formats["label"] = lambda s: html.escape(s).replace("+", "+<wbr>")
    formats["speedup"] = "{:.2f}x".format
    if "idle_fraction" in shown:
        formats["idle_fraction"] = lambda v: "" if pd.isna(v) else f"{v:.0%}"
    table = shown.rename(columns=TABLE).to_html(
        index=False, escape=False, border=0, classes="accel-results", na_rep="",
        formatters={TABLE[c]: f for c, f in formats.items()},
    )  # fmt: skip
    return TABLE_STYLE + table

