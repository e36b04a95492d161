"""A bare string where a collection of names is expected is refused, never split into letters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accel import attention, fusion, graphs, memory, sync
from accel.attention.masks import Document, SlidingWindow
from accel.lab import bench
from accel.lab.cases import fusion as fusion_case
from accel.lab.cases import recipe as recipe_case
from accel.lab.cases import sdpa as sdpa_case
from accel.measure import timer
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


# ---- a mistaken argument is refused at once, naming it, with what came and what was expected ----
def _step():
    return torch.randn(4, 4).sum()


def _trainable() -> tuple:
    model = _model()
    return model, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1)


MISTAKES = {
    "group_stats of a number": (
        lambda: fusion.group_stats([3]),
        TypeError,
        r"group_stats: group 0: expected a tensor or an iterable of tensors, got 3 \(int\)",
    ),
    "peak_memory(3)": (lambda: memory.peak_memory(3), TypeError, r"peak_memory\(fn\): expected a"),
    "count_allocations(3)": (
        lambda: memory.count_allocations(3, device="cpu"),
        TypeError,
        r"count_allocations\(fn\): expected a",
    ),
    "count_allocations warmup": (
        lambda: memory.count_allocations(_step, warmup=-1, device="cpu"),
        ValueError,
        r"warmup must be an int >= 0, got -1",
    ),
    "largest_batch(3)": (
        lambda: memory.largest_batch(3, 1000, device="cpu"),
        TypeError,
        r"largest_batch\(run\): expected a",
    ),
    "largest_batch budget string": (
        lambda: memory.largest_batch(torch.randn, "1e6", device="cpu"),
        TypeError,
        r"budget_bytes must be a number, got '1e6' \(str\)",
    ),
    "checkpoint_blocks of a number": (
        lambda: memory.checkpoint_blocks(3, ["0"]),
        TypeError,
        r"checkpoint_blocks: model must be a torch\.nn\.Module, got 3 \(int\)",
    ),
    "tensor_bytes of a number": (
        lambda: memory.tensor_bytes(3),
        TypeError,
        r"tensor_bytes: expected an iterable of tensors, got 3 \(int\)",
    ),
    "ProgressLog capacity string": (
        lambda: sync.ProgressLog(["a"], capacity="3"),
        TypeError,
        r"capacity must be an int >= 1, got '3' \(str\)",
    ),
    "count_syncs(3)": (lambda: sync.count_syncs(3), TypeError, r"count_syncs\(fn\): expected a"),
    "read_scalars of a list": (
        lambda: sync.read_scalars([torch.tensor(1.0)]),
        TypeError,
        r"read_scalars: expected a mapping of names to tensors \(a dict\), got list",
    ),
    "check_planes dim string": (
        lambda: sync.check_planes([[0, 1]], "4"),
        TypeError,
        r"dim must be an int >= 2, got '4' \(str\)",
    ),
    "training_step max_grad_norm string": (
        lambda: graphs.training_step(*_trainable(), max_grad_norm="1"),
        TypeError,
        r"max_grad_norm must be a number, got '1' \(str\)",
    ),
    "rope_cos_sin negative": (
        lambda: attention.rope_cos_sin(-1, 8),
        ValueError,
        r"seq_len must be an int >= 0, got -1",
    ),
    "block_mask block_size 0": (
        lambda: attention.block_mask(
            SlidingWindow(2), *[torch.randn(1, 1, 4, 8)] * 2, block_size=0
        ),
        ValueError,
        r"block_size must be an int >= 1, got 0",
    ),
    "Document causal string": (
        lambda: Document(torch.tensor([3]), causal="no"),
        TypeError,
        r"causal must be True or False, got 'no' \(str\)",
    ),
    "interleaved non-callable": (
        lambda: timer.interleaved({"a": 3}, "cpu", warmup=1, repeats=1),
        TypeError,
        r"interleaved: candidate 'a': expected a",
    ),
    "interleaved repeats string": (
        lambda: timer.interleaved({"a": _step}, "cpu", warmup=1, repeats="3"),
        TypeError,
        r"repeats must be an int >= 1, got '3' \(str\)",
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES.values(), ids=MISTAKES.keys())
def test_a_mistaken_argument_is_named_with_what_came_and_what_was_expected(mistake):
    call, error, match = mistake
    with pytest.raises(error, match=match):
        call()
