"""Bench phase ``recipe``, part ``float8``, on the CPU (torchao's float8 casts run there too):
rows per width, float8 and bf16 trained from the same start, and a clear absence without torchao."""

from __future__ import annotations

import pytest
import torch

from accel.lab.bench import BenchContext
from accel.lab.cases import recipe_float8

pytestmark = [pytest.mark.torchao, pytest.mark.usefixtures("one_thread")]
CPU = BenchContext(torch.device("cpu"), "cpu", only=("float8",))


def test_each_width_has_its_time_and_its_loss_beside_bf16s():
    pytest.importorskip("torchao", reason="the float8 part needs torchao")
    rows = {r.case: r for r in recipe_float8.rows(CPU)}
    widths = recipe_float8.SIZES["cpu"].widths
    assert sorted(rows) == sorted(f"float8 width {w}: {what}" for w in widths
                                  for what in ("time per step", "loss"))  # fmt: skip
    for w in widths:
        loss = rows[f"float8 width {w}: loss"]
        # the same model and data: float8's casts move the loss a little, not away
        assert 0 < loss.optimized < 2 * loss.baseline and "apart" in loss.note
        time = rows[f"float8 width {w}: time per step"]
        assert time.baseline > 0
        # where each step's time goes, from the profiler: the products against the rest
        assert "profiled time per step, bf16 / float8: matmul " in time.note


def test_without_torchao_the_part_is_left_out_with_a_warning(monkeypatch):
    monkeypatch.setattr(recipe_float8, "available", lambda: "torchao is not installed")
    with pytest.warns(RuntimeWarning, match="float8 left out: torchao is not installed"):
        assert recipe_float8.rows(CPU) == []
