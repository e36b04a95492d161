"""Attention: the manual reference beside fused SDPA, named masks run by FlexAttention, and the
attention module's parts.

    from accel.attention import sdpa, SlidingWindow
    out = sdpa(q, k, v, causal=True)                   # PyTorch's pick, as F.sdpa calls it
    out = sdpa(q, k, v, mask=SlidingWindow(1024))      # torch.compile(flex_attention)
    ref = attention_reference(q, k, v, causal=True)    # the same numbers, S x S in memory

Measuring SDPA's kernels against each other at a shape is the lab's
(``accel.lab.sdpa_backends``). Importing this package costs torch only.
"""

from __future__ import annotations

from accel.attention.backends import FORCED, BackendUnavailableError, picked_kernel
from accel.attention.flex import (
    MASKED_BACKENDS,
    block_mask,
    clear_masked_cache,
    flex_unavailable,
    masked_reference,
    masked_sdpa,
)
from accel.attention.masks import (
    ALiBi,
    AttentionMask,
    Causal,
    Document,
    PrefixLM,
    SlidingWindow,
    dense_mask,
)
from accel.attention.module import (
    QKVProjection,
    RotaryEmbedding,
    SelfAttention,
    apply_rope,
    rope_cos_sin,
)
from accel.attention.reference import TOLERANCES, attention_reference, check_inputs
from accel.attention.sdpa import BACKENDS, Backend, sdpa, unavailable_reason

__all__ = [
    "BACKENDS", "FORCED", "MASKED_BACKENDS", "TOLERANCES", "ALiBi", "AttentionMask", "Backend",
    "BackendUnavailableError", "Causal", "Document", "PrefixLM", "QKVProjection", "RotaryEmbedding",
    "SelfAttention", "SlidingWindow", "apply_rope", "attention_reference", "block_mask",
    "check_inputs", "clear_masked_cache", "dense_mask", "flex_unavailable", "masked_reference",
    "masked_sdpa", "picked_kernel", "rope_cos_sin", "sdpa", "unavailable_reason"
]  # fmt: skip
