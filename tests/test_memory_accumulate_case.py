"""The memory phase's accumulation part on the CPU at tiny sizes: the gradients equal the large
batch's, the peak stays one micro-batch's plus the gradients while the large batch's grows, and
its rows are not judged off the GPU."""

from __future__ import annotations

import pytest
import torch

from accel.lab import bench
from accel.lab.cases import memory as case
from accel.lab.cases import memory_accumulate as ma
from accel.workloads import nested_optimizer as no

TINY = no.Sizes(layers=1, width=16, heads=2, context=8, batch=2, text_bytes=1 << 12)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_k_micro_batches_match_the_large_batch_at_one_micro_batch_of_memory():
    bench_ = ma.AccumulationBench(TINY, "cpu", micro_batch=2)
    costs = bench_.measure(4, repeats=1)
    assert costs.effective_batch == 8
    assert 0 < costs.gradient_difference <= ma.GRADIENT_TOLERANCE  # rounding, not identity
    peaks = costs.peak_bytes
    assert peaks["accumulated"] <= costs.peak_bound
    assert peaks["large batch"] > peaks["accumulated"] > peaks["one micro-batch"]
    assert costs.meets()["gradients"] and costs.meets()["peak"]
    assert costs.throughput_ratio > 0


def test_a_nan_in_the_batch_is_not_called_equal():
    bench_ = ma.AccumulationBench(TINY, "cpu", micro_batch=2)
    for p in bench_.model.parameters():
        p.data[...] = float("nan")
        break
    difference = bench_.gradient_difference(bench_.make_batch(4), 2)
    assert not difference <= ma.GRADIENT_TOLERANCE


def test_the_rows_are_named_and_unjudged_on_a_cpu(monkeypatch):
    ctx = bench.BenchContext(torch.device("cpu"), "cpu", only=("accumulate",))
    monkeypatch.setattr(ma, "K", 2)
    rows = case.run(ctx)  # only the accumulate part runs
    assert [r.case for r in rows] == [
        "accumulate_gradients",
        "accumulate_throughput",
        "accumulate_peak",
    ]
    assert all(r.met is None and r.target for r in rows)
    bench.check_parts(["memory"], ("accumulate",))
