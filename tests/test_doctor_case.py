"""The bench's doctor phase on a CPU: its rows of predicted and measured savings, as shares of
the step, for a zoo model whose planted problem a CPU can see."""

from __future__ import annotations

import re

import pytest
import torch

from accel.lab.bench import BenchContext
from accel.lab.cases import doctor
from accel.measure.costs import measure_costs

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")
SHARES = re.compile(
    r"predicted ([\d.]+) ms of a ([\d.]+) ms step, measured (-?[\d.]+) ms of a ([\d.]+) ms step"
)


def test_the_loader_wait_is_found_predicted_and_measured_as_shares_of_the_step():
    ctx = BenchContext(CPU, "cpu", None)
    rows = doctor.model_rows("cnn", ctx, measure_costs(CPU))
    assert len(rows) >= 3, [(r.case, r.note) for r in rows]
    found, twin, top, *_ = rows
    assert (found.optimized, found.baseline) == (1, 1) and twin.optimized == 0
    assert top.case == "cnn: input saving (top finding)" and top.unit == "%"
    assert top.target == "within 30%" and top.met is None  # a CPU run is not judged
    predicted_ms, predicted_step, measured_ms, measured_step = map(
        float, SHARES.search(top.note).groups()
    )
    assert 0 < predicted_ms < predicted_step and measured_step > 0
    assert top.optimized == pytest.approx(100 * predicted_ms / predicted_step, rel=1e-2)
    assert top.baseline == pytest.approx(100 * measured_ms / measured_step, rel=1e-2)
