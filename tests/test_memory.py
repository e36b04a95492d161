"""accel.memory: buffers, allocation counts, checkpointing, the batch search."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from accel import memory
from accel.memory import GiB, MiB

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (the caching allocator)")
cpu_only = pytest.mark.skipif(CUDA, reason="checks the no-CUDA behaviour")


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_importing_memory_pulls_in_no_notebook_stack():
    code = (
        "import sys, accel.memory; "
        "print([m for m in ('pandas', 'plotly', 'ipywidgets') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- buffers allocated once ---------------------------------------------------------------------
def test_buffer_cache_hands_out_the_same_tensor():
    cache = memory.BufferCache("cpu")
    a = cache.get("stats", (3, 2))
    a.copy_(torch.arange(6.0).view(3, 2) + 1)
    b = cache.get("stats", (3, 2))
    assert b is a and cache.misses == 1
    c = cache.get("stats", (4, 2))  # new shape: replaced
    assert c.shape == (4, 2) and cache.misses == 2
    d = cache.get("lr", (5,), dtype=torch.float64)
    assert d.dtype == torch.float64 and cache.misses == 3
    with pytest.raises(ValueError, match="no device given"):
        memory.BufferCache().get("x", (1,))


@pytest.mark.parametrize(
    ("shape", "error", "match"),
    [((-1, 2), ValueError, r"sizes of at least 0, got \(-1, 2\)"),
     (3, TypeError, r"a tuple of sizes, got 3 \(int\)"),
     ((2.5,), TypeError, r"a tuple of sizes, got \(2.5,\)")],
    ids=["negative", "a number", "a float size"],
)
def test_buffer_cache_refuses_a_bad_shape_before_allocating(shape, error, match):
    cache = memory.BufferCache("cpu")
    with pytest.raises(error, match=match):
        cache.get("x", shape)
    assert cache.misses == 0


# ---- counting allocations and peaks -------------------------------------------------------------
def test_a_steps_returned_tensor_is_freed_before_the_next_step(gen):
    """The peak is one step's, however many steps are counted: nothing keeps the results."""
    a, b = torch.randn(300, 70, generator=gen), torch.randn(70, 90, generator=gen)
    peaks = [
        memory.count_allocations(lambda: a @ b, steps=steps, device="cpu").peak_bytes
        for steps in (1, 4)
    ]
    assert peaks[0] == peaks[1] == 300 * 90 * 4


def test_count_allocations_sees_fresh_tensors_not_in_place_work(gen):
    x, y = torch.randn(256, 256, generator=gen), torch.rand(256, 256, generator=gen)
    buf = torch.empty_like(x)
    fresh = memory.count_allocations(lambda: (x * 2 + 1).sum(), steps=3, device="cpu")
    in_place = memory.count_allocations(
        lambda: torch.mul(x, y, out=buf).add_(y), steps=3, device="cpu"
    )
    assert fresh.requests >= 2 and fresh.bytes_requested >= 2 * x.numel() * 4
    assert in_place.requests == 0 and in_place.peak_bytes == 0
    if not CUDA:
        assert fresh.device_allocs is None and fresh.retries is None
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        memory.count_allocations(lambda: None, steps=0)


def test_peak_memory_sees_a_temporary(gen):
    x = torch.randn(1024, 256, generator=gen)  # 1 MiB

    def two_temporaries():
        a = x * 2
        b = a + 1  # a and b alive together: 2 MiB
        del a
        return float(b[0, 0])

    peak = memory.peak_memory(two_temporaries, device="cpu")
    assert 2 * MiB <= peak < 3 * MiB


# ---- the allocator's history --------------------------------------------------------------------
def test_snapshot_events_track_allocated_and_reserved():
    snapshot = {
        "device_traces": [
            [
                {"action": "segment_alloc", "size": 2 * MiB, "time_us": 100},
                {"action": "alloc", "size": 512, "time_us": 101},
                {"action": "alloc", "size": 1024, "time_us": 105},
                {"action": "free_requested", "size": 512, "time_us": 110},
                {"action": "free_completed", "size": 512, "time_us": 111},
                {"action": "segment_free", "size": 2 * MiB, "time_us": 130},
            ]
        ]
    }
    events = memory.snapshot_events(snapshot)
    assert list(events[0]) == ["t_us", "action", "bytes", "allocated_bytes", "reserved_bytes"]
    assert [e["t_us"] for e in events] == [0, 1, 5, 10, 11, 30]
    assert [e["allocated_bytes"] for e in events] == [0, 512, 1536, 1536, 1024, 1024]
    assert [e["reserved_bytes"] for e in events] == [2 * MiB] * 5 + [0]
    assert memory.snapshot_events({"device_traces": []}) == []


@cpu_only
def test_record_memory_history_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"), memory.record_memory_history():
        pass


# ---- activation checkpointing -------------------------------------------------------------------
class Tower(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x).sum()


def grads_and_peak(model, x):
    def step():
        model.zero_grad(set_to_none=False)
        model(x).backward()

    step()  # gradients allocated: the peak below is activations only
    peak = memory.peak_memory(step, device="cpu")
    return [p.grad.clone() for p in model.parameters()], peak


@pytest.mark.parametrize("names", [["blocks.0", "blocks.2"], [f"blocks.{i}" for i in range(4)]])
def test_checkpointing_keeps_gradients_and_lowers_the_peak(gen, names):
    torch.manual_seed(0)
    model = Tower()
    x = torch.randn(256, 64, generator=gen)
    plain, plain_peak = grads_and_peak(model, x)
    with memory.checkpoint_blocks(model, names) as handle:
        assert handle.names == names
        ckpt, ckpt_peak = grads_and_peak(model, x)
    for a, b in zip(ckpt, plain, strict=True):
        assert torch.equal(a, b)  # the recomputation is the same arithmetic
    # each block stores (B, 4w) twice and (B, w) once; checkpointed it keeps its input only
    assert ckpt_peak < (0.75 if len(names) == 2 else 0.5) * plain_peak
    _, again_peak = grads_and_peak(model, x)  # removed: back to storing everything
    assert again_peak == plain_peak


def test_selective_checkpointing_keeps_gradients_and_saves_less(gen):
    torch.manual_seed(0)
    model = Tower()
    x = torch.randn(256, 64, generator=gen)
    plain, plain_peak = grads_and_peak(model, x)
    names = [f"blocks.{i}" for i in range(4)]
    with memory.checkpoint_blocks(model, names, save_ops=memory.SELECTIVE_SAVE):
        selective, selective_peak = grads_and_peak(model, x)
    with memory.checkpoint_blocks(model, names):
        _, full_peak = grads_and_peak(model, x)
    for a, b in zip(selective, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same arithmetic, some of it again
    # kept: the matmul outputs (B, 4w) and (B, w); recomputed: the activation between them
    assert full_peak < selective_peak < plain_peak
    assert torch.ops.aten.mm.default in memory.SELECTIVE_SAVE


def test_checkpointed_block_runs_plainly_without_grad(gen):
    model = Tower(depth=2)
    x = torch.randn(8, 64, generator=gen)
    with torch.no_grad():
        expected = model(x)
    memory.checkpoint_blocks(model, ["blocks.1"])
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_a_copy_of_a_checkpointed_model_runs_its_own_weights(gen):
    """``copy.deepcopy`` (an EMA or evaluation copy) of a checkpointed model: each block of the
    copy runs with the copy's parameters, checkpointed as the original's, with their gradients."""
    import copy

    torch.manual_seed(0)
    model = Tower(depth=2)
    x = torch.randn(8, 64, generator=gen)
    memory.checkpoint_blocks(model, ["blocks.0", "blocks.1"])
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    plain = copy.deepcopy(twin)
    for name in ("blocks.0", "blocks.1"):
        del plain.get_submodule(name).forward  # the copy without checkpointing
    twin(x).backward()
    plain(x).backward()
    assert all(p.grad is None for p in model.parameters())  # the original took no part
    for a, b in zip(twin.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    with torch.no_grad():
        assert torch.equal(twin(x), plain(x)) and not torch.equal(twin(x), model(x))


@pytest.mark.parametrize("selective", [False, True], ids=["whole", "selective"])
def test_a_checkpointed_model_saved_whole_loads_and_still_checkpoints(gen, selective):
    """``torch.save(model)`` pickles the model with its checkpointed forwards (and the selective
    policy, whose ATen ops cannot be pickled themselves)."""
    import pickle

    torch.manual_seed(0)
    model = Tower(depth=2)
    x = torch.randn(8, 64, generator=gen)
    save_ops = memory.SELECTIVE_SAVE if selective else None
    memory.checkpoint_blocks(model, ["blocks.0", "blocks.1"], save_ops=save_ops)
    loaded = pickle.loads(pickle.dumps(model))
    assert "forward" in vars(loaded.get_submodule("blocks.1"))
    model(x).backward()
    loaded(x).backward()
    for a, b in zip(model.parameters(), loaded.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("names", "match"),
    [
        (["block.1"], r"no submodule 'block.1'; close: \['blocks.1'"),
        (["blocks.9"], r"no submodule 'blocks.9'.*top-level modules: \['blocks', 'head'\]"),
        ([""], "no submodule ''"),
    ],
)
def test_checkpointing_unknown_names_are_rejected(names, match):
    with pytest.raises(ValueError, match=match):
        memory.checkpoint_blocks(Tower(), names)


def test_checkpointing_twice_is_rejected():
    model = Tower()
    memory.checkpoint_blocks(model, ["blocks.0"])
    with pytest.raises(ValueError, match=r"'blocks\.0' is already checkpointed"):
        memory.checkpoint_blocks(model, ["blocks.1", "blocks.0"])
    assert "forward" not in vars(model.blocks[1])  # nothing applied when one name fails


# ---- the largest batch --------------------------------------------------------------------------
def allocating(per_sample: int):
    def run(batch: int):
        return torch.empty(batch * per_sample // 4).fill_(0.5).sum()

    return run


@pytest.mark.parametrize(
    ("budget", "resident", "expected"),
    # 1 KiB of slack: the sum's output and scalars take a few bytes on top of the batch (how many
    # depends on the torch build: 12 on 2.13 CPU, 16 on 2.11); one more sample needs 64 KiB
    [(MiB + 1024, 0, 16), (MiB + 60_000, 0, 16), (MiB + 1024, 256 * 1024, 12), (100, 0, 0)],
    ids=["exact", "slack", "resident bytes", "nothing fits"],
)
def test_largest_batch_against_a_budget(budget, resident, expected):
    search = memory.largest_batch(
        allocating(64 * 1024), budget, resident_bytes=resident, device="cpu"
    )
    assert search.batch == expected
    tried = [b for b, _, _ in search.probes]
    assert len(tried) == len(set(tried)) and len(tried) <= 2 * 5 + 2
    if expected:
        assert next(used for b, used, fits in search.probes if b == expected) <= budget
        assert all(not fits for b, _, fits in search.probes if b > expected)


def test_largest_batch_stops_at_the_limit():
    search = memory.largest_batch(allocating(16), 1 * GiB, limit=40, device="cpu")
    assert search.batch == 40
    with pytest.raises(ValueError, match="budget_bytes must be a number > 0, got 0"):
        memory.largest_batch(allocating(16), 0)


def test_tensor_bytes_counts_each_storage_once(gen):
    x = torch.randn(100, generator=gen)
    assert memory.tensor_bytes([x, x[10:], x.view(10, 10), torch.zeros(3)]) == 400 + 12


# ---- on a GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
def test_cuda_steady_state_in_place_step_allocates_nothing(gen):
    x, y = torch.randn(1 << 20, generator=gen).cuda(), torch.rand(1 << 20, generator=gen).cuda()
    buf = torch.empty_like(x)
    stats = memory.count_allocations(lambda: torch.mul(x, y, out=buf).add_(y), device="cuda")
    assert stats.requests == 0 and stats.device_allocs == 0 and stats.retries == 0
    fresh = memory.count_allocations(lambda: x * 2, device="cuda")
    assert fresh.requests == 1 and fresh.device_allocs == 0  # served from the cache


@pytest.mark.gpu
@needs_cuda
def test_cuda_snapshot_events_show_the_allocations(gen):
    x = torch.randn(1 << 20, generator=gen).cuda()
    with memory.record_memory_history() as rec:
        y = x * 2
        del y
    events = memory.snapshot_events(rec["snapshot"], device=x.device.index or 0)
    assert any(e["action"] == "alloc" and e["bytes"] >= 4 << 20 for e in events)
