"""The overhead phase's diversity sweep: what its points read (no GPU needed)."""

import math

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


def test_a_large_point_times_the_kernels_beside_the_same_rows_read_alone(kdev, monkeypatch):
    monkeypatch.setattr(sweep, "LARGE_BYTES", 1)  # every point "large": its device time taken
    monkeypatch.setattr(sweep, "rotating_inputs", lambda shape, dtype, device: [
        torch.randn(shape, device=device).to(dtype) for _ in range(2)
    ])  # fmt: skip
    point = sweep.Point(6, 5, 24, torch.float32, ragged=True)
    bytes_read, measured = sweep.measure(point, torch.device(kdev))
    assert bytes_read > 0 and [m[0] for m in measured] == ["mean", "nearest"]
    for _, mine, plain, ratio, device_ms, read_ms in measured:
        assert all(v > 0 and math.isfinite(v) for v in (mine, plain, ratio, device_ms, read_ms))


def _host_row(plain_us, ours_us):
    from accel.lab.bench import BenchContext
    from accel.lab.cases import overhead
    from accel.lab.timing import Comparison, Timing

    ms = lambda us: tuple(u / 1e3 for u in us)  # noqa: E731
    timing = Comparison(
        {"F.sdpa": Timing("F.sdpa", ms(plain_us)), "sdpa auto": Timing("sdpa auto", ms(ours_us))},
        "F.sdpa",
        schedule=(),
    )
    ctx = BenchContext(torch.device("cuda"), "gpu")  # judged; nothing runs
    return overhead.host_row(ctx, "sdpa auto full", timing, "sdpa auto", added_us=3)


def test_a_host_row_judges_the_time_added_round_by_round():
    """The host's pace drifts between rounds: the time added is taken within each round (here
    +2, +2, +2, +11, -8 us: 2 us) and not as a difference of medians (31 - 20 = 11 us); where
    the rounds' differences spread wider than the target, the row says its verdict is inside
    that spread."""
    row = _host_row(plain_us=(20, 30, 30, 20, 20), ours_us=(22, 32, 32, 31, 12))
    assert row.met is True
    assert "+2.0 us round by round" in row.note
    assert "wider than the 3 us target" in row.note
    steady = _host_row(plain_us=(20, 30, 25, 21, 22), ours_us=(21, 31, 26, 22, 23))
    assert steady.met is True and "wider" not in steady.note
    slower = _host_row(plain_us=(20, 30, 25, 21, 22), ours_us=(25, 35, 30, 26, 27))
    assert slower.met is False and "+5.0 us round by round" in slower.note
