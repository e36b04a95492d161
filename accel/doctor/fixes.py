"""The fixes the doctor can apply to a copy of a step without the user editing code, each with
the tolerance its change to the numbers is allowed and why. A fix changes a :class:`StepCopy` in
place (its parts, the contexts its calls run in, its batch, or the call itself: a CUDA graph);
several applied to one copy are the combined trial.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from accel.doctor.batched_clip import batched_clipping
from accel.doctor.check_compute import FUSED_UPDATE_BYTES
from accel.doctor.check_memory import repeated_blocks
from accel.doctor.deferred import deferred_item_reads
from accel.doctor.own_scope import own_code, own_names
from accel.doctor.parts import StepParts
from accel.doctor.products import backend_flags

__all__ = ["FIXES", "Fix", "FixNotApplicable", "StepCopy", "left_as_written", "own_batch"]


class FixNotApplicable(RuntimeError):
    """The fix cannot apply to this step here; the message says why."""


@dataclass
class StepCopy:
    """A copy of the user's step under construction: what each fix changes."""

    step: Callable[..., Any]
    parts: StepParts
    batch: Any
    device: torch.device
    contexts: list[Callable[[], contextlib.AbstractContextManager]] = field(default_factory=list)
    on_device_batch: bool = False  # pinned once, copied in non-blocking before each call
    graphed: bool = False
    graph: Any = None  # the GraphedStep, once built (its ``reason`` says if it ran eagerly)
    channels_last: bool = False  # 4-d batch tensors in channels-last memory
    findings: list[Any] = field(default_factory=list)  # the report's, for fixes that need them
    edits: list[str] = field(default_factory=list)  # the code changes made, as diffs to paste
    # for a fix that acts only on calls the step makes: once the copy ran, what it never did
    idle: list[Callable[[], str | None]] = field(default_factory=list)

    def build(self) -> Callable[[], Any]:
        """The call the trials time: one step on the batch, with every fix applied."""
        contexts, step = list(self.contexts), self.step

        def inner(batch: Any) -> Any:
            with contextlib.ExitStack() as stack:
                for context in contexts:
                    stack.enter_context(context())
                return step(batch) if batch is not NO_BATCH else step()

        if self.graphed:
            from accel.graphs import GraphedStep

            inner = self.graph = GraphedStep(inner, warmup=GRAPH_WARMUP, device=self.device)
        batch = own_batch(self.batch)  # each call built starts from the user's batch
        batch = _channels_last(batch) if self.channels_last else batch
        if self.on_device_batch and not self.graphed:
            # the change the finding advises, as a hand-optimized loop makes it: the batch comes
            # pinned (DataLoader(pin_memory=True)) and is copied in every step, non-blocking
            pinned, device = _pinned_host(batch), self.device
            return lambda: inner(_to_device(pinned, device))
        batch = _to_device(batch, self.device) if self.on_device_batch else batch  # a graph's
        return lambda: inner(batch_for_a_call(batch))  # inputs stay where it captured them


NO_BATCH = object()  # the step takes no argument
GRAPH_WARMUP = 2  # eager calls before the capture (optimizer state is created in the first)


@dataclass(frozen=True)
class Fix:
    name: str
    label: str
    apply: Callable[[StepCopy], None]
    rtol: float  # relative error allowed on the step's outputs and parameters after the trial
    why: str  # the argument for that tolerance
    needs_cuda: bool = True
    # a fix that sums in another order: its allowance where the products already run in 16 bits
    rtol_16bit: float | None = None
    redraws_dropout: bool = False  # its dropout draws other masks: judged with dropout off

    def tolerance(self, sixteen_bit: bool) -> float:
        """The allowance on a step whose matrix products run in 16 bits (``sixteen_bit``) or not."""
        return self.rtol_16bit if sixteen_bit and self.rtol_16bit is not None else self.rtol


_DATA = ("numpy", "pandas")
# trained or loaded where they are, never copied: a batch object may hold its dataset or loader
_NOT_DATA = (types.ModuleType, torch.nn.Module, torch.optim.Optimizer,
             torch.utils.data.Dataset, torch.utils.data.DataLoader)  # fmt: skip


def own_batch(batch: Any, depth: int = 0) -> Any:
    """The batch's tensors (pinned where they were, and needing grad as they did), NumPy and
    pandas data, and the objects holding them (a dataclass, a tokenizer's mapping) copied: a
    step that changes its batch in place changes the copy, never the user's."""
    return tree_map(lambda leaf: _own_leaf(leaf, depth), batch)


def batch_for_a_call(batch: Any) -> Any:
    """The batch's own mapping or list new for each call, its items the same: a step that takes
    one out (``batch.pop("labels")``) finds it again next call, as training's next batch has it."""
    return copy.copy(batch) if isinstance(batch, (dict, list, collections.UserDict)) else batch


def _own_leaf(leaf: Any, depth: int) -> Any:
    if isinstance(leaf, torch.Tensor):
        return _own_tensor(leaf)
    copy_of = getattr(leaf, "copy", None)
    if callable(copy_of) and type(leaf).__module__.startswith(_DATA):
        return copy_of()
    if depth >= 3 or not hasattr(leaf, "__dict__") or callable(leaf) or isinstance(leaf, _NOT_DATA):
        return leaf  # a model or optimizer in the batch trains where it is, and is named
    try:
        clone = copy.copy(leaf)
    except Exception:  # what cannot be copied is used as it is
        return leaf
    vars(clone).update({k: own_batch(v, depth + 1) for k, v in vars(leaf).items()})
    return clone


def _own_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (a step may work on its layout alone: ``view`` refuses a
    slice), pinned where it is; an overlapping one (expanded) made dense as ``clone`` makes it."""
    pinned = t.device.type == "cpu" and t.is_pinned()
    try:
        if t.layout is not torch.strided or t.is_quantized or t.is_nested:
            raise RuntimeError("no strides to keep")
        copied = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device,
                                     pin_memory=pinned).copy_(t.detach())  # fmt: skip
    except RuntimeError:  # no strides, or more than one element at one place: none to keep
        copied = t.detach().clone()
        copied = copied.pin_memory() if pinned else copied
    return copied.requires_grad_(t.requires_grad)


def _pinned_host(batch: Any) -> Any:
    return tree_map(lambda t: t.pin_memory()
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t, batch)


def _to_device(batch: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.pin_memory().to(device, non_blocking=True)
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t, batch)


def _channels_last(batch: Any) -> Any:
    return tree_map(lambda t: t.contiguous(memory_format=torch.channels_last)
                    if isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() else t,
                    batch)  # fmt: skip


# ---- optimizers -----------------------------------------------------------------------------------
def _retune(opt: torch.optim.Optimizer, **flags: bool) -> None:
    """Set ``flags`` on every group of ``opt`` (a copy) and move step counters where they go."""
    for key in flags:
        if key not in opt.defaults:
            raise FixNotApplicable(f"{type(opt).__name__} has no {key!r} option")
    opt.defaults.update(flags)
    for group in opt.param_groups:
        group.update(flags)
    if flags.get("fused"):  # as the constructor sets it: GradScaler hands over its inf flags
        opt._step_supports_amp_scaling = True
    on_device = flags.get("fused") or flags.get("capturable")
    for param, state in opt.state.items():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor) and on_device:
            state["step"] = step.to(param.device, torch.float32)


def _optimizers_with(copy: StepCopy, has: Callable[[Any], bool], what: str) -> list:
    """The step's optimizers that have ``what``; one without it beside them (SparseAdam for an
    embedding, LBFGS) is left as it is, and only a step with none is refused."""
    opts = copy.parts.optimizers
    if not opts:
        raise FixNotApplicable("no optimizer found in the step")
    able = [opt for opt in opts if has(opt)]
    if not able:
        names = sorted({type(opt).__name__ for opt in opts})
        raise FixNotApplicable(f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} no {what}")
    return able


def _fused(copy: StepCopy) -> None:
    has_fused = lambda opt: type(opt).__name__ in FUSED_UPDATE_BYTES  # noqa: E731
    for opt in _optimizers_with(copy, has_fused, "fused implementation"):
        _retune(opt, fused=True, foreach=False)


def _foreach(copy: StepCopy) -> None:
    for opt in _optimizers_with(copy, lambda opt: "foreach" in opt.defaults, "'foreach' option"):
        _retune(opt, foreach=True)


def _set_to_none(copy: StepCopy) -> None:
    for part in (*copy.parts.optimizers, *copy.parts.models):
        part.zero_grad = functools.partial(type(part).zero_grad, part, set_to_none=True)


_CLIP_PARTS = ("_get_total_norm", "_clip_grads_with_norm_")  # each takes foreach 4th


def _foreach_clip(copy: StepCopy) -> None:
    from torch.nn.utils import clip_grad

    if not all(hasattr(clip_grad, name) for name in _CLIP_PARTS):
        raise FixNotApplicable(f"torch {torch.__version__}'s clip_grad_norm_ cannot be redirected")
    calls: list[None] = []
    copy.contexts.append(functools.partial(_clip_with_foreach, calls))
    copy.idle.append(lambda: None if calls else "the step never called clip_grad_norm_")


@contextlib.contextmanager
def _clip_with_foreach(calls: list[None]) -> Iterator[None]:
    """``clip_grad_norm_`` however it was imported, with ``foreach=True``: the module's two
    helpers it calls are looked up at call time (each call counted in ``calls``)."""
    from torch.nn.utils import clip_grad

    originals = {name: getattr(clip_grad, name) for name in _CLIP_PARTS}

    def forced(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(None)
            kwargs["foreach"] = True
            return original(*args[:3], **kwargs)

        return call

    try:
        for name, original in originals.items():
            setattr(clip_grad, name, forced(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(clip_grad, name, original)


# ---- precision, graphs, compile, memory ---------------------------------------------------------
def _graph(copy: StepCopy) -> None:
    for opt in copy.parts.optimizers:
        if "capturable" in opt.defaults:
            _retune(opt, capturable=True)
    copy.on_device_batch = copy.graphed = True


def _compile(copy: StepCopy, *, cuda_graphs: bool = False) -> None:
    """``cuda_graphs``: inductor replays each compiled graph as a CUDA graph (``mode=
    "reduce-overhead"``, set as its option so that random ops still draw as in eager)."""
    if not copy.parts.models:
        raise FixNotApplicable("no model found in the step to compile")
    models = [m for m in copy.parts.models if not _compiled(m)]
    if not models:
        raise FixNotApplicable("the step's models are already compiled (torch.compile)")
    options = {"fallback_random": True} | ({"triton.cudagraphs": True} if cuda_graphs else {})
    for model in models:
        own_names(model)
        _compile_forwards(model, options)
    if cuda_graphs:
        copy.edits.append('model = torch.compile(model, mode="reduce-overhead")  # compiled, '
                          "then replayed as CUDA graphs")


def _compiled(model: torch.nn.Module) -> bool:
    """Compiled already: wrapped by ``torch.compile(model)`` or by ``model.compile()``."""
    wrapped = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    return wrapped or getattr(model, "_compiled_call_impl", None) is not None


def _compile_forwards(model: torch.nn.Module, options: dict) -> None:
    """The forward, bound (Module.compile() is skipped by some torch); a container without one
    (ModuleList, ModuleDict), whose layers the step calls itself: each layer's. Random ops
    (dropout) draw as in eager, so the trial compares the same masks as the unchanged step's."""
    if type(model).forward is not torch.nn.Module.forward:
        forward = own_code(model.forward)
        model.forward = torch.compile(forward, options=options)
        return
    for child in model.children():
        _compile_forwards(child, options)


def _checkpoint(copy: StepCopy) -> None:
    from accel.recompute import checkpoint_blocks

    found = [(model, blocks) for model in copy.parts.models if (blocks := repeated_blocks(model))]
    if not found:
        raise FixNotApplicable("no repeated blocks (a ModuleList of layers) to checkpoint")
    for model, blocks in found:
        checkpoint_blocks(model, blocks)


def left_as_written(site) -> str:
    """What the SDPA fix's edit says of the attention at ``site`` that it could not rewrite."""
    return f"# not rewritten: the attention at {site}"


def _sdpa(copy: StepCopy) -> None:
    """Each written-out attention the attention check found, rewritten as SDPA in the copied
    models (:mod:`accel.doctor.rewrite`); the diffs are the edit to paste. One the rewrite cannot
    read stays as written, and the edit says why."""
    from accel.doctor.rewrite import NotRewritable, rewrite_attention

    chains = [f.detail for f in copy.findings if f.kind == "attention" and f.detail is not None]
    if not chains:
        raise FixNotApplicable("no written-out attention found at a line of your code")
    left, diffs = [], []
    by_lines: dict[tuple, list] = {}  # one code, called at several shapes: rewritten once,
    for c in chains:  # causal only where every call of it was
        by_lines.setdefault(tuple((s.file, s.line) for s in (c.site, c.values_site)), []).append(c)
    for lines, calls in by_lines.items():
        chain = calls[0]
        try:
            rewrite = rewrite_attention(copy.parts.models, *lines, all(c.causal for c in calls))
        except NotRewritable as error:
            left.append((chain.site, str(error)))
            continue
        if not rewrite.apply(copy.parts.models, copy.contexts):
            left.append((chain.site, "no copied module runs it"))
            continue
        diffs.append(rewrite.diff)
    if not diffs:
        raise FixNotApplicable("; ".join(f"the attention at {site}: {why}" for site, why in left))
    copy.edits += [*diffs, *(f"{left_as_written(site)}: {why}" for site, why in left)]


def _foreach_loop(copy: StepCopy) -> None:
    """Each loop of in-place calls over tensors the loop check found in the step function,
    rewritten as foreach calls in the copy's step (:mod:`accel.doctor.loop_rewrite`); the diffs
    are the edit to paste."""
    from accel.doctor.loop_rewrite import NotRewritable, rewrite_loop

    lines = _step_lines(copy, "tensor_loop")
    if not lines:
        raise FixNotApplicable("no loop over tensors found in the step function itself")
    try:
        rewrite = rewrite_loop(copy.step, *lines)
    except NotRewritable as error:
        raise FixNotApplicable(str(error)) from None
    copy.step = rewrite.step
    copy.edits += [rewrite.diff, *(f"# {why}" for why in rewrite.refused)]


def _step_lines(copy: StepCopy, kind: str) -> list[int]:
    """The lines of the step function's own file where the findings of ``kind`` ran, once each."""
    code = getattr(getattr(copy.step, "__func__", copy.step), "__code__", None)
    return list(dict.fromkeys(s.line for f in copy.findings if f.kind == kind for s in f.sites
                              if code is not None and s.file == code.co_filename))  # fmt: skip


def _batched_clip(copy: StepCopy) -> None:
    """The loop clipping one gradient at a time that the clip check found in the step function,
    rewritten as one pass in the copy's step (:func:`~accel.doctor.loop_rewrite.rewrite_clip_loop`;
    the diff is the edit to paste). Where the loop is in a function the step calls, or is not
    rewritten, its clips are batched as they run (:func:`batched_clipping`)."""
    from accel.doctor.loop_rewrite import ClipNormRead, LoopsLeft, NotRewritable, rewrite_clip_loop

    try:
        rewrite = rewrite_clip_loop(copy.step, *_step_lines(copy, "clip_loop"))
    except NotRewritable as error:  # the finding's change says what to write instead
        if isinstance(error, LoopsLeft) and any(isinstance(c, ClipNormRead) for c in error.causes):
            raise FixNotApplicable(f"{error}: the loop reads each clip's norm") from None
        copy.contexts.append(batched_clipping)
        return
    copy.step = rewrite.step
    copy.edits += [rewrite.diff, *(f"# {why}" for why in rewrite.refused)]
    if rewrite.refused:
        copy.contexts.append(batched_clipping)


def _mha_without_weights(copy: StepCopy) -> None:
    """Each ``nn.MultiheadAttention`` of the copied models called with ``need_weights=False``:
    SDPA inside, no weights returned (a step that uses them fails its trial, which says so)."""
    modules = [m for model in copy.parts.models for m in model.modules()
               if isinstance(m, torch.nn.MultiheadAttention)]  # fmt: skip
    if not modules:
        raise FixNotApplicable("no nn.MultiheadAttention in the step's models")
    for module in modules:
        module.forward = functools.partial(_without_weights, module.forward)
    copy.edits += [f.change for f in copy.findings if "mha_without_weights" in f.fixes]


def _without_weights(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **{**kwargs, "need_weights": False})


def _padded_products(copy: StepCopy) -> None:
    """Each ``nn.Linear`` with an odd number of outputs the odd_shape check found (a vocabulary's
    head) run at the padded width and sliced back: zero rows added to its weight give zero
    logits that are cut off, so the numbers are the same, at shapes the tensor cores tile."""
    odd = dict(f.detail for f in copy.findings if f.kind == "odd_shape" and f.detail is not None)
    linears = [m for model in copy.parts.models for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m.out_features in odd]  # fmt: skip
    if not linears:
        raise FixNotApplicable(
            f"no nn.Linear with {' or '.join(map(str, odd)) or 'an odd number of'} outputs to "
            "pad: pad the dimension where your code sets it"
        )
    for module in linears:
        module.forward = _padded_linear(module, odd[module.out_features])
    copy.edits += [f.change for f in copy.findings if f.kind == "odd_shape"]


def _padded_linear(module: torch.nn.Linear, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    extra = width - module.out_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = torch.nn.functional.pad(module.weight, (0, 0, 0, extra))
        bias = None if module.bias is None else torch.nn.functional.pad(module.bias, (0, extra))
        return torch.nn.functional.linear(x, weight, bias)[..., : module.out_features]

    return forward


def _to_channels_last(copy: StepCopy) -> None:
    modules = [m for model in copy.parts.models for m in model.modules()]
    if not any(isinstance(m, torch.nn.Conv2d) for m in modules):
        raise FixNotApplicable("no Conv2d in the step's models")
    for model in copy.parts.models:
        model.to(memory_format=torch.channels_last)
    for opt in copy.parts.optimizers:  # a fused update wants its state laid out as its parameter
        for state in opt.state.values():
            for name, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.dim() == 4:
                    state[name] = value.contiguous(memory_format=torch.channels_last)
    copy.channels_last = True


def _context(
    factory: Callable[[], contextlib.AbstractContextManager],
) -> Callable[[StepCopy], None]:
    return lambda copy: copy.contexts.append(factory)


def _autocast(copy: StepCopy) -> None:
    copy.contexts.append(lambda: torch.autocast(copy.device.type, dtype=torch.bfloat16))


def _pinned(copy: StepCopy) -> None:
    leaves = tree_leaves(copy.batch)
    if not any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in leaves):
        raise FixNotApplicable("no tensor of the batch is on the host")
    copy.on_device_batch = True


def _deferred(copy: StepCopy) -> None:
    reads: list[None] = []
    copy.contexts.append(functools.partial(deferred_item_reads, reads))
    copy.idle.append(lambda: None if reads else "the step never read a CUDA number with .item()")


_REORDERED = (
    "float32 rounding (1e-7 an operation) through every layer and a few steps, 1e-3; where the "
    "products run in bf16, its rounding (2^-9) instead, 2e-2"
)
_ROUNDING = (
    "the same arithmetic in another order: float32 rounding (1e-7 an operation), over a few steps"
)
FIXES: dict[str, Fix] = {
    f.name: f
    for f in (
        # torch's fused (since 2.4) and foreach optimizers, and foreach norms, run on a CPU too
        Fix("fused_optimizer", "fused optimizer", _fused, 1e-4, _ROUNDING, needs_cuda=False),
        Fix("foreach_optimizer", "foreach optimizer", _foreach, 1e-4, _ROUNDING, needs_cuda=False),
        Fix("foreach_clip", "foreach clipping", _foreach_clip, 1e-4, _ROUNDING, needs_cuda=False),
        Fix("batched_clip", "per-tensor clipping batched", _batched_clip, 1e-4,
            _ROUNDING, needs_cuda=False),
        Fix("foreach_loop", "loop over tensors as foreach calls", _foreach_loop, 1e-4,
            _ROUNDING, needs_cuda=False),
        Fix("set_to_none", "zero_grad(set_to_none=True)", _set_to_none, 1e-6,
            "adding a gradient to zeros or to nothing gives the same numbers", needs_cuda=False),
        Fix("tf32", "TF32 matrix products", _context(functools.partial(backend_flags, tf32=True)), 2e-2,
            "TF32 keeps 10 of float32's 23 mantissa bits in products (2^-11 relative each); "
            "through a few layers and steps, about 1e-2"),
        Fix("bf16_autocast", "bf16 autocast", _autocast, 5e-2,
            "bf16 keeps 8 mantissa bits (2^-9 relative a rounding); through a few layers and "
            "steps a few 1e-2", needs_cuda=False),
        Fix("pinned_batch", "batch pinned and copied in first", _pinned, 1e-6,
            "the same values, copied earlier"),
        Fix("cuda_graph", "GraphedStep (CUDA graph)", _graph, 1e-3,
            "the same operations replayed, but cuBLAS may pick another kernel for a product while "
            "capturing, summing in another order: " + _REORDERED, rtol_16bit=2e-2),
        Fix("compile", "torch.compile", _compile, 1e-3,
            "fused kernels sum in another order: " + _REORDERED, needs_cuda=False,
            rtol_16bit=2e-2),
        Fix("compile_graphs", "torch.compile with CUDA graphs", functools.partial(_compile, cuda_graphs=True),
            1e-3, "fused kernels sum in another order: " + _REORDERED, rtol_16bit=2e-2),
        Fix("checkpointing", "activation checkpointing", _checkpoint, 1e-4,
            "the recomputed forward is the same arithmetic", needs_cuda=False),
        Fix("sdpa_attention", "attention rewritten as SDPA", _sdpa, 1e-3,
            "the same attention by a fused kernel that sums in another order: " + _REORDERED,
            needs_cuda=False, rtol_16bit=2e-2, redraws_dropout=True),
        Fix("mha_without_weights", "nn.MultiheadAttention without its weights",
            _mha_without_weights, 1e-3,
            "the same attention by SDPA's fused kernel, summed in another order: " + _REORDERED,
            needs_cuda=False, rtol_16bit=2e-2, redraws_dropout=True),
        Fix("padded_products", "odd product dimension padded", _padded_products, 1e-4,
            "the same products at a wider shape, which cuBLAS may tile and sum in another order: "
            "float32 rounding (1e-7 an operation) over a few steps", needs_cuda=False,
            rtol_16bit=2e-2),
        Fix("deferred_reads", ".item() read later (no wait in the step)",
            _deferred, 1e-6,
            "the same values, read after the step instead of inside it"),
        Fix("cudnn_benchmark", "cudnn.benchmark", _context(functools.partial(backend_flags, cudnn_benchmark=True)), 1e-3,
            "cuDNN picks the fastest convolution algorithm, which sums in another order: "
            + _REORDERED, rtol_16bit=2e-2),
        Fix("channels_last", "channels-last convolutions", _to_channels_last, 1e-3,
            "the same convolutions on another memory layout, summed in another order: "
            + _REORDERED, rtol_16bit=2e-2),
    )
}  # fmt: skip
