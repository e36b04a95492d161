"""The memory phase's offload part: the line through two models' peaks and what it fits, and a
row that says why it did not run where the offload optimizer cannot (a CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from accel.lab import bench
from accel.lab.cases import memory as case
from accel.lab.cases import memory_offload as mo


def test_the_line_through_two_peaks_gives_bytes_per_parameter_and_what_fits():
    gen = torch.Generator().manual_seed(0)
    per_param, besides = 8 + torch.rand((), generator=gen).item(), 1e6 * torch.rand(()).item()
    params = (10_000, 40_000)
    peaks = tuple(round(besides + per_param * n) for n in params)
    got, got_besides = mo.line_through(params, peaks)
    assert got == pytest.approx(per_param, rel=1e-4)
    assert got_besides == pytest.approx(besides, abs=1.0)
    assert mo.largest_fitting(peaks[1], got, got_besides) == pytest.approx(params[1], rel=1e-4)
    assert math.isnan(mo.largest_fitting(1 << 30, 0.0, 0.0))  # a flat line fits no estimate


def test_the_part_says_why_it_did_not_run_on_a_cpu():
    ctx = bench.BenchContext(torch.device("cpu"), "cpu", only=("offload",))
    (row,) = case.run(ctx)
    assert row.case == "offload: device bytes per parameter"
    assert math.isnan(row.optimized) and "not run: needs a CUDA GPU" in row.note
    bench.check_parts(["memory"], ("offload",))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the offload optimizer needs a CUDA GPU")
def test_offload_halves_about_the_device_bytes_per_parameter_on_a_gpu():
    pytest.importorskip("torchao.optim")
    # the gpu preset's widths: at the cpu preset's, the allocator's fixed costs outweigh the weights
    ctx = bench.BenchContext(torch.device("cuda"), "gpu", only=("offload",))
    rows = {r.case: r for r in case.run(ctx)}
    per_param = rows["offload: device bytes per parameter"]
    # fused AdamW keeps a parameter, its gradient and two states (16 B); offloaded, the states go
    assert per_param.baseline > 14 and per_param.optimized < 0.75 * per_param.baseline
    assert rows["offload: largest model that fits"].speedup > 1
    assert rows["offload: time per step"].optimized > 0
