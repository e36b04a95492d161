"""LiveFigure: every draw puts the whole figure in the output widget's state."""

import plotly.graph_objects as go
import pytest

from accel.lab.live_figure import NO_RENDERER, LiveFigure

MIMETYPE = "application/vnd.plotly.v1+json"  # what plotly's renderer shows


def _shown(live: LiveFigure) -> dict:
    (output,) = live.widget.outputs
    return output["data"][MIMETYPE]


def test_a_batch_of_edits_is_drawn_once_whole():
    live = LiveFigure(go.Figure(go.Scatter(y=[]), layout=dict(height=300, title="t")))
    assert _shown(live)["data"][0]["y"] == []
    with live.batch_update() as figure:
        figure.data[0].y = [3.0, 1.5]
        assert _shown(live)["data"][0]["y"] == []  # not yet: drawn at the block's end
    assert _shown(live)["data"][0]["y"] == [3.0, 1.5]
    assert _shown(live)["layout"]["title"]["text"] == "t"
    assert live.widget.layout.min_height == "300px"
    assert live.widget.outputs[0]["data"]["text/plain"] == f"plotly figure: t {NO_RENDERER}"


def test_a_throttled_draw_waits_for_its_interval():
    live = LiveFigure(go.Figure(go.Scatter(y=[])))
    live.figure.data[0].y = [1.0]
    live.draw(at_most_every_s=3600)  # drawn a moment ago, at construction: skipped
    assert _shown(live)["data"][0]["y"] == []
    live.draw()
    assert _shown(live)["data"][0]["y"] == [1.0]


def test_it_takes_a_figure_not_a_dict():
    with pytest.raises(TypeError, match=r"expected a plotly go.Figure, got dict"):
        LiveFigure({"data": []})


def test_numpy_and_pandas_values_reach_the_widget_state_as_json():
    """The output's state goes to the page as JSON: arrays and timestamps must survive it."""
    import json

    import numpy as np
    import pandas as pd

    x = pd.date_range("2026-01-01", periods=3)
    live = LiveFigure(go.Figure(go.Scatter(x=x, y=np.random.default_rng(0).random(3))))
    shown = json.loads(json.dumps(live.widget.outputs))[0]["data"][MIMETYPE]["data"][0]
    assert shown["x"][0].startswith("2026-01-01") and shown["y"]  # y: plotly's typed-array form
