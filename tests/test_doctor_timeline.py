"""The doctor's timeline replayed with faster kernels: what a device-side saving buys a step whose
device sometimes waits for the host. Synthetic timelines, one stream, times in µs."""

from __future__ import annotations

import math

import pytest

from accel.doctor.timeline import Timeline


def timeline(kernels, *, launches=(), syncs=(), window=None, steps=1, host_end=math.nan,
             events=(), event_us=0.0, queue_depth=0):  # fmt: skip
    """``kernels``: (start, end, category); ``launches``: each kernel's launch, in order (none
    seen for the rest); ``syncs``: the host's blocking calls (start, end); ``events``: when the
    host recorded an event, each costing the profiler ``event_us``; the per-step totals derived
    from them."""
    by_category: dict[str, float] = {}
    for a, b, c in kernels:
        by_category[c] = by_category.get(c, 0.0) + (b - a) / steps
    window = window or (0.0, max(b for _, b, _ in kernels))
    at = [*launches, *[math.nan] * (len(kernels) - len(launches))]
    return Timeline(
        device="cuda:0", steps=steps, step_us=(window[1] - window[0]) / steps,
        kernel_us=sum(b - a for a, b, _ in kernels) / steps, busy_us=0.0, kernels=len(kernels),
        launches=len(launches), syncs=len(syncs), by_category=by_category,
        spans=tuple((*k, t) for k, t in zip(kernels, at, strict=True)), sync_spans=tuple(syncs),
        host_events=tuple(sorted(events)), window=window, host_end=host_end, host_event_us=event_us,
        queue_depth=queue_depth,
    )  # fmt: skip


def test_a_device_bound_step_saves_all_its_kernels_save():
    # queued back to back: products of 100 and an elementwise kernel of 50, twice
    t = timeline([(0, 100, "matmul"), (100, 150, "other"), (150, 250, "matmul"), (250, 300, "other")])
    assert t.step_saving_us({"matmul": 100.0}) == pytest.approx(100.0)


def test_a_step_whose_device_waits_for_the_host_saves_nothing():
    # each kernel launched (at 0, 190, 390) long after the last one ended; the host ends at 460
    kernels = [(0, 50, "matmul"), (200, 250, "matmul"), (400, 450, "matmul")]
    t = timeline(kernels, launches=(0, 190, 390), window=(0, 460), host_end=460)
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
    # products, then the host reads a number (waits from 20 to 105), then launches more at 110
    kernels = [(0, 100, "matmul"), (120, 170, "other")]
    t = timeline(kernels, launches=(0, 110), syncs=((20, 105),), window=(0, 170))
    assert t.step_saving_us({"matmul": 40.0}) == pytest.approx(40.0)


def test_a_saving_spread_over_categories_goes_in_proportion_to_their_time_and_is_replayed():
    kernels = [(0, 100, "elementwise and other"), (100, 150, "normalization"), (150, 250, "matmul")]
    fused = ("elementwise and other", "normalization")
    assert timeline(kernels).spread_saving_us(30.0, fused) == pytest.approx(30.0)
    # the host queues each kernel after the one before ended: a shorter kernel saves nothing
    held = timeline(kernels, launches=(0, 120, 170), window=(0, 270), host_end=270)
    assert held.spread_saving_us(30.0, fused) == pytest.approx(0.0)
    # 20 of the 30 off the first kernel, 10 off the second: the host queued the second at 90
    near = timeline(kernels, launches=(0, 90, 100))
    assert near.spread_saving_us(30.0, fused) == pytest.approx(10.0 + 10.0)
    assert timeline(kernels).spread_saving_us(30.0, ("attention",)) == 30.0  # none ran: its own


def test_a_full_launch_queue_holds_the_host_back_until_a_kernel_starts():
    # four products of 100 queued at once, then 300 µs of the host's own work (to 303): with
    # room for two launches, the fourth waits for the second product to start (at 100), and the
    # host's work ends at 400; halved products start it at 50, so 50 of the 200 saved stay
    kernels = [(0, 100, "matmul"), (100, 200, "matmul"), (200, 300, "matmul"), (300, 400, "matmul")]
    launches, events = (0, 1, 2, 3), tuple(range(4, 304, 10))
    held = timeline(kernels, launches=launches, host_end=303, events=events, queue_depth=2)
    assert held._replayed_us({}) == pytest.approx(400.0)
    assert held.step_saving_us({"matmul": 200.0}) == pytest.approx(50.0)
    # with room for all four the host's work ends at 303, before the halved products' 200
    free = timeline(kernels, launches=launches, host_end=303, events=events)
    assert free.step_saving_us({"matmul": 200.0}) == pytest.approx(97.0)
    # the launch waits only while the queue is full: room for three, and it never is
    assert timeline(kernels, launches=launches, host_end=303, events=events,
                    queue_depth=3).step_saving_us({"matmul": 200.0}) == pytest.approx(97.0)  # fmt: skip


def test_savings_are_per_step():
    two_steps = timeline([(0, 100, "matmul"), (100, 200, "matmul")], steps=2)
    assert two_steps.step_saving_us({"matmul": 50.0}) == pytest.approx(50.0)


def test_the_profilers_own_cost_per_event_is_taken_off_the_host():
    # the host recorded 20 events between the first kernel's end and queuing the second (at 190)
    kernels = [(0, 100, "matmul"), (200, 300, "other")]
    events = [100 + 4 * i for i in range(20)]
    # the profiled host, 90 µs late: a faster first kernel changes nothing
    assert timeline(kernels, launches=(0, 190), events=events).step_saving_us(
        {"matmul": 50.0}) == pytest.approx(0.0)  # fmt: skip
    # 5 µs an event: the bare host queues it at 90, still after the halved kernel's end
    slow = timeline(kernels, launches=(0, 190), events=events, event_us=5.0)
    assert slow.step_saving_us({"matmul": 50.0}) == pytest.approx(0.0)
    # 6 µs an event: queued at 70 and started 10 later (the launch's own latency): 20 of 50 stay
    fast = timeline(kernels, launches=(0, 190), events=events, event_us=6.0)
    assert fast.step_saving_us({"matmul": 50.0}) == pytest.approx(20.0)
    # the host's own time never goes below nothing, however costly the events: all of it stays
    free = timeline(kernels, launches=(0, 190), events=events, event_us=1e3)
    assert free.step_saving_us({"matmul": 50.0}) == pytest.approx(50.0)


def test_a_host_that_ends_after_the_kernels_keeps_the_step_as_long():
    tail = timeline([(0, 100, "matmul"), (100, 200, "matmul")], launches=(0, 50), host_end=400)
    assert tail.step_saving_us({"matmul": 100.0}) == pytest.approx(0.0)
    # the bare host ends sooner: 50 events at 4 µs leave it ending at 200, when the kernels end
    bare = timeline([(0, 100, "matmul"), (100, 200, "matmul")], launches=(0, 50), host_end=400,
                    events=[200 + i for i in range(50)], event_us=4.0)  # fmt: skip
    assert bare.step_saving_us({"matmul": 100.0}) == pytest.approx(0.0)
    assert bare.step_saving_us({"matmul": 0.0}) == 0.0


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
    waiting = timeline([(0, 50, "matmul"), (200, 250, "matmul")], launches=(0, 190), window=(0, 260),
                       host_end=260)  # fmt: skip
    bf16, sync = finding(("bf16_autocast",), 60.0), finding(("deferred_reads",), 60.0)
    replay_device_savings([bf16, sync], waiting)
    assert bf16.saved_us == 0.0 and bf16.saved_by_fix == {"bf16_autocast": 0.0}
    assert "device waits for the host" in bf16.cost_model
    assert sync.saved_us == 60.0 and sync.cost_model == "model"  # the host's own saving stays
    busy = timeline([(0, 100, "matmul"), (100, 200, "matmul")])
    tf32 = finding(("tf32",), 80.0)
    replay_device_savings([tf32], busy)
    assert tf32.saved_us == pytest.approx(80.0) and tf32.cost_model == "model"


def test_the_host_is_taken_as_fast_as_the_step_timed_without_the_profiler_shows():
    # the profiled host queues the second kernel at 190 after 20 events; the probe found 2 µs an
    # event, which would leave the bare step 260 long: timed bare it took 220, so the host is
    # faster, 4 µs an event less (queued at 110, started 10 later, ended 220)
    kernels = [(0, 100, "matmul"), (200, 300, "other")]
    events = [100 + 4 * i for i in range(20)]
    t = timeline(kernels, launches=(0, 190), events=events, event_us=2.0)
    bare = t.at_step_time(220.0)
    assert bare.host_event_us == pytest.approx(4.0, rel=1e-6)
    assert bare._replayed_us({}) == pytest.approx(220.0, rel=1e-6)
    # timed bare shorter than the kernels alone: the host no later than needed to reach them
    assert t.at_step_time(150.0)._replayed_us({}) == pytest.approx(200.0, rel=1e-2)
    # timed bare longer than the replay at the probe's cost: the probe's cost stands
    assert t.at_step_time(400.0).host_event_us == 2.0
