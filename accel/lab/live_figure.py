"""LiveFigure: a plotly figure in a notebook that redraws when the kernel changes it.

    live = LiveFigure(go.Figure(go.Scatter(y=[])))
    live                                    # shows it
    with live.batch_update() as figure:     # edit the figure, then one redraw
        figure.data[0].y = samples
    live.draw(at_most_every_s=0.25)         # in a loop: a redraw when the last is that old

Each draw replaces an ``ipywidgets.Output``'s content with the whole figure as plotly JSON, so a
page that loads late or is reloaded draws the last figure (``go.FigureWidget`` depends on every
edit reaching a view that may not have loaded yet, and then stays blank or stale).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import ipywidgets as widgets
import plotly.graph_objects as go
import plotly.io as pio

# What a frontend without plotly's renderer shows instead of the figure.
NO_RENDERER = "(needs plotly's renderer)"


class LiveFigure:
    """``figure`` (a ``go.Figure``, edited in place) shown in ``widget`` (an ``Output``)."""

    def __init__(self, figure: go.Figure):
        if not isinstance(figure, go.Figure):
            raise TypeError(f"expected a plotly go.Figure, got {type(figure).__name__}")
        self.figure = figure
        self.widget = widgets.Output()
        self._drawn_at = -math.inf
        self.draw()

    @contextlib.contextmanager
    def batch_update(self) -> Iterator[go.Figure]:
        """Edit ``figure`` inside the block; it is drawn once at the end."""
        yield self.figure
        self.draw()

    def draw(self, *, at_most_every_s: float = 0.0) -> None:
        """Show ``figure`` as it is now; skipped when the last draw is younger than
        ``at_most_every_s`` (a loop's last state must then be drawn without it)."""
        now = time.monotonic()
        if now - self._drawn_at < at_most_every_s:
            return
        bundle = pio.renderers["plotly_mimetype"].to_mimebundle(self.figure.to_dict())
        title = self.figure.layout.title.text
        bundle["text/plain"] = f"plotly figure{f': {title}' if title else ''} {NO_RENDERER}"
        # The output keeps its height while the renderer replaces the plot: no jump on the page.
        height = self.figure.layout.height
        self.widget.layout.min_height = f"{height}px" if height else None
        self.widget.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)
        self._drawn_at = now

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
