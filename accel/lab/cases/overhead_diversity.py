"""The diversity sweep of the ``overhead`` phase: ``mean_diversity`` and ``nearest_diversity``
at group sizes, widths, dtypes, ragged counts and batches they were never tuned on (shapes off
the powers of two among them), beside what a user would otherwise write, ``torch.compile``'d:
one call's latency, and at points that read ``LARGE_BYTES`` the kernels' device time
(CUDA-graph replays over inputs that do not fit in L2) against the copy bandwidth."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from accel import diversity as dv
from accel.lab.bench import BenchContext, Row
from accel.lab.cases.diversity import rotating_inputs, time_per_call
from accel.lab.cases.overhead_timing import PHASE, latencies
from accel.lab.cases.sdpa_measure import release_memory

TARGET_VS_COMPILED = 1.5
TARGET_BANDWIDTH = 0.75
LARGE_BYTES = 64 << 20
GROUP_SIZES = (2, 3, 4, 8, 16, 32, 64)
WIDTHS = (64, 256, 768, 2048)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (N, D, dtype, ragged) off the powers of two: 16-bit rows of 200 and 600 bytes (no 16-byte
# loads), and groups of 6-40 rows, which pad their tiles to 8-64.
OFF_POWER_POINTS = (
    (6, 100, torch.bfloat16, False),
    (12, 1000, torch.float32, False),
    (20, 300, torch.float16, True),
    (40, 100, torch.float32, True),
)
SMALL_BATCH = 64
# Ragged counts are uniform over 0..N, so a group holds N/2 rows on average: twice the groups,
# and a margin, read as many bytes as the full groups of a point without counts.
RAGGED_GROUPS = 2.1


@dataclass(frozen=True)
class Point:
    batch: int
    n: int
    dim: int
    dtype: torch.dtype
    ragged: bool

    def bytes_read(self, counts: torch.Tensor | None) -> int:
        """Bytes the kernels read: every row, or with counts only the rows they hold."""
        rows = self.batch * self.n if counts is None else int(counts.clamp(0, self.n).sum())
        return rows * self.dim * self.dtype.itemsize

    def name(self, reduction: str) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        ragged = " ragged" if self.ragged else ""
        return f"sweep diversity {reduction} B={self.batch} N={self.n} D={self.dim} {dtype}{ragged}"


def points(device: torch.device) -> list[Point]:
    if device.type != "cuda":
        return [Point(16, 4, 48, torch.float32, False), Point(8, 33, 40, torch.float32, True)]
    shapes = [
        (n, dim, DTYPES[i % len(DTYPES)], i % 2 == 1)
        for i, (n, dim) in enumerate((n, d) for n in GROUP_SIZES for d in WIDTHS)
    ]
    out = []
    for n, dim, dtype, ragged in shapes + list(OFF_POWER_POINTS):
        groups = LARGE_BYTES * (RAGGED_GROUPS if ragged else 1) / (n * dim * dtype.itemsize)
        out.append(Point(math.ceil(groups), n, dim, dtype, ragged))
    out += [Point(SMALL_BATCH, n, 384, torch.float32, False) for n in GROUP_SIZES]
    return out


@functools.cache
def compiled_baselines(device: torch.device):
    """(the closed-form mean, the naive nearest), compiled once for any shape (as a user's loop
    over shapes turns dynamic after the first recompile)."""
    if device.type != "cuda":  # nothing to compile for on a CPU in a few seconds: eager
        return dv.mean_diversity_closed_form, dv.nearest_diversity_reference
    return (
        torch.compile(dv.mean_diversity_closed_form, dynamic=True),
        torch.compile(dv.nearest_diversity_reference, dynamic=True),
    )


def measure(point: Point, device: torch.device) -> tuple[int, list[tuple]]:
    """The bytes the kernels read, and per reduction (checked against the compiled form first):
    (name, our latency µs, the compiled form's, their round-by-round ratio, our device ms per
    call over inputs that do not fit in L2, NaN under :data:`LARGE_BYTES`)."""
    gen = torch.Generator(device).manual_seed(point.n * point.dim)
    x = torch.randn((point.batch, point.n, point.dim), device=device, generator=gen).to(point.dtype)
    counts = None
    if point.ragged:
        counts = torch.randint(0, point.n + 1, (point.batch,), device=device, generator=gen)
    bytes_read = point.bytes_read(counts)
    mean_cf, nearest_naive = compiled_baselines(device)
    out = []
    for reduction, ours, plain in (
        ("mean", dv.mean_diversity, mean_cf),
        ("nearest", dv.nearest_diversity, nearest_naive),
    ):
        torch.testing.assert_close(ours(x, counts), plain(x, counts), atol=2e-5, rtol=1e-5)
        fns = {
            "compiled": lambda p=plain, x=x, c=counts: p(x, c),
            "accel": lambda f=ours, x=x, c=counts: f(x, c),
        }
        alone = latencies(fns, device, repeats=15)
        device_ms = math.nan
        if bytes_read >= LARGE_BYTES:  # the kernels' own time: graph replays, no host
            buffers = rotating_inputs((point.batch, point.n, point.dim), point.dtype, device)
            calls = {"accel": lambda x, f=ours, c=counts: f(x, c)}
            device_ms = time_per_call(calls, buffers, device, repeats=10)["accel"]
        out.append((
            reduction,
            alone.timings["accel"].median_ms * 1e3,
            alone.timings["compiled"].median_ms * 1e3,
            alone.paired_ratio("compiled", "accel"),
            device_ms,
        ))  # fmt: skip
    return bytes_read, out


def rows(ctx: BenchContext) -> list[Row]:
    out: list[Row] = []
    ratios, fractions = [], []
    for point in points(ctx.device):
        bytes_read, measured = measure(point, ctx.device)
        release_memory(ctx.device)
        for reduction, mine, plain, ratio, device_ms in measured:
            name = point.name(reduction)
            ratios.append(ratio)
            out.append(Row(
                PHASE, name, "single-call latency", "us", mine, baseline=plain,
                target=f">= {TARGET_VS_COMPILED}x",
                met=ratio >= TARGET_VS_COMPILED if ctx.judged else None,
                note=f"{ctx.where}; compiled {'closed form' if reduction == 'mean' else 'naive'}"
                f" / accel round by round {ratio:.2f}x",
            ))  # fmt: skip
            if bytes_read >= LARGE_BYTES:
                fractions.append(ctx.ceilings.bandwidth_fraction(bytes_read, device_ms))
                out.append(Row(
                    PHASE, name, "bandwidth", "fraction of copy", fractions[-1],
                    target=f">= {TARGET_BANDWIDTH}", higher_is_better=True,
                    met=fractions[-1] >= TARGET_BANDWIDTH if ctx.judged else None,
                    note=f"{ctx.where}; {bytes_read / 2**20:.0f} MiB read in "
                    f"{device_ms * 1e3:.1f} us (CUDA-graph replays over rotating inputs); copy "
                    f"{ctx.ceilings.copy_gb_s:.0f} GB/s",
                ))  # fmt: skip
    summaries = [("single-call latency", "x", ratios, TARGET_VS_COMPILED),
                 ("bandwidth", "fraction of copy", fractions, TARGET_BANDWIDTH)]  # fmt: skip
    for metric, unit, values, target in summaries:
        missed = sum(v < target for v in values)
        out.append(Row(
            PHASE, f"diversity sweep: worst {metric} of {len(values)} points", metric, unit,
            min(values, default=math.nan), target=f">= {target}", higher_is_better=True,
            met=missed == 0 if ctx.judged and values else None,
            note=f"{ctx.where}; {missed} point(s) missed",
        ))  # fmt: skip
    return out
