"""What one kernel launch and one host-device sync cost on this machine, and the speedup that
removing some of them predicts: the cost model of the launch-bound phases (sync, fusion, graphs).
"""

from __future__ import annotations

import math
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
