"""The overhead phase's diversity sweep: what its points read (no GPU needed)."""

import math

import pytest
import torch

from accel.lab.cases import overhead_diversity as sweep


def test_ragged_points_count_only_the_rows_their_counts_hold():
    point = sweep.Point(3, 4, 8, torch.bfloat16, ragged=True)
    counts = torch.tensor([0, 4, 9])  # a count past N holds N rows
    assert point.bytes_read(counts) == (0 + 4 + 4) * 8 * 2
    assert point.bytes_read(None) == 3 * 4 * 8 * 2


def test_every_large_point_reads_64_mb_ragged_or_not():
    points = sweep.points(torch.device("cuda"))  # the GPU's points; nothing runs
    large = [p for p in points if p.batch != sweep.SMALL_BATCH]
    assert any(p.ragged for p in large) and any(not p.ragged for p in large)
    for p in large:
        gen = torch.Generator().manual_seed(p.n * p.dim)
        counts = torch.randint(0, p.n + 1, (p.batch,), generator=gen) if p.ragged else None
        assert p.bytes_read(counts) >= sweep.LARGE_BYTES, p


def test_the_sweep_has_shapes_off_the_powers_of_two():
    """A user's rows are as often 100 or 300 long as 256, and groups of 6 or 40 rows: such
    points (whose rows are not a multiple of 16 bytes, or whose groups pad the tiles) are swept
    too, in each dtype, with and without counts."""
    large = [p for p in sweep.points(torch.device("cuda")) if p.batch != sweep.SMALL_BATCH]
    odd = [p for p in large if p.dim not in sweep.WIDTHS]
    assert any((p.dim * p.dtype.itemsize) % 16 for p in odd)
    assert any(p.n & (p.n - 1) and p.n > 32 for p in odd)
    assert {p.dtype for p in odd} == set(sweep.DTYPES)
    assert {p.ragged for p in odd} == {True, False}


def test_a_large_point_times_the_kernels_device_time_and_a_small_one_does_not(kdev, monkeypatch):
    monkeypatch.setattr(sweep, "rotating_inputs", lambda shape, dtype, device: [
        torch.randn(shape, device=device).to(dtype) for _ in range(2)
    ])  # fmt: skip
    point = sweep.Point(6, 5, 24, torch.float32, ragged=True)
    for large, device_time in ((1, math.isfinite), (1 << 40, math.isnan)):
        monkeypatch.setattr(sweep, "LARGE_BYTES", large)
        bytes_read, measured = sweep.measure(point, torch.device(kdev))
        assert bytes_read > 0 and [m[0] for m in measured] == ["mean", "nearest"]
        for _, mine, plain, ratio, device_ms in measured:
            assert all(v > 0 and math.isfinite(v) for v in (mine, plain, ratio))
            assert device_time(device_ms)


def test_the_sweeps_summaries_give_the_worst_point_and_count_the_misses(monkeypatch):
    from accel.lab.bench import BenchContext

    fractions = {"mean": 0.8, "nearest": 0.5}  # of copy: the nearest misses

    def measure(point, device):
        return 64 << 20, [(r, 1.0, 3.0, 3.0, fractions[r]) for r in ("mean", "nearest")]

    class Ceilings:
        copy_gb_s = 1000.0

        def bandwidth_fraction(self, bytes_read, ms):
            return ms  # the fractions pass through as "times"

    monkeypatch.setattr(
        sweep, "points", lambda device: [sweep.Point(4, 2, 8, torch.float32, False)]
    )
    monkeypatch.setattr(sweep, "measure", measure)
    ctx = BenchContext(torch.device("cuda"), "gpu")  # judged; nothing runs
    ctx._ceilings = Ceilings()
    rows = sweep.rows(ctx)
    bandwidth = next(r for r in rows if r.case == "diversity sweep: worst bandwidth of 2 points")
    assert bandwidth.optimized == 0.5 and bandwidth.met is False
    assert bandwidth.note.endswith("1 point(s) missed")
    latency = next(r for r in rows if r.case.startswith("diversity sweep: worst single-call"))
    assert latency.optimized == 3.0 and latency.met is True


def _host_rows(plain_us, ours_us):
    from accel.lab.bench import BenchContext
    from accel.lab.cases import overhead
    from accel.measure.timer import Comparison, Timing

    ms = lambda us: tuple(u / 1e3 for u in us)  # noqa: E731
    timing = Comparison(
        {"F.sdpa": Timing("F.sdpa", ms(plain_us)), "sdpa": Timing("sdpa", ms(ours_us))},
        "F.sdpa",
        schedule=(),
    )
    ctx = BenchContext(torch.device("cuda"), "gpu")  # judged; nothing runs
    return overhead.host_rows(ctx, "sdpa full", timing, "sdpa", added_us=3)


def test_the_host_time_added_is_a_row_of_its_own_judged_round_by_round():
    """The host's pace drifts between rounds: the time added is taken within each round (here
    +2, +2, +2, +11, -8 us: 2 us) and not as a difference of medians (31 - 20 = 11 us); the
    number judged is the row's own, so a reader of the results can check the verdict. It gives
    the share of the baseline's host time, which holds across hosts of other paces."""
    per_call, added = _host_rows(plain_us=(20, 30, 30, 20, 20), ours_us=(22, 32, 32, 31, 12))
    assert per_call.metric == "host time per call"
    assert (per_call.optimized, per_call.baseline) == (31, 20)
    assert per_call.met is None and per_call.target == ""
    assert added.metric == "host time added per call" and added.optimized == pytest.approx(2)
    assert added.met is True and added.target == "<= 3 us over F.sdpa"
    assert "over F.sdpa's 20.0 us (10% of it)" in added.note  # the host's pace: its share
    _, slower = _host_rows(plain_us=(20, 30, 25, 21, 22), ours_us=(25, 35, 30, 26, 27))
    assert slower.met is False and slower.optimized == pytest.approx(5)
