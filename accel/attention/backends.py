"""SDPA's kernels forced one at a time, why one cannot run (in PyTorch's words), and the kernel
PyTorch's own pick runs (:func:`picked_kernel`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "AUTO_IS_GONE",
    "FORCED",
    "BackendUnavailableError",
    "picked_kernel",
    "run_forced",
    "try_once",
]

# The kernels SDPA can be forced to; "default" is PyTorch's own pick.
FORCED: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
# What a caller of backend="auto" is told: PyTorch's pick is the default, measuring is the lab's.
AUTO_IS_GONE = (
    "backend='auto' is gone: the default, backend='default', is PyTorch's own pick (with a mask "
    "kind, FlexAttention); to compare SDPA's kernels at your shape, call "
    "accel.lab.sdpa_backends(q, k, v) and force the fastest by name where it wins by more than "
    "the spread it reports"
)
# SDPBackend values as torch._fused_sdp_choice returns them
_KERNEL_NAMES = {int(b): name for name, b in FORCED.items()}


class BackendUnavailableError(RuntimeError):
    """A forced SDPA backend cannot run these inputs; ``reason`` says why (from PyTorch)."""

    def __init__(self, backend: str, reason: str):
        self.backend, self.reason = backend, reason
        super().__init__(f"SDPA backend {backend!r} cannot run these inputs: {reason}")


def picked_kernel(q, k, v, mask=None, causal=False, scale=None) -> str:
    """The kernel PyTorch's own pick runs on these inputs ("" if not one of :data:`FORCED`)."""
    choice = torch._fused_sdp_choice(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return _KERNEL_NAMES.get(int(choice), "")


def _lean_switches():
    """(backend, getter, setter) of each SDPA enable flag; None if this torch lacks them."""
    try:
        from torch.nn.attention import _backend_names

        return tuple(
            (
                getattr(SDPBackend, attr),
                getattr(torch._C, f"_get_{name}_sdp_enabled"),
                getattr(torch._C, f"_set_sdp_use_{name}"),
            )
            for name, attr in _backend_names.items()
        )
    except (ImportError, AttributeError):
        return None


_SWITCHES = _lean_switches()
if _SWITCHES is not None:
    _GETTERS = tuple(get for _, get, _ in _SWITCHES)
    _SETTERS = tuple(set_ for _, _, set_ in _SWITCHES)
    # per forced backend: each switch's state while it runs alone
    _ALONE = {name: tuple(b == sdp for b, _, _ in _SWITCHES) for name, sdp in FORCED.items()}


def run_forced(backend: str, q, k, v, mask, causal, scale) -> torch.Tensor:
    """SDPA with only ``backend`` enabled: ``sdpa_kernel([backend])`` with the switches set
    directly (no context manager's Python cost per call); while tracing, ``sdpa_kernel``."""
    if _SWITCHES is None or torch.compiler.is_compiling():
        with sdpa_kernel([FORCED[backend]]):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale
            )
    saved = [get() for get in _GETTERS]
    for set_, on in zip(_SETTERS, _ALONE[backend], strict=True):
        set_(on)
    try:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale
        )
    finally:
        for set_, was in zip(_SETTERS, saved, strict=True):
            set_(was)


# TORCH_WARN headers before each backend's reasons when no forced kernel can run (CUDA)
_REASON_HEADERS = {
    "flash attention": "flash",
    "memory efficient attention": "efficient",
    "cudnn attention": "cudnn",
}


def _documented_limits(backend: str, q: torch.Tensor, mask: torch.Tensor | None) -> list[str]:
    """Input limits of the fused CUDA kernels, from PyTorch's documentation: the reason to give
    when PyTorch's own warnings are not there (it may have shown them once already)."""
    limits = []
    if backend in ("flash", "cudnn") and q.dtype not in (torch.float16, torch.bfloat16):
        limits.append(f"{backend} takes float16 or bfloat16 inputs, got dtype {q.dtype}")
    if backend == "flash" and mask is not None:
        limits.append("flash takes no explicit attention mask (causal only)")
    if backend in ("flash", "efficient") and (q.shape[-1] > 256 or q.shape[-1] % 8):
        limits.append(f"head dimension must be a multiple of 8 up to 256, got {q.shape[-1]}")
    return limits


def _reason(
    backend: str, q: torch.Tensor, mask: torch.Tensor | None, error: Exception, messages: list[str]
) -> str:
    """PyTorch's own reasons for ``backend``, picked out of the warnings it emits."""
    mine, current = [], None
    for message in messages:
        lowered = message.strip().lower()
        if lowered.endswith("kernel not used because:"):
            header = lowered.removesuffix("kernel not used because:").strip()
            current = _REASON_HEADERS.get(header, header)
        elif current == backend:
            mine.append(message.strip())
    if mine:
        return "; ".join(mine)
    if q.device.type == "cpu" and backend in ("efficient", "cudnn"):
        return f"PyTorch has no {backend} attention kernel for CPU tensors (CUDA only)"
    said = str(error).strip() or type(error).__name__
    known = _documented_limits(backend, q, mask) if q.device.type == "cuda" else []
    return f"{said} ({'; '.join(known)})" if known else said


def try_once(
    backend: str, call: Callable[[], object], q: torch.Tensor, mask: torch.Tensor | None
) -> tuple[object, str]:
    """(result, "") of ``call`` (``backend`` forced) run once, or (None, why it could not run);
    other warnings are passed on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = call()
        except RuntimeError as error:
            return None, _reason(backend, q, mask, error, [str(w.message) for w in caught])
    for w in caught:  # it ran: pass on any unrelated warning
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out, ""
