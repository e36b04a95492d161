"""Bench phase ``recipe``, part ``adopted``, on the CPU: each workbook workload with every flag its
phases adopted against none, the flags this device cannot run left out and named."""

from __future__ import annotations

import pytest
import torch

from accel.lab.bench import BenchContext
from accel.lab.cases import recipe_adopted

pytestmark = pytest.mark.usefixtures("one_thread")


def test_one_row_per_workbook_workload_with_what_it_switched_on_and_left_out():
    ctx = BenchContext(torch.device("cpu"), "cpu", only=("adopted",))
    rows = {r.case: r for r in recipe_adopted.rows(ctx, repeats=2)}
    assert sorted(rows) == sorted(f"adopted {w}: every adopted flag against none"
                                  for w in recipe_adopted.WORKLOADS)  # fmt: skip
    vit = rows["adopted vit: every adopted flag against none"]
    assert vit.baseline > 0 and vit.optimized > 0 and vit.unit == "ms"
    assert "sdpa" in vit.note and "fused_adamw" in vit.note
    assert "left out here: compile" in vit.note  # needs a CUDA GPU
    assert all(r.met is None for r in rows.values())  # no target: what a user takes home


def test_the_part_is_picked_by_its_name():
    from accel.lab.cases import recipe

    assert "adopted" in recipe.parts()
