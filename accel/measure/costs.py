"""What one kernel launch and one host-device sync cost on this machine, and the speedup that
removing some of them predicts: the cost model of the launch-bound phases (sync, fusion, graphs).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch

from accel.measure.timer import compare


@dataclass(frozen=True)
class CostModel:
    """Per-event costs measured on one device, in microseconds.

    ``launch_us``: host time per tiny kernel launched back to back (the queue never drains);
    ``sync_us``: what a host read adds on top of its kernel's launch (on CUDA: a copy, the wait
    for the queue to drain and the restart; on a CPU only ``.item()``'s own overhead).
    """

    launch_us: float
    sync_us: float
    device: str

    def saved_ms(self, syncs_removed: float, launches_removed: float) -> float:
        return (syncs_removed * self.sync_us + launches_removed * self.launch_us) / 1e3

    def predict_speedup(
        self, baseline_ms: float, syncs_removed: float, launches_removed: float
    ) -> float:
        """Speedup if each removed sync and launch saves exactly its measured cost."""
        left = baseline_ms - self.saved_ms(syncs_removed, launches_removed)
        return baseline_ms / left if left > 0 else math.inf


def measure_costs(device: torch.device | str, *, calls: int = 200, repeats: int = 15) -> CostModel:
    """Time ``calls`` tiny in-place adds, with and without an ``.item()`` after each."""
    x = torch.ones((), device=device)

    def launches() -> None:
        for _ in range(calls):
            x.add_(1.0)

    def launches_and_syncs() -> None:
        for _ in range(calls):
            x.add_(1.0)
            x.item()  # sync: the cost being measured

    timing = compare(
        {"launch": launches, "sync": launches_and_syncs}, warmup=2, repeats=repeats, device=device
    )
    launch_us = timing.timings["launch"].median_ms * 1e3 / calls
    sync_us = timing.timings["sync"].median_ms * 1e3 / calls - launch_us
    return CostModel(launch_us, max(sync_us, 0.0), str(torch.device(device)))


def launch_queue_depth(device: torch.device | str, *, most: int = 4096) -> int:
    """How many kernel launches the device's queue holds before the next launch waits for room:
    tiny launches timed one by one behind a kernel that keeps the device busy (a fifth of a
    second), twice. 0 where none waited within ``most`` launches, and on a CPU."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch.cuda, "_sleep"):
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _queue_depth(torch.device("cuda", index), most)


@functools.cache
def _queue_depth(device: torch.device, most: int) -> int:
    x = torch.ones((), device=device)
    khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 2_000_000
    cycles = int(0.2 * khz * 1e3)
    depths = []
    with torch.cuda.device(device):
        for _ in range(2):  # a launch slowed by something else only finds a shallower queue
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            depths.append(_launches_before_a_wait(lambda: x.add_(1.0), most))
            torch.cuda.synchronize()
    return max(depths)


def _launches_before_a_wait(launch, most: int, waited_s: float = 1e-3) -> int:
    """Launches made before one took ``waited_s`` (0: none did within ``most``)."""
    for made in range(most):
        start = time.perf_counter()
        launch()
        if time.perf_counter() - start > waited_s:
            return made
    return 0

