"""Sync removal: keep numbers on the device and bring them to the host once, when asked.

A host read of a device tensor (``.item()``, ``.tolist()``, ``float(t)``, ``if t:``, a boolean
mask) waits until the GPU has run everything queued: the queue drains and the GPU idles. Each
fast version sits beside its plain reference: :func:`read_scalars` (one transfer for many),
:class:`MetricAccumulator` (sums on the device), :class:`ProgressLog` (rows copied without
blocking), :func:`apply_givens` and :func:`update_rotor_angles` (batched index ops instead of
loops over planes). :func:`count_syncs` and :func:`no_sync` find syncs (CUDA only).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from accel.errors import checked_callable, checked_count, collection_of, warn_once

SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's sync-debug-mode text


class HostSyncError(RuntimeError):
    """A host-device sync happened inside :func:`no_sync`."""


class SyncCheckUnavailableWarning(UserWarning):
    """Syncs cannot be counted or checked here (no CUDA device)."""


def read_scalars(values: Mapping[str, torch.Tensor]) -> dict[str, float | int | bool]:
    """Bring several one-element tensors to the host in one transfer (one sync, not one each).

    Values of one dtype are read in that dtype, each as its ``.item()`` reads it; mixed dtypes
    are read as float64 (exact for float32, bfloat16 and integers below 2**53).
    """
    if not isinstance(values, Mapping):
        raise TypeError(
            "read_scalars: expected a mapping of names to tensors (a dict), got "
            f"{type(values).__name__}"
        )
    if not values:
        return {}
    names = list(values)
    tensors = [_as_scalar(name, values[name]) for name in names]
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"read_scalars: values must share one device, got {sorted(map(str, devices))}"
        )
    dtypes = {t.dtype for t in tensors}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    host = torch.stack([t.to(dtype) for t in tensors]).tolist()  # sync: the one read, for all
    return dict(zip(names, host, strict=True))


def read_scalars_reference(values: Mapping[str, torch.Tensor]) -> dict[str, float | int | bool]:
    """The "before": one ``.item()`` (one sync) per value."""
    return {name: _as_scalar(name, t).item() for name, t in values.items()}


def _as_scalar(name: str, value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name!r}: expected a tensor, got {type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(f"{name!r}: expected one element, got shape {tuple(value.shape)}")
    return value.detach().reshape(())


class MetricAccumulator:
    """Running sums of named scalar metrics kept on the device; read back in one transfer.

    acc = MetricAccumulator(["loss", "grad_norm"], device="cuda")
    acc.add(loss=loss, grad_norm=norm)   # no sync: one in-place add
    acc.read()                           # {'loss': ..., 'grad_norm': ...}: means, one sync
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.names = collection_of(names, "metric names")
        if not self.names or len(set(self.names)) != len(self.names):
            raise ValueError(f"MetricAccumulator needs distinct metric names, got {self.names}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"MetricAccumulator sums means in a floating dtype, got {dtype}")
        try:
            self.totals = torch.zeros(len(self.names), device=device, dtype=dtype)
        except (RuntimeError, AssertionError) as error:  # no such device, or none built in
            raise ValueError(f"MetricAccumulator cannot hold its sums on {device!r}: "
                             f"{str(error).splitlines()[0]}") from None  # fmt: skip
        self.count = 0

    def add(
        self, values: Mapping[str, torch.Tensor] | None = None, /, **named: torch.Tensor
    ) -> None:
        """Add one value per metric (one-element tensors on the accumulator's device)."""
        given = {**(values or {}), **named}
        if set(given) != set(self.names):
            raise KeyError(
                f"add() needs exactly the metrics {list(self.names)}, got {sorted(given)}"
            )
        scalars = [_as_scalar(n, given[n]) for n in self.names]
        for name, value in zip(self.names, scalars, strict=True):
            if value.device != self.totals.device:
                raise ValueError(f"{name!r} is on {value.device} and the accumulator's on "
                                 f"{self.totals.device}: add values where the sums are")  # fmt: skip
        row = torch.stack([value.to(self.totals.dtype) for value in scalars])
        self.totals.add_(row)
        self.count += 1

    def means(self) -> torch.Tensor:
        """The running means, on the device (no sync)."""
        return self.totals / max(self.count, 1)

    def read(self) -> dict[str, float]:
        """The running means on the host, all in one transfer."""
        means = self.means().tolist()  # sync: asked for; one transfer for every metric
        return dict(zip(self.names, means, strict=True))

    def read_reference(self) -> dict[str, float]:
        """The "before": one ``.item()`` per metric."""
        means = self.means()
        return {n: means[i].item() for i, n in enumerate(self.names)}

    def reset(self) -> None:
        self.totals.zero_()
        self.count = 0


class ProgressLog:
    """Progress rows recorded on the device (``record``, no sync), copied to pinned host memory
    without blocking (``flush``), returned once landed (``collect``). Use it from one stream."""

    def __init__(
        self,
        names: Sequence[str],
        capacity: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.names = collection_of(names, "column names")
        capacity = checked_count(capacity, "ProgressLog capacity", at_least=1)
        self.rows = torch.zeros(capacity, len(self.names), device=device, dtype=dtype)
        self._cuda = self.rows.device.type == "cuda"
        self._filled = 0
        self._pending: deque[tuple[torch.cuda.Event | None, torch.Tensor]] = deque()
        self.history: list[dict[str, float]] = []

    def record(self, values: Mapping[str, torch.Tensor], *, scale: float = 1.0) -> None:
        """Write ``values`` (times ``scale``) as the next row, on the device."""
        if self._filled == len(self.rows):
            raise ValueError(f"ProgressLog is full ({len(self.rows)} rows): call flush() first")
        if not isinstance(values, Mapping):
            raise TypeError(
                "ProgressLog.record: expected a mapping of column names to tensors, got "
                f"{type(values).__name__}"
            )
        if not set(self.names) <= set(values):
            raise KeyError(f"record() needs the columns {list(self.names)}, got {list(values)}")
        row = torch.stack([_as_scalar(n, values[n]) for n in self.names])
        torch.mul(row, scale, out=self.rows[self._filled])
        self._filled += 1

    def assume_recorded(self, rows: int) -> None:
        """Declare the first ``rows`` rows written on the device by work whose Python did not run
        (a replayed CUDA graph that captured ``record`` calls), so that ``flush`` copies them."""
        if not 0 <= rows <= len(self.rows):
            raise ValueError(f"ProgressLog holds {len(self.rows)} rows; cannot assume {rows}")
        self._filled = rows

    def flush(self) -> None:
        """Start copying the recorded rows to the host; returns at once."""
        if self._filled == 0:
            return
        rows = self.rows[: self._filled]
        if self._cuda:
            # Pinned memory makes the copy asynchronous; torch's host allocator reuses the block
            # once this copy's event has completed, so steady state allocates nothing new.
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)  # queued on the rows' device's current stream
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(rows.device))
        else:
            host, event = rows.clone(), None
        self._pending.append((event, host))
        self._filled = 0

    def collect(self, *, wait: bool = False) -> list[dict[str, float]]:
        """Move the rows that have reached the host into ``history`` and return it; ``wait=True``
        first waits for every copy in flight."""
        while self._pending:
            event, host = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    break
                event.synchronize()  # sync: asked to wait for the rows still in flight
            self._pending.popleft()
            self.history += [dict(zip(self.names, r, strict=True)) for r in host.tolist()]
        return self.history


def to_device_without_sync(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to ``device`` without a host sync (pinned, then non-blocking: a
    pageable copy waits for the device, which keeps :class:`accel.graphs.GraphedStep` from
    capturing)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def count_syncs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int | None:
    """Call ``fn(*args, **kwargs)`` once and return how many host-device syncs it made.

    Counts torch's sync-debug warnings: every ``.item()``, ``.cpu()``, ``.tolist()``, blocking
    copy, ``nonzero`` or boolean mask on a CUDA tensor (not explicit ``synchronize()`` calls).
    Without CUDA ``fn`` still runs, the result is ``None``, and a
    :class:`SyncCheckUnavailableWarning` says so (once per process).
    """
    checked_callable(fn, "count_syncs(fn)")
    if not torch.cuda.is_available():
        warn_once(
            "sync: count",
            "count_syncs: no CUDA device here, so there are no host-device syncs "
            "to count; returning None (fn was still called).",
            SyncCheckUnavailableWarning,
            stacklevel=3,
        )
        fn(*args, **kwargs)
        return None
    with recording_syncs() as syncs:
        fn(*args, **kwargs)
    return len(syncs)


@contextmanager
def recording_syncs() -> Iterator[list[warnings.WarningMessage]]:
    """CUDA only: the host-device syncs made inside the block, recorded, not forbidden: the
    list it yields gets one warning record (file and line) per sync when the block ends."""
    syncs: list[warnings.WarningMessage] = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for w in caught:
        if SYNC_MESSAGE in str(w.message):
            syncs.append(w)
        else:  # not ours: pass it on
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@contextmanager
def no_sync() -> Iterator[None]:
    """Make any host-device sync inside the block an error (:class:`HostSyncError`). Without
    CUDA the block runs unchecked and a :class:`SyncCheckUnavailableWarning` says so (once)."""
    if not torch.cuda.is_available():
        warn_once(
            "sync: guard",
            "no_sync: no CUDA device here, so host-device syncs cannot be "
            "checked; the block runs unchecked.",
            SyncCheckUnavailableWarning,
            stacklevel=3,
        )
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as exc:
        if SYNC_MESSAGE in str(exc):
            raise HostSyncError(
                "a host-device sync happened inside no_sync() (an .item(), .cpu(), .tolist(), "
                "blocking copy, nonzero or boolean mask on a CUDA tensor); see the traceback "
                "above for where"
            ) from exc
        raise
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def check_planes(planes: Any, dim: int) -> torch.Tensor:
    """Rotation planes for vectors of ``dim`` coordinates, checked, as a CPU long tensor
    (layers, k, 2): pairs (i, j) of distinct coordinates in ``0..dim-1``, disjoint within a
    layer (so :func:`apply_givens` applies them at once). Reads them on the host: call it once."""
    dim = checked_count(dim, "dim", at_least=2)
    t = torch.as_tensor(planes)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"planes must hold integer coordinates, got dtype {t.dtype}")
    if t.ndim == 2:
        t = t.unsqueeze(0)  # one layer
    if t.ndim != 3 or t.shape[-1] != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(
            f"planes must have shape (layers, k, 2) with layers, k >= 1, "
            f"got {tuple(torch.as_tensor(planes).shape)}"
        )
    t = t.to("cpu", torch.long)
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= dim:
        raise ValueError(
            f"planes: coordinates must be in 0..{dim - 1} (vectors of {dim}), "
            f"got values in {lo}..{hi}"
        )
    same = (t[..., 0] == t[..., 1]).nonzero().tolist()
    if same:
        layer, p = same[0]
        raise ValueError(
            f"planes: plane {p} of layer {layer} is ({t[layer, p, 0]}, "
            f"{t[layer, p, 1]}); the two coordinates of a plane must differ"
        )
    for layer, pairs in enumerate(t):
        values, counts = pairs.flatten().unique(return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"planes: layer {layer} uses coordinate(s) "
                f"{values[counts > 1].tolist()} in more than one plane; the planes "
                "of a layer must be disjoint"
            )
    return t


def _check_rotor_args(v: torch.Tensor, planes: torch.Tensor, theta: torch.Tensor) -> None:
    # Shapes, dtypes and devices only: checking index values would read them back (a sync).
    if not v.is_floating_point():
        raise TypeError(f"v must be a floating-point tensor, got {v.dtype}")
    if planes.dtype != torch.long:
        raise TypeError(f"planes must be torch.long (from check_planes), got {planes.dtype}")
    if planes.ndim != 3 or planes.shape[-1] != 2:
        raise ValueError(f"planes must have shape (layers, k, 2), got {tuple(planes.shape)}")
    if theta.shape != planes.shape[:2]:
        raise ValueError(
            f"theta must have shape (layers, k) = {tuple(planes.shape[:2])}, "
            f"got {tuple(theta.shape)}"
        )
    if planes.device != v.device or theta.device != v.device:
        raise ValueError(
            f"v, planes and theta must share a device (move planes there once), "
            f"got {v.device}, {planes.device}, {theta.device}"
        )


def apply_givens(v: torch.Tensor, planes: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Rotate the last dimension of ``v`` in each plane (i, j) by its angle, layer after layer:
    ``v_i, v_j <- c v_i - s v_j, s v_i + c v_j`` with ``c, s = cos, sin(theta)``.

    ``planes``: (layers, k, 2) long on ``v``'s device (see :func:`check_planes`); ``theta``:
    (layers, k). One gather, rotation and scatter per layer; no sync once a planes tensor has
    been checked (on its first call, and after it changes in place). Returns a new tensor.
    """
    _check_rotor_args(v, planes, theta)
    if not torch.compiler.is_compiling():
        _check_planes_once(planes, v.shape[-1])
    c, s = theta.cos().to(v.dtype), theta.sin().to(v.dtype)  # (layers, k)
    k = planes.shape[1]
    for layer in range(planes.shape[0]):
        pairs = planes[layer].reshape(2 * k)  # i0 j0 i1 j1 ...: one contiguous index
        w = v.index_select(-1, pairs).unflatten(-1, (k, 2))  # (..., k, 2)
        vi, vj = w[..., 0], w[..., 1]
        cl, sl = c[layer], s[layer]
        rotated = torch.stack((cl * vi - sl * vj, sl * vi + cl * vj), dim=-1).flatten(-2)
        v = v.index_copy(-1, pairs, rotated)
    return v


_CHECKED_PLANES: dict[int, tuple] = {}  # id -> (weak reference, version, dim) of checked planes


def _check_planes_once(planes: torch.Tensor, dim: int) -> None:
    """:func:`check_planes` on a planes tensor the first time it is seen with ``dim`` or after it
    changed in place; later calls read nothing (a loop passes the same tensor every step)."""
    key = id(planes)
    seen = _CHECKED_PLANES.get(key)
    if seen is not None and seen[0]() is planes and seen[1:] == (planes._version, dim):
        return
    check_planes(planes, dim)
    gone = weakref.ref(planes, lambda _, key=key: _CHECKED_PLANES.pop(key, None))
    _CHECKED_PLANES[key] = (gone, planes._version, dim)


def apply_givens_reference(v: torch.Tensor, planes: Any, theta: torch.Tensor) -> torch.Tensor:
    """The "before": a Python loop over layers and planes, a handful of kernels per plane."""
    out = v.clone()
    for layer, pairs in enumerate(torch.as_tensor(planes).tolist()):
        for p, (i, j) in enumerate(pairs):
            c = torch.cos(theta[layer, p]).to(v.dtype)
            s = torch.sin(theta[layer, p]).to(v.dtype)
            vi, vj = out[..., i].clone(), out[..., j].clone()
            out[..., i] = c * vi - s * vj
            out[..., j] = s * vi + c * vj
    return out


def update_rotor_angles(
    theta: torch.Tensor,
    planes: torch.Tensor,
    v_diff: torch.Tensor,
    signal: torch.Tensor | float,
    lr: float,
) -> torch.Tensor:
    """Contrastive update of every plane's angle at once, in place; returns ``theta``.

    For plane (i, j): ``theta += lr * (-signal) * atan2(d_j, d_i) * hypot(d_i, d_j)`` with
    ``d = v_diff`` (shape (dim,)). ``signal`` may stay a device scalar: nothing is read back.
    """
    if v_diff.ndim != 1:
        raise ValueError(f"v_diff must have shape (dim,), got {tuple(v_diff.shape)}")
    _check_rotor_args(v_diff, planes, theta)
    d = v_diff.index_select(0, planes.reshape(-1)).view(*theta.shape, 2)  # one gather
    di, dj = d[..., 0], d[..., 1]
    step = torch.atan2(dj, di) * torch.hypot(di, dj)
    return theta.add_(step * (-lr * signal))


def update_rotor_angles_reference(
    theta: torch.Tensor,
    planes: torch.Tensor,
    v_diff: torch.Tensor,
    signal: torch.Tensor | float,
    lr: float,
) -> torch.Tensor:
    """The "before": nested loops with ``.item()`` per index and per value (a sync each)."""
    s = signal.item() if isinstance(signal, torch.Tensor) else float(signal)
    layers, k = theta.shape
    for layer in range(layers):
        for p in range(k):
            i = int(planes[layer, p, 0].item())
            j = int(planes[layer, p, 1].item())
            di, dj = v_diff[i].item(), v_diff[j].item()
            theta[layer, p] += lr * (-s) * math.atan2(dj, di) * math.hypot(di, dj)
    return theta
