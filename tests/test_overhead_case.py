"""The overhead phase's diversity sweep: what its points read (no GPU needed)."""

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
