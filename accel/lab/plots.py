"""Plots: pure functions from the lab's DataFrames to plotly figures; the caller shows
them (``lab.LiveFigure(fig)`` redraws one as it changes)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from accel.measure.show import LAYOUT, bars_height, short, wrap_label


def ceilings(frame: pd.DataFrame) -> go.Figure:
    """Copy bandwidth and matrix-product rate, one bar per device (``Ceilings.as_dict()`` rows:
    ``device``, ``copy_gb_s``, ``matmul_tflop_s``, ``matmul_dtype``)."""
    titles = ("copy bandwidth (read + write), GB/s", "dense matrix product, TFLOP/s")
    fig = make_subplots(rows=1, cols=2, subplot_titles=titles)
    labels = [f"{d} ({t})" for d, t in zip(frame["device"], frame["matmul_dtype"], strict=True)]
    bars = (("copy", "copy_gb_s", "{:,.0f}"), ("matmul", "matmul_tflop_s", "{:,.3g}"))
    for col, (name, column, fmt) in enumerate(bars, start=1):
        text = [fmt.format(v) for v in frame[column]]
        fig.add_bar(x=labels, y=frame[column], name=name, row=1, col=col, text=text,
                    textposition="auto")  # fmt: skip
    return fig.update_layout(**LAYOUT, showlegend=False, title="What this machine can do")


def step_times(frame: pd.DataFrame, *, title: str = "Step time") -> go.Figure:
    """Median time per configuration (``label``, ``median_ms``, ``q25_ms``, ``q75_ms``, optional
    ``speedup``) with its interquartile range."""
    fig = go.Figure()
    if len(frame):
        text = [f"{s:.2f}x" for s in frame["speedup"]] if "speedup" in frame else None
        fig.add_bar(  # horizontal, labels wrapped: "a+b+c" stays readable beside its bar
            y=[wrap_label(x) for x in frame["label"]],
            x=frame["median_ms"],
            orientation="h",
            text=text,
            textposition="outside",
            error_x=dict(
                type="data",
                symmetric=False,
                array=frame["q75_ms"] - frame["median_ms"],
                arrayminus=frame["median_ms"] - frame["q25_ms"],
            ),
        )
    fig.update_yaxes(autorange="reversed", automargin=True)
    height = max(LAYOUT["height"], bars_height(list(frame["label"]), 120))
    return fig.update_layout(
        **{**LAYOUT, "height": height}, title=title, xaxis_title="median ms (IQR bars)"
    )


def replay_split(frame: pd.DataFrame, *, title: str = "What a replay spends") -> go.Figure:
    """Each graphed variant's replay as kernel time and the gaps between kernels, stacked, with
    the replay over its eager kernels' time on top (``ReplayAccount`` rows)."""
    gaps = (frame["replay_ms"] - frame["inside_ms"]).clip(lower=0)
    fig = go.Figure()
    fig.add_bar(x=frame["label"], y=frame["inside_ms"], name="kernels")
    fig.add_bar(
        x=frame["label"],
        y=gaps,
        name="gaps",
        text=[f"{r:.2f}x the kernels" for r in frame["ratio"]],
        textposition="outside",
    )
    return fig.update_layout(**LAYOUT, barmode="stack", title=title, yaxis_title="ms a window")


def kernel_breakdown(
    kernels: pd.DataFrame, *, top: int = 15, title: str = "Where the time goes"
) -> go.Figure:
    """Horizontal bars of total time per kernel (a ``ProfileReport.kernels`` frame)."""
    head = kernels.head(top).iloc[::-1]
    fig = go.Figure(
        go.Bar(
            x=head["total_us"],
            y=[short(n) for n in head["name"]],
            orientation="h",
            text=[f"{c} calls, {s:.0%}" for c, s in zip(head["count"], head["share"], strict=True)],
            textposition="outside",  # beside the bar at full size: inside, a short bar shrinks it
            cliponaxis=False,
            hovertext=head["name"],
        )
    )
    margin = {**LAYOUT["margin"], "r": 110}  # room for the longest bar's text
    return fig.update_layout(
        **{**LAYOUT, "margin": margin}, title=title, xaxis_title="total µs in the window"
    )


def timeline(
    frame: pd.DataFrame, *, idle_fraction: float | None = None, title: str = "Device timeline"
) -> go.Figure:
    """Kernels of a ``ProfileReport.timeline`` as bars on a time axis; the white between them is
    the device idling."""
    fig = go.Figure()
    for kind, part in frame.groupby("kind", sort=False):
        fig.add_bar(
            base=part["start_us"],
            x=part["end_us"] - part["start_us"],
            y=[kind] * len(part),
            orientation="h",
            name=kind,
            hovertext=part["name"],
            width=0.6,
        )
    if idle_fraction is not None:
        title = f"{title}: idle {idle_fraction:.0%} of the window"
    return fig.update_layout(
        **(LAYOUT | dict(height=240)),
        title=title,
        barmode="overlay",
        xaxis_title="µs from the first step",
    )


def memory_over_time(frame: pd.DataFrame, *, title: str = "Allocated memory") -> go.Figure:
    """Allocated bytes over the profiled window (a ``ProfileReport.memory`` frame)."""
    fig = go.Figure(
        go.Scatter(x=frame["t_us"], y=frame["bytes"] / 2**20, mode="lines", line_shape="hv")
    )
    axes = {"xaxis_title": "µs from the first step", "yaxis_title": "MiB (relative to the start)"}
    return fig.update_layout(**LAYOUT, title=title, **axes)


def speedups(frame: pd.DataFrame, *, title: str = "Speedup over the baseline") -> go.Figure:
    """Bench rows (``case``, ``speedup``, optional ``target`` such as ``">= 1.6x"``) as bars,
    with the speedup targets marked."""
    rows = frame.dropna(subset=["speedup"])
    fig = go.Figure(
        go.Bar(
            x=rows["case"],
            y=rows["speedup"],
            name="measured",
            text=[f"{s:.2f}x" for s in rows["speedup"]],
            textposition="outside",
        )
    )
    if "target" in rows:
        # Only targets on the speedup itself (">= 1.6x") can be drawn on this axis.
        wanted = pd.to_numeric(
            rows["target"].astype("string").str.extract(r"^>=\s*([\d.]+)\s*x$")[0],
            errors="coerce",
        )
        if wanted.notna().any():
            fig.add_scatter(
                x=rows["case"],
                y=wanted,
                mode="markers",
                name="target",
                marker=dict(symbol="line-ew-open", size=30, line_width=3),
            )
    fig.add_hline(y=1.0, line_dash="dot")
    return fig.update_layout(**LAYOUT, title=title, yaxis_title="x baseline")


CALL_BARS = {"host_us": "host time per call", "alone_us": "one call, idle device"}


def call_costs(
    frame: pd.DataFrame, *, bars: dict[str, str] = CALL_BARS, title: str = "What one call costs"
) -> go.Figure:
    """Per ``label``, one horizontal bar (µs) per column of ``bars`` (column -> name): by default
    the host time per call, the part a profiler's kernel table leaves out, beside one call from
    an idle device with its host time in it."""
    fig = go.Figure()
    for column, name in bars.items():
        fig.add_bar(
            y=frame["label"], x=frame[column], name=name, orientation="h",
            text=["" if pd.isna(v) else f"{v:.1f}" for v in frame[column]],  # missing: no number
            textposition="outside",
        )  # fmt: skip
    height = bars_height(list(frame["label"]), 160) + 20 * len(frame)
    layout = {**LAYOUT, "height": height}
    return fig.update_layout(**layout, title=title, barmode="group", xaxis_title="µs")


def sdpa_sweep(
    frame: pd.DataFrame, *, ceiling_tflop_s: float | None = None, title: str = "SDPA sweep"
) -> go.Figure:
    """TFLOP/s over sequence length of ``accel.lab.cases.sdpa.backend_frame`` rows, one line per
    (backend, head dim), a panel per (direction, causal), the matmul ceiling dotted."""
    import plotly.express as px  # heavier than graph_objects: loaded when this figure is drawn

    data = frame.dropna(subset=["tflop_s"]).assign(
        mask=lambda f: f["causal"].map({True: "causal", False: "full"}),
        head_dim=lambda f: "D=" + f["D"].astype(str),
    )
    fig = px.line(
        data,
        x="S",
        y="tflop_s",
        color="backend",
        line_dash="head_dim",
        facet_col="direction",
        facet_row="mask",
        markers=True,
        log_x=True,
        category_orders={"direction": ["fwd", "fwd+bwd"], "mask": ["full", "causal"]},
    )
    if ceiling_tflop_s:
        fig.add_hline(
            y=ceiling_tflop_s,
            line_dash="dot",
            annotation_text=f"matmul ceiling {ceiling_tflop_s:,.3g}",
            row="all",
            col="all",
        )
    return fig.update_layout(
        template="plotly_white", height=560, title=title, yaxis_title="TFLOP/s"
    )


def diversity_sweep(
    records: list[dict] | pd.DataFrame,
    *,
    x: str,
    y: str,
    ceiling: float,
    ceiling_name: str,
    title: str = "",
) -> go.Figure:
    """Lines of ``y`` over ``x`` (log axis), one per ``candidate``, with a measured ceiling
    dashed; ``records``: ``accel.lab.cases.diversity.group_sweep`` or ``large_sweep``."""
    frame = pd.DataFrame(records)
    fig = go.Figure()
    for name, part in frame.groupby("candidate", sort=True):
        part = part.sort_values(x)
        fig.add_scatter(x=part[x], y=part[y], mode="lines+markers", name=name)
    fig.add_hline(y=ceiling, line_dash="dash", annotation_text=ceiling_name)
    return fig.update_layout(**LAYOUT, title=title, xaxis_title=x, yaxis_title=y, xaxis_type="log")


def recipe_progression(
    frame: pd.DataFrame, *, title: str = "Performance progression by phase"
) -> go.Figure:
    """The recipe case's table: throughput per ``config`` (bars, speedup on each) beside the
    validation error after equal steps (markers, right axis)."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_bar(
        x=frame["config"],
        y=frame["samples_per_s"],
        text=[f"{s:.2f}x" for s in frame["speedup"]],
        name="throughput (samples/s)",
    )
    fig.add_scatter(
        x=frame["config"],
        y=frame["val_error"],
        mode="markers+lines",
        name="validation error after equal steps",
        secondary_y=True,
    )
    fig.update_yaxes(title_text="samples/s", secondary_y=False)
    fig.update_yaxes(title_text="relative L2 error", secondary_y=True, rangemode="tozero")
    return fig.update_layout(**{**LAYOUT, "height": 420}, title=title)


def distributed_scaling(frame: pd.DataFrame, *, title: str = "") -> dict[str, go.Figure]:
    """Throughput, scaling efficiency and memory per rank of the distributed case's table, one
    bar per configuration."""
    import plotly.express as px

    common = {"x": "config", "color": "wrapper", "text_auto": ".3g"}
    throughput = px.bar(frame, y="samples_per_s", title=f"{title}throughput", **common)
    efficiency = px.bar(frame, y="scaling_efficiency", title=f"{title}scaling efficiency", **common)
    efficiency.add_hline(y=1.0, line_dash="dot", annotation_text="perfect")
    memory_cols = ["state_mib_per_rank"] + (
        ["peak_mib_per_rank"] if frame["peak_mib_per_rank"].notna().any() else []
    )
    long = frame.melt(id_vars=["config"], value_vars=memory_cols, var_name="what")
    memory = px.bar(long, x="config", y="value", color="what", barmode="group", text_auto=".3g",
                    title=f"{title}memory per rank (MiB)")  # fmt: skip
    for fig in (throughput, efficiency, memory):
        fig.update_layout(**{**LAYOUT, "height": 320})
    return {"throughput": throughput, "efficiency": efficiency, "memory": memory}


def predicted_measured(
    frame: pd.DataFrame, *, title: str = "Fixes: predicted and measured"
) -> go.Figure:
    """Per fix (``label``), its predicted and measured speedup over the unchanged step."""
    fig = go.Figure()
    for column, name in (("predicted speedup", "predicted"), ("measured speedup", "measured")):
        fig.add_bar(
            y=[wrap_label(x) for x in frame["label"]], x=frame[column], name=name,
            orientation="h", text=[f"{v:.2f}x" for v in frame[column]], textposition="outside",
        )  # fmt: skip
    fig.add_vline(x=1.0, line_dash="dot", line_color="gray")
    fig.update_yaxes(autorange="reversed", automargin=True)
    height = max(LAYOUT["height"], bars_height(list(frame["label"]), 140) + 20 * len(frame))
    return fig.update_layout(
        **{**LAYOUT, "height": height}, title=title, barmode="group", xaxis_title="speedup"
    )
