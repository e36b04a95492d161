"""The sdpa phase's ground: targets, sizes, one attention case (:class:`AttnCase`) and its cost
model, and how a case is measured: variants timed interleaved, every kernel at a shape
(:func:`backend_frame`), which backend really ran (the profiler), peak memory, errors against
float64. FLOPs follow the FlashAttention papers: a forward is two products of 2 Sq Sk D each, a
backward five (recomputation not counted); causal halves both.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from accel import attention, memory
from accel.errors import collection_of
from accel.measure.attention import sdpa_backends
from accel.measure.profile import profile_step
from accel.measure.timer import interleaved

PHASE = "sdpa"
# Targets, judged on a CUDA GPU with the gpu preset only.
TARGET_TFLOP_S = 640.0  # sdpa as a user calls it (PyTorch's pick), B=4 H=16 S=4096 D=128 bf16 fwd
TARGET_VS_MANUAL = 6.0
TARGET_CAUSAL_TRAIN_TFLOP_S = 450.0
TARGET_VIT = 2.5
# The ATen op each backend dispatches to: what the profiler shows for "which one really ran".
SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


# ---- cost model --------------------------------------------------------------------------------
def attention_flops(batch, heads, seq_q, seq_k, head_dim, *, causal=False, backward=False) -> float:
    """Matrix-product FLOPs of attention (forward, or forward + backward)."""
    flops = 4.0 * batch * heads * seq_q * seq_k * head_dim
    flops = flops / 2 if causal else flops
    return flops * 3.5 if backward else flops


def attention_bytes(batch, heads, seq_q, seq_k, head_dim, *, elem_bytes, manual=False) -> float:
    """Bytes a forward moves through memory at least. Fused: read q, k, v, write the output.
    Manual adds the (B, H, Sq, Sk) scores six times: written by q k^T, read and written by the
    scale, read and written by the softmax, read by the product with v."""
    moved = batch * heads * (2 * seq_q + 2 * seq_k) * head_dim * elem_bytes
    if manual:
        moved += 6 * batch * heads * seq_q * seq_k * elem_bytes
    return float(moved)


# ---- one attention case ------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnCase:
    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool = False
    backward: bool = False
    dtype: torch.dtype = torch.bfloat16

    @property
    def flops(self) -> float:
        shape = (self.batch, self.heads, self.seq, self.seq, self.head_dim)
        return attention_flops(*shape, causal=self.causal, backward=self.backward)

    @property
    def direction(self) -> str:
        return "fwd+bwd" if self.backward else "fwd"

    @property
    def name(self) -> str:
        return (
            f"B={self.batch} H={self.heads} S={self.seq} D={self.head_dim} "
            f"{'causal' if self.causal else 'full'} {self.direction}"
        )


@dataclass(frozen=True)
class BenchSizes:
    headline: AttnCase
    repeats: int
    vit_repeats: int


BENCH_SIZES = {
    "gpu": BenchSizes(headline=AttnCase(4, 16, 4096, 128), repeats=20, vit_repeats=10),
    "cpu": BenchSizes(
        headline=AttnCase(1, 2, 255, 32, dtype=torch.float32), repeats=7, vit_repeats=5
    ),
}


def make_inputs(case: AttnCase, device: torch.device, seed: int = 0):
    """Random q, k, v (B, H, S, D) and, for a backward, a random incoming gradient."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (case.batch, case.heads, case.seq, case.head_dim)
    q, k, v, grad = (
        torch.randn(shape, generator=gen, device=device, dtype=case.dtype) for _ in range(4)
    )
    return *(t.requires_grad_(case.backward) for t in (q, k, v)), grad


def variant_fn(variant: str, case: AttnCase, q, k, v, grad) -> Callable[[], object]:
    """One timed call of ``variant``: "manual", or an ``accel.attention.sdpa`` backend."""

    def forward():
        if variant == "manual":
            return attention.attention_reference(q, k, v, causal=case.causal)
        return attention.sdpa(q, k, v, causal=case.causal, backend=variant)

    return as_timed(forward, case, (q, k, v), grad)


def as_timed(forward: Callable[[], torch.Tensor], case: AttnCase, inputs, grad) -> Callable:
    """``forward`` as a case times it: without autograd, or with the backward to ``inputs``."""
    if case.backward:
        return lambda: torch.autograd.grad(forward(), inputs, grad)

    def no_grad_forward():
        with torch.no_grad():
            return forward()

    return no_grad_forward


def first_call_s(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call (a compile among them) to the device's end."""
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


@dataclass(frozen=True)
class PointTimes:
    """One case measured: median ms per variant, the reason of each one skipped."""

    times: dict[str, float]
    skipped: dict[str, str]


def measure_point(case: AttnCase, device, variants: Sequence[str], *, repeats=10, warmup=2, seed=0):
    """Median ms of each variant that can run ``case`` and the reason of each one skipped, in one
    interleaved measurement."""
    variants = collection_of(variants, "variant names")
    q, k, v, grad = make_inputs(case, device, seed)
    fns, skipped = {}, {}
    for variant in variants:
        fn = variant_fn(variant, case, q, k, v, grad)
        try:
            fn()  # the first call finds out whether the backend can run (and warms it)
        except (attention.BackendUnavailableError, RuntimeError) as error:
            skipped[variant] = getattr(error, "reason", str(error))
            continue
        fns[variant] = fn
    times = {}
    if fns:
        timed = interleaved(fns, device, warmup=warmup, repeats=repeats, name_errors=True)
        times = timed.medians()
    del q, k, v, grad, fns
    release_memory(device)
    return PointTimes(times, skipped)


def backend_frame(device, cases: Iterable[AttnCase], *, repeats: int = 10) -> pd.DataFrame:
    """``lab.sdpa_backends`` at each of ``cases``: a row per (case, backend), with ``tflop_s``."""
    frames = []
    for case in cases:
        q, k, v, _ = make_inputs(case, device)
        rows = sdpa_backends(q, k, v, causal=case.causal, backward=case.backward, repeats=repeats)
        frames.append(rows.assign(
            S=case.seq, D=case.head_dim, B=case.batch, H=case.heads, causal=case.causal,
            direction=case.direction, tflop_s=tflop_s(case.flops, rows["ms"]),
        ))  # fmt: skip
        del q, k, v
        release_memory(device)
    return pd.concat(frames, ignore_index=True)


def release_memory(device: torch.device) -> None:
    """Give cached GPU memory back between cases (S=16k next to S=256 fragments the cache)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def tflop_s(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# ---- what ran, and how much memory it took ------------------------------------------------------
def which_backend(fn: Callable[[], object], device: torch.device) -> dict[str, str]:
    """The SDPA backend a call really ran, from the profiler's ATen ops, and its largest kernel."""
    report = profile_step(fn, steps=1, warmup=1, device=device)
    ops = [name for name in report.ops["name"] if name in SDPA_OPS]
    backend = ",".join(sorted({SDPA_OPS[name] for name in ops})) or "none (manual)"
    kernel = str(report.kernels["name"].iloc[0]) if len(report.kernels) else ""
    return {"backend": backend, "op": ",".join(sorted(set(ops))), "kernel": kernel}


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Most bytes allocated during one call above what was allocated before it."""
    fn()  # warm-up: cuDNN builds its plan, the allocator settles
    return memory.peak_memory(fn, device=device)


def check_backends(q, k, v, *, mask: torch.Tensor | None = None, causal=False) -> pd.DataFrame:
    """Every backend on the same inputs against attention in float64: ran or why not, the
    largest error and whether it is within the dtype's tolerance."""
    exact_mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    with torch.no_grad():
        exact = attention.attention_reference(
            q.double(), k.double(), v.double(), mask=exact_mask, causal=causal
        )
        tol = attention.TOLERANCES[q.dtype]
        rows = []
        for name in ("manual", *attention.BACKENDS):
            try:
                if name == "manual":
                    out = attention.attention_reference(q, k, v, mask=mask, causal=causal)
                else:
                    out = attention.sdpa(q, k, v, mask=mask, causal=causal, backend=name)
            except attention.BackendUnavailableError as error:
                rows.append({"backend": name, "ran": False, "reason": error.reason})
                continue
            err = (out.double() - exact).abs()
            within = bool((err <= tol["atol"] + tol["rtol"] * exact.abs()).all())
            rows.append({"backend": name, "ran": True, "max_abs_error": err.max().item(),
                         "within_tolerance": within, "reason": ""})  # fmt: skip
    return pd.DataFrame(rows)
