"""Memory: allocate once, store fewer activations, and measure it.

PyTorch's CUDA caching allocator keeps freed blocks, so a steady step asks the driver for
nothing new (``torch.cuda.empty_cache()`` in the loop undoes that: a device sync now,
``cudaMalloc`` calls later). :class:`BufferCache` allocates one tensor per name once;
:func:`count_allocations`, :func:`peak_memory`, :func:`record_memory_history` measure (on a
CPU from the profiler's memory events); :func:`checkpoint_blocks` (:mod:`accel.recompute`)
recomputes activations in backward; :func:`largest_batch` fits a batch to a memory budget.
"""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from accel.errors import checked_callable, checked_count, checked_number
from accel.recompute import (  # noqa: F401 (public here: this module measures what they save)
    SELECTIVE_SAVE,
    CheckpointedBlocks,
    checkpoint_blocks,
    save_ops_policy,
)

GiB, MiB = 1 << 30, 1 << 20


class BufferCache:
    """Named tensors allocated once and handed out again on every later request
    (``buffers.get("stats", (groups, 2))``). A new shape or dtype under a known name replaces
    that buffer (counted in ``misses``). Contents are whatever was last written: write before
    you read."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None
        self._buffers: dict[str, torch.Tensor] = {}
        self.misses = 0

    def get(
        self,
        name: str,
        shape: tuple[int, ...] | torch.Size,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        device = torch.device(device) if device is not None else self.device
        if device is None:
            raise ValueError(f"BufferCache.get({name!r}): no device given here or to the cache")
        shape = _checked_shape(shape, f"BufferCache.get({name!r})")
        buf = self._buffers.get(name)
        if (
            buf is not None
            and buf.shape == shape
            and buf.dtype == dtype
            and buf.device.type == device.type
            and (device.index is None or buf.device == device)
        ):
            return buf
        self.misses += 1
        self._buffers[name] = buf = torch.empty(shape, dtype=dtype, device=device)
        return buf


def _checked_shape(shape, what: str) -> torch.Size:
    """``shape`` as a ``torch.Size``, or an error that says what came."""
    try:
        sizes = torch.Size(shape)
    except TypeError:
        raise TypeError(f"{what}: expected a tuple of sizes, got {shape!r} "
                        f"({type(shape).__name__})") from None  # fmt: skip
    if any(n < 0 for n in sizes):
        raise ValueError(f"{what}: expected sizes of at least 0, got {tuple(sizes)}")
    return sizes


@dataclass(frozen=True)
class AllocationStats:
    """Allocator activity per step, averaged over ``steps`` steady-state steps: ``requests``
    (tensors allocated), ``device_allocs`` (``cudaMalloc`` calls), ``retries`` (failed
    ``cudaMalloc`` calls that freed the cache and retried; both None on a CPU), and
    ``peak_bytes`` above the level at the start."""

    steps: int
    requests: float
    bytes_requested: float
    device_allocs: float | None
    retries: float | None
    peak_bytes: int
    device: str

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


_CUDA_KEYS = {
    "requests": "allocation.all.allocated",
    "bytes_requested": "allocated_bytes.all.allocated",
    "device_allocs": "segment.all.allocated",  # segments come from cudaMalloc, one each
    "retries": "num_alloc_retries",
}


def count_allocations(
    fn: Callable[[], object],
    *,
    steps: int = 5,
    warmup: int = 2,
    device: torch.device | str | None = None,
) -> AllocationStats:
    """Run ``fn`` ``warmup`` times, then ``steps`` times while counting what it allocates:
    deltas of ``torch.cuda.memory_stats`` on CUDA, the profiler's memory events on a CPU (where
    a Python number in an op shows as an 8-byte host allocation)."""
    checked_callable(fn, "count_allocations(fn)")
    steps = checked_count(steps, "steps", at_least=1)
    warmup = checked_count(warmup, "warmup")
    dev = torch.device(device) if device is not None else _default_device()
    cuda = dev.type == "cuda"
    for _ in range(warmup if cuda else max(warmup - 1, 0)):
        fn()
    if cuda:
        before, after, peak = _cuda_window(dev, lambda: _repeat(fn, steps))
        keys = dict(_CUDA_KEYS)
        if "num_device_alloc" in after:  # counts cuMemMap (expandable segments) as well
            keys["device_allocs"] = "num_device_alloc"
        delta = {k: (after.get(key, 0) - before.get(key, 0)) / steps for k, key in keys.items()}
        return AllocationStats(steps, **delta, peak_bytes=peak, device=str(dev))
    # The last warm-up step runs under the profiler too: the profiler sees no free of a block
    # allocated before it started, so tensors from that step (gradients, say) freed during the
    # counted steps would otherwise never leave the running total.
    events, start = _cpu_memory_events(lambda: _repeat(fn, steps), lead=fn if warmup else None)
    counted = [(t, n) for t, n in events if t >= start]
    allocs = [n for _, n in counted if n > 0]
    return AllocationStats(
        steps,
        requests=len(allocs) / steps,
        bytes_requested=sum(allocs) / steps,
        device_allocs=None,
        retries=None,
        peak_bytes=_peak(events, start),
        device=str(dev),
    )


def _cuda_window(dev: torch.device, run: Callable[[], object]) -> tuple[dict, dict, int]:
    """``run()`` between two synchronizes: the allocator's stats before and after, and the
    highest allocated bytes above the level at the start."""
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_stats(dev)
    start = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    run()
    torch.cuda.synchronize(dev)
    return before, torch.cuda.memory_stats(dev), int(torch.cuda.max_memory_allocated(dev) - start)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


MARK = "accel.memory.window"


def _repeat(fn: Callable[[], object], times: int) -> None:
    for _ in range(times):  # each result dropped before the next call
        fn()


def _cpu_memory_events(
    fn: Callable[[], object], *, lead: Callable[[], object] | None = None
) -> tuple[list[tuple[int, int]], int]:
    """(time ns, bytes: + allocated / - freed) of every CPU allocation and free while ``lead``
    then ``fn`` ran, from the profiler's raw records in time order, and the time ``fn`` began."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, record_function

    from accel.profiling import quiet_profile

    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if lead is not None:
            lead()
        with record_function(MARK):
            fn()
    records = prof.profiler.kineto_results.events()
    start = min(e.start_ns() for e in records if e.name() == MARK)
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in records
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    )
    return events, start


def _peak(events: list[tuple[int, int]], start: int = 0) -> int:
    """Highest running total from ``start`` on, above the total at ``start``."""
    return max(itertools.accumulate((n for t, n in events if t >= start), initial=0))


def peak_memory(fn: Callable[[], object], *, device: torch.device | str | None = None) -> int:
    """Bytes allocated at the highest point while ``fn`` ran, above the level at its start:
    ``max_memory_allocated`` on CUDA, the profiler's allocation records on a CPU (which miss
    frees of blocks allocated before, so a ``fn`` that frees such tensors reads high)."""
    checked_callable(fn, "peak_memory(fn)")
    dev = torch.device(device) if device is not None else _default_device()
    if dev.type == "cuda":
        return _cuda_window(dev, fn)[2]
    events, start = _cpu_memory_events(fn)
    return _peak(events, start)


@contextmanager
def record_memory_history(
    *, max_entries: int = 100_000, device: torch.device | str | None = None
) -> Iterator[dict[str, Any]]:
    """Record the CUDA allocator's events inside the block (without stack traces); the yielded
    dict gets the snapshot under ``"snapshot"`` at exit. CUDA only.

        with record_memory_history() as rec:
            step()
        events = snapshot_events(rec["snapshot"])
    """
    dev = torch.device(device) if device is not None else _default_device()
    if dev.type != "cuda":
        raise RuntimeError(
            "record_memory_history needs a CUDA device (it records the CUDA caching "
            "allocator); on a CPU use peak_memory or count_allocations"
        )
    out: dict[str, Any] = {}
    record = torch.cuda.memory._record_memory_history
    try:  # a fresh history each time (clear_history: torch >= 2.5)
        record("all", context=None, max_entries=max_entries, clear_history=True)
    except TypeError:
        record("all", context=None, max_entries=max_entries)
    try:
        yield out
        torch.cuda.synchronize(dev)
        out["snapshot"] = torch.cuda.memory._snapshot()
    finally:
        record(None)


def snapshot_events(snapshot: dict[str, Any], *, device: int = 0) -> list[dict[str, Any]]:
    """The allocator's event history of one device, one dict per event: ``t_us`` (from the
    first event; its index without times), ``action`` (alloc, free_completed, segment_alloc ...),
    ``bytes``, and the running ``allocated_bytes`` and ``reserved_bytes`` after it, relative to
    the start of the history."""
    traces = snapshot.get("device_traces", [])
    entries = traces[device] if device < len(traces) else []
    allocated = reserved = 0
    start = float(entries[0].get("time_us", 0)) if entries else 0.0
    events = []
    for i, e in enumerate(entries):
        action, size = e.get("action", "?"), int(e.get("size", 0))
        if action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        elif action == "segment_alloc":
            reserved += size
        elif action == "segment_free":
            reserved -= size
        events.append(
            {
                "t_us": float(e.get("time_us", i)) - start,
                "action": action,
                "bytes": size,
                "allocated_bytes": allocated,
                "reserved_bytes": reserved,
            }
        )
    return events


@dataclass
class BatchSearch:
    """Result of :func:`largest_batch`: the batch, and every probe as (batch, bytes, fits)."""

    batch: int
    budget_bytes: int
    probes: list[tuple[int, int | None, bool]] = field(default_factory=list)


def largest_batch(
    run: Callable[[int], object],
    budget_bytes: int,
    *,
    resident_bytes: int = 0,
    start: int = 1,
    limit: int = 4096,
    device: torch.device | str | None = None,
) -> BatchSearch:
    """The largest batch ``b`` (``start`` <= b <= ``limit``) for which ``resident_bytes`` (weights,
    optimizer state) plus :func:`peak_memory` of ``run(b)`` stays within ``budget_bytes``.

    Doubles from ``start`` until a batch does not fit, then bisects (memory assumed to grow with
    the batch); an out-of-memory error counts as "does not fit". ``batch`` is 0 if ``start``
    does not fit.
    """
    checked_callable(run, "largest_batch(run)")
    if not checked_number(budget_bytes, "budget_bytes") > 0:  # 8e9 is a budget too
        raise ValueError(f"largest_batch: budget_bytes must be a number > 0, got {budget_bytes}")
    checked_number(resident_bytes, "resident_bytes")
    start = checked_count(start, "start", at_least=1)
    if checked_count(limit, "limit") < start:
        raise ValueError(f"largest_batch: need start <= limit, got {start=}, {limit=}")
    dev = torch.device(device) if device is not None else _default_device()
    result = BatchSearch(0, budget_bytes)

    def fits(batch: int) -> bool:
        try:
            used: int | None = resident_bytes + peak_memory(lambda: run(batch), device=dev)
            ok = used <= budget_bytes
        except torch.cuda.OutOfMemoryError:
            used, ok = None, False
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        result.probes.append((batch, used, ok))
        return ok

    if not fits(start):
        return result
    lo, hi = start, None  # lo fits; hi (when known) does not
    while hi is None:
        nxt = min(2 * lo, limit)
        if nxt == lo:
            result.batch = lo
            return result
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    result.batch = lo
    return result


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors`` (each storage counted once)."""
    seen: dict[int, int] = {}
    if not isinstance(tensors, Iterable):
        raise TypeError(
            f"tensor_bytes: expected an iterable of tensors, got {reprlib.repr(tensors)} "
            f"({type(tensors).__name__})"
        )
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
