import pandas as pd
import plotly.graph_objects as go
import pytest

from accel.doctor.figure import doctor_figure
from accel.lab import plots


def test_ceilings_plot_has_one_bar_per_ceiling():
    frame = pd.DataFrame(
        [
            {
                "device": "gpu",
                "copy_gb_s": 3000.0,
                "matmul_tflop_s": 700.0,
                "matmul_dtype": "bfloat16",
            }
        ]
    )
    fig = plots.ceilings(frame)
    assert [t.type for t in fig.data] == ["bar", "bar"]
    assert fig.data[0].y[0] == 3000.0


def test_step_times_carry_iqr_and_speedup():
    frame = pd.DataFrame(
        {
            "label": ["baseline", "fast"],
            "median_ms": [2.0, 1.0],
            "q25_ms": [1.9, 0.9],
            "q75_ms": [2.2, 1.1],
            "speedup": [1.0, 2.0],
        }
    )
    fig = plots.step_times(frame)
    assert list(fig.data[0].text) == ["1.00x", "2.00x"]
    assert list(fig.data[0].y) == ["baseline", "fast"] and fig.data[0].orientation == "h"
    assert list(fig.data[0].error_x.array) == pytest.approx([0.2, 0.1])
    assert list(fig.data[0].error_x.arrayminus) == pytest.approx([0.1, 0.1])


def test_replay_split_stacks_kernels_and_gaps():
    frame = pd.DataFrame(
        {"label": ["plain", "overlapped"], "inside_ms": [2.5, 2.0], "replay_ms": [2.9, 2.1]}
    )
    frame["ratio"] = [1.2, 1.05]
    fig = plots.replay_split(frame)
    assert fig.layout.barmode == "stack"
    assert list(fig.data[1].y) == pytest.approx([0.4, 0.1])  # the gaps
    assert list(fig.data[1].text) == ["1.20x the kernels", "1.05x the kernels"]


def test_kernel_breakdown_shows_the_top_kernels_largest_on_top():
    kernels = pd.DataFrame(
        {
            "name": list("abc"),
            "count": [1, 2, 3],
            "total_us": [30.0, 20.0, 10.0],
            "share": [0.5, 0.33, 0.17],
        }
    )
    fig = plots.kernel_breakdown(kernels, top=2)
    assert list(fig.data[0].y) == ["b", "a"]  # plotly draws the last bar on top


def test_timeline_has_a_trace_per_kind_and_states_idle():
    frame = pd.DataFrame(
        {
            "name": ["k1", "k2", "copy"],
            "kind": ["kernel", "kernel", "memcpy"],
            "start_us": [0.0, 5.0, 9.0],
            "end_us": [2.0, 6.0, 10.0],
        }
    )
    fig = plots.timeline(frame, idle_fraction=0.6)
    assert [t.name for t in fig.data] == ["kernel", "memcpy"]
    assert "idle 60%" in fig.layout.title.text


def test_memory_and_speedups_build():
    assert isinstance(
        plots.memory_over_time(pd.DataFrame({"t_us": [0, 1], "bytes": [0, 2**20]})), go.Figure
    )
    rows = pd.DataFrame(
        {
            "case": ["a", "b", "c"],
            "speedup": [1.5, float("nan"), 2.0],
            "target": [">= 1.2x", None, ">= 640 TFLOP/s"],
        }
    )
    fig = plots.speedups(rows)
    assert list(fig.data[0].x) == ["a", "c"]
    assert list(fig.data[1].y[:1]) == [1.2] and pd.isna(fig.data[1].y[1])


def test_diversity_sweep_draws_a_line_per_candidate_in_order_of_x():
    records = [
        {"B": b, "candidate": name, "gb_s": gb_s}
        for name, scale in (("triton", 2.0), ("naive eager", 1.0))
        for b, gb_s in ((4096, 3.0 * scale), (1024, 1.0 * scale))
    ]
    fig = plots.diversity_sweep(records, x="B", y="gb_s", ceiling=10.0, ceiling_name="copy")
    assert [t.name for t in fig.data] == ["naive eager", "triton"]
    assert list(fig.data[1].x) == [1024, 4096] and list(fig.data[1].y) == [2.0, 6.0]
    assert fig.layout.xaxis.type == "log" and fig.layout.shapes[0].y0 == 10.0


def test_recipe_progression_puts_the_speedup_on_each_bar_and_the_error_on_the_right_axis():
    frame = pd.DataFrame(
        {
            "config": ["baseline", "+bf16", "+compile"],
            "samples_per_s": [100.0, 180.0, 310.0],
            "speedup": [1.0, 1.8, 3.1],
            "val_error": [0.04, 0.041, 0.039],
        }
    )
    fig = plots.recipe_progression(frame)
    bar, line = fig.data
    assert list(bar.text) == ["1.00x", "1.80x", "3.10x"]
    assert line.yaxis == "y2" and list(line.y) == [0.04, 0.041, 0.039]


def test_distributed_scaling_shows_peak_memory_only_where_it_was_measured():
    frame = pd.DataFrame(
        {
            "config": ["1 GPU", "ddp x2"],
            "wrapper": ["none", "ddp"],
            "samples_per_s": [10.0, 19.0],
            "scaling_efficiency": [1.0, 0.95],
            "state_mib_per_rank": [40.0, 40.0],
            "peak_mib_per_rank": [float("nan"), float("nan")],
        }
    )
    figs = plots.distributed_scaling(frame, title="2 x cpu: ")
    assert set(figs) == {"throughput", "efficiency", "memory"}
    assert {t.name for t in figs["memory"].data} == {"state_mib_per_rank"}
    with_peak = plots.distributed_scaling(frame.assign(peak_mib_per_rank=[55.0, 48.0]))
    assert {t.name for t in with_peak["memory"].data} == {"state_mib_per_rank", "peak_mib_per_rank"}


def test_a_long_configuration_label_wraps_after_a_plus_and_keeps_every_part():
    label = "activation_checkpointing+aux_loss_every=4+query_subsample=2+precision=bf16+fused_adamw"
    wrapped = plots.wrap_label(label, width=32)
    lines = wrapped.split("<br>")
    assert len(lines) > 1 and "".join(lines) == label
    assert all(len(line) <= 32 or "+" not in line for line in lines)
    assert plots.wrap_label("baseline") == "baseline"
    assert plots.bars_height([label], 100) > plots.bars_height(["baseline"], 100)


def test_call_costs_leave_a_missing_bar_unlabelled():
    """A row with one of its bars missing (the host's pace has no plain PyTorch beside it) shows
    no number for it, not "nan"."""
    frame = pd.DataFrame(
        {"label": ["sdpa", "host pace"], "optimized": [21.5, 6.4], "baseline": [19.2, None]}
    )
    fig = plots.call_costs(frame, bars={"optimized": "accel", "baseline": "plain PyTorch"})
    assert list(fig.data[0].text) == ["21.5", "6.4"]
    assert list(fig.data[1].text) == ["19.2", ""]


def test_doctor_figure_keeps_its_legend_off_the_axis_title():
    fig = doctor_figure({"matmul": 2.0, "host": 1.0}, {"a finding": 0.5}, 3.0)
    legend = fig.layout.legend
    # at the foot of the whole figure, in a bottom margin deeper than the axis title needs
    assert (legend.yref, legend.y, legend.yanchor) == ("container", 0, "bottom")
    assert fig.layout.margin.b >= 100
    assert list(fig.data[-1].text) == ["0.5 ms"]  # rounded, not 0.500
