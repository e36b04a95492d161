"""Fusion: fewer, larger kernels for work done over many tensors or in many small steps.

A Python loop over ~150 parameter tensors launches a kernel or two per tensor per statistic;
``torch._foreach_*`` ops take the whole list in a handful of launches. Each fast version sits
beside its plain reference: ``foreach=`` picks between them in :func:`group_stats` (no host
read); :func:`lior_step_fused` beside its plain form;
:class:`CompiledFunction` makes ``torch.compile``'s recompiles per shape visible. Norms
accumulate in float32 (float64 for float64 tensors). Clipping is torch's own
``torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)``.
"""

from __future__ import annotations

import functools
import reprlib
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from accel.errors import checked_callable, checked_count
from accel.sync import to_device_without_sync

Tensors = torch.Tensor | Iterable[torch.Tensor]


def _as_list(tensors: Tensors, what: str) -> list[torch.Tensor]:
    """``tensors`` as a non-empty list of floating-point tensors, or an error naming ``what``."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    try:
        out = list(tensors)
    except TypeError:
        raise TypeError(
            f"{what}: expected a tensor or an iterable of tensors, got "
            f"{reprlib.repr(tensors)} ({type(tensors).__name__})"
        ) from None
    if not out:
        raise ValueError(
            f"{what}: got no tensors (an empty list, or a generator such as "
            "model.parameters() that was already consumed)"
        )
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: item {i} is a {type(t).__name__}, not a tensor")
        if not t.is_floating_point():
            raise TypeError(f"{what}: item {i} has dtype {t.dtype}; norms need floating point")
    return out


def _one_device(tensors: Sequence[torch.Tensor], what: str) -> torch.device:
    try:
        devices = {t.device for t in tensors}
    except AttributeError:  # checked only on the way to the error: the common call pays nothing
        i, bad = next((i, t) for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor))
        raise TypeError(f"{what}: item {i} is a {type(bad).__name__}, not a tensor") from None
    if len(devices) > 1:
        raise ValueError(
            f"{what}: tensors are on several devices ({', '.join(sorted(map(str, devices)))}); "
            "call once per device (a total across devices would need a copy between them)"
        )
    return devices.pop()


def group_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """Indices of ``tensors`` (on one device) per dtype: a foreach op takes one dtype at a time."""
    buckets: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault(t.dtype, []).append(i)
    return buckets


def _one_dtype(tensors: Sequence[torch.Tensor]) -> bool:  # cheaper than group_by_dtype
    return len({t.dtype for t in tensors}) == 1


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a norm is summed in: float32 for 16-bit tensors (their own dtype loses ~3 digits),
    float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def _foreach_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor L2 norms (:func:`_norm_dtype`) in input order, the tensors on one device: one
    ``_foreach_norm`` per dtype (an empty tensor's norm is 0)."""
    if _one_dtype(tensors):
        return list(torch._foreach_norm(list(tensors), 2.0, dtype=_norm_dtype(tensors[0].dtype)))
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    for indices in group_by_dtype(tensors).values():
        bucket = [tensors[i] for i in indices]
        bucket_norms = torch._foreach_norm(bucket, 2.0, dtype=_norm_dtype(bucket[0].dtype))
        for i, n in zip(indices, bucket_norms, strict=True):
            norms[i] = n
    return norms  # type: ignore[return-value]


def group_stats(
    groups: Sequence[Sequence[torch.Tensor]],
    *,
    foreach: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per group of parameters: the L2 norms of its gradients (a missing ``.grad`` counts as
    zero) and of its values, float32 (G, 2), without autograd (a controller fed with it trains on
    its own). ``out``, (G, 2) float32 on the parameters' device, receives it without an
    allocation. ``foreach=False`` is the per-tensor reference.
    """
    groups = [_as_list(g, f"group_stats: group {i}") for i, g in enumerate(groups)]
    if not groups:
        raise ValueError("group_stats: got no groups")
    device = _one_device([t for g in groups for t in g], "group_stats")
    if out is not None and (
        out.shape != (len(groups), 2) or out.dtype != torch.float32 or out.device != device
    ):
        raise ValueError(
            f"group_stats: out must be float32 of shape ({len(groups)}, 2) on {device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    impl = _group_stats_foreach if foreach else _group_stats_loop
    with torch.no_grad():
        return impl(groups, device, out)


def _group_stats_loop(
    groups: list[list[torch.Tensor]], device: torch.device, out: torch.Tensor | None
) -> torch.Tensor:
    """The plain version: pow and sum per tensor (4 kernels per parameter), then per group a
    stack, a sum and a sqrt per statistic."""
    stats = torch.zeros(len(groups), 2, device=device) if out is None else out.zero_()
    for i, params in enumerate(groups):
        grad_sq = [p.grad.float().pow(2).sum() for p in params if p.grad is not None]
        param_sq = [p.float().pow(2).sum() for p in params]
        if grad_sq:
            stats[i, 0] = torch.stack(grad_sq).sum().sqrt()
        stats[i, 1] = torch.stack(param_sq).sum().sqrt()
    return stats


def _group_stats_foreach(
    groups: list[list[torch.Tensor]], device: torch.device, out: torch.Tensor | None
) -> torch.Tensor:
    """One ``_foreach_norm`` over every gradient and parameter (per dtype), one stack, one
    gather into a zero-padded (2, G, longest group) block and a sum: about ten launches for any
    number of tensors. The gather's indices are built once per layout (:func:`_group_index`);
    the padding keeps the per-group sums deterministic (no atomic ``index_add``)."""
    flat = [p for g in groups for p in g]
    has_grad = tuple(p.grad is not None for p in flat)
    grads = [p.grad for p, h in zip(flat, has_grad, strict=True) if h]
    norms = _foreach_norms(grads + flat)
    zero = torch.zeros((), device=device)  # the norm of a missing gradient, and the padding
    squares = torch.stack([*norms, zero]).float().square_()  # float64 norms: stats are float32
    index = _group_index(device, tuple(len(g) for g in groups), has_grad)
    sums = squares[index].sum(-1)  # (stat, group)
    if out is None:
        return sums.sqrt_().T.contiguous()  # (G, 2)
    torch.sqrt(sums, out=out.T)  # written through the transposed view: no copy
    return out


@functools.lru_cache(maxsize=64)
def _group_index(
    device: torch.device, sizes: tuple[int, ...], has_grad: tuple[bool, ...]
) -> torch.Tensor:
    """(2, G, longest group) positions in ``[grad norms..., param norms..., 0]`` of each group's
    gradient norms (row 0) and parameter norms (row 1); a missing gradient and the padding point
    at the trailing zero."""
    has = torch.tensor(has_grad, dtype=torch.bool)
    grads = int(has.sum())
    zero = grads + len(has_grad)
    grad_at = torch.where(has, has.long().cumsum(0) - 1, zero)
    param_at = grads + torch.arange(len(has_grad))
    rows = torch.stack(
        [
            torch.nn.utils.rnn.pad_sequence(at.split(sizes), batch_first=True, padding_value=zero)
            for at in (grad_at, param_at)
        ]
    )
    return to_device_without_sync(rows, device)


# ---- the field trainer's fused LIoR step --------------------------------------------------------
def quad_form(v: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(g(v, v) + eps)`` per row of ``v`` (..., d); ``g`` is (d, d) or its diagonal (d,)."""
    q = ((v @ g) * v).sum(-1) if g.ndim == 2 else (v * v * g).sum(-1)
    return torch.sqrt(q + eps)


def lior_step(R_sc: torch.Tensor, v: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """The "before": the LIoR loss ``R_sc * sqrt(g(v, v) + eps)`` computes its own quadratic form,
    and the caller computes the same form again for the speed (5 kernels each, full metric)."""
    return R_sc * quad_form(v, g, eps)


def lior_step_fused(
    R_sc: torch.Tensor, v: torch.Tensor, g: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """LIoR and the speed from one quadratic form: ``(R_sc * spd, spd)``."""
    spd = quad_form(v, g, eps)
    return R_sc * spd, spd


class CompiledFunction:
    """``fn`` through ``torch.compile`` with static shapes and ``fullgraph``, counting compiles.

    ``compiles`` counts the graphs the backend was handed (one per input shape; a new Python
    number is a new compile too), ``signatures`` their input shapes; past ``max_compiles`` a
    warning says so. ``direct=True`` calls a compiled graph straight away, skipping dynamo's
    frame evaluation, when a call's tensor layouts, other arguments, grad mode and autocast state
    match a call that compiled a graph taking exactly those tensors: for pure functions of their
    tensor arguments only. :meth:`check` compiles on an example and compares with ``fn``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        backend: str | Callable[..., Any] = "inductor",
        max_compiles: int = 8,
        direct: bool = False,
    ):
        self.fn = checked_callable(fn, "CompiledFunction(fn)")
        self.max_compiles = checked_count(max_compiles, "max_compiles", at_least=1)
        self.direct = direct
        self.compiles = 0
        self.calls = 0
        self.direct_calls = 0
        self.signatures: list[tuple] = []
        self._backend = backend
        self._last_graph: tuple[Callable, list[Any]] | None = None  # (compiled, example inputs)
        self._direct: dict[tuple, tuple[Callable, bool]] = {}  # key -> (graph, returns a tuple)
        self._compiled = torch.compile(
            fn, backend=self._counting_backend, dynamic=False, fullgraph=True
        )
        self.__name__ = getattr(fn, "__name__", "compiled")
        self.__doc__ = fn.__doc__

    def _counting_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.compiles += 1
        self.signatures.append(
            tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        )
        if self.compiles == self.max_compiles + 1:
            warnings.warn(
                f"{self.__name__}: compiled {self.compiles} graphs; latest input shapes: "
                f"{self.signatures[-3:]}. Each new shape costs a compile: pad or bucket the "
                "shapes, or compile with dynamic=True.",
                RuntimeWarning,
                stacklevel=2,
            )
        backend = self._backend
        if isinstance(backend, str):
            from torch._dynamo import lookup_backend

            backend = lookup_backend(backend)
        compiled = backend(gm, example_inputs)
        self._last_graph = (compiled, list(example_inputs))
        return compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if not self.direct or kwargs:
            return self._compiled(*args, **kwargs)
        key = _direct_key(args)
        hit = self._direct.get(key) if key is not None else None
        if hit is not None:
            self.direct_calls += 1
            graph, returns_tuple = hit
            outs = graph(*[a for a in args if isinstance(a, torch.Tensor)])
            return tuple(outs) if returns_tuple else outs[0]
        self._last_graph = None
        out = self._compiled(*args)
        if key is not None and not torch.compiler.is_compiling():
            self._remember(key, args, out)
        return out

    def _remember(self, key: tuple, args: tuple, out: Any) -> None:
        """Keep the graph just compiled for direct calls if it takes exactly this call's
        tensors, in order, and returns tensors only (a graph that read anything else, or a
        call that compiled nothing new, stays with dynamo)."""
        if self._last_graph is None:
            return
        graph, inputs = self._last_graph
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        same_inputs = len(inputs) == len(tensors) and all(
            x is t for x, t in zip(inputs, tensors, strict=False)
        )
        returns_tuple = isinstance(out, tuple)
        outs = out if returns_tuple else (out,)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            return
        if same_inputs and not any(t.requires_grad for t in tensors):
            self._direct[key] = (graph, returns_tuple)

    def check(self, *args: Any, rtol: float = 1e-5, atol: float = 1e-6, **kwargs: Any) -> Any:
        """Call once (compiling for these shapes now) and assert the result matches ``fn``."""
        out = self(*args, **kwargs)
        torch.testing.assert_close(out, self.fn(*args, **kwargs), rtol=rtol, atol=atol)
        if self.direct and not kwargs and _direct_key(args) in self._direct:  # direct too
            torch.testing.assert_close(self(*args), out, rtol=0, atol=0)
        return out

    def __repr__(self) -> str:
        direct = f", direct_calls={self.direct_calls}" if self.direct else ""
        return (
            f"CompiledFunction({self.__name__}, compiles={self.compiles}, calls={self.calls}"
            f"{direct})"
        )


def _direct_key(args: tuple) -> tuple | None:
    """What a static-shape graph depends on, per argument (None if an argument is unhashable):
    tensor layout, or the value itself for Python numbers and strings."""
    key: list[Any] = [torch.is_grad_enabled(), torch.is_autocast_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.device, a.requires_grad))
        elif isinstance(a, (int, float, bool, str, type(None))):
            key.append((type(a), a))
        else:
            return None
    return tuple(key)


def compile_per_shape(fn: Callable[..., Any], **kwargs: Any) -> CompiledFunction:
    """Compile ``fn`` once per input shape, counting compiles (see :class:`CompiledFunction`)."""
    return CompiledFunction(fn, **kwargs)
