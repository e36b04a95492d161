"""Pairwise-cosine diversity in Triton: the launchers behind ``accel.diversity``.

Groups of N <= ``SMALL_N`` rows take the group kernels (``pairwise_cosine_groups``: whole groups
per program, every cosine in registers or in one tensor-core product; means of groups padded to
``CLOSED_FORM_MIN_N`` rows by the O(N D) closed form over whole rows), launched as
``pairwise_cosine_config`` says; larger groups (and float32 means past ``CLOSED_FORM_LARGE_N``
rows too long for one step) take the large-set kernels (``pairwise_cosine_large``): the mean by
the closed form with a group's rows split over programs, the nearest distances and the matrix by
a fused-attention-shaped tiled kernel that never stores the N x N matrix. Each kernel reads the
embeddings from device memory once, through their strides (non-contiguous tensors need no
copy), and accumulates in float32.

The functions here take embeddings ``(B, N, D)`` and ``counts`` already checked by the caller
(``accel.diversity.check_embeddings``) and ``eps`` (vectors are normalized as x / max(||x||,
eps)), and run the kernels unconditionally; ``accel.diversity`` decides whether they can run
(CUDA, or Triton's interpreter) and otherwise falls back to its references. Results are float32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from .launch import Launcher, hooked, row_alignment
from .pairwise_cosine_config import (
    DOT_MAX_ROWS,
    DOT_MIN_ROWS,
    PAIRS_MAX_N,
    SMALL_N,
    SWEEP_VARIANTS,
    GroupConfig,
    block_rows,
    closed_form_rows,
    group_config,
    group_kernel_takes_mean,
    mean_config,
    rule_config,
)
from .pairwise_cosine_groups import (
    closed_form_kernel,
    group_dot_kernel,
    group_kernel,
    pairs_kernel,
)
from .pairwise_cosine_large import (
    INTERPRET_TILED,
    ROWS_BLOCK_D,
    ROWS_BLOCK_M,
    group_mean_kernel,
    inv_norm_kernel,
    mean_from_partials_kernel,
    normalized_sum_kernel,
    tiled_16bit,
    tiled_fp32,
    tiled_kernel,
)

MODE_MEAN, MODE_NEAREST, MODE_MATRIX = 0, 1, 2

# True when the kernels were decorated under TRITON_INTERPRET=1 (triton.jit reads it as it
# decorates); accel.triton_support.kernel_module keeps one set of kernel modules per mode.
INTERPRETED: bool = type(group_kernel).__name__ == "InterpretedFunction"

# One launcher per kernel: after a signature's first call, its launches skip Triton's per-call
# argument binding (accel.kernels.launch).
_launch_group, _launch_pairs = Launcher(group_kernel), Launcher(pairs_kernel)
_launch_group_dot = Launcher(group_dot_kernel)
_launch_closed_form = Launcher(closed_form_kernel)
_launch_inv_norms, _launch_normalized_sum = (
    Launcher(inv_norm_kernel),
    Launcher(normalized_sum_kernel),
)
_launch_mean_from_partials = Launcher(mean_from_partials_kernel)
_launch_group_mean = Launcher(group_mean_kernel)
FINISH_BLOCK = 128  # columns (or members) a finishing program sums at a time
_launch_tiled = {torch.float32: Launcher(tiled_fp32), "16 bit": Launcher(tiled_16bit)}
_launch_tiled_interpreted = Launcher(tiled_kernel)


class GroupPlan(NamedTuple):
    """How the group kernels launch on one signature of inputs."""

    launch: Launcher
    grid: tuple[int]
    constexprs: dict
    no_matrix: bool  # the pairs kernel: no matrix pointer among its arguments
    key: int  # the launcher's key: a small int, cheaper to hash per call than the signature


_GROUP_PLANS: dict[tuple, GroupPlan] = {}  # signature -> its plan


def _signature(x: torch.Tensor, counts: torch.Tensor | None, *extra) -> tuple | None:
    """What a compiled launch on ``x`` and ``counts`` is specialized on (None in the
    interpreter, which compiles nothing): the launch cache's key."""
    if INTERPRETED:
        return None
    counts_key = None if counts is None else (counts.dtype, counts.data_ptr() % 16)
    return (*extra, x.shape, x.stride(), x.dtype, x.data_ptr() % 16, counts_key)


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot takes ``dtype``'s values as float32 (two TF32 passes): float32 inputs,
    and bfloat16 in the interpreter, whose dot multiplies bfloat16's raw bits (Triton 3.9).
    16-bit products are exact in float32 anyway, so the tensor cores' result differs from the
    float32 one only in the order of the sums."""
    return dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)


def check_runnable(x: torch.Tensor) -> None:
    if not (INTERPRETED or x.is_cuda):
        raise ValueError(
            f"the Triton kernels need a CUDA tensor, got one on {x.device.type} (set "
            "TRITON_INTERPRET=1 before the call to run them through Triton's interpreter)"
        )


# ---- groups of N <= SMALL_N ------------------------------------------------------------------


def group_outputs(x: torch.Tensor, mode: int):
    """(out (B,), items (B, N), matrix (B, N, N)) float32; those the mode does not fill are
    ``out`` itself, passed where the kernel wants a pointer it never writes."""
    B, N, _ = x.shape
    dev = x.device
    out = torch.empty(B, device=dev, dtype=torch.float32)
    items = torch.empty(B, N, device=dev, dtype=torch.float32) if mode == MODE_NEAREST else out
    matrix = torch.empty(B, N, N, device=dev, dtype=torch.float32) if mode == MODE_MATRIX else out
    return out, items, matrix


def run_group(
    x: torch.Tensor,
    counts: torch.Tensor | None,
    mode: int,
    config: GroupConfig | None = None,
    *,
    eps: float,
):
    """(out (B,), items (B, N), matrix (B, N, N)); only the mode's outputs are filled.

    ``config`` overrides the table and rule (for tests and sweeps). A "pairs" configuration runs
    :func:`pairs_kernel`; it has no matrix mode, which then takes the rule's launch. A "dot" one
    runs :func:`group_dot_kernel`. The variants kept for the bench sweep run in
    ``pairwise_cosine_variants``, not here.
    """
    B, N, D = x.shape
    key = _signature(x, counts, mode) if config is None else None
    plan = _GROUP_PLANS.get(key) if key is not None else None
    if plan is None:
        plan = GroupPlan(*_group_plan(x, mode, counts is not None, config), len(_GROUP_PLANS))
        if key is not None:
            _GROUP_PLANS[key] = plan
    launch, grid, constexprs, no_matrix, launch_key = plan
    out, items, matrix = group_outputs(x, mode)
    counts_or_any = counts if counts is not None else out
    if no_matrix:
        args = (x, counts_or_any, out, items, B, N, D, *x.stride(), eps)
    else:
        args = (x, counts_or_any, out, items, matrix, B, N, D, *x.stride(), eps)
    launch(launch_key if key is not None else None, grid, args, constexprs)
    return out, items, matrix


def _group_plan(x: torch.Tensor, mode: int, has_counts: bool, config: GroupConfig | None):
    """(launcher, grid, constexprs, no matrix pointer) of the group kernels for ``x``."""
    B, N, D = x.shape
    block_n = block_rows(N)
    itemsize = x.element_size()
    if config is None:
        choose = mean_config if mode == MODE_MEAN else group_config
        config = choose(block_n, D, B, itemsize, ragged=has_counts)
    if config.variant in SWEEP_VARIANTS:
        raise ValueError(
            f"the {config.variant!r} group kernel is kept for the bench sweep: launch it with "
            "accel.kernels.pairwise_cosine_variants.run_variant"
        )
    if config.variant == "pairs" and mode == MODE_MATRIX:
        config = rule_config(block_n, D, B, itemsize, pairs=False)
    if config.variant == "pairs" and not 2 <= N <= PAIRS_MAX_N:
        raise ValueError(f"the 'pairs' group kernel takes 2 <= N <= {PAIRS_MAX_N}, got N={N}")
    grid = (triton.cdiv(B, config.groups),)
    common = dict(MODE=mode, HAS_COUNTS=has_counts, GROUPS=config.groups, ALIGN=row_alignment(x))
    common |= config.options()
    if config.variant == "pairs":
        block_d = min(config.block_d, max(16, triton.next_power_of_2(D)))
        return _launch_pairs, grid, common | dict(BLOCK_D=block_d, ROWS=N), True
    if config.variant == "closed":
        if mode != MODE_MEAN or config.block_d < D:
            raise ValueError(
                "the 'closed' group kernel takes the mean only, of rows no longer than its "
                f"block_d; got mode {mode} and D={D} for block_d={config.block_d}"
            )
        step = closed_form_rows(block_n, config, ragged=has_counts)
        rows = dict(BLOCK_N=step, BLOCK_D=config.block_d)
        return _launch_closed_form, grid, common | rows, True
    if config.variant == "dot":
        if not DOT_MIN_ROWS <= config.groups * block_n <= DOT_MAX_ROWS:
            raise ValueError(
                f"the 'dot' group kernel takes a tile of {DOT_MIN_ROWS} to {DOT_MAX_ROWS} rows "
                f"(groups x N rounded up to a power of 2), got {config.groups} x {block_n}"
            )
        tile = dict(BLOCK_N=block_n, BLOCK_D=config.block_d, DOT_FP32=_dot_in_fp32(x.dtype))
        # 16 bits only: the float32 tile of 64 rows ran slower with the branch, even untaken
        # (results/diversity-notes.md)
        half = has_counts and config.groups == 1 and block_n >= 2 * DOT_MIN_ROWS
        tile["HALF_TILE"] = half and mode != MODE_MATRIX and itemsize == 2
        return _launch_group_dot, grid, common | tile, False
    return _launch_group, grid, common | dict(BLOCK_N=block_n) | config.meta(D, itemsize), False


# ---- a seen signature's call, at the least host work -----------------------------------------

# What each function returns of the group kernel's outputs, and the mode that fills it.
_GROUP_RESULTS = {
    "mean_diversity": (MODE_MEAN, "out"),
    "nearest_distances": (MODE_NEAREST, "items"),
    "nearest_diversity": (MODE_NEAREST, "out"),
    "pairwise_distances": (MODE_MATRIX, "matrix"),
}


class ReadyCall:
    """``name`` on inputs of one seen signature, with nothing between the call and the launch
    but the result's allocation: the compiled kernel is launched directly with addresses. What
    the mode writes besides the result (the nearest distances of ``nearest_diversity``, the
    group means of ``nearest_distances``) goes to a scratch that nothing reads (:func:`_scratch`).
    Calling it returns the result, or None while a launch hook is set or another device is
    current (then the usual path runs)."""

    __slots__ = ("after", "before", "device", "direct", "index", "scalars", "scratch", "shape")

    def __init__(self, name: str, x: torch.Tensor, plan: GroupPlan, direct, eps: float):
        B, N, D = x.shape
        mode, result = _GROUP_RESULTS[name]
        shapes = {"out": (B,), "items": (B, N), "matrix": (B, N, N)}
        written = {MODE_MEAN: ["out"], MODE_NEAREST: ["out", "items"], MODE_MATRIX: ["matrix"]}
        others = [part for part in written[mode] if part != result]
        self.scratch = _scratch(x.device, sum(math.prod(shapes[part]) for part in others))
        addresses, at = {}, self.scratch.data_ptr()
        for part in others:
            addresses[part] = at
            at += 4 * math.prod(shapes[part])  # bytes of float32
        # the pointers out, items (and matrix, unless the pairs kernel runs): the result's at
        # each call, the others fixed; one the mode never writes points at the scratch
        slots = ("out", "items", "matrix")[: 2 if plan.no_matrix else 3]
        fixed = [addresses.get(part, self.scratch.data_ptr()) for part in slots]
        place = slots.index(result)
        self.before, self.after = tuple(fixed[:place]), tuple(fixed[place + 1 :])
        self.scalars = (B, N, D, *x.stride(), eps)
        self.shape, self.direct = shapes[result], direct
        self.index = torch._C._cuda_getDevice()
        self.device = x.device

    def __call__(self, x: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor | None:
        if hooked() or torch._C._cuda_getDevice() != self.index:
            return None
        result = torch.empty(*self.shape, device=self.device, dtype=torch.float32)
        counts_at = self.scratch.data_ptr() if counts is None else counts.data_ptr()
        args = (x.data_ptr(), counts_at, *self.before, result.data_ptr(), *self.after)
        self.direct.launch(self.index, args + self.scalars)
        return result


# (device, float32 elements, a power of 2) -> scratch shared by every ReadyCall of that size
_SCRATCH: dict[tuple[torch.device, int], torch.Tensor] = {}


def _scratch(device: torch.device, floats: int) -> torch.Tensor:
    """Room for outputs that kernels write and nobody reads, so any launches may share it:
    sizes rounded up to a power of 2, so all of it together stays under 4 times the largest."""
    size = 1 << max(0, floats - 1).bit_length()
    if (device, size) not in _SCRATCH:
        _SCRATCH[(device, size)] = torch.empty(size, device=device, dtype=torch.float32)
    return _SCRATCH[(device, size)]


def ready_call(name: str, x: torch.Tensor, counts: torch.Tensor | None, eps: float):
    """After ``name`` ran on ``x`` and ``counts`` (counts contiguous): its :class:`ReadyCall`
    for inputs of the same signature, or None where the call takes another path (groups over
    ``SMALL_N``, fewer than two members, the interpreter) or launched without a direct handle."""
    B, N, _ = x.shape
    if INTERPRETED or B == 0 or not 2 <= N <= SMALL_N:
        return None
    plan = _GROUP_PLANS.get(_signature(x, counts, _GROUP_RESULTS[name][0]))
    if plan is None:
        return None
    direct = plan.launch.direct(plan.key)
    return None if direct is None else ReadyCall(name, x, plan, direct, eps)


# ---- large groups ------------------------------------------------------------------------------


def _run_inv_norms(x: torch.Tensor, eps: float) -> torch.Tensor:
    B, N, D = x.shape
    inv = torch.empty(B, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, ROWS_BLOCK_M), B)
    _launch_inv_norms(
        _signature(x, None),
        grid,
        (x, inv, N, D, *x.stride(), eps),
        dict(BLOCK_M=ROWS_BLOCK_M, BLOCK_D=ROWS_BLOCK_D),
    )
    return inv


def _run_tiled(x: torch.Tensor, counts: torch.Tensor | None, mode: int, eps: float) -> torch.Tensor:
    """Nearest distances (B, N) or the distance matrix (B, N, N) of groups of any size."""
    B, N, D = x.shape
    inv = _run_inv_norms(x, eps)
    if mode == MODE_NEAREST:
        out = torch.empty(B, N, device=x.device, dtype=torch.float32)
        items, matrix = out, inv
    else:
        out = torch.zeros(B, N, N, device=x.device, dtype=torch.float32)
        items, matrix = inv, out
    args = (x, inv, counts if counts is not None else inv, items, matrix, N, D, *x.stride())
    meta = dict(MODE=mode, HAS_COUNTS=counts is not None, DOT_FP32=_dot_in_fp32(x.dtype))
    if INTERPRETED:
        grid = (triton.cdiv(N, INTERPRET_TILED["BLOCK_M"]), B)
        _launch_tiled_interpreted(None, grid, args, meta | INTERPRET_TILED)
    else:
        tuned = _launch_tiled[torch.float32 if x.dtype == torch.float32 else "16 bit"]
        grid = lambda m: (triton.cdiv(N, m["BLOCK_M"]), B)  # noqa: E731
        tuned(_signature(x, counts, mode), grid, args, meta)
    return out


def _run_closed_form_mean(x: torch.Tensor, counts: torch.Tensor | None, eps: float) -> torch.Tensor:
    B, N, D = x.shape
    blocks = triton.cdiv(N, ROWS_BLOCK_M)
    partial = torch.empty(B, blocks, D, device=x.device, dtype=torch.float32)
    partial_sq = torch.empty(B, blocks, device=x.device, dtype=torch.float32)
    args = (x, counts if counts is not None else partial_sq, partial, partial_sq, N, D)
    _launch_normalized_sum(
        _signature(x, counts),
        (blocks, B),
        (*args, *x.stride(), eps),
        dict(HAS_COUNTS=counts is not None, BLOCK_M=ROWS_BLOCK_M, BLOCK_D=ROWS_BLOCK_D),
    )
    out = torch.empty(B, device=x.device, dtype=torch.float32)
    _launch_mean_from_partials(
        _signature(x, counts),
        (B,),
        (partial, partial_sq, counts if counts is not None else out, out, N, D, blocks),
        dict(HAS_COUNTS=counts is not None, BLOCK_D=FINISH_BLOCK),
    )
    return out


def _group_means(items: torch.Tensor, counts: torch.Tensor | None, x: torch.Tensor):
    """Each group's mean of ``items`` (B, N) over its members; 0 for fewer than two."""
    B, N = items.shape
    out = torch.empty(B, device=items.device, dtype=torch.float32)
    _launch_group_mean(
        _signature(x, counts),
        (B,),
        (items, counts if counts is not None else out, out, N),
        dict(HAS_COUNTS=counts is not None, BLOCK=FINISH_BLOCK),
    )
    return out


# ---- the functions accel.diversity dispatches to: x (B, N, D) checked, results float32 --------


def mean_diversity(x: torch.Tensor, counts: torch.Tensor | None = None, *, eps: float):
    """1 - mean cosine over pairs i != j of each group: (B,)."""
    check_runnable(x)
    B, N, D = x.shape
    if B == 0 or N < 2:  # no pairs anywhere: diversity 0 by definition
        return torch.zeros(B, device=x.device)
    if group_kernel_takes_mean(N, D, x.element_size()):
        return run_group(x, counts, MODE_MEAN, eps=eps)[0]
    return _run_closed_form_mean(x, counts, eps)


def nearest_distances(x: torch.Tensor, counts: torch.Tensor | None = None, *, eps: float):
    """Cosine distance from each member to its nearest other member: (B, N)."""
    check_runnable(x)
    B, N, _ = x.shape
    if B == 0 or N < 2:
        return torch.zeros(B, N, device=x.device)
    if N <= SMALL_N:
        return run_group(x, counts, MODE_NEAREST, eps=eps)[1]
    return _run_tiled(x, counts, MODE_NEAREST, eps)


def nearest_diversity(x: torch.Tensor, counts: torch.Tensor | None = None, *, eps: float):
    """Group mean of the nearest-other distances: (B,)."""
    check_runnable(x)
    B, N, _ = x.shape
    if B == 0 or N < 2:
        return torch.zeros(B, device=x.device)
    if N <= SMALL_N:
        return run_group(x, counts, MODE_NEAREST, eps=eps)[0]
    return _group_means(_run_tiled(x, counts, MODE_NEAREST, eps), counts, x)


def pairwise_distances(x: torch.Tensor, counts: torch.Tensor | None = None, *, eps: float):
    """The matrix 1 - cos(x_i, x_j): (B, N, N); zero outside each group's count."""
    check_runnable(x)
    B, N, _ = x.shape
    if B == 0 or N == 0:
        return torch.zeros(B, N, N, device=x.device)
    if N <= SMALL_N:
        return run_group(x, counts, MODE_MATRIX, eps=eps)[2]
    return _run_tiled(x, counts, MODE_MATRIX, eps)
