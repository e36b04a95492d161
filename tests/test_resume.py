"""Saved and resumed equals uninterrupted, for a whole training step with its learning-rate
controller (the optimizers alone are in test_optim)."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from accel.workloads import nested_optimizer as no

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; this machine has none")


def through_bytes(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


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
def test_graphed_nested_optimizer_step_resumes_exactly():
    flags = dataclasses.replace(CASES["fast"], cuda_graph="whole_step", controller_update_every=2)
    _resume_equals_uninterrupted(flags, "cuda", steps=12, cut=7)  # the cut falls after capture
