"""The machine's own limits, measured: memory copy bandwidth, dense matrix-product rate, and on
CUDA the rate of a copy in from pinned or pageable host memory.

Every later figure is also reported against these: a kernel that moves B bytes in t seconds ran at
(B / t) / copy_bandwidth of what this device can move; a step's floor time is the larger of
bytes / bandwidth and flops / matmul rate (the roofline).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch

from accel.measure.device import Preset, default_device, device_name, preset
from accel.measure.timer import time_fn


@dataclass(frozen=True)
class CeilingSizes:
    copy_bytes: int  # size of the source buffer; a copy reads it and writes as much again
    matmul_n: int  # square product n x n x n
    repeats: int


# GPU sizes are many times the H100/H200 L2 (50-60 MB) so that the copy measures HBM, not cache.
CEILING_SIZES: dict[str, CeilingSizes] = {
    "gpu": CeilingSizes(copy_bytes=1 << 30, matmul_n=8192, repeats=30),
    "cpu": CeilingSizes(copy_bytes=64 << 20, matmul_n=1024, repeats=7),
}


@dataclass(frozen=True)
class Ceilings:
    device: str
    copy_gb_s: float  # bytes read plus bytes written, per second, / 1e9
    matmul_tflop_s: float
    matmul_dtype: str
    copy_bytes: int
    matmul_n: int

    def floor_ms(self, flops: float = 0.0, bytes_moved: float = 0.0) -> float:
        """Roofline floor: no version of a kernel doing this much work runs much faster."""
        return max(bytes_moved / (self.copy_gb_s * 1e9), flops / (self.matmul_tflop_s * 1e12)) * 1e3

    def bandwidth_fraction(self, bytes_moved: float, ms: float) -> float:
        """Achieved bandwidth over the measured copy bandwidth."""
        return bytes_moved / (ms * 1e-3) / (self.copy_gb_s * 1e9)

    def compute_fraction(self, flops: float, ms: float) -> float:
        """Achieved rate over the measured matrix-product rate."""
        return flops / (ms * 1e-3) / (self.matmul_tflop_s * 1e12)

    def as_dict(self) -> dict:
        return asdict(self)


def matmul_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU (the tensor cores' training type), fp32 on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def measure_copy_gb_s(device: torch.device, nbytes: int, repeats: int) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    gen = torch.Generator(device).manual_seed(0)  # the process's own generators left as they were
    src = torch.rand(nbytes // 4, device=device, generator=gen)  # random, never zeros
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), label="copy", warmup=3, repeats=repeats, device=device)
    return 2 * src.numel() * src.element_size() / (t.median_ms * 1e-3) / 1e9


COPY_IN_PROBE_BYTES = 64 << 20  # a larger copy runs at the same rate, only for longer


def copy_in_probe_bytes(nbytes: int) -> int:
    """The size :func:`measure_copy_in_gb_s` copies for a copy of ``nbytes``: at most
    :data:`COPY_IN_PROBE_BYTES`."""
    return max(1, min(int(nbytes), COPY_IN_PROBE_BYTES))


PAGEABLE_SOURCES_BYTES = 256 << 20  # pageable sources cycled through, to leave the host's caches


def measure_copy_in_gb_s(
    device: torch.device | str, nbytes: int, pinned: bool = True, repeats: int = 5
) -> float:
    """Host-to-device rate (bytes copied per second / 1e9) of a copy of ``nbytes`` of random
    data from pinned (non-blocking) or pageable host memory: the median of ``repeats`` copies
    timed with CUDA events, outside any profiler. Pageable copies read the source through the
    host's caches, so they cycle through sources as a new batch each step would (a source read
    again while cached copies faster than a step's batch does). The buffers go back to torch's
    caching allocators (pinned host, device), as any freed tensor's do."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"a copy in from the host needs a CUDA device, got {str(device)!r}")
    count = 1 if pinned else min(8, max(2, PAGEABLE_SOURCES_BYTES // max(1, nbytes)))
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
               for _ in range(count)]  # fmt: skip
    sources = [src.pin_memory() for src in sources] if pinned else sources
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    turn = itertools.count()
    t = time_fn(
        lambda: dst.copy_(sources[next(turn) % count], non_blocking=pinned),
        label="pinned copy" if pinned else "pageable copy",
        warmup=2, repeats=repeats, device=device,
    )  # fmt: skip
    return nbytes / (t.median_ms * 1e-3) / 1e9


def measure_matmul_tflop_s(device: torch.device, n: int, repeats: int) -> float:
    """Dense n x n x n matrix-product rate on random inputs."""
    dtype = matmul_dtype(device)
    gen = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, dtype=dtype, generator=gen) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    t = time_fn(
        lambda: torch.mm(a, b, out=out), label="matmul", warmup=3, repeats=repeats, device=device
    )
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def measure_ceilings(
    device: torch.device | str | None = None, sizes: CeilingSizes | Preset | None = None
) -> Ceilings:
    """Measure both ceilings on ``device`` at the sizes of its preset (or the sizes given)."""
    device = torch.device(device) if device is not None else default_device()
    if sizes is None or isinstance(sizes, str):
        sizes = CEILING_SIZES[sizes or preset(device)]
    copy = measure_copy_gb_s(device, sizes.copy_bytes, sizes.repeats)
    matmul = measure_matmul_tflop_s(device, sizes.matmul_n, sizes.repeats)
    dtype = str(matmul_dtype(device)).removeprefix("torch.")
    return Ceilings(device_name(device), copy, matmul, dtype, sizes.copy_bytes, sizes.matmul_n)
