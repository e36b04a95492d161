"""Numbers and labels as accel's tables and figures show them: one rounding for the bench's
tables, the README, the panel and the doctor's page; long configuration labels wrapped, and bars
sized for them; the figures' common layout. Plain Python: it imports no plotting library."""

from __future__ import annotations

import math

LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=50, b=40), height=360)


def readable(value) -> str:
    """A value as a person reads it: a number to three significant figures (thousands grouped,
    no trailing digits), nothing where there is none."""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)


def short(name: str, width: int = 60) -> str:
    """``name`` cut to ``width`` characters, an ellipsis at the cut."""
    return name if len(name) <= width else name[: width - 1] + "…"


def wrap_label(label: str, width: int = 32) -> str:
    """A configuration label ("a+b=2+c") broken after a "+" into lines of about ``width``
    characters (plotly's ``<br>``), so a long one does not squeeze the plot beside it."""
    lines = [""]
    for part in label.split("+"):
        piece = f"+{part}" if lines[-1] else part
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append(piece)
        else:
            lines[-1] += piece
    return "<br>".join(lines)


def bars_height(labels: list[str], base: int) -> int:
    """Figure height for horizontal bars of wrapped ``labels``: ``base`` plus room per line."""
    return base + sum(18 * (1 + wrap_label(x).count("<br>")) + 10 for x in labels)
