"""Named attention masks: each gives every query one contiguous range of keys ``[lo, hi)``
(:meth:`~AttentionMask.bounds`), from which the block mask and the dense mask are built, and the
same rule as the ``mask_mod`` FlexAttention evaluates on tiles only partly kept. Causal masks are
top-left aligned when ``Sq != Sk``, as SDPA's ``is_causal``.

    mask = SlidingWindow(1024)            # each query sees itself and the 1023 keys before it
    out = attention.sdpa(q, k, v, mask=mask)   # compiled FlexAttention on the block mask
    keep = dense_mask(mask, q, k)         # (1, 1, Sq, Sk) bool, True = attend
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from accel.errors import checked_count

__all__ = [
    "ALiBi", "AttentionMask", "Causal", "Document", "PrefixLM", "SlidingWindow", "dense_mask"
]  # fmt: skip

MaskMod = Callable[..., torch.Tensor]  # (b, h, q_idx, kv_idx) -> bool
ScoreMod = Callable[..., torch.Tensor]  # (score, b, h, q_idx, kv_idx) -> score


class AttentionMask:
    """A mask kind: per query a range of keys ``[lo, hi)`` and the same rule as a ``mask_mod``.

    ``cache_key`` decides the block mask: the kind and its sizes (equal masks are one key), or
    the object and its data tensor's version where the mask is made from one. ``rows`` is the batch size of a mask that
    differs per batch row (None: one mask for every row)."""

    is_causal: ClassVar[bool] = False  # exactly SDPA's is_causal: plain SDPA can run it

    def bounds(self, seq_q: int, seq_k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(lo, hi), each (rows or 1, Sq) int32: query i sees keys lo[i] <= j < hi[i]."""
        raise NotImplementedError

    def mask_mod(self, seq_q: int, seq_k: int, device: torch.device) -> MaskMod:
        raise NotImplementedError

    def score_mod(self, heads: int) -> ScoreMod | None:
        """A change to each kept score, or None."""
        return None

    def score_bias(self, heads, seq_q, seq_k, device, dtype) -> torch.Tensor | None:
        """``score_mod`` as an additive (1, heads, Sq, Sk) bias for the dense path, or None."""
        return None

    @property
    def rows(self) -> int | None:
        return None

    def data(self) -> torch.Tensor | None:
        """The tensor the mask is made from, if any (its device must be q's)."""
        return None

    @property
    def cache_key(self) -> Hashable:
        data = self.data()  # a mask made from data is rebuilt when the data changes in place
        return self if data is None else (self, data._version)

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Raise a ValueError naming the problem unless this mask fits q (B, H, Sq, D), k."""
        data = self.data()
        if data is not None and data.device != q.device:
            raise ValueError(
                f"{type(self).__name__}'s tensor is on {data.device}, q on {q.device}: move it "
                f"once (e.g. .to({str(q.device)!r}, non_blocking=True)); a copy in every call "
                "would wait for the device"
            )
        if self.rows not in (None, 1, q.shape[0]):
            raise ValueError(
                f"{type(self).__name__} holds {self.rows} batch rows, q has batch {q.shape[0]}"
            )


def _positions(seq: int, device: torch.device) -> torch.Tensor:
    return torch.arange(seq, dtype=torch.int32, device=device)


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def keep_all(b, h, q_idx, kv_idx):
    return q_idx >= 0


@dataclass(frozen=True)
class Causal(AttentionMask):
    """Query i sees keys 0..i."""

    is_causal: ClassVar[bool] = True

    def bounds(self, seq_q, seq_k, device):
        q = _positions(seq_q, device)
        return torch.zeros_like(q)[None], (q + 1).clamp(max=seq_k)[None]

    def mask_mod(self, seq_q, seq_k, device):
        return causal_mask


@dataclass(frozen=True)
class SlidingWindow(AttentionMask):
    """Query i sees the ``window`` keys ending at itself: i - window < j <= i."""

    window: int

    def __post_init__(self):
        # a NumPy integer is taken as the int it is (the mask's key and the kernels want an int)
        window = checked_count(self.window, "window (keys seen)", at_least=1)
        object.__setattr__(self, "window", window)

    def bounds(self, seq_q, seq_k, device):
        q = _positions(seq_q, device)
        return (q - self.window + 1).clamp(min=0)[None], (q + 1).clamp(max=seq_k)[None]

    def mask_mod(self, seq_q, seq_k, device):
        window = self.window

        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        return sliding_window


def _int_tensor(value, name: str, dims: tuple[int, ...]) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
    if value.dim() not in dims or value.numel() == 0:
        raise ValueError(
            f"{name} must be a non-empty tensor of {' or '.join(map(str, dims))} dimensions, "
            f"got shape {tuple(value.shape)}"
        )
    # checked where it costs no host read; on a GPU a check would be a sync per mask
    if value.device.type == "cpu" and bool((value < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {int(value.min())}")


@dataclass(frozen=True, eq=False)
class Document(AttentionMask):
    """Sequences packed one after another in each row: a query sees keys of its own document
    only (and, with ``causal``, none after itself).

    ``lengths``: (n,) for every row alike, or (batch, n) per row, integers >= 0 on q's device
    (negative ones, or a sum past the sequence, are refused on a CPU; on a GPU the check would
    read them on the host). Tokens after the last document form one more, so a row may end in
    padding. Built on the device without a host read: a new ``Document`` per batch costs a few
    small kernels, not a sync. Needs Sq == Sk."""

    lengths: torch.Tensor
    causal: bool = True
    _ranges: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        _int_tensor(self.lengths, "lengths", (1, 2))
        if not isinstance(self.causal, bool):
            raise TypeError(
                f"causal must be True or False, got {self.causal!r} ({type(self.causal).__name__})"
            )

    @property
    def rows(self):
        return self.lengths.shape[0] if self.lengths.dim() == 2 else None

    def data(self):
        return self.lengths

    def check(self, q, k):
        super().check(q, k)
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"Document needs as many queries as keys (self-attention over packed "
                f"sequences), got Sq={q.shape[2]}, Sk={k.shape[2]}"
            )
        self._check_fits(q.shape[2])

    def _check_fits(self, seq: int) -> None:
        """A ValueError unless every row's documents fit in ``seq`` positions (else the last
        would be cut without a word); lengths on a GPU are not read (a sync)."""
        if self.lengths.device.type != "cpu" or torch.compiler.is_compiling():
            return
        totals = self.lengths.reshape(-1, self.lengths.shape[-1]).sum(-1)
        over = (totals > seq).nonzero()
        if len(over):
            row = int(over[0, 0])
            raise ValueError(
                f"Document lengths sum to {int(totals[row])} in batch row {row}, past the {seq} "
                f"positions of the sequence: expected a sum <= {seq} (positions after the last "
                "document form one more)"
            )

    def _spans(self, seq: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(document id, first key, end key) of every position, each (rows or 1, seq) int32."""
        key = (seq, device, self.lengths._version)
        if key not in self._ranges:
            lengths = self.lengths.reshape(-1, self.lengths.shape[-1]).to(device, torch.int32)
            ends = lengths.cumsum(-1, dtype=torch.int32)  # (R, n)
            self._check_fits(seq)
            pos = _positions(seq, device).expand(ends.shape[0], seq).contiguous()
            doc = torch.searchsorted(ends, pos, right=True, out_int32=True)  # (R, S) in [0, n]
            starts = torch.cat([ends - lengths, ends[:, -1:]], -1)  # the trailing padding last
            stops = torch.cat([ends, torch.full_like(ends[:, :1], seq)], -1).clamp(max=seq)
            self._ranges.clear()  # one length at a time: a new object per batch is the use
            self._ranges[key] = (doc, starts.gather(-1, doc), stops.gather(-1, doc))
        return self._ranges[key]

    def bounds(self, seq_q, seq_k, device):
        _, first, stop = self._spans(seq_q, device)
        return first, ((_positions(seq_q, device) + 1)[None] if self.causal else stop)

    def mask_mod(self, seq_q, seq_k, device):
        doc, causal = self._spans(seq_q, device)[0], self.causal
        if doc.shape[0] == 1:  # one layout for every row: b is not an index into it
            ids = doc[0]

            def document(b, h, q_idx, kv_idx):
                same = ids[q_idx] == ids[kv_idx]
                return same & (q_idx >= kv_idx) if causal else same

            return document

        def document_per_row(b, h, q_idx, kv_idx):
            same = doc[b, q_idx] == doc[b, kv_idx]
            return same & (q_idx >= kv_idx) if causal else same

        return document_per_row


@dataclass(frozen=True, eq=False)
class PrefixLM(AttentionMask):
    """The first ``prefix`` keys are seen by every query (bidirectional prefix), the rest
    causally. ``prefix``: an int, or a (batch,) integer tensor on q's device, one per row."""

    prefix: int | torch.Tensor

    def __post_init__(self):
        if isinstance(self.prefix, torch.Tensor):
            _int_tensor(self.prefix, "prefix", (1,))
        else:
            object.__setattr__(self, "prefix", checked_count(self.prefix, "prefix", at_least=0))

    @property
    def rows(self):
        return self.prefix.shape[0] if isinstance(self.prefix, torch.Tensor) else None

    def data(self):
        return self.prefix if isinstance(self.prefix, torch.Tensor) else None

    @property
    def cache_key(self):  # an int prefix is a size: equal masks share one key
        return ("PrefixLM", self.prefix) if isinstance(self.prefix, int) else super().cache_key

    def _prefix(self, device) -> torch.Tensor | int:
        if isinstance(self.prefix, torch.Tensor):
            return self.prefix.to(device, torch.int32)[:, None]  # (R, 1)
        return self.prefix

    def bounds(self, seq_q, seq_k, device):
        q = _positions(seq_q, device)[None]
        hi = torch.maximum(q + 1, torch.as_tensor(self._prefix(device), device=device))
        hi = hi.clamp(max=seq_k).to(torch.int32)
        return torch.zeros_like(hi), hi

    def mask_mod(self, seq_q, seq_k, device):
        prefix = self._prefix(device)
        if isinstance(prefix, int):

            def prefix_lm(b, h, q_idx, kv_idx):
                return (kv_idx < prefix) | (q_idx >= kv_idx)

            return prefix_lm
        per_row = prefix[:, 0]
        if per_row.shape[0] == 1:  # one prefix for every row: b is not an index into it

            def prefix_lm_shared(b, h, q_idx, kv_idx):
                return (kv_idx < per_row[0]) | (q_idx >= kv_idx)

            return prefix_lm_shared

        def prefix_lm_per_row(b, h, q_idx, kv_idx):
            return (kv_idx < per_row[b]) | (q_idx >= kv_idx)

        return prefix_lm_per_row


@dataclass(frozen=True)
class ALiBi(AttentionMask):
    """Attention with linear biases: each kept score minus ``slope[h] * |i - j|`` (slopes
    2^(-8 (h + 1) / heads)), over the keys ``mask`` keeps (``Causal()`` by default, as ALiBi
    was made for; None: every key)."""

    mask: AttentionMask | None = Causal()
    _mods: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.mask is not None and not isinstance(self.mask, AttentionMask):
            raise TypeError(f"ALiBi's mask must be a mask kind or None, got {self.mask!r}")
        if isinstance(self.mask, ALiBi):
            raise ValueError("ALiBi over ALiBi adds the bias twice; pass the inner mask only")

    @property
    def rows(self):
        return None if self.mask is None else self.mask.rows

    def data(self):
        return None if self.mask is None else self.mask.data()

    @property
    def cache_key(self):
        return ("ALiBi", None if self.mask is None else self.mask.cache_key)

    def check(self, q, k):
        if self.mask is not None:
            self.mask.check(q, k)

    def bounds(self, seq_q, seq_k, device):
        if self.mask is not None:
            return self.mask.bounds(seq_q, seq_k, device)
        q = _positions(seq_q, device)[None]
        return torch.zeros_like(q), torch.full_like(q, seq_k)

    def mask_mod(self, seq_q, seq_k, device):
        return keep_all if self.mask is None else self.mask.mask_mod(seq_q, seq_k, device)

    def score_mod(self, heads):
        if heads not in self._mods:  # one function per head count: compiled code keyed on it

            def alibi(score, b, h, q_idx, kv_idx):
                slope = torch.exp2(-8.0 * (h + 1) / heads)
                return score - slope * (q_idx - kv_idx).abs()

            self._mods[heads] = alibi
        return self._mods[heads]

    def score_bias(self, heads, seq_q, seq_k, device, dtype):
        work = torch.promote_types(dtype, torch.float32)
        slopes = torch.exp2(-8.0 * (torch.arange(heads, device=device, dtype=work) + 1) / heads)
        distance = (_positions(seq_q, device)[:, None] - _positions(seq_k, device)[None]).abs()
        return (-slopes[:, None, None] * distance.to(work))[None]


def dense_mask(mask: AttentionMask, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``mask`` as SDPA and the reference take it: bool (rows or 1, 1, Sq, Sk), True = attend;
    with a score modification, q's dtype (rows or 1, H, Sq, Sk): the bias where kept, -inf
    elsewhere. Memory grows as Sq x Sk: what the block mask avoids."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            got = type(t).__name__
            raise TypeError(f"dense_mask: {name} must be a tensor (B, H, S, D), got {got}")
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    lo, hi = mask.bounds(seq_q, seq_k, q.device)
    keys = _positions(seq_k, q.device)
    keep = ((keys >= lo[..., None]) & (keys < hi[..., None]))[:, None]  # (R, 1, Sq, Sk)
    bias = mask.score_bias(q.shape[1], seq_q, seq_k, q.device, q.dtype)
    if bias is None:
        return keep
    return bias.masked_fill(~keep, -math.inf).to(q.dtype)
