"""The report as a person reads it: each finding with its evidence, place, predicted (and once
tried, measured) gain and change; the fixes tried as a narrow table. A missing number shows a
dash and the reason. HTML for the page and the notebook, text for the command line."""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

# Scoped to the report's own element: a notebook's page keeps its styles.
STYLE = """<style>
.accel-doctor { max-width: 940px; font-family: system-ui, sans-serif; line-height: 1.4; }
.accel-doctor .finding { border-left: 4px solid #636efa; padding: 2px 12px; margin: 12px 0; }
.accel-doctor pre { background: #f6f8fa; padding: 8px; white-space: pre-wrap;
                    overflow-wrap: anywhere; font-size: 13px; }
.accel-doctor code { overflow-wrap: anywhere; }
.accel-doctor table { border-collapse: collapse; font-size: 13px; table-layout: auto; }
.accel-doctor th, .accel-doctor td { border-bottom: 1px solid #ddd; padding: 4px 8px;
                                     text-align: left; vertical-align: top; }
.accel-doctor .missing { color: #666; }
</style>"""
DASH = "\u2014"


def _esc(value: Any) -> str:
    return html.escape(str(value))


def rounded(value: float) -> str:
    """A number rounded as the bench rounds it (pandas: imported on the first render)."""
    from accel.measure.show import readable

    return readable(value)


def absent(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def missing(why: str) -> str:
    """A number that is not there: a dash, and the reason beside it."""
    return f"<span class='missing'>{DASH} {_esc(why)}</span>"


def predicted_gain(finding, iteration_us: float, device: str) -> str:
    """The finding's predicted saving per step and speedup, with its cost model; a dash and the
    cost model (which says why) where this machine does not predict it."""
    if finding.saved_us is None:
        return "<b>Predicted gain:</b> " + missing(f"not predicted on {device}: {finding.cost_model}")
    ms, speedup = finding.saved_us / 1e3, finding.speedup(iteration_us)
    return (f"<b>Predicted gain:</b> saves {rounded(ms)} ms a step ({speedup:.2f}x). "
            f"<i>Cost model:</i> {_esc(finding.cost_model)}")  # fmt: skip


def measured_gain(finding, trials: pd.DataFrame | None) -> str:
    """What trying the finding's own fixes measured, one line per fix; '' before any try."""
    if trials is None or trials.empty or not finding.fixes:
        return ""
    rows = trials[trials["fixes"].isin(finding.fixes)]
    said = [f"{_esc(row['label'])}: {measured(row)}" for row in rows.to_dict("records")]
    return "<b>Measured:</b> " + "; ".join(said) if said else ""


def measured(row: dict[str, Any]) -> str:
    """A trial's measured speedup with its times, or a dash and its status."""
    if absent(row["measured speedup"]):
        return missing(row["status"])
    times = f"{rounded(row['unchanged ms'])} \u2192 {rounded(row['measured ms'])} ms"
    return f"{row['measured speedup']:.2f}x ({times})"


def finding_html(number: int, finding, report) -> str:
    where = "".join(
        f"<li><code>{_esc(site)}</code>: <code>{_esc(site.text)}</code></li>"
        for site in dict.fromkeys(finding.sites)
    )
    fixes, gain = ", ".join(finding.fixes), measured_gain(finding, report.trials)
    parts = [
        f"<h4>{number}. {_esc(finding.title)}</h4>",
        f"<p><b>Evidence:</b> {_esc(finding.evidence)}</p>",
        f"<p><b>Where:</b></p><ul>{where}</ul>" if where else "",
        f"<p>{predicted_gain(finding, report.evidence.iteration_us, report.device)}</p>",
        f"<p>{gain}</p>" if gain else "",
        f"<p><b>The change</b> (notebook <code>{_esc(finding.notebook)}</code>):</p>",
        f"<pre><code>{_esc(finding.change)}</code></pre>",
        f"<p><b>Automatic fixes:</b> {_esc(fixes)}</p>" if fixes else "",
    ]
    return f"<div class='finding'>{''.join(parts)}</div>"


def findings_html(report) -> str:
    if not report.findings:
        return "<p>No finding.</p>"
    return "".join(finding_html(i, f, report) for i, f in enumerate(report.findings, 1))


TRIAL_HEADER = ("fix", "predicted", "measured", "error (allowed)", "first call", "peak memory")


def predicted(row: dict[str, Any]) -> str | None:
    """A trial's predicted speedup as its row gives it; None where the row has none (a speedup
    of 1 would claim no gain)."""
    value = row.get("predicted speedup")
    if value is None or not math.isfinite(value):
        return None
    return f"{value:.2f}x"


def unpredicted(row: dict[str, Any]) -> str:
    """Why a trial's row has no prediction, as the row says it."""
    return str(row.get("predicted from", "")).removeprefix("nothing: ") or "not predicted"


def best_set(row: dict[str, Any]) -> bool:
    """The trial that made the step fastest within its allowance (where trials say so): True or
    numpy's True, never NaN, which is truthy."""
    return row.get("best set") in (True,)


def trials_html(report) -> str:
    """One row per trial of ``report.trials``; where nothing was measured, one cell says why."""
    head = "".join(f"<th>{h}</th>" for h in TRIAL_HEADER)
    body = []
    for row in report.trials.to_dict("records"):
        fix = _esc(row["label"]) + (" <i>(together)</i>" if row["mode"] == "together" else "")
        fix += " <b>(best set)</b>" if best_set(row) else ""
        if absent(row["measured speedup"]):
            rest = f"<td colspan='4'>{missing(row['status'])}</td>"
        else:
            status = "" if row["status"] == "ok" else f"<br><b>{_esc(row['status'])}</b>"
            rest = (
                f"<td>{measured(row)}{status}</td>"
                f"<td title='{_esc(row['why'])}; allowed by {_esc(row['allowed by'])}'>"
                f"{rounded(row['error'])} "
                f"({rounded(row['allowance'])})</td>"
                f"<td>{rounded(row['first call s'])} s</td>"
                f"<td>{rounded(row['unchanged peak MiB'])} \u2192 "
                f"{rounded(row['fixed peak MiB'])} MiB</td>"
            )
        guess = predicted(row) or missing(unpredicted(row))
        if _edit(row):
            fix += f"<pre>{_esc(row['edit'])}</pre>"
        body.append(f"<tr><td>{fix}</td><td>{guess}</td>{rest}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def trials_text(report) -> str:
    """The trials for a terminal: fix, predicted and measured speedup, error, or why none."""
    lines = []
    for row in report.trials.to_dict("records"):
        guess = predicted(row) or f"{DASH} ({unpredicted(row)})"
        best = ", the best set" if best_set(row) else ""
        head = f"{row['label']} ({row['mode']}{best}): predicted {guess}, "
        if absent(row["measured speedup"]):
            lines.append(head + f"measured {DASH} ({row['status']})")
            continue
        error = f"error {rounded(row['error'])} (allowed {rounded(row['allowance'])})"
        status = "" if row["status"] == "ok" else f"; {row['status']}"
        lines.append(head + f"measured {row['measured speedup']:.2f}x, {error}{status}")
        if _edit(row):  # the change to paste into your own code
            lines += ["   edit:", *("     " + line for line in row["edit"].splitlines())]
    return "\n".join(lines)


def _edit(row: dict) -> bool:
    """An edit of the user's code worth showing: a fix alone that measured, not a loss."""
    edit = row["edit"]
    return row["mode"] == "alone" and row["status"] == "ok" and isinstance(edit, str) and bool(edit)


def change_text(change: str) -> list[str]:
    """The change to make, every line of it, indented under its label."""
    first, *rest = change.splitlines() or [""]
    return ["   change: " + first, *("           " + line for line in rest)]
