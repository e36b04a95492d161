"""When ``auto`` replaces PyTorch's SDPA pick by a forced kernel: the rules its measurement is
judged by (``accel.attention_auto`` measures).

PyTorch's pick is kept outright where comparing kernels cannot pay: calls too short to tell them
apart and calls whose host time is most of their time on the GPU (:func:`kept_without_comparing`).
Elsewhere a forced kernel must beat the pick both back to back and one call at a time, by more
than :data:`AUTO_MARGIN` or the pick's spread against itself (:func:`winner`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from accel.timer import Samples, interleaved

# A forced kernel replaces PyTorch's pick only when it is faster by more than this share (or the
# measured spread of the pick against itself, if wider) both back to back and called alone:
# forcing costs host time per call, and a coin-flip win is not worth it. So auto stays within
# this share of the fastest kernel where the measurement is steadier than it.
AUTO_MARGIN = 0.02
DEFAULT_AGAIN = "default again"
# Under this a call is mostly host time: a forced kernel's switching costs more than it could
# gain on the GPU, and single calls are too noisy to tell kernels apart.
SHORT_CALL_MS = 0.2
SHORT_CALL_NOTE = f"calls under {SHORT_CALL_MS} ms keep PyTorch's pick (host time dominates them)"
# A call whose host time is at least this share of its time on the GPU back to back keeps the
# GPU waiting on the host (a short forward and backward: autograd's host work outlasts the
# kernels): a faster kernel cannot shorten it and forcing one adds host time.
HOST_BOUND_SHARE = 0.75
HOST_BOUND_CHECK_MS = 1.0  # longer calls are not asked: an SDPA call's host part is far shorter
HOST_BOUND_CALLS = 5  # calls a sample, so the device clock sees the GPU wait between calls
HOST_BOUND_NOTE = (
    f"the host takes over {HOST_BOUND_SHARE:.0%} of a call's time on the GPU: PyTorch's pick "
    "kept (a faster kernel cannot shorten the call; forcing one adds host time)"
)


def kept_without_comparing(back_to_back: Samples, default_call, device: torch.device) -> str:
    """Why PyTorch's pick is kept before the kernels are compared one call at a time (its note),
    or "": on CUDA, calls too short to tell kernels apart and calls bound by the host."""
    if device.type != "cuda":
        return ""
    default_ms = back_to_back.medians()["default"]
    if default_ms < SHORT_CALL_MS:
        return SHORT_CALL_NOTE
    if default_ms < HOST_BOUND_CHECK_MS and host_share(default_call, device) >= HOST_BOUND_SHARE:
        return HOST_BOUND_NOTE
    return ""


def host_share(call: Callable[[], object], device: torch.device) -> float:
    """``call``'s host time per call over its time per call on ``device`` back to back, both
    over :data:`HOST_BOUND_CALLS` calls a sample: near 1 where the GPU waits on the host."""

    def per_call(clock: str) -> float:
        samples = interleaved(
            {"call": call}, device, warmup=1, repeats=5, calls_per_sample=HOST_BOUND_CALLS,
            clock=clock,
        )  # fmt: skip
        return statistics.median(samples.times_ms["call"])

    return per_call("host") / per_call("device")


def winner(back_to_back: Samples, alone: Samples, margin: float) -> str:
    """The forced kernel that beats the default by the most, in the worse of the two views,
    if that is more than ``margin``; else ``"default"``."""
    best, best_gain = "default", 1.0 + margin
    for name in back_to_back.times_ms:
        if name in ("default", DEFAULT_AGAIN):
            continue
        gain = min(t.paired_ratio("default", name) for t in (back_to_back, alone))
        if gain > best_gain:
            best, best_gain = name, gain
    return best
