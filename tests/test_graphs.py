"""accel.graphs: argument checks and eager fallbacks everywhere; capture, replay, shape changes,
capture failures, memory and whole training steps on a CUDA GPU."""

from __future__ import annotations

import copy
import math
import threading
import warnings

import pytest
import torch
from conftest import CUDA, requires_cuda
from torch import nn

from accel import graphs
from accel.graphs import GraphCaptureWarning, GraphedStep, GraphInputError


def mix(x: torch.Tensor, w: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
    """A few dozen small kernels: the kind of step a graph pays for."""
    h = x
    for _ in range(8):
        h = torch.tanh(h @ w) * scale + h
    return h.sum(-1)


# ---- everywhere (on a CPU machine: the eager fallback) ------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup": 0}, "warmup must be an int >= 1"),
        ({"on_new_shape": "grow"}, "on_new_shape must be 'error' or 'recapture'"),
        ({"fallback": "ignore"}, "fallback must be 'warn' or 'raise'"),
        ({"device": "nonsense"}, r"device must be a torch.device or its name .*'nonsense'"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GraphedStep(mix, **kwargs)


def test_a_step_must_be_callable():
    with pytest.raises(TypeError, match="warmup must be an int >= 1"):
        GraphedStep(mix, warmup=1.5)
    with pytest.raises(TypeError, match=r"GraphedStep\(fn\): expected a function to call, got 3"):
        GraphedStep(3)


def test_unhashable_constants_are_refused(seed):
    step = GraphedStep(lambda x, options: x * 2)
    with pytest.raises(GraphInputError, match="unhashable set"):
        step(torch.randn(3), {1, 2})


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA fallback")
def test_without_cuda_runs_eagerly_with_one_warning(seed):
    x, w = torch.randn(4, 8), torch.randn(8, 8) / 3
    step = GraphedStep(mix, warmup=2)
    with pytest.warns(GraphCaptureWarning, match="need a CUDA GPU.*running eagerly"):
        first = step(x, w)
    torch.testing.assert_close(first, mix(x, w), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        for _ in range(3):
            y = torch.randn(4, 8)
            torch.testing.assert_close(step(y, w), mix(y, w), rtol=0, atol=0)
    assert step.reason is not None and "CUDA" in step.reason
    assert (step.graphs, step.replays, step.eager_calls) == (0, 0, 4)
    assert "eager" in repr(step)


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA fallback")
def test_fallback_raise_raises_instead():
    step = GraphedStep(mix, fallback="raise")
    with pytest.raises(RuntimeError, match="cannot use a CUDA graph") as raised:
        step(torch.randn(2, 3), torch.randn(3, 3))
    assert "running eagerly" not in str(raised.value)  # nothing ran
    assert "fallback='warn'" in str(raised.value) and step.eager_calls == 0


def test_mismatch_messages_name_the_argument():
    a = torch.randn(2, 3)
    leaves, spec = graphs.pytree.tree_flatten(((a, 2.0), {"w": a}))
    key = graphs._signature(leaves, spec)
    b_leaves, b_spec = graphs.pytree.tree_flatten(((a[:1], 2.0), {"w": a}))
    names = graphs._leaf_names(spec, len(leaves))
    assert names == ["args[0]", "args[1]", "kwargs['w']"]
    text = graphs._mismatch(key, graphs._signature(b_leaves, b_spec), names)
    assert text == "argument args[0]: captured for float32[2, 3] on cpu, got float32[1, 3] on cpu"
    c_leaves, c_spec = graphs.pytree.tree_flatten(((a, 3.0), {"w": a}))
    assert "the constant 2.0, got the constant 3.0" in graphs._mismatch(
        key, graphs._signature(c_leaves, c_spec), names
    )


def test_sync_failures_are_explained():
    exc = RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    text = graphs._explain(exc)
    assert "operation not permitted" in text and ".item()" in text and "more" not in text
    assert ".item()" not in graphs._explain(ValueError("shape mismatch"))


def _model(seed: int, device) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device)


def test_training_step_equals_the_written_out_step(seed, device):
    """Eager, the step is the usual five lines (clipping included)."""
    model, reference = _model(seed, device), _model(seed, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = graphs.training_step(model, nn.functional.mse_loss, opt, max_grad_norm=0.5)
    for _ in range(4):
        x, y = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
        loss = step(x, y)
        ref_opt.zero_grad()
        ref_loss = nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach())
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_training_step_refuses_a_max_grad_norm_that_cannot_clip(bad, device):
    model = _model(0, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="max_grad_norm must be finite and > 0"):
        graphs.training_step(model, nn.functional.mse_loss, opt, max_grad_norm=bad)


# ---- on a CUDA GPU ------------------------------------------------------------------------------
@requires_cuda
def test_replays_equal_eager_on_fresh_inputs(seed):
    w = torch.randn(64, 64, device="cuda") / 8
    step = GraphedStep(mix, warmup=2)
    for i in range(40):
        x = torch.randn(32, 64, device="cuda")
        out = step(x, w)
        torch.testing.assert_close(out, mix(x, w), rtol=1e-5, atol=1e-5, msg=f"call {i}")
    assert (step.eager_calls, step.captures, step.replays) == (2, 1, 38)
    assert step.reason is None and step.graphs == 1


@requires_cuda
def test_outputs_are_static(seed):
    w = torch.randn(16, 16, device="cuda") / 4
    step = GraphedStep(mix, warmup=1)
    step(torch.randn(8, 16, device="cuda"), w)
    first = step(torch.randn(8, 16, device="cuda"), w)
    x = torch.randn(8, 16, device="cuda")
    again = step(x, w)
    assert again is first  # the same tensor, overwritten
    torch.testing.assert_close(again, mix(x, w))


@requires_cuda
def test_no_memory_growth_over_1000_replays(seed):
    w = torch.randn(64, 64, device="cuda") / 8
    step = GraphedStep(mix)
    xs = [torch.randn(32, 64, device="cuda") for _ in range(4)]
    for x in xs:
        step(x, w)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for i in range(1000):
        step(xs[i % 4], w)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved
    assert step.replays == 1001


@requires_cuda
def test_a_new_shape_is_an_error_naming_it(seed):
    w = torch.randn(16, 16, device="cuda")
    step = GraphedStep(mix, warmup=1)
    for _ in range(3):
        step(torch.randn(8, 16, device="cuda"), w, 0.5)
    with pytest.raises(
        GraphInputError, match=r"args\[0\]: captured for float32\[8, 16\].*\[4, 16\]"
    ):
        step(torch.randn(4, 16, device="cuda"), w, 0.5)
    with pytest.raises(GraphInputError, match=r"float32.*got bfloat16"):
        step(torch.randn(8, 16, device="cuda", dtype=torch.bfloat16), w, 0.5)
    with pytest.raises(GraphInputError, match=r"args\[2\]: captured for the constant 0.5, got"):
        step(torch.randn(8, 16, device="cuda"), w, 0.25)


@requires_cuda
def test_calls_of_tensors_by_position_replay_without_pytree_and_equal_the_step(seed):
    w = torch.randn(16, 16, device="cuda") / 4
    step = GraphedStep(mix, warmup=1)
    for _ in range(3):
        step(torch.randn(8, 16, device="cuda"), w)
    assert len(step._positional) == 1  # the third call found the graph and registered it
    replays = step.replays
    for _ in range(3):
        x = torch.randn(8, 16, device="cuda")
        torch.testing.assert_close(step(x, w), mix(x, w), rtol=1e-5, atol=1e-5)
    assert step.replays == replays + 3 and step.graphs == 1
    with pytest.raises(GraphInputError, match=r"args\[0\]: captured for float32\[8, 16\]"):
        step(torch.randn(4, 16, device="cuda"), w)  # the general path says what differs
    with pytest.raises(GraphInputError, match="structure differs"):
        step(torch.randn(8, 16, device="cuda"), w=w)
    step.reset()
    assert step._positional == {}


@requires_cuda
def test_recapture_keeps_one_graph_per_shape_in_one_pool(seed):
    w = torch.randn(16, 16, device="cuda") / 4
    step = GraphedStep(mix, warmup=1, on_new_shape="recapture")
    for i in range(12):
        x = torch.randn(4 + 4 * (i % 3), 16, device="cuda")  # 3 shapes, interleaved
        torch.testing.assert_close(step(x, w), mix(x, w), rtol=1e-5, atol=1e-5)
    assert step.graphs == 3 and step.captures == 3 and step.eager_calls == 3
    assert step.pool is not None and step.pool_bytes > 0


@requires_cuda
@pytest.mark.parametrize("body", ["item", "branch", "cpu_copy"])
def test_a_step_that_syncs_runs_eagerly_after_one_warning(seed, body):
    """Caught in the last warm-up call, before any capture: no failed capture, so CUDA (its
    random-number state included) stays usable."""

    def step_fn(x: torch.Tensor):
        y = x * 2
        if body == "item":
            return y + y.sum().item()
        if body == "branch":
            return y if y.sum() > 0 else -y  # data-dependent control flow: a sync
        return y.cpu()

    step = GraphedStep(step_fn, warmup=1)
    x = torch.randn(5, device="cuda")
    with pytest.warns(GraphCaptureWarning, match="synchronized with the host"):
        torch.testing.assert_close(step(x), step_fn(x))
    assert step.reason is not None and "test_graphs.py" in step.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            x = torch.randn(5, device="cuda")
            torch.testing.assert_close(step(x), step_fn(x))
    assert step.graphs == 0 and step.eager_calls == 4


@requires_cuda
def test_a_sync_in_an_earlier_warm_up_only_still_captures(seed):
    """One-time work on the first call (here a check that reads its input) is what warm-ups are
    for: only a sync in the last one before the capture stops it."""
    checked = []

    def step_fn(x: torch.Tensor):
        if not checked:
            checked.append(bool((x.abs() < 10).all()))  # a read on the host, first call only
        return x * 2 + 1

    step = GraphedStep(step_fn, warmup=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            x = torch.randn(5, device="cuda")
            torch.testing.assert_close(step(x), x * 2 + 1)
    assert step.reason is None and step.captures == 1 and step.replays == 3


@requires_cuda
def test_an_output_on_the_cpu_falls_back(seed):
    def step_fn(x):
        return x * 2, torch.arange(3) * 2  # host work: a replay would never redo it

    step = GraphedStep(step_fn, warmup=1)
    x = torch.randn(4, device="cuda")
    step(x)
    with pytest.warns(GraphCaptureWarning, match="tensor on cpu, which a replay would never"):
        out = step(x)
    torch.testing.assert_close(out[0], x * 2)
    assert step.reason is not None and step.graphs == 0
    torch.testing.assert_close(step(x)[0], x * 2)


@requires_cuda
def test_a_cpu_input_falls_back(seed):
    step = GraphedStep(lambda a, b: a + b.to(a.device, non_blocking=True), warmup=1)
    with pytest.warns(GraphCaptureWarning, match="tensor on cpu"):
        step(torch.randn(3, device="cuda"), torch.randn(3))


@requires_cuda
def test_a_polling_thread_does_not_break_capture(seed):
    """capture_error_mode='thread_local': another thread's CUDA calls are not capture errors."""
    stop = threading.Event()

    def poll():
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                torch.cuda.memory_allocated()
                # no random numbers: torch's CUDA generator belongs to the capture meanwhile
                (torch.ones(256, device="cuda") ** 2).sum()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        w = torch.randn(64, 64, device="cuda") / 8
        step = GraphedStep(mix, warmup=1, fallback="raise")
        for _ in range(20):
            x = torch.randn(32, 64, device="cuda")
            torch.testing.assert_close(step(x, w), mix(x, w), rtol=1e-5, atol=1e-5)
    finally:
        stop.set()
        thread.join()
    assert step.graphs == 1


@requires_cuda
def test_reset_frees_the_pool(seed):
    w = torch.randn(1024, 1024, device="cuda") / 32
    step = GraphedStep(mix, warmup=1)
    for _ in range(3):
        out = step(torch.randn(2048, 1024, device="cuda"), w)
    pool = step.pool
    assert step.pool_bytes >= out.numel() * 4 and graphs.pool_bytes(pool) == step.pool_bytes
    del out
    step.reset()
    assert step.graphs == 0 and graphs.pool_bytes(pool) == 0 and step.pool_bytes == 0
    x = torch.randn(2048, 1024, device="cuda")
    step(x, w)
    torch.testing.assert_close(step(x, w), mix(x, w), rtol=1e-4, atol=1e-4)  # captures again
    assert step.graphs == 1


def _capturable_pair(seed: int, lr):
    model = _model(seed, "cuda")
    reference = copy.deepcopy(model)

    def adamw(m, capturable):
        return torch.optim.AdamW(
            m.parameters(), lr=lr, fused=True, capturable=capturable, weight_decay=0.1
        )

    return model, reference, adamw(model, True), adamw(reference, False)


@requires_cuda
def test_whole_training_step_graphed_equals_eager(seed):
    model, reference, opt, ref_opt = _capturable_pair(seed, 1e-2)
    graphed = GraphedStep(
        graphs.training_step(model, nn.functional.mse_loss, opt, max_grad_norm=0.5)
    )
    eager = graphs.training_step(reference, nn.functional.mse_loss, ref_opt, max_grad_norm=0.5)
    for i in range(25):
        x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
        torch.testing.assert_close(graphed(x, y), eager(x, y), rtol=1e-5, atol=1e-6, msg=f"{i}")
    assert graphed.graphs == 1 and graphed.replays == 22
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
