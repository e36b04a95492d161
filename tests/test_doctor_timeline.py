"""The doctor's timeline replayed with faster kernels: what a device-side saving buys a step whose
device sometimes waits for the host. Synthetic timelines, one stream, times in µs."""

from __future__ import annotations

import math

import pytest

from accel.doctor.timeline import Timeline


def timeline(kernels, *, launches=(), syncs=(), window=None, steps=1, gap_scale=1.0):
    """``kernels``: (start, end, category); ``launches``: each kernel's launch, in order (none
    seen for the rest); the per-step totals derived from them."""
    by_category: dict[str, float] = {}
    for a, b, c in kernels:
        by_category[c] = by_category.get(c, 0.0) + (b - a) / steps
    window = window or (0.0, max(b for _, b, _ in kernels))
    at = [*launches, *[math.nan] * (len(kernels) - len(launches))]
    return Timeline(
        device="cuda:0", steps=steps, step_us=(window[1] - window[0]) / steps,
        kernel_us=sum(b - a for a, b, _ in kernels) / steps, busy_us=0.0, kernels=len(kernels),
        launches=len(launches), syncs=len(syncs), by_category=by_category,
        spans=tuple((*k, t) for k, t in zip(kernels, at, strict=True)), sync_ends=tuple(syncs),
        window=window, gap_scale=gap_scale,
    )  # fmt: skip


def test_a_device_bound_step_saves_all_its_kernels_save():
    # queued back to back: products of 100 and an elementwise kernel of 50, twice
    t = timeline([(0, 100, "matmul"), (100, 150, "other"), (150, 250, "matmul"), (250, 300, "other")])
    assert t.step_saving_us({"matmul": 100.0}) == pytest.approx(100.0)


def test_a_step_whose_device_waits_for_the_host_saves_nothing():
    # each kernel launched (at 0, 200, 400) long after the last one ended
    kernels = [(0, 50, "matmul"), (200, 250, "matmul"), (400, 450, "matmul")]
    t = timeline(kernels, launches=(0, 190, 390), window=(0, 460))
    assert t.step_saving_us({"matmul": 75.0}) == pytest.approx(0.0)
    # the host sends the second kernel 10 µs after the first ends: of 25 saved on the first, 0 stay
    near = timeline([(0, 50, "matmul"), (60, 110, "other")], launches=(0, 55))
    assert near.step_saving_us({"matmul": 25.0}) == pytest.approx(0.0)


def test_a_host_barely_ahead_keeps_the_saving_it_leaves_room_for():
    # the second kernel was queued 20 µs ahead (launched at 30, the first ended at 50): of 25
    # saved on the first, 20 stay; a launch in the gap of another kernel changes nothing
    t = timeline([(0, 50, "matmul"), (50, 100, "other")], launches=(0, 30))
    assert t.step_saving_us({"matmul": 25.0}) == pytest.approx(20.0)
    far = timeline([(0, 50, "matmul"), (52, 100, "other")], launches=(0, 5))
    assert far.step_saving_us({"matmul": 25.0}) == pytest.approx(25.0)


def test_after_a_sync_the_host_goes_on_as_much_earlier_as_the_device_finished():
    # products, then the host reads a number (sync returns at 105), then launches more at 110
    kernels = [(0, 100, "matmul"), (120, 170, "other")]
    t = timeline(kernels, launches=(0, 110), syncs=(105,), window=(0, 170))
    assert t.step_saving_us({"matmul": 40.0}) == pytest.approx(40.0)


def test_savings_are_per_step_and_gaps_scale_to_the_unprofiled_step():
    two_steps = timeline([(0, 100, "matmul"), (100, 200, "matmul")], steps=2)
    assert two_steps.step_saving_us({"matmul": 50.0}) == pytest.approx(50.0)
    # the profiler's host time made the device wait 100 µs; the real step waits 10
    kernels = [(0, 100, "matmul"), (200, 300, "other")]
    t = timeline(kernels, launches=(0, 150), gap_scale=0.1)
    assert t.step_saving_us({"matmul": 50.0}) == pytest.approx(0.0)
    # the gap after the second kernel is the host's too: its saving is lost in it, scaled or not
    tail = timeline([(0, 100, "matmul"), (100, 200, "matmul")], launches=(0, 50), window=(0, 400),
                    gap_scale=0.5)  # fmt: skip
    assert tail.step_saving_us({"matmul": 100.0}) == pytest.approx(0.0)


def test_without_profiled_kernels_the_saving_is_the_kernels_own():
    t = timeline([(0, 100, "matmul")])
    cpu = Timeline(device="cpu", steps=1, step_us=100.0, kernel_us=100.0, busy_us=100.0,
                   kernels=1, launches=0, syncs=float("nan"))  # fmt: skip
    assert cpu.step_saving_us({"matmul": 30.0}) == 30.0
    assert t.step_saving_us({"attention": 30.0}) == 0.0  # no such kernels: nothing to save


def test_findings_of_the_kernels_alone_keep_what_the_replayed_step_keeps():
    from accel.doctor.findings import Finding
    from accel.doctor.trial import replay_device_savings

    def finding(fixes, saved):
        return Finding("k", "t", "e", "model", "01_sync", "change", saved_us=saved, fixes=fixes,
                       saved_by_fix={fixes[0]: saved})  # fmt: skip

    # the host sends every kernel late: faster kernels leave the step as long as it was
    waiting = timeline([(0, 50, "matmul"), (200, 250, "matmul")], launches=(0, 190), window=(0, 260))
    bf16, sync = finding(("bf16_autocast",), 60.0), finding(("deferred_reads",), 60.0)
    replay_device_savings([bf16, sync], waiting)
    assert bf16.saved_us == 0.0 and bf16.saved_by_fix == {"bf16_autocast": 0.0}
    assert "device waits for the host" in bf16.cost_model
    assert sync.saved_us == 60.0 and sync.cost_model == "model"  # the host's own saving stays
    busy = timeline([(0, 100, "matmul"), (100, 200, "matmul")])
    tf32 = finding(("tf32",), 80.0)
    replay_device_savings([tf32], busy)
    assert tf32.saved_us == pytest.approx(80.0) and tf32.cost_model == "model"
