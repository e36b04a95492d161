"""What ``examine`` returns: the ranked findings as a table, where the step's time goes as a
figure, ``try_fixes`` to measure the fixes, and the same as text (the command line) or as one
HTML file that works offline."""

from __future__ import annotations

import dataclasses
import html
import math
import os
import warnings
from pathlib import Path
from typing import Any

from accel.doctor import page
from accel.doctor.check_compile import own_breaks
from accel.doctor.effects import Effects
from accel.doctor.findings import Evidence, Finding
from accel.doctor.fixes import FIXES
from accel.doctor.parts import StepParts

__all__ = ["Report"]

_IDLE_NAMES = {"host": "idle: waiting for the host", "sync": "idle: after a sync",
               "other": "idle: other"}  # fmt: skip
_CPU_IDLE = "host: Python, dispatch"  # a CPU has no device to idle
_SHOWN_SITES = 3  # a finding's lines in the text; the table and the page list them all


class Report:
    """The doctor's findings on one step (see :func:`accel.doctor.examine`)."""

    def __init__(self, step: Any, batch: Any, parts: StepParts, evidence: Evidence,
                 findings: list[Finding], side_effects: list[str] | None = None,
                 effects: Effects | None = None, changed: list[str] | None = None):  # fmt: skip
        self.step, self.batch, self.parts = step, batch, parts
        self.evidence, self.findings = evidence, findings
        self.trials = None  # the DataFrame of the last try_fixes()
        # what examining (and trying fixes) changed that it could not keep from changing, which
        # the summary names first: cautions about the copy, what the step's code did (files,
        # connections), and the user's objects found changed
        self.cautions = list(side_effects or [])
        self.effects = effects or Effects()
        self.changed = list(changed or [])
        self._fix_flags: type | None = None  # made once: a panel takes only its own class's flags

    @property
    def side_effects(self) -> list[str]:
        return [*self.cautions, *self.effects.said(), *self.changed]

    @property
    def step_ms(self) -> float:
        return self.evidence.step_us / 1e3

    @property
    def device(self) -> str:
        return str(self.evidence.device)

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    def fixes(self) -> list[str]:
        """The automatic fixes the findings name, in the findings' order."""
        return list(dict.fromkeys(name for f in self.findings for name in f.fixes))

    # ---- tables and figures ------------------------------------------------------------------
    def table(self):
        """The findings, ranked, one row each (pandas)."""
        import pandas as pd

        rows = [f.row(self.evidence.iteration_us) for f in self.findings]
        columns = list(Finding("", "", "", "", "", "").row(1.0))
        return pd.DataFrame(rows, columns=columns)

    def breakdown(self) -> dict[str, float]:
        """ms per step: the kernels by category, then the device's idle time by cause."""
        t = self.evidence.timeline
        parts = {k: v / 1e3 for k, v in sorted(t.by_category.items(), key=lambda kv: -kv[1])}
        for cause, us in t.idle_us.items():
            label = _IDLE_NAMES.get(cause, cause) if self.evidence.cuda else _CPU_IDLE
            parts[label] = parts.get(label, 0.0) + us / 1e3
        return parts

    def figure(self):
        """Where the time goes (one stacked bar) and each finding's predicted saving."""
        from accel.doctor.figure import doctor_figure

        savings = {f.title: f.saved_us / 1e3 for f in self.findings if f.saved_us is not None}
        title = f"Where a {self.step_ms:.3f} ms step goes on {self.device}"
        with warnings.catch_warnings():  # plotly's first imports add warning filters of their own
            return doctor_figure(self.breakdown(), savings, self.step_ms, title=title)

    # ---- fixes -------------------------------------------------------------------------------
    def try_fixes(self, fixes: list[str] | None = None, *, steps: int = 3,
                  repeats: int | None = None, progress: bool = False):  # fmt: skip
        """Apply each fix alone, then together, to copies of the step; check each against the
        unchanged step within the fix's tolerance, time it against the unchanged step
        (interleaved), and put the measured time beside the prediction. Returns a DataFrame
        (kept as ``self.trials``). Your model and optimizer are never changed. Without
        ``fixes`` (the findings' own), the best set on a GPU is also tried compiled with CUDA
        graphs, which an expert adds last. A fix that compiles takes tens of seconds:
        ``progress`` shows a bar naming the fix being tried."""
        from accel.doctor.trial import try_fixes

        self.trials = try_fixes(self, fixes, steps=steps, repeats=repeats, progress=progress)
        return self.trials

    def reached(self) -> str:
        """After :meth:`try_fixes`: how far the best set of fixes took the step, and what the
        findings it could not try still predict (their change is an edit of your code)."""
        if self.trials is None:
            return "no fixes tried yet: report.try_fixes() measures them"
        best = self.trials[self.trials["best set"].eq(True)]
        if self.trials.empty:
            said = ("no automatic fix applies to these findings: each one names its change"
                    if self.findings else "nothing was found, so no fix was tried")  # fmt: skip
        elif self.trials["measured ms"].isna().all():
            said = "no fix could be measured here: " + "; ".join(self.trials["status"].unique())
        elif best.empty:
            said = "no fix made the step faster within its allowance"
        else:
            row = best.iloc[0]
            said = (
                f"the fixes reached {row['measured speedup']:.2f}x ({row['unchanged ms']:.3f} -> "
                f"{row['measured ms']:.3f} ms a step) with {row['label']}"
            )
        # predicted, and no fix of theirs measured on them: not applicable, or failed, or none
        open_ = [f for f in self.findings if f.saved_us is not None and f.measured_us is None]
        if open_:
            more = sum(f.saved_us for f in open_) / 1e3
            said += (
                f"; the findings with no automatic fix predict up to {more:.3f} ms more, with "
                f"your edit: {'; '.join(f.title for f in open_[:3])}"
            )
        return said

    def fix_flags(self) -> type:
        """The fixes as a frozen ``Flags`` dataclass for ``lab.FeaturePanel``: one checkbox per
        fix the findings name (off: the step as you wrote it), grouped by the phase whose
        notebook teaches it. The same class on every call."""
        from accel.workloads.flags import flag

        if self._fix_flags is not None:
            return self._fix_flags
        fields = []
        for name in self.fixes():
            finding = next(f for f in self.findings if name in f.fixes)
            phase = finding.notebook.partition("_")[2] or finding.notebook  # "02_fusion": fusion
            requires = "cuda" if FIXES[name].needs_cuda else None
            help_text = f"{FIXES[name].label}: for '{finding.title}'"
            fields.append((name, bool, flag(help_text, phase, requires=requires)))
        self._fix_flags = dataclasses.make_dataclass("DoctorFixes", fields, frozen=True)
        return self._fix_flags

    def isolated(self):
        """A context in which calls of :meth:`fixed_step` leave the process as they found it, as
        ``try_fixes`` does: ``lab.FeaturePanel(..., around=report.isolated)``."""
        from accel.doctor.trial import isolated

        return isolated(self)

    def fixed_step(self, flags: Any):
        """A callable that runs one step, per call, of a fresh copy with the fixes ``flags``
        turns on, built as the trials build it; what the step's code changes is put back where
        it runs inside :meth:`isolated`."""
        from accel.doctor.trial import fixed_step

        return fixed_step(self, [f.name for f in dataclasses.fields(flags) if getattr(flags, f.name)])

    # ---- text and HTML ---------------------------------------------------------------------------
    def summary(self) -> str:
        t = self.evidence.timeline
        syncs = "" if math.isnan(t.syncs) else f", {t.syncs:.0f} syncs"
        caution = f"Caution: {'; '.join(self.side_effects)}. " if self.side_effects else ""
        breaks = self.evidence.graph_breaks
        own = len(own_breaks(breaks or []))
        compiled = "" if breaks is None else (
            f". torch.compile traced: {len(breaks)} graph break{'s' * (len(breaks) != 1)}"
            + (f" (none but where every step breaks: {_lines(breaks)})" if breaks and not own
               else f" ({own} besides where every step breaks)" if own < len(breaks) else "")
        )  # fmt: skip
        return caution + (
            f"{self.device}: a step takes {self.step_ms:.3f} ms ({t.launches:.0f} launches"
            f"{syncs}, {t.kernel_us / 1e3:.3f} ms of kernels); {len(self.findings)} finding"
            f"{'s' * (len(self.findings) != 1)}{compiled}. Examined: {self.parts.describe()}"
        )

    def __str__(self) -> str:
        lines = [self.summary(), ""]
        for i, f in enumerate(self.findings, 1):
            gain = "" if f.saved_us is None else f"  [saves {f.saved_us / 1e3:.3f} ms/step, "
            gain += "" if f.saved_us is None else f"{f.speedup(self.evidence.iteration_us):.2f}x]"
            lines += [f"{i}. {f.title}{gain}  ({f.notebook})", f"   {f.evidence}"]
            lines += [f"   where: {s}" for s in f.sites[:_SHOWN_SITES]]
            if len(f.sites) > _SHOWN_SITES:
                lines.append(f"   and {len(f.sites) - _SHOWN_SITES} more line"
                             f"{'s' * (len(f.sites) - _SHOWN_SITES != 1)} (report.table())")  # fmt: skip
            lines += page.change_text(f.change)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<accel.doctor.Report: {self.summary()}>"

    def _repr_html_(self) -> str:
        return self.html(plotlyjs=False)

    def _ipython_display_(self) -> None:
        from IPython.display import HTML, display

        display(HTML(f"{page.STYLE}<div class='accel-doctor'><p>{html.escape(self.summary())}</p>"
                     f"{page.findings_html(self)}</div>"))  # fmt: skip
        display(self.figure())

    def html(self, *, plotlyjs: bool | str = True) -> str:
        """One HTML page: summary, figure (plotly.js inline by default), findings, trials."""
        trials = ""
        if self.trials is not None and not self.trials.empty:
            reached = html.escape(self.reached())
            trials = f"<h3>Fixes tried</h3>{page.trials_html(self)}<p>{reached}</p>"
        with warnings.catch_warnings():  # as in figure(): plotly.io's first import too
            figure = self.figure().to_html(full_html=False, include_plotlyjs=plotlyjs)
        return (f"{page.STYLE}<div class='accel-doctor'><h2>accel.doctor</h2>"
                f"<p>{html.escape(self.summary())}</p>{figure}"
                f"<h3>Findings</h3>{page.findings_html(self)}{trials}</div>")  # fmt: skip

    def to_html(self, path: str | Path) -> Path:
        from accel.files import check_writable, write_text_atomic

        check_writable(path)  # before creating its folders
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        page = f"<!doctype html><html><meta charset='utf-8'><body>{self.html()}</body></html>"
        write_text_atomic(path, page)
        return path


def _lines(breaks: list) -> str:
    """The distinct lines of ``breaks`` (reason, site) as file:line, the folder left out."""
    sites = dict.fromkeys(f"{os.path.basename(site.file)}:{site.line}"
                          for _, site in breaks if site is not None)  # fmt: skip
    return ", ".join(sites) or "inside torch"
