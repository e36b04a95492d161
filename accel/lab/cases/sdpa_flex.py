"""The sdpa phase's masked rows (cases ``flex ...``): FlexAttention against SDPA on the dense
boolean mask (kept, as a user would) for a sliding window and packed documents, and against
SDPA's causal kernel for plain causal; every path checked against float64 before it is timed,
its first call (the compile) timed apart; the mask's memory.

Cost model: FlexAttention computes only the 128 x 128 tiles of the scores that keep a key, the
dense mask all of them: at an equal rate per tile it is faster by 1 / (fraction of tiles kept).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import pandas as pd
import torch

from accel import attention
from accel.attention import AttentionMask, dense_mask
from accel.lab.bench import BenchContext, Row, release_memory
from accel.lab.cases.sdpa_measure import (
    PHASE,
    AttnCase,
    as_timed,
    first_call_s,
    make_inputs,
    peak_memory_bytes,
)
from accel.measure.timer import compare
from accel.workloads.flags import flag

# Targets (bf16, B=4 H=16 D=128), judged on a CUDA GPU with the gpu preset only.
TARGET_WINDOW_VS_DENSE = 3.0  # sliding window 1024 at S = 8192 and 16384, fwd and fwd+bwd
TARGET_MASK_MEMORY = 0.01  # the block mask's bytes over the dense boolean mask's
TARGET_DOCUMENT_VS_DENSE = 2.0  # 8 packed documents per row at S = 8192
TARGET_CAUSAL_VS_SDPA = 0.85  # causal alone: FlexAttention's speed over SDPA's causal kernel


@dataclass(frozen=True)
class FlexSizes:
    batch: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    window: int
    seqs: tuple[int, ...]  # sliding window, forward: time against S
    judged_seqs: tuple[int, ...]  # where the window's targets are judged, also fwd+bwd
    documents: int
    document_seq: int
    causal_seq: int
    repeats: int

    def case(self, seq: int, backward: bool = False) -> AttnCase:
        shape = (self.batch, self.heads, seq, self.head_dim)
        return AttnCase(*shape, backward=backward, dtype=self.dtype)


FLEX_SIZES = {
    "gpu": FlexSizes(
        4, 16, 128, torch.bfloat16, 1024, (2048, 4096, 8192, 16384), (8192, 16384), 8, 8192, 8192,
        repeats=10,
    ),
    "cpu": FlexSizes(1, 2, 16, torch.float32, 32, (128, 256), (256,), 4, 256, 256, repeats=3),
}  # fmt: skip


def document_lengths(batch: int, seq: int, documents: int, seed: int = 0) -> torch.Tensor:
    """(batch, documents) random lengths >= 1, each row summing to ``seq``."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.stack(
        [torch.randperm(seq - 1, generator=gen)[: documents - 1] + 1 for _ in range(batch)]
    )
    first, last = torch.zeros(batch, 1, dtype=torch.long), torch.full((batch, 1), seq)
    return torch.cat([first, cuts.sort(-1).values, last], -1).diff(dim=-1)


# ---- the mask's cost model: tiles kept, bytes held ---------------------------------------------
def mask_costs(mask: AttentionMask, batch: int, seq: int, device="cpu") -> dict[str, float]:
    """The block mask of ``mask`` over ``seq`` x ``seq`` against its dense boolean mask: the
    fraction of tiles kept, the bytes each holds, the speedup the kept fraction predicts."""
    empty = torch.empty(batch, 1, seq, 1, device=device)  # only shape and device are read
    blocks = attention.block_mask(mask, empty, empty)
    tiles = blocks.kv_num_blocks.numel() * blocks.kv_indices.shape[-1]
    kept = (blocks.kv_num_blocks.sum() + blocks.full_kv_num_blocks.sum()).item() / tiles
    return {"S": seq, "tiles kept": kept, "block sparsity": 1 - kept, "predicted speedup": 1 / kept,
            "block mask bytes": _held_bytes(blocks),
            "dense mask bytes": (mask.rows or 1) * seq * seq}  # fmt: skip


def tile_states(mask: AttentionMask, seq: int, row: int = 0) -> torch.Tensor:
    """(tiles, tiles) of one batch row: 0 skipped, 1 partial (the mask evaluated in the
    kernel), 2 full (every score kept, no mask evaluated)."""
    from torch.nn.attention.flex_attention import BlockMask

    empty = torch.empty((mask.rows or 1), 1, seq, 1)
    blocks = attention.block_mask(mask, empty, empty)
    full_tiles = blocks.full_kv_num_blocks, blocks.full_kv_indices
    full = BlockMask.from_kv_blocks(*full_tiles, BLOCK_SIZE=blocks.BLOCK_SIZE)
    return blocks.to_dense()[row, 0] + full.to_dense()[row, 0]


def _held_bytes(blocks) -> int:
    """Every tensor of a BlockMask and the tensors its mask_mod reads (a document's ids)."""
    tensors = [t for t in blocks.as_tuple() if isinstance(t, torch.Tensor)]
    cells = getattr(blocks.mask_mod, "__closure__", None) or ()
    tensors += [c.cell_contents for c in cells if isinstance(c.cell_contents, torch.Tensor)]
    return sum(t.nbytes for t in {id(t): t for t in tensors}.values())


# ---- one masked case, checked then timed -------------------------------------------------------
def masked_fn(path: str, mask: AttentionMask, case: AttnCase, q, k, v, grad) -> Callable:
    """One timed call of ``sdpa(mask=mask, backend=path)``."""

    def forward():
        return attention.sdpa(q, k, v, mask=mask, backend=path)

    return as_timed(forward, case, (q, k, v), grad)


def check_masked(q, k, v, mask: AttentionMask, paths: Sequence[str]) -> dict[str, float | str]:
    """Each path's largest error against float64 on the first (batch, head) of the inputs (the
    whole would not fit at S = 16384), or why it failed or could not run."""
    keep = dense_mask(mask, q, k)[:1, :1]
    keep = keep if keep.dtype == torch.bool else keep.double()
    one = [t.detach()[:1, :1].double() for t in (q, k, v)]
    exact = attention.attention_reference(*one, mask=keep)
    tol = attention.TOLERANCES[q.dtype]
    result: dict[str, float | str] = {}
    for path in paths:
        try:  # in the grad mode timed: for a backward case, the training variant it compiled
            with torch.set_grad_enabled(q.requires_grad):
                out = attention.sdpa(q, k, v, mask=mask, backend=path)[:1, :1]
        except RuntimeError as error:  # BackendUnavailableError among them
            result[path] = getattr(error, "reason", str(error))[:200]
            continue
        err = (out.detach().double() - exact).abs()
        worst = err.max().item()
        ok = bool((err <= tol["atol"] + tol["rtol"] * exact.abs()).all())
        result[path] = worst if ok else f"differs from float64 by up to {worst:.3g}"
    return result


@dataclass(frozen=True)
class MaskedPoint:
    """One masked case: median ms, first call s, error against float64 (or why not timed) and
    peak bytes, per path."""

    times: dict[str, float]
    first_call_s: dict[str, float]
    checked: dict[str, float | str]
    peak_bytes: dict[str, int]


def measure_masked(mask: AttentionMask, case: AttnCase, device, paths: Sequence[str], *,
                   repeats: int, peak: bool = False) -> MaskedPoint:  # fmt: skip
    """Each path's first call timed apart, every path checked against float64, those equal
    timed interleaved; with ``peak``, each path's peak memory too."""
    q, k, v, grad = make_inputs(case, device)
    fns, first, checked = {}, {}, {}
    for path in paths:  # the first call alone: FlexAttention compiles, the dense path measures
        fn = masked_fn(path, mask, case, q, k, v, grad)
        try:
            first[path] = first_call_s(fn, device)
        except RuntimeError as error:  # BackendUnavailableError among them
            checked[path] = getattr(error, "reason", str(error))[:200]
            continue
        fns[path] = fn
    checked |= check_masked(q, k, v, mask, list(fns))  # correctness before timing
    fns = {path: fn for path, fn in fns.items() if not isinstance(checked[path], str)}
    times = {}
    if fns:
        timing = compare(fns, warmup=2, repeats=repeats, device=device)
        times = {path: t.median_ms for path, t in timing.timings.items()}
    peaks = {path: peak_memory_bytes(fn, device) for path, fn in fns.items()} if peak else {}
    del q, k, v, grad, fns
    release_memory(device)
    return MaskedPoint(times, first, checked, peaks)


# ---- rows ----------------------------------------------------------------------------------
def flex_rows(ctx: BenchContext, judged: bool) -> list[Row]:
    """Every masked case of the preset: the window over ``seqs`` (fwd+bwd too at the judged
    lengths), packed documents, causal alone; mask memory and sparsity."""
    sizes = FLEX_SIZES[ctx.preset]
    attention.clear_masked_cache()
    point = partial(_point_rows, ctx.device, sizes.repeats, judged)
    window, label = attention.SlidingWindow(sizes.window), f"sliding window {sizes.window}"
    rows = []
    for seq in sizes.seqs:
        target = TARGET_WINDOW_VS_DENSE if seq in sizes.judged_seqs else None
        rows += point(label, window, sizes.case(seq), "dense", target)
    for seq in sizes.judged_seqs:
        rows += point(label, window, sizes.case(seq, True), "dense", TARGET_WINDOW_VS_DENSE)
        rows.append(_mask_row(label, window, sizes.batch, seq, judged))
    lengths = document_lengths(sizes.batch, sizes.document_seq, sizes.documents)
    documents = attention.Document(lengths.to(ctx.device))
    label = f"causal document x{sizes.documents}"
    for backward in (False, True):
        case = sizes.case(sizes.document_seq, backward)
        rows += point(label, documents, case, "dense", TARGET_DOCUMENT_VS_DENSE)
    rows.append(_mask_row(label, documents, sizes.batch, sizes.document_seq, judged))
    for backward in (False, True):
        case = sizes.case(sizes.causal_seq, backward)
        rows += point("causal", attention.Causal(), case, "default", TARGET_CAUSAL_VS_SDPA)
    attention.clear_masked_cache()
    return rows


def _point_rows(device, repeats, judged, label, mask, case, baseline, target):
    """FlexAttention's time against ``baseline``'s ("dense", or "default": SDPA's causal kernel,
    which ``sdpa(mask=Causal())`` runs), every check and first call in the note."""
    point = measure_masked(mask, case, device, ("flex", baseline), repeats=repeats)
    name = f"flex {label} B={case.batch} H={case.heads} S={case.seq} D={case.head_dim}"
    name += f" {case.direction}"
    flex, base = point.times.get("flex", math.nan), point.times.get(baseline, math.nan)
    checks = "; ".join(
        f"{p}: {'error ' + format(c, '.2g') if not isinstance(c, str) else 'skipped: ' + c}"
        for p, c in point.checked.items()
    )
    firsts = " ".join(f"{p}={s:.2f}s" for p, s in point.first_call_s.items())
    met = None
    if judged and target is not None:
        met = not math.isnan(flex) and base / flex >= target
    other = "SDPA on the dense boolean mask" if baseline == "dense" else "SDPA causal kernel"
    dtype = str(case.dtype).removeprefix("torch.")
    return [Row(
        PHASE, name, f"time per call, FlexAttention vs {other}", "ms", flex, baseline=base,
        target=f">= {target:g}x" if target is not None else "", met=met,
        note=f"{dtype}; against float64 on one (batch, head): {checks}; first calls (compile, "
        f"not in the median): {firsts}",
    )]  # fmt: skip


def _mask_row(label: str, mask: AttentionMask, batch: int, seq: int, judged: bool) -> Row:
    """The block mask's bytes against the dense mask's."""
    data = mask.data()
    costs = mask_costs(mask, batch, seq, device="cpu" if data is None else data.device)
    ratio = costs["block mask bytes"] / costs["dense mask bytes"]
    return Row(
        PHASE, f"flex {label} S={seq} mask memory",
        "bytes held by the mask: BlockMask (and the tensors its mask_mod reads) vs dense bool",
        "MiB", costs["block mask bytes"] / 2**20, baseline=costs["dense mask bytes"] / 2**20,
        target=f"<= {TARGET_MASK_MEMORY:.0%} of the dense mask",
        met=ratio <= TARGET_MASK_MEMORY if judged else None,
        note=f"{ratio:.3%} of the dense boolean mask",
    )  # fmt: skip


# ---- recorded rows back, for the notebook's figures --------------------------------------------
_TIME_CASE = re.compile(
    r"flex (?P<kind>.+?) B=\d+ H=\d+ S=(?P<S>\d+) D=\d+ (?P<direction>fwd\+bwd|fwd)(?P<peak> peak memory)?"
)


def flex_frame(recorded: pd.DataFrame) -> pd.DataFrame:
    """Recorded ``flex ...`` time and peak-memory rows as one row per (device, kind, S,
    direction, path): ``ms`` or ``peak MiB``."""
    out = []
    for _, row in recorded.iterrows():
        match = _TIME_CASE.fullmatch(str(row["case"]))
        if not match:
            continue
        what = "peak MiB" if match["peak"] else "ms"
        other = "causal" if match["kind"] == "causal" else "dense"
        for path, value in (("flex", row["optimized"]), (other, row["baseline"])):
            out.append([row.get("device", ""), match["kind"], int(match["S"]),
                        match["direction"], path, what, float(value)])  # fmt: skip
    return pd.DataFrame(out, columns=["device", "kind", "S", "direction", "path", "what", "value"])


# ---- the notebook's toggle ---------------------------------------------------------------------
@dataclass(frozen=True)
class MaskFlags:
    """Off: SDPA on the dense boolean mask; on: FlexAttention on the block mask."""

    flex: bool = flag(
        "FlexAttention on the block mask instead of SDPA on the dense boolean mask", PHASE
    )


def masked_step(flags: MaskFlags, mask: AttentionMask, case: AttnCase, device) -> Callable:
    """One masked attention call on fixed random inputs by the path ``flags`` picks, called once
    here so that a compile happens at build time."""
    q, k, v, grad = make_inputs(case, torch.device(device))
    step = masked_fn("flex" if flags.flex else "dense", mask, case, q, k, v, grad)
    step()
    return step
