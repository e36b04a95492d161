"""Whether a fixed copy of a step computes what the unchanged one does: both run the same steps
from the same start, and their results are compared in two parts, each on its own scale: as one
vector, the parameters' norm hides a changed loss, and a loss near zero, whose rounding is large
beside it, would widen the parameters' allowance."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_leaves

from accel.doctor.fixes import StepCopy
from accel.doctor.isolation import put_back_files, seed_generators

__all__ = ["SEED", "Errors", "dropout_off", "result_error"]

SEED = 1234  # the seed both copies start from


class Errors(NamedTuple):
    """Relative errors (norm of the difference over the norm of the unchanged) of the tensors
    the steps returned, every step's as one vector, and of the parameters and buffers (running
    statistics) after the last."""

    outputs: float
    trained_state: float


def result_error(base_call, fixed_call, base: StepCopy, fixed: StepCopy, steps: int):
    """(:class:`Errors`, the fixed copy's first call in s): ``steps`` steps of each from the same
    start with the same seeds (torch's, ``random``'s, NumPy's)."""
    outputs, first_s = [], math.nan
    for label, call in (("base", base_call), ("fixed", fixed_call)):
        put_back_files()  # each from the user's files, not what the other copy left
        seed_generators(SEED)
        got = []
        for i in range(steps):
            started = time.perf_counter()
            got.append([_clone(t) for t in tree_leaves(call())])
            if label == "fixed" and i == 0:
                if fixed.device.type == "cuda":
                    torch.cuda.synchronize(fixed.device)
                first_s = time.perf_counter() - started
        outputs.append(got)
    returned = [(a, b) for run_a, run_b in zip(*outputs, strict=True)
                for a, b in zip(run_b, run_a, strict=True)]  # fmt: skip
    trained = list(zip(_trained_state(fixed), _trained_state(base), strict=True))
    return Errors(_relative_error(returned), _relative_error(trained)), first_s


def _relative_error(pairs: list[tuple[Any, Any]]) -> float:
    """The norm of (fixed - unchanged) over the norm of the unchanged, the tensors of ``pairs``
    as one vector."""
    diff = norm = 0.0
    for a, b in pairs:
        tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        if tensors and a.shape == b.shape and not (a.is_meta or b.is_meta):  # meta: no values
            wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
            a64, b64 = a.detach().to(wide), b.detach().to(wide)  # complex kept whole
            # NaN or inf where the unchanged step has it too is no difference; elsewhere, infinite
            same = (a64 == b64) | (a64.isnan() & b64.isnan())
            apart = torch.where(same, 0, a64 - b64).abs().nan_to_num(math.inf)
            diff += float(apart.square().sum())  # sync: once per tensor, outside timing
            norm += float(torch.where(b64.isfinite(), b64, 0).abs().square().sum())
    return math.sqrt(diff / norm) if norm > 0 else math.sqrt(diff)


def _clone(value: Any) -> Any:
    if isinstance(value, float):  # a loss read with .item(): compared as the tensor was
        return torch.tensor(value, dtype=torch.float64)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _trained_state(copy: StepCopy) -> list[torch.Tensor]:
    return [t for model in copy.parts.models for t in (*model.parameters(), *model.buffers())]


@contextlib.contextmanager
def dropout_off() -> Iterator[None]:
    """Dropout drawn nowhere while inside (``F.dropout``, which ``nn.Dropout`` and
    ``nn.MultiheadAttention`` call, ``torch.dropout``, SDPA's ``dropout_p``): SDPA draws its own
    mask, so a step whose attention it runs is compared with the step as written without any."""
    functional = torch.nn.functional
    kept = functional.dropout, torch.dropout, functional.scaled_dot_product_attention
    sdpa = kept[2]

    def no_dropout(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    functional.dropout = lambda input, p=0.5, training=True, inplace=False: input
    torch.dropout = lambda input, p, train: input
    functional.scaled_dot_product_attention = no_dropout
    try:
        yield
    finally:
        functional.dropout, torch.dropout, functional.scaled_dot_product_attention = kept
