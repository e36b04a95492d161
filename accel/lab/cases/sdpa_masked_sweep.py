"""The sdpa phase's masked sweep: ``sdpa(q, k, v, mask=<kind>)`` against what a user writes with
attention-gym, their own ``torch.compile(flex_attention)`` with a block mask made once by
``create_block_mask`` from the same ``mask_mod``.

Points: a sliding window, packed documents and a prefix-LM (random per batch row); S from 1k to
32k at a fixed number of tokens; head dims 64 and 128; forward and forward + backward. At each
point both are called once (compiling), checked against each other, then timed interleaved; a
summary row judges the median ratio and the worst point. On the CPU the baseline runs uncompiled
and ``sdpa`` its dense-mask fallback, unjudged.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass

import torch

from accel import attention
from accel.attention.flex import room_to_compile
from accel.lab.bench import BenchContext, Row, release_memory
from accel.lab.cases.sdpa_flex import document_lengths
from accel.lab.cases.sdpa_measure import (
    PHASE,
    AttnCase,
    as_timed,
    first_call_s,
    make_inputs,
)
from accel.measure.timer import compare

TARGET_MEDIAN = 0.95  # compiled flex_attention's time over sdpa's, median over the points
TARGET_WORST = 0.90  # ... at every point
KINDS = ("window", "document", "prefix-LM")
RECOMPILE_ROOM = 256  # both compiled functions see every kind, head dim and direction


@dataclass(frozen=True)
class MaskedSweepSizes:
    seqs: tuple[int, ...]
    head_dims: tuple[int, ...]
    heads: int
    tokens: int  # batch x seq at every point
    dtype: torch.dtype
    window: int
    documents: int  # per batch row
    repeats: int
    directions: tuple[bool, ...] = (False, True)  # backward or not


MASKED_SWEEP = {
    "gpu": MaskedSweepSizes(
        # 64k tokens: two rows at S=32k, so every point's masks are per row (one compiled
        # variant per kind, not a second one for a single row)
        seqs=(1024, 4096, 16384, 32768), head_dims=(64, 128), heads=16, tokens=65536,
        dtype=torch.bfloat16, window=1024, documents=8, repeats=10,
    ),
    "cpu": MaskedSweepSizes(  # forward only: FlexAttention has no backward on the CPU
        seqs=(64, 160), head_dims=(16,), heads=2, tokens=160, dtype=torch.float32, window=16,
        documents=3, repeats=3, directions=(False,),
    ),
}  # fmt: skip


def make_mask(kind: str, sizes: MaskedSweepSizes, case: AttnCase, device):
    """The point's mask: its random parts drawn from a generator of their own, seeded by S."""
    if kind == "window":
        return attention.SlidingWindow(sizes.window)
    if kind == "document":
        lengths = document_lengths(case.batch, case.seq, sizes.documents, seed=case.seq)
        return attention.Document(lengths.to(device))
    gen = torch.Generator().manual_seed(case.seq)
    prefix = torch.randint(case.seq // 8, case.seq // 2 + 1, (case.batch,), generator=gen)
    return attention.PrefixLM(prefix.to(device))


def _user_flex(device: torch.device):
    """``torch.compile(flex_attention)`` as a user writes it once, where accel compiles it."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cuda":
        return torch.compile(flex_attention)

    def uncompiled(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without")
            return flex_attention(*args, **kwargs)

    return uncompiled


def _case_name(kind: str, case: AttnCase) -> str:
    return f"sweep masked {kind} {case.direction} D={case.head_dim} S={case.seq}"


def rows(ctx: BenchContext) -> list[Row]:
    """Every point's row, then the summary row."""
    sizes, device = MASKED_SWEEP[ctx.preset], ctx.device
    flex = _user_flex(device)
    attention.clear_masked_cache()
    out, ratios = [], []
    points = [
        (kind, AttnCase(max(1, sizes.tokens // s), sizes.heads, s, head_dim, backward=backward,
                        dtype=sizes.dtype))
        for kind in KINDS for backward in sizes.directions for head_dim in sizes.head_dims
        for s in sizes.seqs
    ]  # fmt: skip
    with room_to_compile(RECOMPILE_ROOM):
        for kind, case in points:
            row, ratio = _point_row(ctx, kind, sizes, case, flex)
            release_memory(device)  # the point's tensors went with its frame
            out.append(row)
            ratios.append(ratio)
    attention.clear_masked_cache()
    return [*out, _summary_row(ctx, ratios)]


def _point_row(ctx: BenchContext, kind, sizes, case: AttnCase, flex) -> tuple[Row, float]:
    """One point: both calls made once (compiling), compared, then timed interleaved; its row and
    its ratio, flex_attention's time over sdpa's round by round (NaN where the two disagreed and
    nothing was timed)."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = ctx.device
    q, k, v, grad = make_inputs(case, device)
    mask = make_mask(kind, sizes, case, device)
    mask_mod = mask.mask_mod(case.seq, case.seq, device)
    blocks = create_block_mask(mask_mod, mask.rows, None, case.seq, case.seq, device=device)
    inputs = (q, k, v)
    fns = {
        "flex_attention": as_timed(lambda: flex(q, k, v, block_mask=blocks), case, inputs, grad),
        "sdpa": as_timed(lambda: attention.sdpa(q, k, v, mask=mask), case, inputs, grad),
    }
    firsts = " ".join(f"{name}={first_call_s(fn, device):.2f}s" for name, fn in fns.items())
    with torch.no_grad():
        ours, theirs = attention.sdpa(q, k, v, mask=mask), flex(q, k, v, block_mask=blocks)
    worst = (ours.float() - theirs.float()).abs().max().item()
    check = f"sdpa against flex_attention: largest difference {worst:.2g}"
    if not torch.allclose(ours, theirs, **attention.TOLERANCES[case.dtype]):
        return Row(PHASE, _case_name(kind, case), "time per call", "ms", math.nan,
                   met=False if ctx.judged else None,
                   note=f"NOT timed: {check}, past the dtype's tolerance"), math.nan  # fmt: skip
    timing = compare(fns, warmup=2, repeats=sizes.repeats, device=device)
    ratio = timing.paired_ratio("flex_attention", "sdpa")
    return Row(
        PHASE, _case_name(kind, case),
        "time per call, sdpa(mask=...) vs compiled flex_attention with a block mask made once",
        "ms", timing.timings["sdpa"].median_ms,
        baseline=timing.timings["flex_attention"].median_ms, target=f">= {TARGET_WORST}x",
        met=ratio >= TARGET_WORST if ctx.judged else None,
        note=f"B={case.batch} H={case.heads} {str(case.dtype).removeprefix('torch.')}"
        f"; flex_attention / sdpa round by round {ratio:.3f}x; {check}; first calls (compile, "
        f"outside the timing): {firsts}",
    ), ratio  # fmt: skip


def _summary_row(ctx: BenchContext, ratios: list[float]) -> Row:
    timed = [r for r in ratios if not math.isnan(r)]
    median = statistics.median(timed) if timed else math.nan
    worst = min(timed, default=math.nan)
    met = median >= TARGET_MEDIAN and worst >= TARGET_WORST and len(timed) == len(ratios)
    return Row(
        PHASE, f"masked sweep: sdpa(mask=...) vs compiled flex_attention over {len(ratios)} points",
        "speedup, median of the points", "x", median, higher_is_better=True,
        target=f"median >= {TARGET_MEDIAN}x, every point >= {TARGET_WORST}x",
        met=met if ctx.judged else None,
        note=f"worst point {worst:.3f}x; {len(ratios) - len(timed)} point(s) not "
        "timed; each point's ratio round by round, as in its row",
    )  # fmt: skip
