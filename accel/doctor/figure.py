"""The doctor's figure: where a step's time goes, above each finding's predicted saving."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.measure.show import LAYOUT, bars_height, short, wrap_label

if TYPE_CHECKING:  # plotly is the notebook stack's: imported when a figure is drawn
    import plotly.graph_objects as go


def doctor_figure(
    breakdown: dict[str, float], savings: dict[str, float], step_ms: float, *, title: str = ""
) -> go.Figure:
    """Where a step's time goes (one stacked bar, ms per part) above each finding's predicted
    saving (ms per step), on one time axis."""
    from plotly.subplots import make_subplots
    rows = 2 if savings else 1
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.18,
                        row_heights=[0.35, 0.65] if rows == 2 else [1.0],
                        subplot_titles=("the step", "predicted saving of each finding")[:rows])
    for part, ms in breakdown.items():
        fig.add_bar(
            y=["step"], x=[ms], name=part, orientation="h", row=1, col=1,
            hovertemplate=f"{part}: %{{x:.3f}} ms<extra></extra>",
        )  # fmt: skip
    if savings:
        labels = [wrap_label(short(k, 48).replace(" ", "+"), 36).replace("+", " ") for k in savings]
        fig.add_bar(
            y=labels, x=list(savings.values()), orientation="h", row=2, col=1, showlegend=False,
            text=[f"{v:.3g} ms" for v in savings.values()], textposition="outside",
            cliponaxis=False, marker_color="#636efa",
        )  # fmt: skip
        fig.update_yaxes(autorange="reversed", automargin=True, row=2, col=1)
    fig.add_vline(x=step_ms, line_dash="dot", line_color="gray")
    # the legend (the step's parts) at the figure's foot, below the axis title, in its own margin
    height = 260 + (bars_height(list(savings), 40) if savings else 0)
    return fig.update_layout(
        **{**LAYOUT, "height": height, "margin": {**LAYOUT["margin"], "b": 110}},
        barmode="stack",
        title=title,
        legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0),
        xaxis_title="ms per step" if rows == 1 else None,
    ).update_xaxes(title_text="ms per step", row=rows, col=1)
