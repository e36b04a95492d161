"""The doctor's code changes tried on a copy (the written-out attention rewritten as SDPA), the
reads it defers, and how try_fixes judges a fix: the allowance from the step's own spread, the
best set never below its best fix, the combined prediction from the fixes measured alone."""

from __future__ import annotations

import contextlib
import copy
import html
import inspect
import math
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import plain_step, requires_cuda
from torch import nn

from accel import doctor
from accel.doctor import trial
from accel.doctor.agreement import Errors
from accel.doctor.deferred import deferred_item_reads
from accel.doctor.fixes import FIXES, FixNotApplicable, StepCopy
from accel.doctor.parts import copy_step
from accel.doctor.rewrite import NotRewritable, rewrite_attention

pytestmark = pytest.mark.usefixtures("one_thread")


class NanoAttention(nn.Module):
    """nanoGPT's first attention: a causal masked_fill on a tril buffer."""

    def __init__(self, width=32, heads=4, length=16, dropout=0.0):
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads
        self.drop = nn.Dropout(dropout)
        self.register_buffer(
            "bias", torch.tril(torch.ones(length, length)).view(1, 1, length, length)
        )

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.drop(att)
        y = att @ v
        return y.transpose(1, 2).reshape(B, T, C)


class PaddedCausalAttention(nn.Module):
    """A decoder on left-padded batches: its mask, causal and padded, comes with each batch."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads

    def forward(self, x, keep):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~keep, float("-inf"))
        att = F.softmax(att, dim=-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C)


def test_a_mask_that_comes_with_the_batch_stays_a_mask_though_this_batch_made_it_causal(seed):
    """This batch has no padding, so its mask is exactly causal; the next one's will not be.
    The edit keeps the mask (``is_causal=True`` would drop the padding), while one built from
    the module's own buffer, as nanoGPT's, becomes ``is_causal=True``."""
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    rewrite = rewrite_attention([PaddedCausalAttention()],
                                *lines(PaddedCausalAttention, "q @ k", "att @ v"), True)  # fmt: skip
    assert "is_causal" not in rewrite.diff and "attn_mask=keep" in rewrite.diff, rewrite.diff
    fixed = PaddedCausalAttention()
    model = copy.deepcopy(fixed)
    rewrite.apply([fixed], [])
    padded = causal & (torch.arange(16) >= 3)  # three pads on the left: their keys hidden
    padded[:3, 0] = True  # ... but for the pads' own rows, which keep one key
    x = torch.randn(2, 16, 32)
    torch.testing.assert_close(fixed(x, padded), model(x, padded), rtol=1e-5, atol=1e-6)
    nano = rewrite_attention([NanoAttention()], *lines(NanoAttention, "q @ k", "att @ v"), True)
    assert "is_causal=True" in nano.diff


ALIASED_ATTENTION = """
import math
import subprocess

import torch as th
from torch import nn


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(32)
        att = th.softmax(att, dim=-1)
        return att @ v
"""


def test_the_sdpa_edit_calls_torch_by_the_name_the_users_module_gives_it(seed, tmp_path):
    import importlib.util

    path = tmp_path / "aliased_attention.py"
    path.write_text(ALIASED_ATTENTION)
    spec = importlib.util.spec_from_file_location("aliased_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Attention()
    source = path.read_text().splitlines()
    first, last = (1 + next(i for i, line in enumerate(source) if text in line)
                   for text in ("q @ k", "att @ v"))  # fmt: skip
    rewrite = rewrite_attention([model], (str(path), first), (str(path), last), False)
    assert "+        return th.nn.functional.scaled_dot_product_attention(" in rewrite.diff
    fixed = copy.deepcopy(model)
    rewrite.apply([fixed], [])
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(fixed(x), model(x), rtol=1e-5, atol=1e-6)


class BertAttention(nn.Module):
    """An encoder's attention as BERT writes it: scaled in its own statement, an additive mask,
    the probabilities renamed."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.q, self.k, self.v, self.heads = (*(nn.Linear(width, width) for _ in range(3)), heads)

    def split(self, x):
        B, T, C = x.shape
        return x.view(B, T, self.heads, C // self.heads).permute(0, 2, 1, 3)

    def forward(self, x, mask):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(q.shape[-1])
        scores = scores + mask
        probs = nn.functional.softmax(scores, dim=-1)
        context = torch.matmul(probs, v)
        return context


class InlineAttention(nn.Module):
    """An encoder's attention with its padding mask compared in place and the values' product
    inside the statement that reshapes it, as many first versions write it."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        att = (q @ k.transpose(-2, -1)) / (C // self.heads) ** 0.5
        att = att.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C)


class EagerAttention(nn.Module):
    """Hugging Face's eager attention: an additive mask, a float32 softmax cast back, dropout
    called as a function."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.qkv, self.heads, self.attention_dropout = nn.Linear(width, 3 * width), heads, 0.0

    def forward(self, x, attention_mask):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * (C // self.heads) ** -0.5
        attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_weights = nn.functional.dropout(
            attn_weights, p=self.attention_dropout, training=self.training
        )
        attn_output = torch.matmul(attn_weights, v)
        return attn_output.transpose(1, 2).reshape(B, T, C)


class LlamaAttention(nn.Module):
    """Meta's Llama reference: an additive mask when given, the softmax of the scores upcast to
    float32 and cast back to the queries' dtype, a dropout of p=0."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads

    def forward(self, x, mask=None):
        B, T, C = x.shape
        xq, keys, values = (
            t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2)
        )
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(C // self.heads)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        scores = F.dropout(scores, p=0.0, training=self.training)
        output = torch.matmul(scores, values)
        return output.transpose(1, 2).reshape(B, T, C)


class OptionalMaskAttention(nn.Module):
    """A mask applied only when one is given, as many encoders write it."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads

    def forward(self, x, mask=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // self.heads)
        if mask is not None:
            scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        probs = scores.softmax(dim=-1)
        return (probs @ v).transpose(1, 2).reshape(B, T, C)


class Unreadable(nn.Module):
    def forward(self, q, k, v):
        att = q @ k.transpose(-2, -1)
        att = torch.tanh(att)  # not a step of attention's chain
        att = att.softmax(-1)
        return att @ v


def lines(cls, first: str, last: str) -> tuple[tuple[str, int], tuple[str, int]]:
    import inspect

    source, start = inspect.getsourcelines(cls.forward)
    file = inspect.getsourcefile(cls)
    at = [start + i for i, line in enumerate(source) if first in line or last in line]
    return (file, at[0]), (file, at[-1])


def rewritten(cls, first: str, last: str, causal: bool = False):
    """(a model of ``cls``, its copy with the attention rewritten, the rewrite)."""
    model = cls()
    rewrite = rewrite_attention([model], *lines(cls, first, last), causal)
    fixed = copy.deepcopy(model)
    rewrite.apply([fixed], [])
    return model, fixed, rewrite


@pytest.mark.parametrize("causal", [True, False])
def test_nanogpt_attention_rewritten_as_sdpa_computes_the_same(seed, causal):
    model = nn.Sequential(NanoAttention(), NanoAttention())
    rewrite = rewrite_attention([model], *lines(NanoAttention, "q @ k", "att @ v"), causal)
    fixed = copy.deepcopy(model)
    assert rewrite.apply([fixed], []) == 2
    x = torch.randn(3, 16, 32)
    torch.testing.assert_close(fixed(x), model(x), rtol=1e-5, atol=1e-6)
    assert "scaled_dot_product_attention" in rewrite.diff and "-        att = F.softmax" in rewrite.diff
    assert ("is_causal=True" in rewrite.diff) == causal
    assert type(model[0]).forward is NanoAttention.forward  # the class is left as it was


class AdditiveCausalAttention(nn.Module):
    """A causal mask kept as a float buffer of 0 and -inf, added to the scores."""

    def __init__(self, width=32, heads=4, length=16):
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        self.register_buffer("causal", torch.zeros(length, length).masked_fill(future, -math.inf))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att + self.causal[:T, :T]
        att = torch.softmax(att, dim=-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C)


class FiniteFillAttention(PaddedCausalAttention):
    """Hugging Face's eager attention: the hidden scores filled with the dtype's lowest number."""

    def forward(self, x, keep):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~keep, torch.finfo(att.dtype).min)
        att = F.softmax(att, dim=-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_finite_fill_keeps_its_meaning_on_rows_that_hide_every_key(seed, dtype):
    """A left pad's row hides every key: a finite fill averages the values there (softmax of
    equal scores), where SDPA's boolean mask would give 0 or NaN; the pad's output feeds the
    next token's loss, so the rewrite must give the same."""
    rewrite = rewrite_attention([FiniteFillAttention()],
                                *lines(FiniteFillAttention, "q @ k", "att @ v"), False)  # fmt: skip
    fixed = FiniteFillAttention().to(dtype)
    model = copy.deepcopy(fixed)
    rewrite.apply([fixed], [])
    keep = torch.ones(16, 16, dtype=torch.bool).tril() & (torch.arange(16) >= 3)  # 3 pads
    x = torch.randn(2, 16, 32, dtype=dtype)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(fixed(x, keep), model(x, keep), **tol)


class WeightsReturned(nn.Module):
    """timm's and DINO's attention, its weights handed back for a loss or a plot."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        attn = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        attn = attn.softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(B, T, C)
        return y, attn


def test_weights_read_after_the_values_product_are_not_rewritten_away():
    with pytest.raises(NotRewritable, match=r"attn.*read after"):
        rewrite_attention([WeightsReturned()], *lines(WeightsReturned, "q @ k", "attn @ v"), False)


def test_an_added_causal_mask_is_recorded_as_causal_and_rewritten_as_is_causal(seed):
    from accel.doctor import check_attention, recorder

    model, x = AdditiveCausalAttention(), torch.randn(2, 16, 32)
    ops = [o for o in recorder.record_step(lambda: model(x), torch.device("cpu")).ops]
    (case,) = check_attention.find_manual_attention(ops)
    assert case.causal
    written, fixed, rewrite = rewritten(AdditiveCausalAttention, "q @ k", "att @ v", case.causal)
    assert "is_causal=True" in rewrite.diff and "attn_mask" not in rewrite.diff
    torch.testing.assert_close(fixed(x), written(x), rtol=1e-5, atol=1e-6)
    # the same buffer with one more key hidden is a mask, not causality
    model.causal[5, 2] = -math.inf
    ops = [o for o in recorder.record_step(lambda: model(x), torch.device("cpu")).ops]
    (case,) = check_attention.find_manual_attention(ops)
    assert not case.causal


class ModuleNamedDropout(nn.Module):
    """Hugging Face's BERT: the weights' dropout is a module the model calls ``self.dropout``."""

    def __init__(self, width=32, heads=4, p=0.1):
        super().__init__()
        self.qkv, self.heads, self.dropout = nn.Linear(width, 3 * width), heads, nn.Dropout(p)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        att = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(k.size(-1))
        att = nn.functional.softmax(att, dim=-1)
        att = self.dropout(att)
        return torch.matmul(att, v).transpose(1, 2).reshape(B, T, C)


def test_a_dropout_module_named_dropout_keeps_its_own_rate(seed):
    """``self.dropout(att)`` is the module's dropout (its p, off in eval), not F.dropout's p=0.5."""
    model, fixed, rewrite = rewritten(ModuleNamedDropout, "matmul(q", "matmul(att")
    assert "self.dropout.p if self.dropout.training else 0.0" in rewrite.diff
    model.eval(), fixed.eval()
    x = torch.randn(2, 16, 32)
    torch.testing.assert_close(fixed(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_causal_mask_with_padding_in_a_later_sequence_is_no_causal_mask(seed):
    """Causal and left padding, the first sequence unpadded: its first slice alone reads causal."""
    from accel.doctor import check_attention, recorder

    q, k, v = (torch.randn(2, 4, 8, 8) for _ in range(3))
    hidden = torch.ones(8, 8, dtype=torch.bool).triu(1).repeat(2, 1, 1, 1)
    hidden[1, ..., :3] = True  # the second sequence's first three keys are padding

    def attention():
        att = (q @ k.transpose(-2, -1)).masked_fill(hidden, float("-inf"))
        return att.softmax(-1).nan_to_num() @ v

    (case,) = check_attention.find_manual_attention(
        recorder.record_step(attention, torch.device("cpu")).ops
    )
    assert not case.causal


def test_bert_attention_with_an_additive_mask_rewritten_as_sdpa(seed):
    model, fixed, _ = rewritten(BertAttention, "matmul(q", "matmul(probs")
    x, mask = torch.randn(2, 16, 32), torch.zeros(2, 1, 1, 16)
    mask[0, ..., 11:] = -10000.0  # padding
    torch.testing.assert_close(fixed(x, mask), model(x, mask), rtol=1e-5, atol=1e-6)


def test_a_values_product_inside_a_larger_expression_is_rewritten_in_place(seed):
    model, fixed, rewrite = rewritten(InlineAttention, "q @ k", "att @ v")
    x, mask = torch.randn(2, 16, 32), torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0  # padding
    torch.testing.assert_close(fixed(x, mask), model(x, mask), rtol=1e-5, atol=1e-6)
    added = [line for line in rewrite.diff.splitlines() if line.startswith("+ ")]
    assert ").transpose(1, 2).reshape(B, T, C)" in added[-1], rewrite.diff


def test_a_float32_softmax_cast_back_is_rewritten(seed):
    model, fixed, _ = rewritten(EagerAttention, "matmul(q", "matmul(attn_w")
    x, mask = torch.randn(2, 16, 32), torch.zeros(2, 1, 16, 16)
    mask[0, ..., 10:] = torch.finfo(torch.float32).min
    torch.testing.assert_close(fixed(x, mask), model(x, mask), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_softmax_of_upcast_scores_cast_back_is_rewritten(seed, dtype):
    model, fixed, rewrite = rewritten(LlamaAttention, "matmul(xq", "matmul(scores")
    model, fixed = model.to(dtype), fixed.to(dtype)
    x = torch.randn(2, 16, 32, dtype=dtype)
    causal = torch.full((16, 16), -math.inf).triu(1).to(dtype)
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for kwargs in ({}, {"mask": causal}):
        torch.testing.assert_close(fixed(x, **kwargs), model(x, **kwargs), **tolerance)
    assert "-        scores = F.softmax(scores.float(), dim=-1).type_as(xq)" in rewrite.diff
    assert "dropout_p" not in rewrite.diff  # a dropout of p=0 is none


def test_a_mask_added_only_when_given_is_passed_as_it_is(seed):
    # `if mask is not None: scores = scores + mask`: SDPA's attn_mask takes None as no mask
    model, fixed, rewrite = rewritten(LlamaAttention, "matmul(xq", "matmul(scores")
    x, mask = torch.randn(2, 16, 32), torch.randn(16, 16)
    for kwargs in ({}, {"mask": mask}):
        torch.testing.assert_close(fixed(x, **kwargs), model(x, **kwargs), rtol=1e-5, atol=1e-6)
    assert "attn_mask=mask," in rewrite.diff and "else None" not in rewrite.diff


def test_a_mask_applied_only_when_given_is_rewritten_for_both_cases(seed):
    model, fixed, rewrite = rewritten(OptionalMaskAttention, "q @ k", "probs @ v")
    x, mask = torch.randn(2, 16, 32), torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0  # padding
    for kwargs in ({}, {"mask": mask}):
        torch.testing.assert_close(fixed(x, **kwargs), model(x, **kwargs), rtol=1e-5, atol=1e-6)
    assert "if mask is not None else None" in rewrite.diff


def test_scores_read_besides_the_values_product_are_not_rewritten():
    class Twice(nn.Module):
        def forward(self, q, k, v):
            att = q @ k.transpose(-2, -1)
            att = att.softmax(-1)
            return (att @ v) + att.sum()

    with pytest.raises(NotRewritable, match="besides"):
        rewrite_attention([Twice()], *lines(Twice, "q @ k", "att @ v"), False)


def test_scores_masked_and_softmaxed_in_one_expression_are_refused_with_how_to_split_them():
    class OneLiner(nn.Module):
        def forward(self, q, k, v, mask):
            att = (q @ k.transpose(-2, -1) / 8.0).masked_fill(~mask, float("-inf")).softmax(-1)
            return att @ v

    with pytest.raises(NotRewritable, match=r"one expression.*its own statement"):
        rewrite_attention([OneLiner()], *lines(OneLiner, "q @ k", "att @ v"), False)


def padding(batch=2, length=16):
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, 10:] = 0
    return mask


REWRITTEN_FORMS = {  # class, its scores' and values' lines, causal, the extra arguments
    "nanoGPT": (NanoAttention, "q @ k", "att @ v", True, lambda: ()),
    "inline": (InlineAttention, "q @ k", "att @ v", False, lambda: (padding(),)),
    "eager": (EagerAttention, "matmul(q", "matmul(attn_w", False,
              lambda: (torch.zeros(2, 1, 16, 16),)),
    "optional mask": (OptionalMaskAttention, "q @ k", "probs @ v", False, lambda: (padding(),)),
    "llama": (LlamaAttention, "matmul(xq", "matmul(scores", False,
              lambda: (torch.zeros(16, 16),)),
}  # fmt: skip


@pytest.mark.parametrize("form", REWRITTEN_FORMS)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_and_inf_in_the_inputs_reach_the_rewrite_as_the_original(seed, form, bad):
    cls, first, last, causal, extra = REWRITTEN_FORMS[form]
    model, fixed, _ = rewritten(cls, first, last, causal)
    x = torch.randn(2, 16, 32)
    x[0, 3, 5] = bad
    args = extra()
    assert torch.equal(fixed(x, *args).isnan(), model(x, *args).isnan())
    finite = model(x, *args).isfinite()
    torch.testing.assert_close(fixed(x, *args)[finite], model(x, *args)[finite], rtol=1e-5, atol=1e-6)


def test_a_chain_with_a_step_it_cannot_read_is_not_rewritten_and_says_which():
    with pytest.raises(NotRewritable, match="tanh"):
        rewrite_attention([Unreadable()], *lines(Unreadable, "q @ k", "att @ v"), False)


def test_lines_outside_every_models_forward_are_refused():
    with pytest.raises(NotRewritable, match="no module's forward"):
        rewrite_attention([nn.Linear(2, 2)], ("elsewhere.py", 1), ("elsewhere.py", 2), False)


def gpt_step(attention: type[nn.Module] = NanoAttention):
    model = nn.Sequential(nn.Linear(32, 32), attention(), nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return plain_step(model, opt), model


def test_attention_with_dropout_on_its_weights_is_found_on_a_cpu(seed):
    # nanoGPT's attention drops out its weights: on a CPU the dropout is five operators, and the
    # values' product comes that much later after the softmax
    step, _ = gpt_step(lambda: NanoAttention(dropout=0.1))
    report = doctor.examine(step, torch.randn(4, 16, 32), steps=1, warmup=1)
    (finding,) = [f for f in report.findings if f.kind == "attention"]
    assert finding.fixes == ("sdpa_attention",) and "dropout_p=" in finding.change


def test_attention_with_dropout_rewritten_as_sdpa_is_judged_with_dropout_off(seed):
    """SDPA draws its own dropout mask, so the rewritten step cannot match the step as written
    value by value in training: both are compared with dropout off, then timed with it on."""
    step, _ = gpt_step(lambda: NanoAttention(dropout=0.2))
    report = doctor.examine(step, torch.randn(4, 16, 32), steps=1, warmup=1)
    (row,) = report.try_fixes(["sdpa_attention"], steps=2, repeats=2).to_dict("records")
    assert row["status"] == "ok" and row["error"] < 1e-5, row
    assert "dropout off" in row["allowed by"]


def test_examine_and_try_fixes_rewrite_the_attention_on_the_copy_only(seed):
    step, model = gpt_step()
    before = [p.detach().clone() for p in model.parameters()]
    report = doctor.examine(step, torch.randn(4, 16, 32), steps=1, warmup=1)
    (finding,) = [f for f in report.findings if f.kind == "attention"]
    assert finding.fixes == ("sdpa_attention",)
    # the change to paste is the user's own forward rewritten, before any trial
    assert "-        att = F.softmax(att, dim=-1)" in finding.change
    assert "+        y = torch.nn.functional.scaled_dot_product_attention(" in finding.change
    (row,) = report.try_fixes(["sdpa_attention"], steps=2, repeats=2).to_dict("records")
    assert row["status"] == "ok" and row["error"] <= row["allowance"]
    assert "scaled_dot_product_attention" in row["edit"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert model[1].forward.__func__ is NanoAttention.forward


def annotated_attention(query, key, value, mask=None):
    """The Annotated Transformer's attention: a plain function, the mask filled with -1e9."""
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, value)


class AnnotatedHeads(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4, second_keys: int = 5):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.second_keys = second_keys

    def forward(self, x, keep):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        out = annotated_attention(q, k, v, mask=keep)
        n = self.second_keys  # the same code at another shape
        first = annotated_attention(q, k[:, :, :n], v[:, :, :n])
        return self.out((out + first).transpose(1, 2).reshape(B, T, C))


def annotated_step(keep: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A training step of :class:`AnnotatedHeads` with the padding mask ``keep``."""
    model = AnnotatedHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x, keep).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


@pytest.mark.parametrize("bad", [None, "nan", "inf"])
def test_attention_in_a_plain_function_is_rewritten_for_the_copy_alone(seed, bad, tmp_path):
    """A function outside any module (the Annotated Transformer's ``attention``) with its mask
    filled with -1e9 where keys are padding: rewritten as SDPA while the copy's step runs, the
    user's function left as it is; NaN and inf in the inputs reach both alike."""
    keep = (torch.arange(16) < torch.tensor([[16], [11], [7], [16]]))[:, None, None, :]
    step = annotated_step(keep)
    x = torch.randn(4, 16, 32)
    if bad is not None:
        x[1, 12, 3] = float(bad)  # a padded position: masked out of every query's keys
    code = annotated_attention.__code__
    report = doctor.examine(step, x, steps=1, warmup=1)
    found = [f for f in report.findings if f.kind == "attention"]
    assert len(found) == 2 and all(f.fixes == ("sdpa_attention",) for f in found), found
    assert "def annotated_attention" in found[0].change and "-1000000000.0" not in found[0].change
    (row,) = report.try_fixes(["sdpa_attention"], steps=2, repeats=2).to_dict("records")
    assert row["status"] == "ok" and row["error"] <= row["allowance"], row
    assert row["edit"].count("scaled_dot_product_attention") == 1, row["edit"]
    assert annotated_attention.__code__ is code
    # a hunk at the function's end keeps the file's lines after it: it applies without fuzz
    pasted = tmp_path / "pasted.py"
    pasted.write_text(Path(__file__).read_text())
    applied = subprocess.run(["patch", "--fuzz=0", str(pasted)], input=row["edit"], text=True,
                             capture_output=True)  # fmt: skip
    assert applied.returncode == 0, applied.stdout + applied.stderr


@pytest.mark.parametrize("order", [("sdpa_attention", "compile"), ("compile", "sdpa_attention")])
def test_a_function_rewritten_for_the_copy_is_what_its_compiled_callers_run(seed, order):
    """A compiled copy's forwards call copies of their module's functions (dynamo's names go to
    the copies' globals): the plain function's SDPA rewrite reaches those copies too, whichever
    fix comes first, and leaves the user's function as it was."""
    step = annotated_step(torch.ones(4, 1, 1, 16, dtype=torch.bool))
    x = torch.randn(4, 16, 32)
    report = doctor.examine(step, x, steps=1, warmup=1)
    fixed = StepCopy(*copy_step(step, report.parts), x, torch.device("cpu"), findings=report.findings)
    for name in order:
        FIXES[name].apply(fixed)
    (layer,) = fixed.parts.models
    forward = layer.forward._torchdynamo_orig_callable  # what compile wraps
    called = forward.__globals__["annotated_attention"]
    assert called is not annotated_attention
    with contextlib.ExitStack() as stack:
        for context in fixed.contexts:
            stack.enter_context(context())
        assert "scaled_dot_product_attention" in called.__code__.co_names
    assert "scaled_dot_product_attention" not in called.__code__.co_names
    assert "scaled_dot_product_attention" not in annotated_attention.__code__.co_names


def test_the_fused_optimizer_takes_gradscalers_overflow_check_as_its_constructor_would(
    seed, monkeypatch
):
    """Built with fused=True, Adam tells GradScaler to hand it the scale and the overflow flags,
    so the scaler reads nothing on the host; the fix must do the same, or the trial keeps the
    read the user's edit removes."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")

    def step(x):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    report = doctor.examine(step, torch.randn(8, 16), steps=1, warmup=1)
    reads = []
    read_on_host = torch.amp.GradScaler._maybe_opt_step  # the path that reads the flags
    monkeypatch.setattr(torch.amp.GradScaler, "_maybe_opt_step",
                        lambda *a, **k: reads.append(1) or read_on_host(*a, **k))  # fmt: skip
    with report.isolated():
        fixed = trial.fixed_step(report, ["fused_optimizer"])
        for _ in range(2):
            fixed()
    assert reads == []
    (row,) = report.try_fixes(["fused_optimizer"], steps=2, repeats=2).to_dict("records")
    assert row["status"] == "ok", row


def test_a_values_product_followed_by_another_attention_is_no_third_attention(seed):
    """Two attentions back to back, the second with as many keys as a head has dimensions: the
    first's values' product has the second's scores' shape, but it reads weights, not q."""
    model = AnnotatedHeads(second_keys=8)  # a head's dimension: 32 / 4
    keep = torch.ones(4, 1, 1, 16, dtype=torch.bool)
    step = plain_step(lambda x: model(x, keep), torch.optim.SGD(model.parameters(), lr=0.1))
    report = doctor.examine(step, torch.randn(4, 16, 32), steps=1, warmup=1)
    found = [f.detail for f in report.findings if f.kind == "attention"]
    assert sorted(d.seq_k for d in found) == [8, 16], found


class TwoAttentions(nn.Module):
    """One attention the rewrite reads, then one it cannot (a tanh of the scores)."""

    def __init__(self):
        super().__init__()
        self.nano, self.other = NanoAttention(), Unreadable()

    def forward(self, x):
        x = self.nano(x)
        return self.other(x, x, x)


def test_an_attention_the_rewrite_cannot_read_leaves_the_others_rewritten(seed):
    model = nn.Sequential(nn.Linear(32, 32), TwoAttentions(), nn.Linear(32, 32))
    step = plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    report = doctor.examine(step, torch.randn(4, 16, 32), steps=1, warmup=1)
    assert len([f for f in report.findings if f.kind == "attention"]) == 2
    (row,) = report.try_fixes(["sdpa_attention"], steps=2, repeats=2).to_dict("records")
    assert row["status"] == "ok", row
    assert "+        y = torch.nn.functional.scaled_dot_product_attention(" in row["edit"]
    assert "not rewritten" in row["edit"] and "tanh" in row["edit"]
    rewritten, left = sorted((f for f in report.findings if f.kind == "attention"),
                             key=lambda f: f.measured_us is None)  # fmt: skip
    assert rewritten.measured_us is not None and left.measured_us is None


class MethodCallsAttention(nn.Module):
    """Scores by a tensor's method on heads flattened into the batch, a mask of what to keep
    filled where it is not (``~keep``)."""

    def forward(self, q, k, v, keep):
        att = q.bmm(k.transpose(1, 2)) * q.size(-1) ** -0.5
        att = att.masked_fill(~keep, float("-inf"))
        att = att.softmax(dim=-1)
        return att.bmm(v)


def test_method_products_on_3d_heads_and_a_negated_mask_are_rewritten(seed):
    model, fixed, rewrite = rewritten(MethodCallsAttention, "q.bmm", "att.bmm")
    assert "~~" not in rewrite.diff and "attn_mask=keep" in rewrite.diff
    q, k, v = (torch.randn(6, 16, 8) for _ in range(3))
    keep = torch.rand(6, 16, 16) > 0.2
    keep[..., 0] = True  # every query keeps a key
    torch.testing.assert_close(fixed(q, k, v, keep), model(q, k, v, keep), rtol=1e-5, atol=1e-6)


def test_the_call_to_write_where_the_rewrite_cannot_read_names_only_what_the_step_had(seed):
    """No mask in the step: no attn_mask in the call to write; its dropout rate kept."""

    class UnreadableWithDropout(nn.Module):
        def forward(self, x):
            q, k, v = x, x * 2.0, x - 1.0
            att = torch.tanh(q @ k.transpose(-2, -1))
            att = F.dropout(att.softmax(-1), p=0.25, training=self.training)
            return att @ v

    model = nn.Sequential(nn.Linear(8, 8), UnreadableWithDropout())
    step = plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    report = doctor.examine(step, torch.randn(2, 3, 16, 8), steps=1, warmup=1)
    (finding,) = [f for f in report.findings if f.kind == "attention"]
    call = finding.change.splitlines()[0]
    # the scores were not scaled after the product (q may have been): SDPA's own 1/sqrt(E) off
    assert call == ("out = torch.nn.functional.scaled_dot_product_attention(q, k, v, "
                    "scale=1.0, dropout_p=0.25 if training else 0.0)")  # fmt: skip
    assert "not rewritten for you" in finding.change
    # the names are SDPA's, not the step's: the layout it takes is said (a UNet's keys, say,
    # come as (..., E, S) to a written-out bmm)
    assert "q, k, v shaped (..., L, E), (..., S, E), (..., S, Ev)" in finding.change


class MhaBlock(nn.Module):
    def __init__(self, width=32, heads=4, need_weights=True, use_weights=False, dropout=0.0):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True, dropout=dropout)
        self.need_weights, self.use_weights = need_weights, use_weights

    def forward(self, x):
        y, weights = self.attn(x, x, x, need_weights=self.need_weights)
        return y + weights.mean() if self.use_weights else y


def mha_step(**kwargs):
    model = nn.Sequential(MhaBlock(**kwargs), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return plain_step(model, opt), model


def test_multihead_attention_returning_its_weights_is_found_and_run_without_them(seed):
    step, _ = mha_step()
    report = doctor.examine(step, torch.randn(4, 16, 32), steps=1, warmup=1)
    (finding,) = [f for f in report.findings if f.kind == "attention"]
    assert "need_weights" in finding.title and finding.fixes == ("mha_without_weights",)
    assert finding.sites[0].text.strip().startswith("y, weights = self.attn(")
    (row,) = report.try_fixes(["mha_without_weights"], steps=2, repeats=2).to_dict("records")
    assert row["status"] == "ok" and row["error"] <= row["allowance"]
    assert "need_weights=False" in row["edit"]
    quiet = doctor.examine(mha_step(need_weights=False)[0], torch.randn(4, 16, 32), steps=1, warmup=1)
    assert not [f for f in quiet.findings if f.kind == "attention"]


class PaddedMha(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha, self.head = nn.MultiheadAttention(32, 4, batch_first=True), nn.Linear(32, 2)

    def forward(self, x):
        pad = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        out, _ = self.mha(x, x, x, key_padding_mask=pad)  # weights returned by default
        return self.head(out)


def test_multihead_attention_change_is_the_users_own_call_with_need_weights_false(seed):
    # a template call would name another attribute and drop the mask the user passes
    model = PaddedMha()
    step = plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    report = doctor.examine(step, torch.randn(4, 16, 32), steps=1, warmup=1)
    (finding,) = [f for f in report.findings if f.kind == "attention"]
    call = "out, _ = self.mha(x, x, x, key_padding_mask=pad, need_weights=False)"
    assert finding.change.startswith(call)
    (row,) = report.try_fixes(["mha_without_weights"], steps=1, repeats=1).to_dict("records")
    assert row["edit"].startswith(call)


def test_multihead_attention_without_weights_on_sdpas_math_path_is_not_found(seed):
    # need_weights=False (as nn.Transformer's layers call it) with dropout while training: SDPA
    # runs its own math path (a product, a softmax, a product), which is no written-out attention
    step, _ = mha_step(need_weights=False, dropout=0.1)
    report = doctor.examine(step, torch.randn(4, 16, 32), steps=1, warmup=1)
    assert not [f for f in report.findings if f.kind == "attention"]


def test_multihead_attention_whose_weights_are_used_fails_its_trial_and_says_so(seed):
    step, _ = mha_step(use_weights=True)
    report = doctor.examine(step, torch.randn(4, 16, 32), steps=1, warmup=1)
    (row,) = report.try_fixes(["mha_without_weights"], steps=1, repeats=1).to_dict("records")
    assert row["status"].startswith("failed")
    line = inspect.getsourcelines(MhaBlock.forward)[1] + 2  # where the weights are read
    assert f"test_doctor_fixes.py:{line}): AttributeError" in row["status"]  # the user's line


def test_sdpa_fix_without_an_attention_finding_is_not_applicable(seed):
    step, _ = gpt_step()
    parts = doctor.parts.find_parts(step)
    step_copy, parts_copy = copy_step(step, parts)
    with pytest.raises(FixNotApplicable, match="no written-out attention"):
        FIXES["sdpa_attention"].apply(StepCopy(step_copy, parts_copy, None, torch.device("cpu")))


class TiedHead(nn.Module):
    """A language model's tied embedding and head over a vocabulary of 101 (not a multiple of
    64)."""

    def __init__(self, vocab: int = 101, width: int = 16, bias: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=bias)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(tokens)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tokens.view(-1))


def odd_shape_finding(d: int, p: int):
    return SimpleNamespace(kind="odd_shape", detail=(d, p), change=f"vocab_size = {p}")


@pytest.mark.parametrize("bias", [False, True])
def test_padded_products_give_the_same_loss_and_updates_as_the_odd_width(seed, bias):
    """The head run at the padded width and sliced: the same loss, gradients and steps (to
    float32 rounding) on fresh random tokens, the tied weight kept at its own shape."""
    model = TiedHead(bias=bias)
    if bias:
        nn.init.normal_(model.head.bias)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]

    def step(tokens):
        opt.zero_grad()
        loss = model(tokens)
        loss.backward()
        opt.step()
        return loss.detach()

    parts = doctor.parts.find_parts(step)
    copies = [copy_step(step, parts) for _ in range(2)]
    padded = StepCopy(*copies[1], None, torch.device("cpu"), findings=[odd_shape_finding(101, 128)])
    FIXES["padded_products"].apply(padded)
    assert padded.edits == ["vocab_size = 128"]
    for _ in range(3):
        tokens = torch.randint(101, (4, 12))
        plain, fixed = copies[0][0](tokens), padded.step(tokens)
        torch.testing.assert_close(fixed, plain, rtol=1e-5, atol=1e-6)
    for a, b in zip(copies[1][1].models[0].parameters(), copies[0][1].models[0].parameters(),
                    strict=True):  # fmt: skip
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    head = copies[1][1].models[0].head
    assert head.weight is copies[1][1].models[0].embed.weight  # still tied
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert model.head.forward.__func__ is nn.Linear.forward  # the user's head: not padded


def test_padded_products_without_an_odd_linear_is_not_applicable(seed):
    model = nn.Linear(8, 64)
    step = lambda x: model(x).sum().backward()  # noqa: E731
    step_copy, parts_copy = copy_step(step, doctor.parts.find_parts(step))
    copy = StepCopy(step_copy, parts_copy, None, torch.device("cpu"),
                    findings=[odd_shape_finding(101, 128)])  # fmt: skip
    with pytest.raises(FixNotApplicable, match=r"no nn\.Linear with 101 outputs"):
        FIXES["padded_products"].apply(copy)


@pytest.mark.parametrize("how", ["wrapped", "in place"])
def test_compile_of_a_model_already_compiled_is_not_applicable(seed, how):
    """A trial of it would time the same compiled step twice and call the noise a gain."""
    model = nn.Linear(8, 4)
    compiled = torch.compile(model) if how == "wrapped" else model
    if how == "in place":
        model.compile()
    step = lambda x: compiled(x).sum().backward()  # noqa: E731
    step_copy, parts_copy = copy_step(step, doctor.parts.find_parts(step))
    copy = StepCopy(step_copy, parts_copy, None, torch.device("cpu"))
    with pytest.raises(FixNotApplicable, match="already compiled"):
        FIXES["compile"].apply(copy)


def test_deferred_reads_leave_host_tensors_alone_and_restore_item():
    original = torch.Tensor.item
    with deferred_item_reads():
        assert torch.tensor(2.5).item() == 2.5 and isinstance(torch.tensor(2.5).item(), float)
    assert torch.Tensor.item is original


@pytest.mark.gpu
def test_deferred_read_of_a_cuda_tensor_is_the_number_it_stands_for(seed):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the read deferred is a device-to-host copy")
    value = torch.randn((), device="cuda")
    with deferred_item_reads():
        read = value.item()
    expected = value.cpu().item()
    assert float(read) == expected and f"{read:.4f}" == f"{expected:.4f}"
    assert read + 1 == expected + 1 and 2 * read == 2 * expected and (read < expected + 1)
    assert sum([read, read]) == 2 * expected


# ---- how try_fixes judges --------------------------------------------------------------------
def noisy_step():
    """A step whose result moves by about 1e-4 from run to run (as cuDNN's backward does): a
    clock, which no copy can share."""
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        # hashing the clock spreads consecutive readings over the whole range
        wobble = 1 + 1e-4 * (1 + hash((time.perf_counter_ns(),)) % 1000 / 1000)
        loss = model(x).square().mean() * wobble
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def test_the_unchanged_steps_own_spread_is_measured(seed):
    report = doctor.examine(noisy_step(), torch.randn(16, 8), steps=1, warmup=1)
    # two clock readings can land close (a run in tens): the widest of three runs stands out
    widest = max(max(trial.own_spread(report, steps=2)) for _ in range(3))
    assert widest > FIXES["set_to_none"].rtol


def test_a_fix_that_only_rounds_differently_passes_where_the_step_amplifies_rounding(seed):
    """A Linear's bias before a BatchNorm has no true gradient: Adam scales the rounding noise
    it gets into updates of the learning rate's size, so the fused optimizer's other order of
    the same arithmetic moves that bias by about the learning rate, on a CPU that computes the
    same every time."""
    blocks = (nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU()) for _ in range(3))
    model = nn.Sequential(*blocks, nn.Linear(32, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(batch):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    report = doctor.examine(step, batch, steps=1, warmup=1)
    (row,) = report.try_fixes(["fused_optimizer"], steps=3, repeats=2).to_dict("records")
    assert row["error"] > FIXES["fused_optimizer"].rtol  # what the allowance must cover
    assert row["status"] == "ok"


def test_the_trials_show_the_allowance_a_fix_was_judged_by(seed, monkeypatch, tmp_path):
    # the step's own spread widens the allowance past the fix's tolerance: the page must show the
    # number the status was judged by, not the narrower tolerance beside an "ok"
    from accel.doctor.page import rounded, trials_text

    monkeypatch.setattr(trial, "own_spread", lambda report, steps: Errors(1e-2, 1e-2))
    report = doctor.examine(noisy_step(), torch.randn(16, 8), steps=1, warmup=1)
    (row,) = report.try_fixes(["set_to_none"], steps=2, repeats=2).to_dict("records")
    assert row["allowance"] == 4e-2 > row["tolerance"]
    assert f"(allowed {rounded(4e-2)})" in trials_text(report)
    assert f"({rounded(4e-2)})</td>" in report.to_html(tmp_path / "r.html").read_text()


def test_a_step_drawing_from_random_and_numpy_runs_the_same_twice(seed):
    # a crop drawn with Python's and NumPy's global generators, as data augmentation does: the
    # unchanged step from the same start must be the same both times (but for the rounding step
    # one run's parameters are moved by), or its "spread" would widen every fix's allowance
    import random

    import numpy as np

    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        x = x[: random.randint(2, 16)] * float(np.random.uniform(0.5, 1.5))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    report = doctor.examine(step, torch.randn(16, 8), steps=1, warmup=1)
    assert max(trial.own_spread(report, steps=3)) < 1e-6


def test_a_fix_is_allowed_a_multiple_of_the_unchanged_steps_own_spread(seed, monkeypatch):
    # the spread as the noisy step shows it at its smallest, so that the fix's own wobble fits
    monkeypatch.setattr(trial, "own_spread", lambda report, steps: Errors(1e-4, 1e-4))
    report = doctor.examine(noisy_step(), torch.randn(16, 8), steps=1, warmup=1)
    (row,) = report.try_fixes(["set_to_none"], steps=2, repeats=2).to_dict("records")
    assert row["allowance"] > FIXES["set_to_none"].rtol and "spread" in row["allowed by"]
    assert row["status"] == "ok"


def fake_rows(speedups: dict[str, float]) -> list[dict]:
    return [
        {"fixes": n, "mode": "alone", "status": "ok", "measured speedup": s,
         "measured ms": 10.0 / s, "unchanged ms": 10.0, "best set": False}
        for n, s in speedups.items()
    ]  # fmt: skip


def test_the_best_set_is_never_below_the_best_fix_alone(monkeypatch):
    """Together slower than bf16 alone: the least helpful fix is dropped, and where no
    combination wins, bf16 alone is the best set."""
    tried = []

    def together(report, names, steps, repeats, spread, predicted_us=None):
        tried.append(list(names))
        return {"fixes": "+".join(names), "mode": "together", "status": "ok",
                "measured speedup": 2.5, "measured ms": 4.0, "unchanged ms": 10.0,
                "best set": False}  # fmt: skip

    monkeypatch.setattr(trial, "_trial", together)
    monkeypatch.setattr(trial, "combined_prediction_us", lambda *a: 1.0)
    monkeypatch.setattr(trial, "_predicted_us", lambda *a, **_: 0.0)  # only a sync retried
    rows = fake_rows({"bf16_autocast": 2.8, "tf32": 2.6, "pinned_batch": 1.1})
    combined = trial._together(step_of(100.0), rows, 1, 1, 0.0)
    assert tried == [["bf16_autocast", "tf32", "pinned_batch"], ["bf16_autocast", "tf32"],
                     ["bf16_autocast", "pinned_batch"]]  # fmt: skip
    best = [r for r in rows + combined if r["best set"]]
    assert [r["fixes"] for r in best] == ["bf16_autocast"]


def test_what_each_combined_trial_compiled_is_tidied_before_the_next(monkeypatch):
    events = []

    def together(report, names, *args, **kwargs):
        events.append("+".join(names))
        return {"fixes": "+".join(names), "mode": "together", "status": "ok",
                "measured speedup": 2.5, "measured ms": 4.0, "unchanged ms": 10.0,
                "best set": False}  # fmt: skip

    monkeypatch.setattr(trial, "_trial", together)
    monkeypatch.setattr(trial, "combined_prediction_us", lambda *a: 1.0)
    monkeypatch.setattr(trial, "_predicted_us", lambda *a, **_: 0.0)
    rows = fake_rows({"bf16_autocast": 2.8, "tf32": 2.6, "pinned_batch": 1.1})
    trial._together(step_of(100.0), rows, 1, 1, 0.0, lambda: events.append("tidy"))
    assert len(events) >= 4 and events[1::2] == ["tidy"] * (len(events) // 2), events


def test_fixes_that_exclude_each_other_are_not_combined(monkeypatch):
    monkeypatch.setattr(trial, "combined_prediction_us", lambda *a: 1.0)
    tried = []

    def together(report, names, *args, **kwargs):
        tried.append(list(names))
        return {"fixes": "+".join(names), "mode": "together", "status": "ok",
                "measured speedup": 9.0, "measured ms": 10 / 9, "unchanged ms": 10.0,
                "best set": False}  # fmt: skip

    monkeypatch.setattr(trial, "_trial", together)
    monkeypatch.setattr(trial, "_predicted_us", lambda *a, **_: 50.0)  # cuda_graph predicted to pay
    rows = fake_rows({"compile": 3.0, "cuda_graph": 2.0, "fused_optimizer": 1.5})
    trial._together(step_of(100.0), rows, 1, 1, 0.0)
    assert tried == [["compile", "fused_optimizer"]]
    tried.clear()  # two cures of one clipping loop: the better one alone
    rows = fake_rows({"batched_clip": 1.4, "compile": 1.2, "foreach_clip": 1.1})
    trial._together(step_of(100.0), rows, 1, 1, 0.0)
    assert tried == [["batched_clip", "compile"]]


def test_a_fix_the_host_holds_back_is_retried_on_what_its_kernels_save():
    """bf16 on a step the host holds back: replayed, it saves nothing now; its kernels would
    save 30% once the host is freed, so the best set is tried with it."""
    from accel.doctor.findings import Finding

    held = Finding("precision", "t", "e", "m", "07_recipe", "c", saved_us=0.0, kernels_us=30.0,
                   fixes=("bf16_autocast",))  # fmt: skip
    report = SimpleNamespace(evidence=SimpleNamespace(step_us=100.0), findings=[held])
    rows = fake_rows({"batched_clip": 2.0, "bf16_autocast": 0.97})
    best = rows[0]  # the batched clip alone: the step as it was
    assert trial._left_out(report, rows, best) == ["bf16_autocast"]
    # the set that frees the host is predicted with bf16's kernels' saving; bf16 alone without
    assert trial._predicted_us(report, ["batched_clip", "bf16_autocast"]) == 30.0
    assert trial._predicted_us(report, ["bf16_autocast"]) == 0.0
    held.kernels_us = 1.0  # under 3% of the step even unbound: not retried
    assert trial._left_out(report, rows, best) == []
    # ... unless the best set leaves a step so short that it is 3% of it
    assert trial._left_out(report, rows, best | {"measured ms": 0.3}) == ["bf16_autocast"]


def test_compile_alone_is_predicted_as_the_host_keeps_it_and_in_full_beside_a_fix_freeing_it():
    """compile launches its kernels from Python: beside it the host holding the device back
    stays, so its fusion's saving is the replayed one; beside a fix that frees the host (fewer
    launches), the kernels'."""
    from accel.doctor.findings import Finding

    fused = Finding("fusion", "t", "e", "m", "02_fusion", "c", saved_us=5.0, kernels_us=40.0,
                    fixes=("compile",))  # fmt: skip
    report = SimpleNamespace(evidence=SimpleNamespace(step_us=100.0), findings=[fused])
    assert trial._predicted_us(report, ["compile"]) == 5.0
    assert trial._predicted_us(report, ["compile", "fused_optimizer"]) == 40.0
    assert "compile" not in trial.FREES_HOST and "compile_graphs" in trial.FREES_HOST


def recording_trial(tried: list, speedup: Callable[[list[str]], float]):
    """A stand-in for ``trial._trial``: each set tried (its names, its prediction) appended to
    ``tried``, measured at ``speedup(names)``."""

    def together(report, names, steps, repeats, spread, predicted_us=None):
        tried.append((list(names), predicted_us))
        measured = speedup(names)
        return {"fixes": "+".join(names), "mode": "together", "status": "ok",
                "measured speedup": measured, "measured ms": 10 / measured, "unchanged ms": 10.0,
                "best set": False}  # fmt: skip

    return together


def step_of(step_us: float, device: str = "cpu"):
    return SimpleNamespace(evidence=SimpleNamespace(step_us=step_us, device=torch.device(device)))


@pytest.mark.parametrize(("graphed_speedup", "best"), [(4.0, "graphed"), (2.5, "compiled")])
def test_compile_in_the_best_set_is_tried_with_cuda_graphs_on_a_gpu(
    monkeypatch, graphed_speedup, best
):
    """The best set has shortened the device's work, so launching the compiled kernels may now
    hold the step back: the set is tried with compile's CUDA-graph rung, kept only if faster,
    and predicted by the combined sets' model."""
    tried = []
    graphed = recording_trial(tried, lambda names: graphed_speedup if "compile_graphs" in names else 3.0)
    monkeypatch.setattr(trial, "_trial", graphed)
    monkeypatch.setattr(trial, "combined_prediction_us", lambda *a: 1.0)
    monkeypatch.setattr(trial, "_predicted_us", lambda *a, **_: 0.0)
    rows = fake_rows({"bf16_autocast": 2.0, "compile": 1.5})
    combined = trial._together(step_of(100.0, "cuda"), rows, 1, 1, 0.0)
    assert [names for names, _ in tried] == [["bf16_autocast", "compile"],
                                             ["bf16_autocast", "compile_graphs"]]  # fmt: skip
    assert tried[1][1] == 1.0  # predicted as every other combined set is
    chosen = [r["fixes"] for r in rows + combined if r["best set"]]
    kept = "compile_graphs" if best == "graphed" else "compile"
    assert chosen == [f"bf16_autocast+{kept}"]
    tried.clear()  # on a CPU there are no CUDA graphs to try
    trial._together(step_of(100.0), fake_rows({"bf16_autocast": 2.0, "compile": 1.5}), 1, 1, 0.0)
    assert [names for names, _ in tried] == [["bf16_autocast", "compile"]]


def test_compile_slower_alone_still_has_its_cuda_graph_rung_tried_on_the_best_set(monkeypatch):
    """A host-bound step: compile alone was slower (its launches stayed), so it joined no set;
    its CUDA-graph rung takes the launches off the host, so it is tried on the best set anyway."""
    tried = []
    speedups = {"bf16_autocast+pinned_batch": 1.4, "bf16_autocast+pinned_batch+compile_graphs": 3.5}
    monkeypatch.setattr(trial, "_trial", recording_trial(tried, lambda n: speedups.get("+".join(n), 1.0)))
    monkeypatch.setattr(trial, "combined_prediction_us", lambda *a: 1.0)
    monkeypatch.setattr(trial, "_predicted_us", lambda *a, **_: 0.0)
    rows = fake_rows({"bf16_autocast": 1.3, "pinned_batch": 1.2, "compile": 0.93})
    rows[2]["status"] = "slower here"
    combined = trial._together(step_of(100.0, "cuda"), rows, 1, 1, 0.0)
    assert ["bf16_autocast", "pinned_batch", "compile_graphs"] in [names for names, _ in tried]
    chosen = [r["fixes"] for r in rows + combined if r["best set"]]
    assert chosen == ["bf16_autocast+pinned_batch+compile_graphs"]


def test_compile_no_finding_named_is_added_last_to_the_doctors_own_best_set_on_a_gpu(monkeypatch):
    """float32 products can hide the memory-bound kernels compile fuses, so no finding names it;
    an expert compiles last all the same. With the doctor's own choice of fixes, the best set is
    tried with compile's CUDA-graph rung on a GPU, kept only if faster; a user's list stays."""
    tried = []
    speedups = {"bf16_autocast+tf32": 3.0, "bf16_autocast+tf32+compile_graphs": 4.5}
    monkeypatch.setattr(trial, "_trial", recording_trial(tried, lambda n: speedups.get("+".join(n), 1.0)))
    monkeypatch.setattr(trial, "_predicted_us", lambda *a, **_: 0.0)
    monkeypatch.setattr(trial, "combined_prediction_us", lambda *a: 1.0)
    rows = fake_rows({"bf16_autocast": 2.8, "tf32": 2.5})
    combined = trial._together(step_of(100.0, "cuda"), rows, 1, 1, 0.0, compile_last=True)
    assert [names for names, _ in tried] == [["bf16_autocast", "tf32"],
                                             ["bf16_autocast", "tf32", "compile_graphs"]]  # fmt: skip
    assert [r["fixes"] for r in rows + combined if r["best set"]] == [
        "bf16_autocast+tf32+compile_graphs"
    ]
    for device, last in (("cuda", False), ("cpu", True)):  # a user's list; no CUDA graphs
        tried.clear()
        trial._together(step_of(100.0, device), fake_rows({"bf16_autocast": 2.8, "tf32": 2.5}),
                        1, 1, 0.0, compile_last=last)  # fmt: skip
        assert [names for names, _ in tried] == [["bf16_autocast", "tf32"]]


def test_a_replayed_set_whose_compile_never_ran_alone_is_predicted_from_its_kernels_left():
    """compile's rung added where compile never ran alone: no fusion counted, the replay's
    kernels' time left."""
    from accel.doctor.check_host import GRAPH_REPLAY_OVER_KERNELS

    report = timeline_report({"matmul": 40.0, "elementwise and other": 20.0}, {"host": 40.0})
    rows = fake_rows({"bf16_autocast": 100 / 80})
    graphed = trial.combined_prediction_us(report, rows, ["bf16_autocast", "compile_graphs"])
    assert graphed == pytest.approx((40 - 20 + 20) * GRAPH_REPLAY_OVER_KERNELS)


@pytest.mark.parametrize(("with_bf16", "kept"), [(5.0, True), (3.5, False)])
def test_device_fixes_left_out_are_retried_once_the_set_is_replayed_as_a_cuda_graph(
    monkeypatch, with_bf16, kept
):
    """bf16 and TF32 were slower alone on a step the host held back, and predicted nothing
    there; a replay leaves the step to its kernels, so each is tried on the graphed set, and
    kept only if faster."""
    sets = []
    speedups = {"compile+pinned_batch": 3.0, "compile_graphs+pinned_batch": 4.0,
                "compile_graphs+pinned_batch+bf16_autocast": with_bf16}  # fmt: skip
    monkeypatch.setattr(trial, "_trial", recording_trial(sets, lambda n: speedups.get("+".join(n), 3.8)))
    monkeypatch.setattr(trial, "combined_prediction_us", lambda *a: 1.0)
    monkeypatch.setattr(trial, "_predicted_us", lambda *a, **_: 0.0)
    rows = fake_rows({"compile": 1.3, "pinned_batch": 1.2, "bf16_autocast": 0.94, "tf32": 0.97})
    rows[2]["status"] = "slower here"
    combined = trial._together(step_of(100.0, "cuda"), rows, 1, 1, 0.0)
    tried = ["+".join(names) for names, _ in sets]
    graphed = "compile_graphs+pinned_batch"
    first = f"{graphed}+bf16_autocast"
    assert tried[-3:] == [graphed, first, f"{first if kept else graphed}+tf32"]
    chosen = [r["fixes"] for r in rows + combined if r["best set"]]
    assert chosen == [first if kept else graphed]
    sets.clear()  # without the rung taken, nothing more is tried
    speedups["compile_graphs+pinned_batch"] = 2.0
    trial._together(step_of(100.0, "cuda"), rows, 1, 1, 0.0)
    assert "+".join(sets[-1][0]) == graphed


@pytest.mark.parametrize(("retried_speedup", "best"), [(3.0, "retried"), (2.0, "combined")])
def test_a_predicted_fix_that_lost_alone_is_retried_on_the_best_set(
    monkeypatch, retried_speedup, best
):
    """bf16 measured slower alone on a step the host held back; once the batched clip frees
    the host it may pay: the best set is tried with it, and kept only if faster."""
    tried = []

    def together(report, names, *args, **kwargs):
        tried.append(list(names))
        speedup = retried_speedup if "bf16_autocast" in names else 2.4
        return {"fixes": "+".join(names), "mode": "together", "status": "ok",
                "measured speedup": speedup, "measured ms": 10 / speedup, "unchanged ms": 10.0,
                "best set": False}  # fmt: skip

    monkeypatch.setattr(trial, "_trial", together)
    monkeypatch.setattr(trial, "combined_prediction_us", lambda *a: 1.0)
    predicted = {"bf16_autocast": 30.0, "pinned_batch": 1.0}  # pinned: under 3% of the step
    monkeypatch.setattr(trial, "_predicted_us", lambda report, names, **_: predicted[names[0]])
    rows = fake_rows({"batched_clip": 2.0, "compile": 1.3, "bf16_autocast": 0.8, "pinned_batch": 0.9})
    rows[2]["status"] = "slower here"
    combined = trial._together(step_of(100.0), rows, 1, 1, 0.0)
    kept = ["batched_clip", "compile"] + (["bf16_autocast"] if best == "retried" else [])
    # one at a time, most predicted first; the pinned batch removes a sync: retried too
    assert tried == [["batched_clip", "compile"], ["batched_clip", "compile", "bf16_autocast"],
                     [*kept, "pinned_batch"]]  # fmt: skip
    chosen = [r["fixes"] for r in rows + combined if r["best set"]]
    assert chosen == ["+".join(kept)]


def test_a_sync_removed_is_retried_on_the_best_set_whatever_it_was_predicted_to_save():
    """A read per step costs what the device has queued when it waits: little on a step the
    host holds back, the device's backlog once the best set frees the host."""
    from accel.doctor.findings import Finding

    read = Finding("sync", "t", "e", "m", "01_sync", "c", saved_us=0.5, fixes=("deferred_reads",))
    report = SimpleNamespace(evidence=SimpleNamespace(step_us=100.0), findings=[read])
    rows = fake_rows({"batched_clip": 2.0, "deferred_reads": 0.95, "fused_optimizer": 0.99})
    rows[1]["status"] = "slower here"
    assert trial._left_out(report, rows, rows[0]) == ["deferred_reads"]
    rows[1]["status"] = "changes results beyond the allowance"
    assert trial._left_out(report, rows, rows[0]) == []


def timeline_report(by_category: dict[str, float], idle: dict[str, float]):
    step_us = sum(by_category.values()) + sum(idle.values())
    t = SimpleNamespace(by_category=by_category, idle_us=idle, step_us=step_us)
    return SimpleNamespace(evidence=SimpleNamespace(timeline=t), findings=[])


def test_combined_prediction_adds_fixes_on_separate_time_and_overlaps_shared_time():
    report = timeline_report({"matmul": 60.0, "elementwise and other": 20.0}, {"sync": 20.0})
    rows = fake_rows({"tf32": 100 / 70, "deferred_reads": 100 / 85, "bf16_autocast": 100 / 60})
    # separate parts: 30 saved on the products and 15 on the sync's idle add up
    assert trial.combined_prediction_us(report, rows, ["tf32", "deferred_reads"]) == pytest.approx(
        55
    )
    # under autocast the products run in bf16, where TF32 has no say: the better one alone
    both = trial.combined_prediction_us(report, rows, ["tf32", "bf16_autocast"])
    assert both == pytest.approx(100 - 40)
    # with another fix beside them: bf16's 40 and the sync's 15, on separate time
    three = trial.combined_prediction_us(report, rows, ["deferred_reads", "tf32", "bf16_autocast"])
    assert three == pytest.approx(100 - 40 - 15)


def test_a_precision_fix_saves_on_the_products_first_and_the_rest_on_the_other_kernels():
    """bf16 makes the products several times faster and the elementwise work little: its saving
    comes off the products first, so a fix of the elementwise work beside it keeps its own."""
    report = timeline_report({"matmul": 150.0, "elementwise and other": 30.0}, {"host": 20.0})
    rows = fake_rows({"bf16_autocast": 200 / 70, "compile": 200 / 180})
    # bf16: 130 of the products' 150; compile: 20 over the elementwise 30 and the host's 20
    together = trial.combined_prediction_us(report, rows, ["bf16_autocast", "compile"])
    assert together == pytest.approx(20 + (30 + 20) * (1 - 20 / 50))
    # a saving larger than the products' room spills over the other kernels it acts on
    rows = fake_rows({"bf16_autocast": 200 / 40})
    left = 150 * (1 - trial._MAX_SHARE)
    spill = (160 - 150 * trial._MAX_SHARE) / 30
    assert trial.combined_prediction_us(report, rows, ["bf16_autocast"]) == pytest.approx(
        left + 30 * (1 - spill) + 20
    )


def test_a_set_with_cuda_graphs_is_predicted_at_its_kernels_left_as_a_replay_runs_them():
    """A replay launches no kernel from the host: what the set leaves of the step is its kernels'
    time, with the gaps a replay keeps between them; the host's and the launches' idle goes."""
    from accel.doctor.check_host import GRAPH_REPLAY_OVER_KERNELS

    report = timeline_report({"matmul": 40.0, "elementwise and other": 20.0}, {"host": 40.0})
    rows = fake_rows({"compile": 100 / 80, "bf16_autocast": 100 / 80})
    plain = trial.combined_prediction_us(report, rows, ["bf16_autocast", "compile"])
    graphed = trial.combined_prediction_us(report, rows, ["bf16_autocast", "compile_graphs"])
    # compile's 20 spread over the elementwise 20 and the host's 40; bf16's 20 off the products
    kernels_left = (40 - 20) + 20 * (1 - 20 / 60)
    assert graphed == pytest.approx(kernels_left * GRAPH_REPLAY_OVER_KERNELS)
    assert graphed < plain
    # a replay is never predicted slower than the same set without it
    busy = timeline_report({"matmul": 95.0, "elementwise and other": 5.0}, {"host": 0.5})
    assert trial.combined_prediction_us(busy, rows, ["compile_graphs"]) == pytest.approx(
        trial.combined_prediction_us(busy, rows, ["compile"])
    )


def test_a_device_fix_the_host_held_back_counts_its_kernels_saving_beside_a_fix_that_frees_it():
    """A host-bound step: TF32 measured nothing alone (the device waited for the host), its
    kernels would save 30; beside the batched clip, which frees the host, it is counted."""
    from accel.doctor.findings import Finding

    report = timeline_report({"matmul": 40.0, "elementwise and other": 10.0}, {"host": 50.0})
    report.findings = [Finding("precision", "t", "e", "m", "07_recipe", "c", saved_us=0.0,
                               kernels_us=30.0, fixes=("tf32",))]  # fmt: skip
    rows = fake_rows({"tf32": 1.0, "batched_clip": 100 / 60})
    # the clip acts on the host's idle time and elementwise work: 40 of them saved
    assert trial.combined_prediction_us(report, rows, ["batched_clip", "tf32"]) == pytest.approx(
        100 - 40 - 30
    )
    # alone, TF32 is held back: what it measured is what counts
    assert trial.combined_prediction_us(report, rows, ["tf32"]) == pytest.approx(100)


def test_the_report_ends_with_how_far_the_fixes_took_the_step(seed):
    step, _ = gpt_step()
    report = doctor.examine(step, torch.randn(4, 16, 32), steps=1, warmup=1)
    assert "try_fixes()" in report.reached()
    trials = report.try_fixes(["sdpa_attention"], steps=2, repeats=2)
    said = report.reached()
    if trials["best set"].any():
        assert "reached" in said and "attention rewritten as SDPA" in said
    else:
        assert "no fix made the step faster" in said
    assert said in html.unescape(report.html(plotlyjs=False))


def test_per_tensor_clipping_batched_equals_the_loop_and_returns_each_norm(seed):
    from accel.doctor.batched_clip import batched_clipping

    def grads():
        gen = torch.Generator().manual_seed(seed)
        params = [nn.Parameter(torch.zeros(s)) for s in [(3, 4), (7,), (2, 2, 2), (1,)]]
        for p, scale in zip(params, [10.0, 0.01, 3.0, 100.0], strict=True):
            p.grad = scale * torch.randn(p.shape, generator=gen)
        params[1].grad[0] = math.inf  # a non-finite gradient: as the loop has it
        return params

    looped, batched = grads(), grads()
    expected = [torch.nn.utils.clip_grad_norm_([p], 1.0) for p in looped]
    with batched_clipping():
        returned = [torch.nn.utils.clip_grad_norm_([p], 1.0) for p in batched]
        assert torch.equal(batched[0].grad, grads()[0].grad)  # not yet: before the next step
    for a, b in zip(looped, batched, strict=True):
        torch.testing.assert_close(b.grad, a.grad, equal_nan=True)
    torch.testing.assert_close(torch.stack(returned), torch.stack(expected), equal_nan=True)
    assert torch.nn.utils.clip_grad._get_total_norm.__module__ == "torch.nn.utils.clip_grad"


def test_a_batched_clips_norm_read_at_once_is_its_norm(seed):
    """A loop that logs each clip's norm as it goes (``clip_grad_norm_([p], c).item()``): the
    read runs the clips recorded so far, so the numbers and the gradients are the loop's."""
    from accel.doctor.batched_clip import batched_clipping

    gen = torch.Generator().manual_seed(seed)
    grads = [s * torch.randn(n, generator=gen) for n, s in ((4, 10.0), (9, 0.1), (3, 5.0))]
    looped, batched = ([nn.Parameter(torch.empty(g.shape)) for g in grads] for _ in range(2))
    for a, b, g in zip(looped, batched, grads, strict=True):
        a.grad, b.grad = g.clone(), g.clone()
    expected = [torch.nn.utils.clip_grad_norm_([p], 1.0).item() for p in looped]
    expected_squares = sum(torch.nn.utils.clip_grad_norm_([p], 1.0) ** 2 for p in looped)
    with batched_clipping():
        logged = [torch.nn.utils.clip_grad_norm_([p], 1.0).item() for p in batched]
        squares = sum(torch.nn.utils.clip_grad_norm_([p], 1.0) ** 2 for p in batched)
    assert logged == pytest.approx(expected, rel=1e-6)
    assert type(squares) is torch.Tensor
    torch.testing.assert_close(squares, expected_squares)
    for a, b in zip(looped, batched, strict=True):
        torch.testing.assert_close(b.grad, a.grad)


def test_batched_clips_with_a_limit_each_equal_the_loop(seed):
    from accel.doctor.batched_clip import batched_clipping

    gen = torch.Generator().manual_seed(seed)
    grads = [s * torch.randn(n, generator=gen) for n, s in ((4, 10.0), (9, 0.1), (3, 5.0))]
    limits = (1.0, 0.5, 2.0)
    looped = [nn.Parameter(torch.empty(g.shape)) for g in grads]
    batched = [nn.Parameter(torch.empty(g.shape)) for g in grads]
    for a, b, g in zip(looped, batched, grads, strict=True):
        a.grad, b.grad = g.clone(), g.clone()
    for p, limit in zip(looped, limits, strict=True):
        torch.nn.utils.clip_grad_norm_([p], limit)
    with batched_clipping():
        for p, limit in zip(batched, limits, strict=True):
            torch.nn.utils.clip_grad_norm_([p], limit)
    for a, b in zip(looped, batched, strict=True):
        torch.testing.assert_close(b.grad, a.grad)


def test_batched_clips_run_before_the_optimizer_steps(seed):
    from accel.doctor.batched_clip import batched_clipping

    p = nn.Parameter(torch.randn(5))
    p.grad = 50 * torch.randn(5)
    opt = torch.optim.SGD([p], lr=1.0)
    reference = p.detach() - p.grad * (1.0 / (p.grad.norm() + 1e-6))
    with batched_clipping():
        torch.nn.utils.clip_grad_norm_([p], 1.0)
        opt.step()
    torch.testing.assert_close(p.detach(), reference)


@requires_cuda
@pytest.mark.parametrize("max_norms", [(1.0, 1.0, 1.0), (1.0, 0.5, 2.0)])
def test_batched_clips_make_no_host_device_sync(seed, max_norms):
    """The loop never waited for the device; its batched form must not either (a limit copied
    in with a blocking copy would make every step wait)."""
    from accel.doctor.batched_clip import batched_clipping
    from accel.sync import recording_syncs

    params = [nn.Parameter(torch.randn(n, device="cuda")) for n in (5, 300, 7)]
    for p in params:
        p.grad = 10 * torch.randn_like(p)
    with recording_syncs() as syncs, batched_clipping():
        for p, limit in zip(params, max_norms, strict=True):
            torch.nn.utils.clip_grad_norm_([p], limit)
    assert syncs == []


def test_backend_flags_are_put_back_after_an_error():
    from accel.doctor.products import backend_flags

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark)
    with pytest.raises(RuntimeError), backend_flags(tf32=not before[0], cudnn_benchmark=True):
        assert torch.backends.cuda.matmul.allow_tf32 is (not before[0])
        assert torch.backends.cudnn.allow_tf32 is (not before[0]) and torch.backends.cudnn.benchmark
        raise RuntimeError("the step failed")
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark) == before


@pytest.mark.gpu
@requires_cuda
def test_the_pinned_batch_trial_copies_the_batch_in_every_call():
    # as the advised change does: a step that changes its batch in place sees the host's values
    # again on the next call, not its own last change
    x = torch.rand(64, 8)

    def step(batch):
        batch = batch.to("cuda")
        total = batch.sum()
        batch.add_(1.0)
        return total

    step_copy, parts_copy = copy_step(step, doctor.parts.find_parts(step))
    fixed = StepCopy(step_copy, parts_copy, x, torch.device("cuda"))
    FIXES["pinned_batch"].apply(fixed)
    call = fixed.build()
    first, second = call().item(), call().item()
    assert second == pytest.approx(first, rel=1e-6)
    assert second == pytest.approx(x.sum().item(), rel=1e-5)


def test_an_optimizer_fix_retunes_the_optimizers_that_have_it_beside_one_that_has_not():
    """SparseAdam for sparse embeddings beside Adam(foreach=False) for the rest: the dense
    optimizer's loop is the finding, and its fixes run on it, SparseAdam left as it is."""
    torch.manual_seed(0)
    table = nn.Embedding(50, 8, sparse=True)
    layers = nn.Sequential(*(nn.Linear(8 + 2 * i, 10 + 2 * i) for i in range(5)))
    sparse_opt = torch.optim.SparseAdam(table.parameters(), lr=1e-2)
    dense_opt = torch.optim.Adam(layers.parameters(), lr=1e-3, foreach=False)

    def step(ids):
        loss = layers(table(ids)).square().mean()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        return loss.detach()

    report = doctor.examine(step, torch.randint(0, 50, (16,)), steps=1, warmup=1)
    assert "optimizer_loop" in report.kinds()
    rows = report.try_fixes(["fused_optimizer", "foreach_optimizer"], steps=2, repeats=2)
    alone = rows[rows["mode"] == "alone"].set_index("fixes")["status"]
    assert alone.to_dict() == {"fused_optimizer": "ok", "foreach_optimizer": "ok"}


def test_a_fix_named_twice_is_tried_once():
    """A list built by hand (or added to) can repeat a name: each fix is one row, one trial."""
    assert trial.fix_names(["set_to_none", "tf32", "set_to_none"]) == ["set_to_none", "tf32"]


def test_compile_reaches_the_layers_of_a_module_list_the_step_iterates(seed):
    """A ModuleList has no forward of its own: the step calls its layers, so those are what
    the compile fix compiles (a compiled ModuleList.forward is never called)."""
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3))
    head = nn.Linear(4, 1)
    opt = torch.optim.SGD([*blocks.parameters(), *head.parameters()], lr=0.1)

    def step(x):
        for block in blocks:
            x = block(x)
        loss = head(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step_copy, parts_copy = copy_step(step, doctor.parts.find_parts(step))
    FIXES["compile"].apply(StepCopy(step_copy, parts_copy, None, torch.device("cpu")))
    (layers,) = [m for m in parts_copy.models if isinstance(m, nn.ModuleList)]
    assert all(hasattr(block.forward, "_torchdynamo_orig_callable") for block in layers)
    (linear,) = [m for m in parts_copy.models if isinstance(m, nn.Linear)]
    assert hasattr(linear.forward, "_torchdynamo_orig_callable")


def test_a_fix_slower_in_every_round_is_slower_here_with_too_few_rounds_for_an_interval(
    seed, monkeypatch
):
    """Five rounds (the CPU's default) give no 95% interval of the median ratio; a fix slower
    in each of them is still slower (the chance of that for an even fix is 1 in 32)."""

    def sleepy(copy: StepCopy) -> None:
        step = copy.step
        copy.step = lambda *args: (time.sleep(0.005), step(*args))[1]

    monkeypatch.setitem(FIXES, "set_to_none", FIXES["set_to_none"].__class__(
        "set_to_none", "a fix that only waits", sleepy, 1e-6, "the same step", needs_cuda=False))
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    report = doctor.examine(step, torch.randn(4, 8), steps=2, warmup=1)
    rows = report.try_fixes(["set_to_none"], repeats=trial.EVERY_ROUND, steps=1)
    (row,) = rows[rows["fixes"] == "set_to_none"].to_dict("records")
    assert row["measured speedup"] < 1 and row["status"] == "slower here", row


def test_try_fixes_with_no_fix_to_try_runs_no_step(seed):
    """Nothing to try: the step is not run again (a generator it draws from is not drawn)."""
    model = nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    drawn = []

    def batches():
        while True:
            drawn.append(1)
            yield torch.randn(4, 6)

    stream = batches()

    def step():
        loss = model(next(stream)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    report = doctor.examine(step, steps=1, warmup=1)
    assert report.fixes() == []
    before = len(drawn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trials = report.try_fixes()
    assert trials.empty and len(drawn) == before
    assert report.reached() == "nothing was found, so no fix was tried"


def test_compile_of_a_model_with_dropout_is_judged_on_the_same_masks(seed):
    """Dropout in training draws its masks: compiled, they are drawn as the unchanged step draws
    them, so the trial's error is rounding, not two different masks."""
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 1))
    step = plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    report = doctor.examine(step, torch.randn(8, 16), steps=1, warmup=1)
    (row,) = report.try_fixes(["compile"], steps=2, repeats=2).to_dict("records")
    assert row["error"] <= row["allowance"] and "changes results" not in row["status"], row


class _TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.layer(x))


def test_compiled_copies_keep_their_compiled_code_off_the_users_class(seed):
    """Dynamo keeps compiled code on the function's code object: copies compiled from the user's
    class would pile every trial's variant (autocast, TF32, a padded head) into one cache, past
    its limit (a later copy then runs uncompiled), and leave it behind in the user's class."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = _TinyNet()
    step = plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    forwards = []
    for autocast in (False, True):
        step_copy, parts_copy = copy_step(step, doctor.parts.find_parts(step))
        FIXES["compile"].apply(StepCopy(step_copy, parts_copy, None, torch.device("cpu")))
        with torch.autocast("cpu", enabled=autocast):
            step_copy(torch.randn(3, 4))
        (net,) = [m for m in parts_copy.models if isinstance(m, _TinyNet)]
        forwards.append(net.forward)
    assert _debug_get_cache_entry_list(_TinyNet.forward.__code__) == []
    codes = [f._torchdynamo_orig_callable.__code__ for f in forwards]
    assert codes[0] is not codes[1]
    assert all(len(_debug_get_cache_entry_list(code)) == 1 for code in codes)


def test_a_named_fix_with_nothing_to_change_says_so(seed):
    """foreach clipping named for a step that never clips: not "ok" at 1.00x, but what is missing."""
    model = nn.Linear(8, 8)
    report = doctor.examine(plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                            torch.randn(16, 8), steps=1, warmup=1)  # fmt: skip
    (row,) = report.try_fixes(["foreach_clip"], steps=1, repeats=1).to_dict("records")
    assert row["status"].startswith("not applicable") and "clip_grad_norm_" in row["status"], row


def test_foreach_clipping_is_tried_where_the_step_clips(seed):
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, foreach=False)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    report = doctor.examine(step, torch.randn(16, 8), steps=1, warmup=1)
    (row,) = report.try_fixes(["foreach_clip"], steps=2, repeats=2).to_dict("records")
    assert row["status"] in ("ok", "slower here"), row


def test_a_pinned_batch_needs_a_tensor_on_the_host():
    model = nn.Linear(8, 8)
    step = plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in ({"steps": 3}, None):
        copy_ = StepCopy(step, doctor.parts.find_parts(step), batch, torch.device("cpu"))
        with pytest.raises(FixNotApplicable, match="no tensor of the batch"):
            FIXES["pinned_batch"].apply(copy_)


def _break_in_a_helper(x):
    torch._dynamo.graph_break()  # as a user's NaN guard (a data-dependent branch) would
    return x


class _BreakingNet(nn.Module):
    def __init__(self, where="forward"):
        super().__init__()
        self.first, self.second, self.where = nn.Linear(4, 4), nn.Linear(4, 4), where

    def forward(self, x):
        x = torch.relu(self.first(x))
        if self.where == "forward":
            torch._dynamo.graph_break()  # as a print or a data-dependent branch would
        elif self.where == "helper":
            x = _break_in_a_helper(x)
        else:
            x = self.guard(x)
        return self.second(x)

    def guard(self, x):
        torch._dynamo.graph_break()
        return x


@pytest.mark.parametrize("where", ["forward", "helper", "method"])
@pytest.mark.parametrize("nested", [False, True])
def test_compiling_the_copies_adds_no_name_to_the_users_module(seed, nested, where):
    """Dynamo keeps a graph break's resume functions and compiled graphs as globals of the code
    it compiled, or that broke inside a call (a layer of torch's Sequential, a function or method
    of the user's the forward calls): the copies run with the module's names copied, not the
    module's own, when examine looks for graph breaks and when compile is tried."""
    torch._dynamo.reset()
    names = set(globals())
    model = _BreakingNet(where)
    model = nn.Sequential(model, nn.Linear(4, 4)) if nested else model
    report = doctor.examine(plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                            torch.randn(3, 4), steps=1, warmup=1, compile=True)  # fmt: skip
    assert set(globals()) == names, set(globals()) - names
    (row,) = report.try_fixes(["compile"], steps=1, repeats=1).to_dict("records")
    assert row["status"] in ("ok", "slower here"), row
    assert set(globals()) == names, set(globals()) - names


class InPlaceAttention(nn.Module):
    """The scores changed in place (``+=``, ``/=``, ``masked_fill_``), which the rewrite does not
    read: the finding's call to write must still carry the bias, the scale and the causal mask."""

    def __init__(self, how, width=32, heads=4, length=16):
        super().__init__()
        self.qkv, self.heads, self.how = nn.Linear(width, 3 * width), heads, how
        self.bias = nn.Parameter(torch.randn(heads, length, length))
        self.register_buffer("future", torch.ones(length, length).tril() == 0)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        att = q @ k.transpose(-2, -1)
        if self.how == "bias":
            att += self.bias
        elif self.how == "scale":
            att /= 4.0
        else:
            att.masked_fill_(self.future, float("-inf"))
        att = att.softmax(dim=-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C)


@pytest.mark.parametrize(("how", "said", "unsaid"), [
    ("bias", "attn_mask=", None), ("scale", "scale=0.25", None), ("causal", "is_causal=True", None)])
def test_the_call_to_write_keeps_what_the_scores_went_through_in_place(seed, how, said, unsaid):
    model = nn.Sequential(nn.Linear(32, 32), InPlaceAttention(how), nn.Linear(32, 32))
    report = doctor.examine(plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                            torch.randn(4, 16, 32), steps=1, warmup=1)  # fmt: skip
    (finding,) = [f for f in report.findings if f.kind == "attention"]
    assert said is None or said in finding.change, finding.change
    assert unsaid is None or unsaid not in finding.change, finding.change


class BiasAfterScores(nn.Module):
    """T5's first layer: its relative-position bias, many small operators, computed between the
    scores' product and the softmax."""

    def __init__(self, width=32, heads=4, length=16):
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads
        self.table = nn.Embedding(32, heads)
        self.length = length

    def position_bias(self):
        relative = torch.arange(self.length)[None, :] - torch.arange(self.length)[:, None]
        buckets = relative.abs()
        for _ in range(3):  # T5's bucketing: logs, divisions, mins and wheres
            buckets = torch.where(buckets > 8, (buckets.float().log() * 4).long() + 8, buckets)
        return self.table(buckets.clamp(max=31)).permute(2, 0, 1)[None]

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        scores = q @ k.transpose(-2, -1)
        scores = scores + self.position_bias()
        weights = scores.softmax(dim=-1)
        return (weights @ v).transpose(1, 2).reshape(B, T, C)


def test_attention_whose_bias_is_made_between_scores_and_softmax_is_found(seed):
    model = nn.Sequential(nn.Linear(32, 32), BiasAfterScores(), nn.Linear(32, 32))
    report = doctor.examine(plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                            torch.randn(4, 16, 32), steps=1, warmup=1)  # fmt: skip
    assert [f for f in report.findings if f.kind == "attention"], report.findings


def test_an_edit_with_an_attention_left_as_written_ends_as_a_file_does(seed, tmp_path):
    """One attention rewritten, one left as written (its scores changed in place): the edit is
    the diff, then why the other was left, and ends with a newline, so that patch reads it whole."""
    model = nn.Sequential(NanoAttention(), InPlaceAttention("bias"), nn.Linear(32, 32))
    report = doctor.examine(plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                            torch.randn(4, 16, 32), steps=1, warmup=1)  # fmt: skip
    (row,) = report.try_fixes(["sdpa_attention"], steps=1, repeats=1).to_dict("records")
    assert "# not rewritten" in row["edit"] and row["edit"].endswith("\n"), row["edit"]
    pasted = tmp_path / "pasted.py"
    pasted.write_text(Path(__file__).read_text())
    applied = subprocess.run(["patch", "--fuzz=0", str(pasted)], input=row["edit"], text=True,
                             capture_output=True)  # fmt: skip
    assert applied.returncode == 0 and "unexpectedly" not in applied.stdout, applied.stdout
