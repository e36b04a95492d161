"""A step's recorded matrix products timed again here, alone, at another precision or shape: what
the precision and padding findings predict from, measured on this GPU rather than taken from its
peak rate (a product of a few hundred rows reaches a fraction of it)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from accel.doctor.recorder import OpRecord

__all__ = ["PRODUCTS", "product_call", "time_products"]

PRODUCTS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
MOST_SHAPES = 8  # distinct products timed per step (the rest take their mean ratio)


def _operands(op: OpRecord) -> list[tuple[int, ...]]:
    shapes = [t.shape for t in op.inputs]
    if op.op in ("aten::addmm", "aten::baddbmm"):
        return shapes[1:3]
    return shapes[:2]


def product_call(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> Callable[[], torch.Tensor]:
    """A product of random operands of ``shapes`` (2-d: mm, 3-d: bmm) in ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(s, generator=gen, device=device, dtype=dtype) for s in shapes)
    return (lambda: torch.bmm(a, b)) if a.dim() == 3 else (lambda: torch.mm(a, b))


@contextlib.contextmanager
def _tf32(on: bool) -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _with_tf32(call: Callable[[], torch.Tensor], on: bool) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with _tf32(on):
            return call()

    return run


def time_products(
    ops: list[OpRecord], device: torch.device, variants: dict[str, Callable]
) -> dict[str, float]:
    """The recorded time of ``ops`` (products only) as it would be under each variant: the
    largest distinct products are timed as recorded and as each variant makes them
    (``variant(shapes, dtype) -> (shapes, dtype, tf32)``), their recorded time scaled by the
    ratio; the rest by the timed ones' overall ratio. Returns variant -> us."""
    from accel.lab.timing import compare

    by_shape: dict[tuple, float] = defaultdict(float)
    for op in ops:
        if op.op in PRODUCTS and op.inputs:
            by_shape[(tuple(_operands(op)), op.inputs[0].dtype)] += op.time_us
    total = sum(by_shape.values())
    top = sorted(by_shape, key=lambda k: -by_shape[k])[:MOST_SHAPES]
    after = dict.fromkeys(variants, 0.0)
    timed_now = 0.0
    for shapes, dtype in top:
        calls = {"as recorded": (list(shapes), dtype, False)}
        calls |= {name: make(list(shapes), dtype) for name, make in variants.items()}
        timing = compare(
            {name: _with_tf32(product_call(s, d, device), tf32) for name, (s, d, tf32) in calls.items()},
            warmup=3, repeats=7, calls_per_sample=None, device=device,
        )  # fmt: skip
        now = timing.timings["as recorded"].median_ms
        timed_now += by_shape[(shapes, dtype)]
        for name in variants:
            after[name] += by_shape[(shapes, dtype)] * timing.timings[name].median_ms / now
    rest = total - timed_now
    for name in variants:
        ratio = after[name] / timed_now if timed_now > 0 else 1.0
        after[name] += rest * ratio
    return after
