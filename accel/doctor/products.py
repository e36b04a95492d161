"""A step's recorded matrix products timed again here, alone, at another precision or shape: what
the precision and padding findings predict from, measured on this GPU rather than taken from its
peak rate (a product of a few hundred rows reaches a fraction of it)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accel.doctor.recorder import PRODUCTS, OpRecord

__all__ = ["backend_flags", "kept_backend_flags", "product_call", "recurrent_call", "time_products"]

CONVOLUTION = "aten::convolution"  # forward only: its backward takes the convolutions' ratio
RECURRENT = "aten::_cudnn_rnn"  # forward and backward timed together; the backward op takes it
# the kind of work an operator does: what is not timed takes the ratio its kind's timed ones got
_FAMILIES = {CONVOLUTION: "convolution", "aten::convolution_backward": "convolution",
             "aten::_convolution": "convolution", RECURRENT: "recurrent",
             "aten::_cudnn_rnn_backward": "recurrent"} | dict.fromkeys(PRODUCTS, "product")  # fmt: skip
# cuDNN's recurrent modes, as the layer that runs them
_RECURRENT_LAYERS = {0: ("RNN", "relu"), 1: ("RNN", "tanh"), 2: ("LSTM", None), 3: ("GRU", None)}
MOST_SHAPES = 8  # distinct products timed per step (the rest take their kind's ratio)


def _operands(op: OpRecord) -> list[tuple[int, ...]]:
    shapes = [t.shape for t in op.inputs]
    if op.op in ("aten::addmm", "aten::baddbmm"):
        return shapes[1:3]
    return shapes[:2]


def _conv_settings(op: OpRecord) -> tuple | None:
    """(stride, padding, dilation, groups) of a 2-d convolution, from its recorded scalars."""
    s = op.scalars
    if len(op.inputs) < 2 or len(op.inputs[0].shape) != 4 or len(s) < 10 or s[6]:
        return None  # not 2-d, or transposed
    return (tuple(s[0:2]), tuple(s[2:4]), tuple(s[4:6]), s[9])


def _recurrent_settings(op: OpRecord) -> tuple | None:
    """(mode, hidden size, layers, batch first, bidirectional) of a cuDNN recurrent layer, from
    its recorded scalars (weight stride, mode, hidden size, projection size, layers, batch
    first, dropout, train, bidirectional); None with a projection or an unread layout."""
    s = op.scalars
    read = len(s) >= 9 and op.inputs and len(op.inputs[0].shape) == 3
    if not read or s[3] or s[1] not in _RECURRENT_LAYERS:
        return None
    return (s[1], s[2], s[4], bool(s[5]), bool(s[8]))


def _key(op: OpRecord) -> tuple | None:
    """What makes two recorded products the same call to time; its first item is the family."""
    tf32, family = "tf32" in op.facts, _FAMILIES.get(op.op)
    if op.op in PRODUCTS and op.inputs:
        return (family, tuple(_operands(op)), op.inputs[0].dtype, tf32, None)
    if op.op == CONVOLUTION:
        settings = _conv_settings(op)
        shapes = tuple(t.shape for t in op.inputs[:2])
    elif op.op == RECURRENT:
        settings = _recurrent_settings(op)
        shapes = (op.inputs[0].shape,)
    else:
        return None
    return (family, shapes, op.inputs[0].dtype, tf32, settings) if settings else None


def product_call(
    shapes: list[tuple], dtype: torch.dtype, device: torch.device, conv: tuple | None = None
) -> Callable[[], torch.Tensor]:
    """An mm, a bmm or (with ``conv``) a conv2d of random ``shapes`` operands."""
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(s, generator=gen, device=device, dtype=dtype) for s in shapes)
    if conv is not None:
        stride, padding, dilation, groups = conv
        return lambda: torch.nn.functional.conv2d(a, b, None, stride, padding, dilation, groups)
    return (lambda: torch.bmm(a, b)) if a.dim() == 3 else (lambda: torch.mm(a, b))


def recurrent_call(
    shapes: list[tuple], dtype: torch.dtype, device: torch.device, settings: tuple
) -> Callable[[], torch.Tensor]:
    """A recurrent layer's forward and backward (``settings`` as :func:`_recurrent_settings`
    reads them) on a random float32 input of ``shapes[0]`` that needs its gradient, with random
    weights; ``dtype`` bf16 or fp16: under autocast, as a step would run it. Returns the
    output."""
    mode, hidden, layers, batch_first, bidirectional = settings
    name, nonlinearity = _RECURRENT_LAYERS[mode]
    kwargs = {"nonlinearity": nonlinearity} if nonlinearity else {}
    shape = shapes[0]
    size = shape[2]
    layer = getattr(torch.nn, name)(size, hidden, layers, batch_first=batch_first,
                                    bidirectional=bidirectional, device="meta", **kwargs)  # fmt: skip
    layer.to_empty(device=device)  # no draw from the process's generators
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * hidden**-0.5)
    x = torch.randn(shape, generator=gen, device=device, requires_grad=True)
    low = dtype in (torch.bfloat16, torch.float16)
    inputs = [x, *layer.parameters()]
    grad = None

    def call() -> torch.Tensor:
        nonlocal grad
        with torch.autocast(device.type, dtype=dtype, enabled=low):
            out = layer(x)[0]
        if grad is None:
            grad = torch.randn(out.shape, generator=gen, device=device, dtype=out.dtype)
        torch.autograd.grad(out, inputs, grad)  # the gradients returned, none accumulated
        return out.detach()

    return call


# the torch.backends settings a step's products run under, by name
_BACKEND_FLAGS = {
    "tf32": ((torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")),
    "cudnn_benchmark": ((torch.backends.cudnn, "benchmark"),),
}


_MATMUL = torch.backends.cuda.matmul
# the other process-wide flags a step may set (a seeding helper's determinism, a debugging
# session's switches)
_KEPT_FLAGS = ((torch.backends.cudnn, "deterministic"), (torch.backends.cudnn, "enabled"),
               (_MATMUL, "allow_fp16_reduced_precision_reduction"),
               (_MATMUL, "allow_bf16_reduced_precision_reduction"),
               (torch.backends.mkldnn, "enabled"))  # fmt: skip
_PRECISION = (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision)


def _flushing_denormals() -> bool:
    """Whether ``torch.set_flush_denormal(True)`` is on (torch has no getter): a float32
    denormal made on the host reads back as 0."""
    return torch.tensor([1e-40], dtype=torch.float32).item() == 0.0


# (read, write) of those set through functions; the precision last: allow_tf32 rewrites it
_KEPT_SWITCHES = (
    (lambda: (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda on: torch.use_deterministic_algorithms(on[0], warn_only=on[1])),
    (lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
     lambda on: torch.autograd.set_detect_anomaly(*on)),
    (torch.get_num_threads, torch.set_num_threads),
    (torch.get_default_dtype, torch.set_default_dtype),
    (torch.is_grad_enabled, torch.set_grad_enabled),
    (_flushing_denormals, torch.set_flush_denormal),
    (torch._C._is_multithreading_enabled, torch.autograd.set_multithreading_enabled),
    (torch._tensor_str.get_printoptions, lambda options: torch.set_printoptions(**options)),
    *((getattr(torch.backends.cuda, f"{kind}_sdp_enabled"),
       getattr(torch.backends.cuda, f"enable_{kind}_sdp"))
      for kind in ("flash", "mem_efficient", "math", "cudnn")),
    _PRECISION,
)  # fmt: skip


@contextlib.contextmanager
def backend_flags(**settings: bool) -> Iterator[None]:
    """``torch.backends`` flags (``tf32``, ``cudnn_benchmark``) set while inside."""
    places = [
        (where, attr, on) for name, on in settings.items() for where, attr in _BACKEND_FLAGS[name]
    ]
    # only what it sets: a fix's context is entered on every call of the step it times
    with _kept([(where, attr) for where, attr, _ in places], (_PRECISION,)):
        for where, attr, on in places:
            setattr(where, attr, on)
        yield


@contextlib.contextmanager
def kept_backend_flags() -> Iterator[None]:
    """Every flag :func:`backend_flags` sets and the other process-wide switches a step may set
    (determinism, anomaly detection, the SDPA kernels allowed, the thread count, the default
    dtype, grad mode, denormals flushed, print options, oneDNN, autograd's threads, the float32
    matmul precision), put back on leaving (a step that turns on
    TF32 changes every later float32 product of the process)."""
    places = [place for places in _BACKEND_FLAGS.values() for place in places] + [*_KEPT_FLAGS]
    with _kept(places, _KEPT_SWITCHES):
        yield


@contextlib.contextmanager
def _kept(places: list[tuple[Any, str]], switches: tuple) -> Iterator[None]:
    saved = [(where, attr, getattr(where, attr)) for where, attr in places]
    values = [(write, read()) for read, write in switches]
    try:
        yield
    finally:
        for where, attr, value in saved:
            setattr(where, attr, value)
        for write, value in values:
            write(value)


def _with_tf32(call: Callable[[], torch.Tensor], on: bool) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with backend_flags(tf32=on):
            return call()

    return run


def time_products(
    ops: list[OpRecord], device: torch.device, variants: dict[str, Callable]
) -> dict[str, float]:
    """The recorded time of ``ops`` (products and convolutions) as it would be under each
    variant: the largest distinct ones are timed as recorded and as each variant makes them
    (``variant(shapes, dtype) -> (shapes, dtype, tf32)``), interleaved, their recorded time scaled
    by the ratio; the rest by the overall ratio of the timed ones of their kind (products,
    convolutions, recurrent layers), or of all timed ones where none of their kind was.
    Returns variant -> us."""
    from accel.measure.timer import compare

    by_key: dict[tuple, float] = defaultdict(float)
    rest: dict[str, float] = defaultdict(float)  # family -> the time of its untimed ops
    for op in ops:
        key = _key(op)
        if key is None:
            rest[_FAMILIES.get(op.op, "other")] += op.time_us
        else:
            by_key[key] += op.time_us
    top = sorted(by_key, key=lambda k: -by_key[k])[:MOST_SHAPES]
    for key in set(by_key) - set(top):
        rest[key[0]] += by_key[key]
    after = {name: defaultdict(float) for name in variants}
    timed_now: dict[str, float] = defaultdict(float)
    for key in top:
        _, shapes, dtype, tf32, conv = key
        calls = {"as recorded": (list(shapes), dtype, tf32)}
        calls |= {name: make(list(shapes), dtype) for name, make in variants.items()}
        make_call = recurrent_call if key[0] == _FAMILIES[RECURRENT] else product_call
        calls = {name: _with_tf32(make_call(s, d, device, conv), t)
                 for name, (s, d, t) in calls.items()}  # fmt: skip
        timing = compare(calls, warmup=3, repeats=7, calls_per_sample=None, device=device)
        now = timing.timings["as recorded"].median_ms
        family = key[0]
        timed_now[family] += by_key[key]
        for name in variants:
            after[name][family] += by_key[key] * timing.timings[name].median_ms / now
    total = sum(timed_now.values())
    result = {}
    for name, by_family in after.items():
        overall = sum(by_family.values()) / total if total > 0 else 1.0
        result[name] = sum(by_family.values()) + sum(
            time * (by_family[family] / timed_now[family] if timed_now[family] > 0 else overall)
            for family, time in rest.items()
        )
    return result
