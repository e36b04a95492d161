"""Checks of the kernels a step runs: many small ones from loops over tensors (an optimizer
without ``foreach``/``fused``, clipping per parameter, statistics per parameter), gradients
zeroed instead of dropped, and float32 matrix products where bf16 or TF32 would do.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter, defaultdict

import torch

from accel.doctor.findings import Evidence, Finding, check
from accel.doctor.loop_rewrite import clip_each_source
from accel.doctor.recorder import PRODUCTS, OpRecord

LOOP_MIN_OPS = 8  # fewer repeats of one operator on one line are not a loop worth a finding
# no work, or a cast (autocast copies each weight once a forward: one kernel per weight, not a loop)
_NO_WORK = {"aten::detach", "aten::view", "aten::t", "aten::lift_fresh", "aten::alias",
            "aten::_to_copy"}  # fmt: skip
FOREACH_TENSORS_PER_LAUNCH = 110  # about what one multi_tensor_apply launch takes
# matrix products, convolutions, and cuDNN's recurrent layers (their gates' products inside one
# operator, which TF32 and autocast speed as they speed a product)
MATMUL_OPS = PRODUCTS | {"aten::convolution", "aten::convolution_backward", "aten::_convolution",
                         "aten::_cudnn_rnn", "aten::_cudnn_rnn_backward"}  # fmt: skip


def _loop_groups(evidence: Evidence) -> dict[tuple, list[OpRecord]]:
    """Ops that touch only parameter-shaped tensors (parameters, gradients, optimizer state,
    scalars), grouped by (user line, innermost torch function), where one operator repeats once
    per parameter or so: a loop over the model's tensors. A forward through the layers repeats
    its operators over parameters too, but each reads an activation beside them."""
    shapes = {tuple(p.shape) for p in evidence.parts.parameters()} | {()}
    groups: dict[tuple, list[OpRecord]] = defaultdict(list)
    for op in evidence.recording.ops:
        if op.site is None or op.backward or _many_tensor_foreach(op):
            continue
        if op.op in _NO_WORK or not op.inputs or any(t.shape not in shapes for t in op.inputs):
            continue
        groups[(op.site, op.library[0] if op.library else "")].append(op)
    floor = max(LOOP_MIN_OPS, _smallest_part(evidence.parts) // 2)
    loops = {}
    for key, ops in groups.items():
        repeats = max(Counter(op.op for op in ops).values())
        if repeats >= floor and len({op.inputs[0].shape for op in ops}) >= 3:
            loops[key] = ops
    return loops


def _smallest_part(parts) -> int:
    """Parameter tensors of the step's smallest model or optimizer: a loop over that one's (a
    GAN's critic beside its generator) runs as often."""
    sizes = [len(list(m.parameters())) for m in parts.models]
    sizes += [sum(len(g["params"]) for g in opt.param_groups) for opt in parts.optimizers]
    return min((n for n in sizes if n > 0), default=0)


def _many_tensor_foreach(op: OpRecord) -> bool:
    """A foreach operator over several tensors: the loop's cure, not a loop. One over a single
    tensor (``clip_grad_norm_([p])`` in a loop over parameters) is one turn of a loop."""
    return op.op.startswith("aten::_foreach") and len(op.inputs) > 2


# (a torch function on the loop's way, then kind, what, change, fixes), the first that matches
_LOOP_KINDS = (
    ("clip_grad", "clip_loop", "gradient clipping one tensor at a time",
     "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)",
     ("foreach_clip",)),
    ("zero_grad", "zero_grad", "zero_grad(set_to_none=False) writing zeros into every gradient",
     "optimizer.zero_grad(set_to_none=True)  # the default since torch 2.0", ("set_to_none",)),
    ("optim/", "optimizer_loop", "the optimizer updating one parameter at a time (foreach=False)",
     "torch.optim.AdamW(model.parameters(), lr=..., fused=True)  # one kernel a step",
     ("fused_optimizer", "foreach_optimizer")),
    ("", "tensor_loop", "a Python loop over tensors, a kernel per tensor",
     "# one launch for every tensor: torch._foreach_* (e.g. norms = torch._foreach_norm(grads))\n"
     "# or torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True) to clip,\n"
     "# accel.fusion.group_stats for per-group norms; for an update rule,\n"
     "# torch.optim with fused=True or accel.optim.MultiTensorAdamW", ("foreach_loop",)),
)  # fmt: skip


def _loop_kind(ops: list[OpRecord]) -> tuple[str, str, str, tuple[str, ...]]:
    """(kind, what, change, fixes) of one loop group (its operators share their torch functions)."""
    chain = " ".join(ops[0].library)
    return next(entry[1:] for entry in _LOOP_KINDS if entry[0] in chain)


def loop_saving_us(evidence: Evidence, ops: list[OpRecord], kind: str) -> tuple[float, str]:
    """(us saved per step, the cost model in words) of doing a loop's work in a few launches.

    The device's part: the loop's kernels now, against its bytes at the copy bandwidth (nothing
    at all for gradients dropped instead of zeroed). The host's part: the launches saved, at the
    measured launch cost, which shorten the step only while the device waits for the host (its
    idle time for the host, measured), so a device-bound step gains the device's part alone."""
    copy = evidence.ceilings.copy_gb_s
    kinds = Counter(op.op for op in ops)
    if kind == "zero_grad":
        launches, after = 0, 0.0
    else:
        launches = sum(math.ceil(n / FOREACH_TENSORS_PER_LAUNCH) for n in kinds.values())
        moved = sum(op.nbytes for op in ops)
        after = moved / (copy * 1e3)
    now = sum(op.time_us for op in ops)
    host, said = launches_saving_us(evidence, len(ops) - launches)
    model = (
        f"kernels {now / 1e3:.3f} ms now, {after / 1e3:.3f} ms after ({launches} launches"
        + (", its bytes at the copy bandwidth" if kind != "zero_grad" else "")
        + f"); plus {said}"
    )
    return max(0.0, now - after) + host, model


def launches_saving_us(evidence: Evidence, saved: int) -> tuple[float, str]:
    """(us, the cost model in words) that ``saved`` fewer launches take off the step: their
    measured cost, only while the device waits for the host (its measured idle time for it)."""
    waiting, launch = evidence.timeline.idle_us.get("host", 0.0), evidence.costs.launch_us
    host = min(waiting, saved * launch)
    return host, (f"{saved} launches at {launch:.1f} us, up to the {waiting / 1e3:.3f} ms the "
                  f"device waits for the host: {host / 1e3:.3f} ms")  # fmt: skip


def _visible(kind: str, evidence: Evidence) -> bool:
    """Whether a loop of ``kind`` is a problem on this device. On a CPU, torch's own optimizers
    loop over tensors by default (their foreach path is for GPUs), so only an optimizer loop
    the user asked for (``foreach=False``) is one; clipping takes its foreach path on a CPU too,
    so a clipping loop there is the user's own (``foreach=False``, a call per parameter)."""
    if evidence.cuda or kind != "optimizer_loop":
        return True
    return any(o.defaults.get("foreach") is False for o in evidence.parts.optimizers)


@check("loops")
def loops(evidence: Evidence) -> list[Finding]:
    """One finding per loop: the groups of one kind in one function (the lines of a loop's
    body) are one loop."""
    merged: dict[tuple, tuple[list, list[OpRecord], str]] = {}
    for (site, library), ops in _loop_groups(evidence).items():
        kind = _loop_kind(ops)[0]
        key = (site.file, site.function, kind)
        sites, known, first = merged.get(key, ([], [], library))
        merged[key] = ([*sites, site], known + ops, first)
    return [
        _loop_finding(evidence, sorted(set(sites), key=lambda s: s.line), library, ops)
        for (_, _, kind), (sites, ops, library) in merged.items()
        if _visible(kind, evidence)
    ]


def _optimizer_change(evidence: Evidence, ops: list[OpRecord], change: str) -> str:
    """The optimizer loop's change on the user's own optimizer class (the one whose module ran
    the loop): fused where torch has a fused path for it, else foreach; ``change`` if none."""
    modules = {entry.split(".py:")[0] for entry in ops[0].library if entry.startswith("optim/")}
    for opt in evidence.parts.optimizers:
        cls = type(opt)
        if cls.__module__.startswith("torch.") and cls.__module__.removeprefix("torch.").replace(".", "/") in modules:
            fused = "fused" in inspect.signature(cls).parameters
            flag = "fused=True)  # one kernel a step" if fused else "foreach=True)  # a few kernels"
            return f"torch.optim.{cls.__name__}(model.parameters(), ..., {flag}"
    return change


def _clip_each_change(ops: list[OpRecord]) -> str:
    """The change for a loop of single-tensor clips, with the norm its clips took."""
    orders = [x for o in ops if o.op in _NORMS for x in o.scalars[:1] if isinstance(x, float)]
    order = orders[0] if orders else 2.0
    norm = None if order == 2.0 else f"float('{order}')" if math.isinf(order) else repr(order)
    argument = "" if norm is None else f", norm_type={norm}"
    return (
        "# each gradient clipped to its own norm as your loop does, all in one pass:\n"
        + clip_each_source("for p in model.parameters()", "max_norm", norm)
        + "# or one norm over every gradient (another rule, the usual one):\n"
        f"# torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm{argument}, foreach=True)"
    )


_NORMS = frozenset({"aten::_foreach_norm", "aten::linalg_vector_norm"})


def _loop_finding(evidence: Evidence, sites: list, library: str, ops: list[OpRecord]) -> Finding:
    kind, what, change, fixes = _loop_kind(ops)
    if kind == "optimizer_loop":
        change = _optimizer_change(evidence, ops, change)
    if kind == "clip_loop":
        # a clip call per tensor (one clamp of its coefficient each) has one tensor for foreach
        # to batch: its calls are batched instead; one call over many takes foreach
        each = sum(op.op == "aten::clamp" for op in ops) > 1
        change, fixes = (_clip_each_change(ops), ("batched_clip",)) if each else (change, fixes)
    if evidence.cuda:
        saved, model = loop_saving_us(evidence, ops, kind)
    else:
        saved, model = None, f"on a GPU each of the {len(ops)} ops is a kernel launch"
    return Finding(
        kind=kind,
        title=f"{what}: {len(ops)} ops per step",
        evidence=f"{len(ops)} ops ({', '.join(sorted({o.op for o in ops})[:4])}) per step at "
        f"{', '.join(str(s) for s in sites)}" + (f" inside {library}" if library else ""),
        cost_model=model,
        notebook="02_fusion",
        change=change,
        saved_us=saved,
        sites=sites,
        fixes=fixes,
    )


# ---- precision --------------------------------------------------------------------------------
def matmul_flops(op: OpRecord) -> float:
    """FLOPs of a matrix product or convolution from its shapes (0 if unknown)."""
    shapes = [t.shape for t in op.inputs]
    if op.op == "aten::mm" and len(shapes) >= 2:
        (m, k), (_, n) = shapes[0], shapes[1]
        return 2.0 * m * k * n
    if op.op == "aten::addmm" and len(shapes) >= 3:
        (m, k), (_, n) = shapes[1], shapes[2]
        return 2.0 * m * k * n
    if op.op in ("aten::bmm", "aten::baddbmm") and len(shapes) >= 2:
        a, b = shapes[-2], shapes[-1]
        return 2.0 * a[0] * a[1] * a[2] * b[2] if len(a) == 3 and len(b) == 3 else 0.0
    if op.op == "aten::convolution_backward" and len(shapes) >= 3:
        # (grad_output, input, weight, ...); output_mask, the last three flags, says which of
        # the input's and the weight's gradients are computed: a forward's worth each
        mask = [m for m in op.scalars if isinstance(m, bool)][-3:]
        products = sum(mask[:2]) if len(mask) == 3 else 2
        return products * 2.0 * math.prod(shapes[2][1:]) * math.prod(shapes[0])
    if "convolution" in op.op and len(shapes) >= 2 and op.outputs:
        return 2.0 * math.prod(shapes[1][1:]) * math.prod(op.outputs[0].shape)
    return 0.0


def _float32_products(evidence: Evidence) -> list[OpRecord]:
    """Matrix products and convolutions in float32, with or without TF32 (bf16 beats both)."""
    return [op for op in evidence.recording.ops
            if op.op in MATMUL_OPS and op.inputs and op.inputs[0].dtype == torch.float32]


@check("precision")
def precision(evidence: Evidence) -> list[Finding]:
    if not evidence.cuda:
        return []
    ops = _float32_products(evidence)
    now = sum(op.time_us for op in ops)
    if not ops or now < 0.05 * evidence.step_us:
        return []
    from accel.doctor.products import time_products

    flops = sum(matmul_flops(op) for op in ops)
    moved = sum(op.nbytes for op in ops)
    after = evidence.measure.get("products", time_products)(ops, evidence.device, {
        "bf16_autocast": lambda shapes, _: (shapes, torch.bfloat16, False),
        "tf32": lambda shapes, dtype: (shapes, dtype, True),
    })  # fmt: skip
    # autocast casts each float32 input of a product once a step (read 4 bytes, write 2)
    inputs = sum(t.nbytes for op in ops for t in op.inputs)
    casts = 1.5 * inputs / (evidence.ceilings.copy_gb_s * 1e3)
    saved = {"bf16_autocast": max(0.0, now - after["bf16_autocast"] - casts)}
    full = [op for op in ops if "tf32" not in op.facts]  # float32's own rate: TF32 would help
    if full:
        saved["tf32"] = max(0.0, now - after["tf32"])
    tf32 = "TF32 off" if len(full) == len(ops) else "TF32 on" if not full else "TF32 on for some"
    return [Finding(
        kind="precision",
        title=f"float32 matrix products take {now / evidence.step_us:.0%} of the step "
        f"({tf32}, no autocast)",
        evidence=f"{len(ops)} float32 products and convolutions per step: "
        f"{flops / 1e9:.2f} GFLOP, {moved / 2**20:.1f} MiB, {now / 1e3:.3f} ms on the device",
        cost_model="the step's largest products timed here as they ran, in bf16 and in TF32, "
        f"at their shapes (the rest at their mean ratio): bf16 "
        f"{after['bf16_autocast'] / 1e3:.3f} ms plus {casts / 1e3:.3f} ms of casts"
        + (f", TF32 {after['tf32'] / 1e3:.3f} ms" if full else ""),
        notebook="07_recipe",
        change="with torch.autocast('cuda', dtype=torch.bfloat16):\n"
        "    loss = loss_fn(model(x), y)\n"
        "# or, keeping float32 storage: torch.set_float32_matmul_precision('high')  # TF32",
        saved_us=max(saved.values()),
        sites=sorted({op.site for op in ops if op.site is not None}, key=str)[:5],
        fixes=tuple(saved),
        saved_by_fix=saved,
    )]
