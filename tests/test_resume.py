"""Saved and resumed equals uninterrupted, for every stateful piece outside the optimizers
(those are in test_optim): the cache cleaner's counters and a whole training step with its
learning-rate controller."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from accel import memory
from accel.workloads import nested_optimizer as no

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; this machine has none")
GiB = 2**30


def through_bytes(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_cache_cleaner_counters_resume(seed):
    gen = torch.Generator().manual_seed(seed)

    # random allocator states from two regimes, taking turns: much cached and free (a cleanup
    # pays) and nearly all in use (it does not, and a fixed schedule would stall there)
    def state(free: bool) -> memory.MemoryState:
        reserved = int(torch.randint(4 * GiB, 8 * GiB, (), generator=gen))
        share = float(torch.rand((), generator=gen)) * (0.3 if free else 0.02)
        used = reserved - int(share * reserved) if not free else int(share * reserved)
        return memory.MemoryState(allocated=used, reserved=reserved, total=80 * GiB)

    states = [state(free=i % 2 == 0) for i in range(30)]

    def cleaner(feed):
        return memory.CacheCleaner(
            "cpu", state=lambda: next(feed), empty=lambda: None, naive_every=3
        )

    whole = cleaner(iter(states))
    for _ in states:
        whole.step()
    first = cleaner(iter(states[:13]))
    for _ in range(13):
        first.step()
    resumed = cleaner(iter(states[13:]))
    resumed.load_state_dict(through_bytes(first.state_dict()))
    for _ in states[13:]:
        resumed.step()
    assert whole.emptied and whole.stalls_avoided  # the walk exercised both
    assert (resumed.calls, resumed.emptied, resumed.stalls_avoided) == (
        whole.calls,
        whole.emptied,
        whole.stalls_avoided,
    )


def test_cache_cleaner_refuses_a_state_of_something_else():
    with pytest.raises(ValueError, match="expected a CacheCleaner state with keys"):
        memory.CacheCleaner("cpu").load_state_dict({"step": 3})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"calls": -1}, r"'calls' must be a count >= 0, got -1"),
        ({"emptied": [[2, "pressure", "extra"]]}, r"'emptied' must be \(call, reason\) pairs"),
        ({"emptied": [[9, "pressure"]]}, r"call 9 is not before the 5 calls"),
    ],
)
def test_cache_cleaner_refuses_counters_that_cannot_be_and_keeps_its_own(change, match):
    cleaner = memory.CacheCleaner("cpu", state=lambda: memory.MemoryState(0, 0, 1), empty=None)
    for _ in range(2):
        cleaner.step()
    state = {"calls": 5, "emptied": [[1, "pressure"]], "stalls_avoided": 0} | change
    with pytest.raises(ValueError, match=match):
        cleaner.load_state_dict(state)
    assert (cleaner.calls, cleaner.emptied, cleaner.stalls_avoided) == (2, [], 0)


CASES = {
    "baseline": no.Flags(),
    "fast": no.Flags(
        foreach_stats=True, fused_clip=True, fused_adamw=True, preallocated_buffers=True
    ),
    "controller every 3": no.Flags(controller_update_every=3),
}


def _resume_equals_uninterrupted(flags, device, steps=7, cut=4):
    sizes = no.Sizes.preset("cpu")
    whole = no.build(flags, sizes, device=device, seed=1)
    for _ in range(steps):
        whole()
    first = no.build(flags, sizes, device=device, seed=1)
    for _ in range(cut):
        first()
    saved = through_bytes(first.state_dict())
    resumed = no.build(flags, sizes, device=device, seed=1)
    with torch.no_grad():  # other weights: the load must set them
        for p in [*resumed.model.parameters(), *resumed.controller.parameters()]:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p))
    resumed.load_state_dict(saved)
    for _ in range(steps - cut):
        resumed()
    got, expected = resumed.result(), whole.result()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_nested_optimizer_step_resumes_exactly(case):
    _resume_equals_uninterrupted(case, "cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "flags",
    [
        dataclasses.replace(CASES["fast"], cuda_graph="optimizer_step"),
        dataclasses.replace(CASES["fast"], cuda_graph="optimizer_step", one_launch_adamw=True),
        dataclasses.replace(CASES["fast"], cuda_graph="whole_step", controller_update_every=2),
    ],
    ids=["graphed optimizer", "graphed one-launch", "whole step graphed"],
)
def test_graphed_nested_optimizer_step_resumes_exactly(flags):
    _resume_equals_uninterrupted(flags, "cuda", steps=12, cut=7)  # the cut falls after capture
