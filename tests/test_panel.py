import dataclasses

import ipywidgets as widgets
import pytest

from accel.lab.panel import FeaturePanel
from accel.workloads import tiny_mlp
from accel.workloads.flags import describe

SIZES = tiny_mlp.Sizes(batch=8, width=16, depth=2, batches=2)


def make_panel(**kwargs):
    builds = []

    def build(flags):
        builds.append(flags)
        return tiny_mlp.build(flags, SIZES, device="cpu")

    panel = FeaturePanel(
        tiny_mlp.Flags, build, device="cpu", warmup=1, repeats=3, profile_steps=1, **kwargs
    )
    return panel, builds


def test_one_checkbox_per_flag():
    panel, _ = make_panel()
    names = [i.name for i in describe(tiny_mlp.Flags)]
    assert list(panel.controls) == names
    assert all(isinstance(c, widgets.Checkbox) for c in panel.controls.values())
    assert panel.flags() == tiny_mlp.Flags()


def test_toggle_and_click_rerun_and_update_the_figure():
    panel, builds = make_panel()
    panel.run_button.click()
    assert panel.status.value == ""
    assert list(panel.figure.data[2].y) == ["baseline"]
    panel.controls["fused_adamw"].value = True
    panel.run_button.click()
    assert list(panel.figure.data[2].y) == ["baseline", "fused_adamw"]  # short: not wrapped
    assert len(panel.figure.data[1].y) == 3  # this run's live samples
    assert panel.figure.data[1].name == "fused_adamw"
    assert "fused_adamw" in panel.table.value
    frame = panel.results
    assert list(frame["label"]) == ["baseline", "fused_adamw"]
    assert (frame["median_ms"] > 0).all()
    assert frame.loc[1, "kernels_per_step"] > 0
    assert len(panel.kernels_live.figure.data[0].x) > 0  # the breakdown was filled by the profiler
    # one build per flag combination, however often it runs
    panel.run_button.click()
    assert builds == [tiny_mlp.Flags(), tiny_mlp.Flags(fused_adamw=True)]


def test_flags_of_another_class_of_the_same_name_are_refused_with_the_way_out():
    panel, _ = make_panel(profile=False)
    other = dataclasses.make_dataclass("Flags", [("fused_adamw", bool, False)], frozen=True)
    with pytest.raises(TypeError, match=r"another class of that name: make the flags with panel\.flags_type"):
        panel.show(other(fused_adamw=True))


def test_a_first_run_with_a_flag_profiles_the_baseline_too():
    panel, _ = make_panel()
    panel.run(tiny_mlp.Flags(fused_adamw=True))
    frame = panel.results
    assert list(frame["label"]) == ["baseline", "fused_adamw"]
    assert (frame["kernels_per_step"] > 0).all()  # the baseline's counts too, to compare with
    assert "nan" not in panel.table.value


def test_the_bars_show_each_speedup_against_the_baseline_timed_beside_it():
    """Runs at different times see different machine load: each bar is a configuration's
    speedup over the baseline interleaved with it in its own run, never a time beside another
    run's baseline."""
    panel, _ = make_panel(profile=False)
    panel.run(tiny_mlp.Flags(fused_adamw=True))
    panel.run(tiny_mlp.Flags(set_to_none=True))
    frame = panel.results
    bars = panel.figure.data[2]
    assert list(bars.x) == pytest.approx(list(frame["speedup"]))
    assert bars.x[0] == 1.0  # the baseline against itself
    assert min(bars.error_x.arrayminus) >= 0 and min(bars.error_x.array) >= 0
    low, high = frame.loc[1, ["speedup_q25", "speedup_q75"]]
    assert low <= high and low > 0


def test_each_bar_says_which_baseline_it_was_timed_against():
    """A rerun times the baseline again: the older bars keep their ratio against the baseline
    of their own run, and say that baseline's time, not the latest one's."""
    panel, _ = make_panel(profile=False)
    panel.run(tiny_mlp.Flags(fused_adamw=True))
    first_baseline = panel.comparison.timings["baseline"].median_ms
    panel.run(tiny_mlp.Flags(fused_adamw=True, set_to_none=True))
    frame = panel.results.set_index("label")
    assert frame.loc["fused_adamw", "baseline_ms"] == first_baseline
    assert frame.loc["baseline", "median_ms"] == panel.comparison.timings["baseline"].median_ms
    text = dict(zip(panel.figure.data[2].y, panel.figure.data[2].text, strict=True))
    fused = frame.loc["fused_adamw"]
    assert text["fused_adamw"].endswith(
        f"{fused['median_ms']:.3g} vs {first_baseline:.3g} ms"
    )
    assert text["baseline"].endswith("(last run)")
    assert panel.figure.layout.xaxis.dtick == 1  # 3 rounds: whole rounds on the axis
    table = panel.table.value
    assert "fused_adamw+<wbr>set_to_none" in table  # a long label breaks after a "+"
    assert "its baseline ms" in table and "median_ms" not in table


def _shown(live) -> dict:
    """The figure a page draws from ``live``'s widget state (as after a reload)."""
    (output,) = live.widget.outputs
    assert output["output_type"] == "display_data"
    return output["data"]["application/vnd.plotly.v1+json"]


def test_a_run_leaves_its_figures_in_the_state_a_reloaded_page_draws():
    """The page draws each figure from its widget's state, whole, never from edits sent before
    it loaded (a late or reloaded page would miss those): after a run that state holds the run."""
    panel, _ = make_panel()
    assert not any(len(t.get("y", ())) for t in _shown(panel.live)["data"])  # as built
    panel.run(tiny_mlp.Flags(fused_adamw=True))
    shown = _shown(panel.live)["data"]
    assert [list(t["y"]) for t in shown] == [list(t.y) for t in panel.figure.data]
    assert len(shown[1]["y"]) == 3 and shown[2]["x"]  # the live samples and the bars
    assert len(_shown(panel.kernels_live)["data"][0]["x"]) > 0


def test_run_takes_a_flag_set_from_code_and_shows_it():
    """Outside a notebook: the configuration passed is set on the controls, then timed."""
    panel, _ = make_panel(profile=False)
    chosen = tiny_mlp.Flags(fused_adamw=True, set_to_none=True)
    summary = panel.run(chosen)
    assert panel.flags() == chosen
    assert list(panel.results["label"]) == ["baseline", "fused_adamw+set_to_none"]
    assert summary["speedup"] > 0
    with pytest.raises(TypeError, match=r"expected a Flags instance, got dict"):
        panel.run({"fused_adamw": True})


def test_a_failing_run_shows_its_error_in_the_panel():
    panel = FeaturePanel(tiny_mlp.Flags, lambda f: 1 / 0, device="cpu", repeats=1)
    panel.run_button.click()
    assert "ZeroDivisionError" in panel.status.value
    assert not panel.run_button.disabled
    with pytest.raises(ZeroDivisionError):
        panel.run()


def test_cuda_only_flags_are_disabled_on_cpu_with_the_reason():
    from dataclasses import dataclass

    from accel.workloads.flags import flag

    @dataclass(frozen=True)
    class Flags:
        graph: bool = flag("capture", "graphs", requires="cuda")

    panel = FeaturePanel(Flags, lambda f: lambda: None, device="cpu", repeats=1)
    assert panel.controls["graph"].disabled
    assert "needs a CUDA GPU" in panel.controls["graph"].tooltip
    panel.controls["graph"].value = True
    with pytest.raises(ValueError, match=r"\['graph'\] cannot run on cpu"):
        panel.run()


def test_the_last_run_keeps_its_comparison_for_the_spread_of_its_speedup():
    panel, _ = make_panel()
    assert panel.comparison is None
    row = panel.run(tiny_mlp.Flags(fused_adamw=True))
    low, high = panel.comparison.ratio_band("baseline", "fused_adamw")
    assert 0 < low <= high
    assert panel.comparison.speedup("fused_adamw") == row["speedup"]
    assert len(panel.comparison.timings["baseline"].times_ms) == 3


def test_a_note_shows_in_the_panel_before_the_run_it_is_about():
    panel, _ = make_panel(profile=False)
    panel.note("bf16 <loses> on a CPU")
    assert "bf16 &lt;loses&gt; on a CPU" in panel.notes.value
    children = list(panel.widget.children)
    run_row = next(i for i, c in enumerate(children) if panel.run_button in getattr(c, "children", ()))
    assert children.index(panel.notes) < run_row  # shown, above the Run button
