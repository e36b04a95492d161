"""Checks of how a step bound by its kernels spends them: memory-bound kernels that
``torch.compile`` would fuse, a matrix dimension that is not a multiple of 64, convolutions left
to cuDNN's default algorithm and layout, and an optimizer that is not fused."""

from __future__ import annotations

import functools
import itertools
import math

import torch

from accel.doctor.check_kernels import MATMUL_OPS
from accel.doctor.findings import Evidence, Finding, check
from accel.doctor.recorder import PRODUCTS, OpRecord

FUSION_MIN_SHARE = 0.05  # memory-bound kernels under this share of the step: not worth a finding
PAD_TO = 64  # tensor cores and cuBLAS's tiles take dimensions in multiples of this
PAD_MIN_DIM = 512  # smaller odd dimensions cost little padded or not
PAD_MIN_SHARE = 0.02  # the odd products' share of the step, to be timed padded
# cuDNN's algorithm search and channels-last win at most about half of the convolutions' time:
# under this share of the step they cannot pay the twentieth of it a fix must
CONV_MIN_SHARE = 0.1
PAD_MIN_GAIN = 0.1  # the share of their own time padding must save: less is inside its timing
# operators that are not memory-bound elementwise or reduction work
_NOT_FUSIBLE = MATMUL_OPS | {
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_to_copy", "aten::copy_", "aten::embedding",
    "aten::embedding_dense_backward", "aten::nll_loss_forward", "aten::nll_loss_backward",
}  # fmt: skip
# the kernel categories (:func:`~accel.doctor.timeline.kernel_category`) compiled code fuses
FUSED_KERNELS = ("elementwise and other", "normalization")
# the optimizers with a fused update, and the bytes an element of a parameter moves in one
# update (read and written, float32)
FUSED_UPDATE_BYTES = {"Adam": 28, "AdamW": 28, "SGD": 20, "Adagrad": 20}


def _memory_bound(ops: list[OpRecord]) -> list[list[OpRecord]]:
    """Runs of consecutive memory-bound operators (elementwise, normalisations, reductions)."""
    runs: list[list[OpRecord]] = []
    last = -2
    for op in ops:
        if op.time_us <= 0 or op.op in _NOT_FUSIBLE or (op.library and "optim/" in op.library[0]):
            continue
        if op.op.startswith("aten::_foreach") or "attention" in op.api:
            continue
        if op.index == last + 1 and runs and runs[-1][-1].backward == op.backward:
            runs[-1].append(op)
        else:
            runs.append([op])
        last = op.index
    return runs


@check("fusion")
def fusion(evidence: Evidence) -> list[Finding]:
    """Memory-bound kernels in a step without compiled kernels. Fused, a run of them no longer
    writes the tensors one member hands the next and the next reads back, and is one kernel
    moving the rest: at the better of the rate the run reaches now and the measured copy rate
    (many small kernels reach a fraction of it)."""
    t = evidence.timeline
    if not evidence.cuda or t.by_category.get("compiled (Triton)", 0.0) > 0:
        return []
    runs = [run for run in _memory_bound(evidence.recording.ops) if len(run) >= 2]
    now = sum(op.time_us for run in runs for op in run)
    if now < FUSION_MIN_SHARE * t.step_us:
        return []
    copy_bytes_per_us = evidence.ceilings.copy_gb_s * 1e3
    saved = moved = kept = 0.0
    for run in runs:
        before = sum(op.nbytes for op in run)
        if not before:
            continue
        left = before - sum(_handed_bytes(a, b) for a, b in itertools.pairwise(run))
        took = sum(op.time_us for op in run)
        fused = min(took * left / before, left / copy_bytes_per_us)
        moved, kept, saved = moved + before, kept + left, saved + took - fused
    kernels = sum(len(run) for run in runs)
    saved = max(0.0, saved)
    kept_us = t.spread_saving_us(saved, FUSED_KERNELS)  # the host may hold the device back
    replayed = (f"; the kernels' saving replayed on the step's timeline, where the device waits "
                f"for the host: {kept_us / 1e3:.3f} ms of it" if kept_us < 0.9 * saved else "")
    sites = sorted({op.site for run in runs for op in run if op.site is not None}, key=str)
    return [Finding(
        kind="fusion",
        title=f"{kernels} memory-bound kernels take {now / t.step_us:.0%} of the step "
        "(normalisations, activations, softmax, masks) where compiled code would fuse them",
        evidence=f"{len(runs)} runs of consecutive elementwise and reduction operators, "
        f"{kernels} kernels, {now / 1e3:.3f} ms per step on the device",
        cost_model=f"each run fused: the tensors its members hand each other neither written "
        f"nor read back ({moved / 2**20:.0f} MiB moved now, {kept / 2**20:.0f} MiB fused), one "
        f"kernel at the better of the run's rate now and the measured copy rate: "
        f"{(now - saved) / 1e3:.3f} ms{replayed}; no host time counted: compiled, the host "
        "issued a BatchNorm CNN's step no faster than eager (CUDA graphs free it)",
        notebook="02_fusion",
        change="model = torch.compile(model)  # fuses the elementwise work between products",
        saved_us=kept_us,
        sites=sites[:5],
        fixes=("compile",),
    )]


def _handed_bytes(first: OpRecord, second: OpRecord) -> int:
    """Bytes fusing two operators saves: the first's output written and read back."""
    read = {(t.shape, t.dtype) for t in second.inputs}
    return sum(2 * t.nbytes for t in first.outputs if (t.shape, t.dtype) in read)


def _odd_products(evidence: Evidence) -> dict[int, list[OpRecord]]:
    """Odd dimension -> the products with a large dimension not a multiple of PAD_TO."""
    odd: dict[int, list[OpRecord]] = {}
    for op in evidence.recording.ops:
        if op.op not in PRODUCTS:
            continue
        dims = {d for t in op.inputs[-2:] for d in t.shape[-2:]}
        for d in dims:
            if d >= PAD_MIN_DIM and d % PAD_TO:
                odd.setdefault(d, []).append(op)
    return odd


def _padded(d: int) -> int:
    return math.ceil(d / PAD_TO) * PAD_TO


@check("odd_shape")
def odd_shape(evidence: Evidence) -> list[Finding]:
    """A large product dimension not a multiple of 64, a layer's output width (a vocabulary, a
    head: padded with zero rows and sliced back, the numbers stay the same): timed here padded
    and not. A hidden size entering a product is the model's author's to choose."""
    if not evidence.cuda:
        return []
    from accel.doctor.products import time_products

    widths = {m.out_features for model in evidence.parts.models for m in model.modules()
              if isinstance(m, torch.nn.Linear)}  # fmt: skip
    found = []
    for d, ops in _odd_products(evidence).items():
        if d not in widths:
            continue
        now = sum(op.time_us for op in ops)
        if now < PAD_MIN_SHARE * evidence.step_us:
            continue
        p = _padded(d)

        def pad(shapes, dtype, d=d, p=p, to=None):
            return [tuple(p if x == d else x for x in s) for s in shapes], to or dtype, False

        after = evidence.measure.get("products", time_products)(ops, evidence.device, {
            "pad": pad, "bf16": lambda shapes, _: (shapes, torch.bfloat16, False),
            "bf16 pad": functools.partial(pad, to=torch.bfloat16),
        })  # fmt: skip
        # as the step runs, and in bf16 (as the precision fix runs them): the larger gain, judged
        # against the products' own time there (the step around them shrinks with the other fixes)
        gains = {"as recorded": (now - after["pad"], now),
                 "in bf16": (after["bf16"] - after["bf16 pad"], after["bf16"])}  # fmt: skip
        where, (saved, base) = max(gains.items(), key=lambda kv: kv[1][0])
        if saved < PAD_MIN_GAIN * base:
            continue
        alone = max(0.0, gains["as recorded"][0])  # the fix tried alone, on the step as it runs
        sites = sorted({op.site for op in ops if op.site is not None}, key=str)
        found.append(Finding(
            kind="odd_shape",
            title=f"a dimension of {d} (not a multiple of {PAD_TO}) in products taking "
            f"{now / evidence.step_us:.0%} of the step",
            evidence=f"{len(ops)} products per step with a dimension of {d}, "
            f"{now / 1e3:.3f} ms on the device",
            cost_model=f"the products timed here at their shapes and with {d} padded to {p} "
            f"(more work, better tiles), {where}: {saved / 1e3:.3f} ms saved"
            + (f"; alone, as the step runs: {alone / 1e3:.3f} ms" if where != "as recorded" else ""),
            notebook="02_fusion",
            change=f"# pad the dimension to a multiple of {PAD_TO}, e.g. a vocabulary:\n"
            f"vocab_size = {p}  # was {d}: the extra rows are never a target",
            saved_us=saved,
            sites=sites[:3],
            fixes=("padded_products",),
            saved_by_fix={"padded_products": alone},
            detail=(d, p),
        ))
    return found


@check("conv_layout")
def conv_layout(evidence: Evidence) -> list[Finding]:
    """Convolutions on a GPU with cuDNN's heuristic algorithm (``cudnn.benchmark`` off) or in the
    channels-first layout, where tensor cores want channels last."""
    if not evidence.cuda:
        return []
    convs = [op for op in evidence.recording.ops if "convolution" in op.op and op.inputs]
    now = sum(op.time_us for op in convs)
    if not convs or now < CONV_MIN_SHARE * evidence.step_us:
        return []
    nchw = [op for op in convs if not op.backward and not _channels_last(evidence, op)]
    benchmarked = all("cudnn.benchmark" in op.facts for op in convs)
    fixes = (() if benchmarked else ("cudnn_benchmark",)) + (("channels_last",) if nchw else ())
    if not fixes:
        return []
    said = ", ".join(["cudnn.benchmark off"] * (not benchmarked) + ["channels first"] * bool(nchw))
    return [Finding(
        kind="conv_layout",
        title=f"convolutions take {now / evidence.step_us:.0%} of the step ({said})",
        evidence=f"{len(convs)} convolution operators per step, {now / 1e3:.3f} ms on the device",
        cost_model="not predicted: cuDNN's algorithms and layouts are measured by trying them",
        notebook="07_recipe",
        change="torch.backends.cudnn.benchmark = True  # input shapes fixed from step to step\n"
        "model = model.to(memory_format=torch.channels_last)\n"
        "x = x.to(device, memory_format=torch.channels_last, non_blocking=True)",
        sites=sorted({op.site for op in convs if op.site is not None}, key=str)[:3],
        fixes=fixes,
    )]


def _channels_last(evidence: Evidence, op: OpRecord) -> bool:
    """Whether a convolution's weight is stored channels last (the model was converted)."""
    shapes = {t.shape for t in op.inputs}
    for model in evidence.parts.models:
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d) and tuple(m.weight.shape) in shapes:
                return m.weight.is_contiguous(memory_format=torch.channels_last)
    return False


@check("optimizer_unfused")
def optimizer_unfused(evidence: Evidence) -> list[Finding]:
    """An optimizer with a fused implementation, not asked for it (torch's default on CUDA is the
    foreach one: a few passes over the state per step where fused makes one)."""
    if not evidence.cuda:
        return []
    slow = [o for o in evidence.parts.optimizers if type(o).__name__ in FUSED_UPDATE_BYTES
            and not o.defaults.get("fused")
            and o.defaults.get("foreach") is not False]  # a per-tensor loop: the loops check's
    ops = [op for op in evidence.recording.ops if op.library and "optim/" in " ".join(op.library)]
    now = sum(op.time_us for op in ops)
    if not slow or now <= 0:
        return []
    sized = [(type(o).__name__, p.numel())
             for o in slow for g in o.param_groups for p in g["params"]]  # fmt: skip
    elements = sum(n for _, n in sized)
    moved = sum(FUSED_UPDATE_BYTES[name] * n for name, n in sized)
    after = moved / (evidence.ceilings.copy_gb_s * 1e3)
    names = ", ".join(sorted({type(o).__name__ for o in slow}))
    return [Finding(
        kind="optimizer_unfused",
        title=f"{names} without fused=True: {now / 1e3:.3f} ms of optimizer kernels per step",
        evidence=f"{len(ops)} optimizer operators per step over {elements / 1e6:.1f} M "
        "parameters (foreach: several passes over the state)",
        cost_model=f"one fused pass reading and writing the state once ({moved / 2**20:.0f} "
        f"MiB) at the measured copy rate: {after / 1e3:.3f} ms",
        notebook="02_fusion",
        change=f"torch.optim.{type(slow[0]).__name__}(model.parameters(), ..., fused=True)",
        saved_us=max(0.0, now - after),
        sites=sorted({op.site for op in ops if op.site is not None}, key=str)[:2],
        fixes=("fused_optimizer",),
    )]
