"""Attention computed by hand: a matrix product whose output ends in (Sq, Sk), a softmax over
such a tensor, and a product of it with values, in that order in the forward's operators. Its
gain is measured, not assumed: the written-out attention, with the passes over its scores the
step made (scaling, masking, casts) and the copies its operands' layout cost, and
``torch.nn.functional.scaled_dot_product_attention`` at the same shape, dtype and layout, timed
here.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from accel.doctor.findings import Evidence, Finding, check
from accel.doctor.recorder import OpRecord, Site

_PRODUCTS = frozenset({"aten::bmm", "aten::mm", "aten::baddbmm", "aten::matmul"})
# not aten::_safe_softmax: only SDPA's own math path runs it (inside nn.MultiheadAttention too,
# called with need_weights=False), and that is no attention written out
_SOFTMAX = frozenset({"aten::_softmax", "aten::softmax"})
# ops between the scores' product, the softmax and the values' product (a dropout of the
# weights is five on a CPU, and a matmul's reshapes five more)
_LOOKAHEAD = 16
_BIAS_LOOKAHEAD = 96  # T5 makes its position bias (bucketing: tens of operators) before softmax
# the passes over the scores or the weights timed again as the step made them; any other operator
# between the products (a view, a small mask's compare) moves no scores
_SCALES = ("aten::mul", "aten::div", "aten::mul_", "aten::div_")
_PASSES = frozenset({*_SCALES, "aten::add", "aten::sub", "aten::masked_fill", "aten::add_",
                     "aten::sub_", "aten::masked_fill_", "aten::where", "aten::_to_copy"})  # fmt: skip


@dataclass(frozen=True)
class ManualAttention:
    heads: int  # batch x heads, flattened as the products see them
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: torch.dtype
    site: Site | None
    causal: bool = False  # the scores were masked with exactly the causal mask
    values_site: Site | None = None  # the line of the product with the values
    # (operator, output dtype) of each pass over the scores before the softmax, and over the
    # weights after it
    before: tuple[tuple[str, torch.dtype], ...] = ()
    after: tuple[tuple[str, torch.dtype], ...] = ()
    # q, k and v were views with the heads split off by a transpose ((B, S, H, D) in memory):
    # the products copied them, where SDPA reads them as they are
    split_heads: bool = False
    batch: int = 1  # the scores' dimensions before their heads, flattened
    # the output was transposed back and copied ((B, S, H, D) again): SDPA's output already
    # lies that way, the values' product's does not
    merged: bool = False
    dims: int = 4  # the scores' (3: heads flattened into the batch, which SDPA runs as given)
    dropout: float = 0.0  # the weights' dropout rate, while training
    scale: float | None = None  # what the scores were multiplied by, where by numbers


def find_manual_attention(ops: list[OpRecord], api: str | None = None) -> list[ManualAttention]:
    """Each product -> softmax -> product chain over (..., Sq, Sk) scores in ``ops`` written in
    the user's code (``api``: inside that torch function instead)."""
    found, mixed = [], set()  # mixed: the values' products of the chains found
    for i, op in enumerate(ops):
        if op.op not in _PRODUCTS or not op.outputs or len(op.outputs[0].shape) < 3:
            continue
        if ("attention" in op.api) if api is None else op.api != api:  # SDPA's own math path
            continue
        if i in mixed:  # a chain's values' product, whose output may have a scores' shape
            continue
        scores = op.outputs[0].shape
        soft = _next(ops, i, lambda o, s=scores: o.op in _SOFTMAX and _scores_in(o.inputs[:1], s),
                     within=_BIAS_LOOKAHEAD)
        if soft is None:
            continue
        reads = lambda o, s=scores: o.op in _PRODUCTS and _scores_in(o.inputs[:2], s)  # noqa: E731
        mix = _next(ops, soft, reads)
        if mix is None:
            continue
        mixed.add(mix)
        q = op.inputs[-2].shape if len(op.inputs) >= 2 else ()
        causal = any("causal mask" in o.facts for o in ops[i + 1 : soft])
        size = math.prod(scores)
        found.append(ManualAttention(math.prod(scores[:-2]), scores[-2], scores[-1],
                                     q[-1] if q else 0, op.inputs[0].dtype, op.site, causal,
                                     values_site=ops[mix].site,
                                     before=_passes(ops[i + 1 : soft], size),
                                     after=_passes(ops[soft + 1 : mix], size),
                                     split_heads=_copied_operands(ops, i),
                                     batch=math.prod(ops[soft].inputs[0].shape[:-3]),
                                     merged=_merged(ops, mix),
                                     dims=len(ops[soft].inputs[0].shape),
                                     dropout=_dropout(ops[soft + 1 : mix]),
                                     scale=_scale(ops[i + 1 : soft], size)))  # fmt: skip
    return found


def _scale(ops: list[OpRecord], size: int) -> float | None:
    """The product of the numbers the scores were multiplied or divided by (None: none, or by a
    tensor)."""
    factors = [o.scalars[0] if o.op.startswith("aten::mul") else 1 / o.scalars[0] for o in ops
               if o.op in _SCALES and o.outputs and math.prod(o.outputs[0].shape) == size
               and o.scalars and isinstance(o.scalars[0], (int, float)) and o.scalars[0]]  # fmt: skip
    return math.prod(factors) if factors else None


def _dropout(ops: list[OpRecord]) -> float:
    """The rate of a dropout between the softmax and the values' product (0: none)."""
    for o in ops:
        if o.op == "aten::native_dropout" and o.scalars and o.scalars[-1] is not False:
            return float(o.scalars[0])
        if o.op == "aten::bernoulli_" and o.scalars:  # a CPU's dropout keeps with 1 - p
            return 1.0 - float(o.scalars[0])
    return 0.0


def _copied_operands(ops: list[OpRecord], product: int) -> bool:
    """Whether the product at ``product`` copied an operand first (``torch.matmul`` clones one
    whose batch dimensions cannot be flattened as a view: heads split off by a transpose)."""
    j = product - 1
    while j >= 0 and ops[j].api == ops[product].api and ops[j].site == ops[product].site:
        if ops[j].op == "aten::clone":
            return True
        j -= 1
    return False


def _merged(ops: list[OpRecord], values: int) -> bool:
    """Whether the values' product's output (4-d: heads apart) is copied soon after (the
    ``.transpose(1, 2).contiguous()`` that joins the heads again)."""
    out = ops[values].outputs[0]
    size = math.prod(out.shape)
    after = ops[values + 1 : values + 1 + _LOOKAHEAD]
    return any(o.op == "aten::clone" and o.api != ops[values].api and o.inputs
               and math.prod(o.inputs[0].shape) == size for o in after)  # fmt: skip


def _passes(ops: list[OpRecord], size: int) -> tuple[tuple[str, torch.dtype], ...]:
    return tuple((o.op, o.outputs[0].dtype) for o in ops if o.op in _PASSES and o.outputs
                 and math.prod(o.outputs[0].shape) == size)  # fmt: skip


def _next(ops: list[OpRecord], start: int, wanted, within: int = _LOOKAHEAD) -> int | None:
    for j in range(start + 1, min(len(ops), start + 1 + within)):
        if wanted(ops[j]):
            return j
    return None


def _scores_in(inputs: tuple, scores: tuple[int, ...]) -> bool:
    """Whether one of ``inputs`` is the scores (their last two dims, their size)."""
    return any(len(t.shape) >= 2 and t.shape[-2:] == scores[-2:]
               and math.prod(t.shape) == math.prod(scores) for t in inputs)  # fmt: skip


def time_attention(case: ManualAttention, device: torch.device, backward: bool) -> dict[str, float]:
    """ms per call of the written-out attention (:func:`written_out`) and of SDPA at ``case``'s
    shape, interleaved."""
    from accel.measure.timer import compare

    timing = compare(timed_calls(case, device, backward), warmup=2, repeats=10,
                     calls_per_sample=None, device=device)  # fmt: skip
    return {name: t.median_ms for name, t in timing.timings.items()}


def timed_calls(case: ManualAttention, device: torch.device, backward: bool) -> dict[str, Callable]:
    """"manual" and "sdpa": one call each of ``case``'s attention on fresh operands laid out as the
    step's were, with the heads joined again after it where the step did (and, where
    ``backward``, the operands' gradients, as a matrix each where the heads were split)."""
    gen = torch.Generator(device=device).manual_seed(0)
    leaves = [
        torch.randn(shape, generator=gen, device=device, dtype=case.dtype).requires_grad_(backward)
        for shape in _operand_shapes(case)
    ]
    q, k, v = (t.transpose(1, 2) for t in leaves) if case.split_heads else leaves
    out = q.transpose(1, 2).shape if case.merged else q.shape  # the output is shaped as q
    grad = torch.randn(out, generator=gen, device=device, dtype=case.dtype)

    def timed(fn):
        def merged(q, k, v):
            return fn(q, k, v).transpose(1, 2).contiguous() if case.merged else fn(q, k, v)

        def gradients():
            grads = torch.autograd.grad(merged(q, k, v), leaves, grad)
            # the projections that made split heads read their gradients as matrices: the
            # products' come transposed and are copied, SDPA's come laid out as its operands
            return [g.contiguous() for g in grads] if case.split_heads else grads

        return gradients if backward else lambda: merged(q, k, v)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=case.causal, dropout_p=case.dropout
        )

    return {"manual": timed(written_out(case, device, gen)), "sdpa": timed(sdpa)}


def _operand_shapes(case: ManualAttention) -> list[tuple[int, ...]]:
    """q's, k's and v's shapes as they lie in memory: (1, B x H, S, D); (B x H, S, D) where the
    step's were 3-d; (B, S, H, D) where it split the heads off by a transpose."""
    seqs = (case.seq_q, case.seq_k, case.seq_k)
    lead = _scores_lead(case)
    if case.split_heads:
        return [(lead[0], s, lead[1], case.head_dim) for s in seqs]
    return [(*lead, s, case.head_dim) for s in seqs]


def _scores_lead(case: ManualAttention) -> tuple[int, ...]:
    """The timed scores' dimensions before (Sq, Sk): the step's batch and heads where it split its
    heads, its heads flattened into the batch where its scores were 3-d, else one batch."""
    if case.split_heads and case.heads % case.batch == 0:
        return case.batch, case.heads // case.batch
    return (case.heads,) if case.dims == 3 and not case.split_heads else (1, case.heads)


def written_out(case: ManualAttention, device: torch.device, gen: torch.Generator):
    """The attention as the step wrote it: the scores' product, each recorded pass over the
    scores (a scale, a mask made once: causal, or hiding random keys, added or filled in; a
    cast), the softmax, each pass over the weights, the values' product."""
    if case.causal:
        hidden = torch.ones(case.seq_q, case.seq_k, dtype=torch.bool, device=device).triu(1)
    else:  # a padding mask: a tenth of the keys hidden from every query
        keys = torch.rand((*_scores_lead(case), 1, case.seq_k), generator=gen, device=device)
        hidden = keys < 0.1
    additive = torch.zeros(hidden.shape, device=device).masked_fill(hidden, -math.inf)
    scale = case.head_dim**-0.5 if case.head_dim else 1.0

    def apply(x: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
        if op in ("aten::mul", "aten::div"):
            return x * scale
        if op in ("aten::add", "aten::sub"):
            return x + additive.to(x.dtype)
        if op == "aten::masked_fill":
            return x.masked_fill(hidden, -math.inf)
        if op == "aten::where":
            return torch.where(hidden, -math.inf, x)
        return x.to(dtype)  # aten::_to_copy

    def manual(q, k, v):
        x = q @ k.transpose(-2, -1)
        for op, dtype in case.before:
            x = apply(x, op, dtype)
        x = x.softmax(dim=-1)
        for op, dtype in case.after:
            x = apply(x, op, dtype)
        if case.dropout:
            x = torch.nn.functional.dropout(x, case.dropout)
        return x.to(v.dtype) @ v

    return manual


# nn.MultiheadAttention's function: its attention written out when it returns the weights
_MHA = "multi_head_attention_forward"


@check("attention")
def manual_attention(evidence: Evidence) -> list[Finding]:
    ops = evidence.forward_ops()
    chains = [(c, False) for c in find_manual_attention(ops)]
    chains += [(c, True) for c in find_manual_attention(ops, api=_MHA)]
    if not chains:
        return []
    backward = any(op.backward for op in evidence.recording.ops)
    found = []
    for (case, weights), calls in Counter(chains).items():
        times = evidence.measure.get("attention", time_attention)(case, evidence.device, backward)
        saved = calls * max(0.0, times["manual"] - times["sdpa"]) * 1e3
        what = "forward and backward" if backward else "forward"
        written = ("nn.MultiheadAttention returning its weights (need_weights=True, the default)"
                   if weights else "attention written out by hand")  # fmt: skip
        change, rewritten = (_mha_change(case.site), False) if weights else _change(evidence, case)
        found.append(Finding(
            kind="attention",
            title=f"{written} ({calls} call{'s' * (calls != 1)} per step) where SDPA would run",
            evidence=f"product -> softmax -> product over ({case.heads}, {case.seq_q}, "
            f"{case.seq_k}) scores, head dim {case.head_dim}, {case.dtype}",
            cost_model=f"measured here at that shape, {what}"
            + (", causal" if case.causal else "")
            + (", with the copies of heads split by a transpose" if case.split_heads else "")
            + f": written out {times['manual']:.3f} ms, SDPA {times['sdpa']:.3f} ms per call",
            notebook="05_sdpa",
            change=change,
            saved_us=saved,
            sites=[case.site] if case.site is not None else [],
            fixes=("mha_without_weights",) if weights else ("sdpa_attention",) * rewritten,
            detail=None if weights else case,
        ))
    return found


_NO_WEIGHTS = "  # SDPA inside; no weights are returned"


def _mha_change(site: Site | None) -> str:
    """The user's own call at ``site`` with ``need_weights=False`` (its other arguments kept);
    a template where that line is not the whole call."""
    code = site.text.partition("#")[0].rstrip() if site is not None else ""
    if re.search(r"need_weights\s*=", code):
        return re.sub(r"need_weights\s*=[^,)]+", "need_weights=False", code) + _NO_WEIGHTS
    if code.endswith(")") and code.count("(") == code.count(")"):
        return f"{code[:-1]}, need_weights=False)" + _NO_WEIGHTS
    return "out, _ = self.attn(q, k, v, need_weights=False)" + _NO_WEIGHTS


def _change(evidence: Evidence, case: ManualAttention) -> tuple[str, bool]:
    """The user's own forward with its attention rewritten (:mod:`accel.doctor.rewrite`), as a
    diff; the call to write where the rewrite cannot read the chain, with why. With whether it
    was rewritten (what the fix then tries on the copy)."""
    from accel.doctor.rewrite import NotRewritable, rewrite_attention

    # a pass over the scores other than a scale or a cast masked them; a causal mask beside a
    # bias (ALiBi's) goes into the mask
    masks = [op for op, _ in case.before if op not in (*_SCALES, "aten::_to_copy")]
    args = ["is_causal=True"] if case.causal and len(masks) == 1 else ["attn_mask=mask"] * bool(masks)
    if case.scale is not None:
        args.append(f"scale={case.scale:.6g}")
    elif not any(op in _SCALES for op, _ in case.before):  # no scale, or q's own
        args.append("scale=1.0")
    if case.dropout:
        args.append(f"dropout_p={case.dropout:g} if training else 0.0")
    call = f"out = torch.nn.functional.scaled_dot_product_attention({', '.join(['q', 'k', 'v', *args])})"
    if case.site is None or case.values_site is None:
        return call, False
    lines = [(s.file, s.line) for s in (case.site, case.values_site)]
    try:
        return rewrite_attention(evidence.parts.models, *lines, case.causal).diff, True
    except NotRewritable as error:
        return (f"{call}\n# q, k, v shaped (..., L, E), (..., S, E), (..., S, Ev): transpose "
                f"yours to that\n# not rewritten for you: {error}"), False
