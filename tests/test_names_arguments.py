"""A bare string where a collection of names is expected is refused, never split into letters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accel import memory, sync
from accel.lab import bench
from accel.lab.cases import fusion as fusion_case
from accel.lab.cases import recipe as recipe_case
from accel.lab.cases import sdpa as sdpa_case
from accel.workloads import nested_optimizer as no


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))


CALLS = {
    "MetricAccumulator": lambda: sync.MetricAccumulator("lr"),
    "ProgressLog": lambda: sync.ProgressLog("lr", capacity=2),
    "checkpoint_blocks": lambda: memory.checkpoint_blocks(_model(), "01"),
    "save_ops_policy": lambda: memory.save_ops_policy("mm"),
    "run_bench": lambda: bench.run_bench("ceilings", progress=False),
    "nested_optimizer.build": lambda: no.build(checkpoint="blocks.0"),
    "op_counts": lambda: fusion_case.op_counts(None, "aten::mm"),
    "sweep variants": lambda: sdpa_case.measure_point(None, torch.device("cpu"), "default"),
    "recipe validate": lambda: recipe_case.measure({}, None, "cpu", validate="baseline"),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_bare_string_is_refused(call):
    with pytest.raises(TypeError, match=r"expected a collection of .*, got the string '"):
        call()


def test_the_message_shows_what_to_write_instead():
    with pytest.raises(TypeError, match=r"\['lr'\]"):
        sync.MetricAccumulator("lr")


def test_names_that_are_not_strings_are_refused():
    with pytest.raises(TypeError, match="metric names must be strings, got 3 \\(int\\)"):
        sync.MetricAccumulator(["loss", 3])


def test_collections_of_names_still_work():
    assert sync.MetricAccumulator(("loss", "lr")).names == ("loss", "lr")
    assert sync.MetricAccumulator({"loss": 0, "lr": 1}.keys()).names == ("loss", "lr")
    handle = memory.checkpoint_blocks(_model(), ["0", "1"])
    handle.remove()
