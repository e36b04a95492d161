"""CUDA graphs: capture a step's kernels once, then launch them all with one call.

A replay runs device work only (no Python, host reads or allocations): a graphed step needs
static memory, no host-device sync inside, and fixed shapes. :class:`GraphedStep` wraps any step
that way; :func:`training_step` builds a whole step whose graph owns the gradients.
``torch.compile(mode="reduce-overhead")`` does the same automatically (notebook 04 compares
them). Off a GPU everything runs eagerly, with one warning saying why.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from accel import sync
from accel.errors import checked_callable, checked_count, checked_instance, checked_number
from accel.optim import load_state_in_place

__all__ = [
    "GraphCaptureWarning",
    "GraphInputError",
    "GraphedStep",
    "pool_bytes",
    "training_step",
]

# Phrases in CUDA's and torch's errors that mean "the step synchronized with the host".
_SYNC_ERRORS = ("not permitted when stream is capturing", "capture", "cudaErrorStreamCapture")
_SYNC_HINT = (
    "a host-device sync inside the step: .item(), .cpu(), .tolist(), print() of a CUDA tensor, "
    "a Python `if` on a CUDA tensor, a boolean mask or nonzero(), or a copy from pageable host "
    "memory. Keep such reads outside the step, or record them on the device"
)


class GraphCaptureWarning(RuntimeWarning):
    """A graph could not be captured (or cannot run here): the step runs eagerly instead."""


class GraphInputError(ValueError):
    """A call does not match what the graph was captured for (shape, dtype, device, constants)."""


def _signature(leaves: Sequence[Any], spec: Any) -> tuple:
    """What a graph depends on: each tensor's shape, dtype and device, every other value."""
    key = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append((leaf.shape, leaf.dtype, leaf.device))
        else:
            try:
                hash(leaf)
            except TypeError:
                raise GraphInputError(
                    f"graph step arguments must be tensors or hashable constants; got an "
                    f"unhashable {type(leaf).__name__}"
                ) from None
            key.append(("const", leaf))
    return (spec, tuple(key))


def _mismatch(expected: tuple, got: tuple, names: list[str]) -> str:
    """Which argument differs, in words."""
    if expected[0] != got[0]:
        return f"the arguments' structure differs: captured {expected[0]}, got {got[0]}"
    for name, (a, b) in zip(names, zip(expected[1], got[1], strict=True), strict=True):
        if a != b:
            return f"argument {name}: captured for {_spec_words(a)}, got {_spec_words(b)}"
    return "the arguments differ"


def _spec_words(entry: tuple) -> str:
    if entry[0] == "const":
        return f"the constant {entry[1]!r}"
    shape, dtype, device = entry
    return f"{str(dtype).removeprefix('torch.')}{list(shape)} on {device}"


def _leaf_names(spec: Any, count: int) -> list[str]:
    """Readable names for flattened arguments: 'args[0]', "kwargs['x']" ..."""
    paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten([0] * count, spec))
    return [
        ("args" if path[0].idx == 0 else "kwargs") + "".join(str(p) for p in path[1:])
        for path, _ in paths
    ]


class _Captured:
    """One graph with its static inputs and outputs."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[Any], outputs: Any):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.tensor_inputs = [(i, t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]


def _checked_device(device: Any) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device must be a torch.device or its name ('cuda', 'cuda:1') or index, got {device!r}"
        ) from None


class GraphedStep:
    """``fn`` captured into a CUDA graph on first use, replayed on every later call.

    The first ``warmup`` calls run eagerly on a side stream (lazy state such as optimizer moments
    is created then; one-time host reads are allowed before the last); the next captures ``fn``
    on static copies of its inputs; later calls copy their inputs in and replay. Outputs are the
    same tensors every call, valid until the next replay in the same pool: clone what you keep.
    Host-side effects of ``fn`` (counters, prints) happen at capture only; while a capture runs
    no other thread may draw CUDA random numbers.

    Arguments are tensors on the graph's device and hashable constants, nested in tuples, lists
    and dicts. Other shapes, dtypes, devices or constants raise :class:`GraphInputError` naming
    the difference, or with ``on_new_shape="recapture"`` get one more graph in the same pool.
    Where capture fails (a host sync inside ``fn``, a tensor on the CPU, no CUDA) ``fn`` runs
    eagerly from then on with one :class:`GraphCaptureWarning` naming the cause (kept in
    ``reason``); ``fallback="raise"`` raises instead.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        warmup: int = 3,
        on_new_shape: Literal["error", "recapture"] = "error",
        fallback: Literal["warn", "raise"] = "warn",
        device: torch.device | str | int | None = None,
        name: str | None = None,
    ):
        checked_callable(fn, "GraphedStep(fn)")
        # eager calls before capture: lazy state must exist before a graph records addresses
        warmup = checked_count(warmup, "warmup", at_least=1)
        if on_new_shape not in ("error", "recapture"):
            raise ValueError(f"on_new_shape must be 'error' or 'recapture', got {on_new_shape!r}")
        if fallback not in ("warn", "raise"):
            raise ValueError(f"fallback must be 'warn' or 'raise', got {fallback!r}")
        self.fn, self.warmup, self.on_new_shape, self.fallback = fn, warmup, on_new_shape, fallback
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self._device = _checked_device(device) if device is not None else None
        if self._device == torch.device("cuda") and torch.cuda.is_available():  # no index
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._pool, self._stream = None, None
        self._graphs: dict[tuple, _Captured] = {}
        # the same graphs keyed without pytree, for calls of tensors passed by position
        self._positional: dict[tuple, _Captured] = {}
        self._warmups: dict[tuple, int] = {}
        self._first: tuple | None = None  # the first call's signature (what "error" compares to)
        self.reason: str | None = None  # why the step runs eagerly, once it does
        self.captures = self.replays = self.eager_calls = 0

    # ---- calling -----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.reason is not None:
            self.eager_calls += 1
            return self.fn(*args, **kwargs)
        if not kwargs:
            try:
                captured = self._positional.get(tuple((a.shape, a.dtype, a.device) for a in args))
            except AttributeError:  # not all tensors: the general path below
                captured = None
            if captured is not None:
                return self._replay(captured, args)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = _signature(leaves, spec)
        captured = self._graphs.get(key)
        if captured is not None:
            if not kwargs and all(type(a) is torch.Tensor for a in args):
                self._positional[tuple((a.shape, a.dtype, a.device) for a in args)] = captured
            return self._replay(captured, leaves)
        return self._first_calls(args, kwargs, leaves, spec, key)

    def _replay(self, captured: _Captured, leaves: Sequence[Any]) -> Any:
        """The new inputs copied into the graph's static ones, one replay, its outputs."""
        for i, static in captured.tensor_inputs:
            static.copy_(leaves[i])
        captured.graph.replay()
        self.replays += 1
        return captured.outputs

    def _first_calls(self, args, kwargs, leaves, spec, key) -> Any:
        if self._first is None:
            self._first = key
        elif key != self._first and self.on_new_shape == "error" and key not in self._warmups:
            names = _leaf_names(spec, len(leaves)) if spec == self._first[0] else []
            raise GraphInputError(
                f"GraphedStep({self.name}) was set up for other inputs: "
                f"{_mismatch(self._first, key, names)}. A graph replays fixed shapes; pass "
                "on_new_shape='recapture' to keep one graph per input signature"
            )
        cause = self._cannot_capture(leaves)
        if cause is not None:
            return self._give_up(cause, args, kwargs)
        done = self._warmups.get(key, 0)
        if done < self.warmup:
            self._warmups[key] = done + 1
            return self._run_on_side_stream(args, kwargs, last=done + 1 == self.warmup)
        return self._capture(leaves, spec, key)

    def _cannot_capture(self, leaves: Sequence[Any]) -> str | None:
        if not torch.cuda.is_available():
            return "CUDA graphs need a CUDA GPU, and torch.cuda.is_available() is False here"
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if self._device is None:
            self._device = next(
                (t.device for t in tensors if t.device.type == "cuda"),
                torch.device("cuda", torch.cuda.current_device()),
            )
        if self._device.type != "cuda":
            return f"CUDA graphs need a CUDA device; this step was given {self._device}"
        for t in tensors:
            if t.device != self._device:
                return (
                    f"an input is a tensor on {t.device}; a graph replays work on "
                    f"{self._device} only, so work on {t.device} would run once, at capture"
                )
        return None

    def _give_up(self, cause: str, args, kwargs, *, stacklevel: int = 4) -> Any:
        """Run eagerly from now on, this call included."""
        self._fall_back(cause, stacklevel=stacklevel)
        self.eager_calls += 1
        return self.fn(*args, **kwargs)

    def _fall_back(self, cause: str, *, stacklevel: int) -> None:
        """Record why there is no graph and say it once (or raise, with fallback="raise")."""
        self.reason = cause
        message = f"GraphedStep({self.name}): cannot use a CUDA graph ({cause})"
        if self.fallback == "raise":
            raise RuntimeError(
                f"{message}. Nothing ran; fix the cause, or pass fallback='warn' to run the step "
                "eagerly with a warning"
            )
        warnings.warn(f"{message}; running eagerly", GraphCaptureWarning, stacklevel=stacklevel + 1)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        return self._stream

    def _run_on_side_stream(self, args, kwargs, *, last: bool) -> Any:
        """An eager call on the capture stream, under sync-debug mode: the ``last`` warm-up
        before a capture that syncs ends the attempt (the capture would fail and could leave
        CUDA's random-number state unusable). Earlier warm-ups may sync: one-time work such as
        a check of an input on its first call is what they are for."""
        stream, current = self._side_stream(), torch.cuda.current_stream(self._device)
        stream.wait_stream(current)
        with sync.recording_syncs() as syncs, torch.cuda.stream(stream):
            out = self.fn(*args, **kwargs)
        current.wait_stream(stream)
        self.eager_calls += 1
        if syncs and last:
            where = f"{syncs[0].filename}:{syncs[0].lineno}"
            self._fall_back(
                f"a warm-up call synchronized with the host {len(syncs)} time(s), first at "
                f"{where}, so a capture would fail; the usual cause is {_SYNC_HINT}",
                stacklevel=4,
            )
        return out

    # ---- capturing ---------------------------------------------------------------------------
    def _capture(self, leaves: list[Any], spec: Any, key: tuple) -> Any:
        static = [
            torch.empty_like(t).copy_(t) if isinstance(t, torch.Tensor) else t for t in leaves
        ]
        args, kwargs = pytree.tree_unflatten(static, spec)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self._device)
        _clear_cublas_workspaces()  # the capture's cuBLAS workspace then lives in our pool
        inner: list[BaseException] = []
        try:
            with torch.cuda.graph(
                graph,
                pool=self._pool,
                stream=self._side_stream(),
                capture_error_mode="thread_local",
            ):
                try:
                    outputs = self.fn(*args, **kwargs)
                except Exception as exc:
                    inner.append(exc)
                    raise
        except Exception as exc:
            _clear_cublas_workspaces()
            torch.cuda.synchronize(self._device)  # a failed capture leaves no work behind
            failure = (
                f"{_explain(inner[0] if inner else exc)}; CUDA's random-number state may now be "
                "unusable in this process (torch leaves it in capture mode after a failed capture)"
            )
        else:
            _clear_cublas_workspaces()  # later eager matmuls must not share the graph's workspace
            off = [
                t.device
                for t in pytree.tree_leaves(outputs)
                if isinstance(t, torch.Tensor) and t.device != self._device
            ]
            failure = off and f"it returns a tensor on {off[0]}, which a replay would never update"
        if failure:
            return self._give_up(failure, *pytree.tree_unflatten(leaves, spec), stacklevel=5)
        self._graphs[key] = _Captured(graph, static, outputs)
        self.captures += 1
        graph.replay()  # capture recorded the work without doing it: this call's work
        self.replays += 1
        return outputs

    # ---- state -------------------------------------------------------------------------------
    @property
    def graphs(self) -> int:
        """Graphs captured and kept (one per input signature)."""
        return len(self._graphs)

    @property
    def pool(self) -> Any:
        """The memory pool the graphs allocate from."""
        return self._pool

    @property
    def pool_bytes(self) -> int:
        """Device memory held by the graphs' pool (their intermediates and outputs), from the
        allocator's snapshot; 0 before the first capture."""
        if self._pool is None or self._device is None:
            return 0
        return pool_bytes(self._pool, self._device)

    def reset(self) -> None:
        """Drop every graph, its static buffers and a fallback to eager, and return the pool's
        memory to the device; the next calls warm up and capture again."""
        self._graphs.clear()
        self._positional.clear()
        self._warmups.clear()
        self._first, self.reason = None, None
        if torch.cuda.is_available() and self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            self._pool = None
            torch.cuda.empty_cache()

    def __repr__(self) -> str:
        state = f"eager: {self.reason}" if self.reason else f"{self.graphs} graph(s)"
        return (
            f"GraphedStep({self.name}, {state}, captures={self.captures}, "
            f"replays={self.replays}, eager_calls={self.eager_calls})"
        )


def _clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces (as compile's CUDA-graph trees do), so that a
    capture allocates its workspace in the graph's own pool rather than recording one that a
    later clear hands to other tensors."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private, torch >= 2.0
    if clear is not None:
        clear()


def pool_bytes(pool: Any, device: torch.device | str | int | None = None) -> int:
    """Bytes of the segments the caching allocator holds for the graph memory pool ``pool`` (a
    ``torch.cuda.graph_pool_handle()``) on ``device``; 0 once the pool has been released."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    index = torch.device(device).index
    return sum(
        seg["total_size"]
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg.get("segment_pool_id", ())) == tuple(pool)
        and (index is None or seg["device"] == index)
    )


def _explain(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    if any(p in str(exc) for p in _SYNC_ERRORS):
        return f"capture failed with {text!r}; the usual cause is {_SYNC_HINT}"
    return f"capture failed with {text!r}"


def training_step(
    model: torch.nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    max_grad_norm: float | None = None,
) -> Callable[..., torch.Tensor]:
    """A whole training step for :class:`GraphedStep`: ``step(inputs, targets)`` zeroes the
    gradients to None (a capture then allocates them in the graph's pool), runs
    ``loss_fn(model(inputs), targets)``, backward, clips to ``max_grad_norm`` on the device and
    steps the (capturable) optimizer. Returns the loss, detached."""
    checked_instance(model, torch.nn.Module, "training_step: model", "torch.nn.Module")
    checked_callable(loss_fn, "training_step(loss_fn)")
    checked_instance(
        optimizer, torch.optim.Optimizer, "training_step: optimizer", "torch.optim.Optimizer"
    )
    if max_grad_norm is not None:
        max_grad_norm = checked_number(max_grad_norm, "training_step: max_grad_norm")
        if not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
            raise ValueError(
                f"training_step: max_grad_norm must be finite and > 0, got {max_grad_norm}"
            )
    params = [p for p in model.parameters() if p.requires_grad]
    load_state_in_place(optimizer)  # a resumed state reaches the captured graph

    def step(inputs: Any, targets: Any) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
        optimizer.step()
        return loss.detach()

    step.__qualname__ = f"training_step({type(model).__name__})"
    return step
