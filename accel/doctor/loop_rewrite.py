"""A Python loop that changes tensors in place one at a time, rewritten as one foreach call per
in-place call in a copy of the step function, and handed to the user as a diff of their own step::

    for p in model.parameters():                # or for e, p in zip(ema.parameters(), ...)
        if p.grad is None:                      # an optional guard first
            continue
        p.data.add_(p.grad, alpha=-lr)          # in-place calls of FOREACH's methods, chained
                                                # (e.mul_(d).add_(p, alpha=1 - d)) or not,
                                                # or p -= lr * p.grad (+=, -=, *=, /=)

becomes, over the loop's items taken once::

    tensors = [p for p in model.parameters() if not p.grad is None]
    torch._foreach_add_([p.data for p in tensors], [p.grad for p in tensors], alpha=-lr)

(``p -= lr * p.grad`` becomes ``torch._foreach_sub_(tensors, [p.grad for p in tensors],
alpha=lr)``; ``p.clamp_(lo, hi)`` a clamp_min_ and a clamp_max_; an average kept as
``e.copy_(d * e + (1 - d) * p)`` a mul_ by d and an add_ of p with alpha=1 - d.) Each call runs
for every item before the next starts, which is what the loop computes wherever the items are
distinct tensors (the trial checks it against the step as written). Any other loop is left as
written, and :class:`NotRewritable` says which one and why.

A loop that clips each gradient to its own norm (``for p in ...: clip_grad_norm_([p], max_norm)``)
becomes one pass with the same rule (:func:`rewrite_clip_loop`)::

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        norms = torch.stack(torch._foreach_norm(grads))
        torch._foreach_mul_(grads, (max_norm / (norms + 1e-06)).clamp(max=1.0).unbind())
"""

from __future__ import annotations

import ast
import itertools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accel.doctor.batched_clip import CLIP_EPS
from accel.doctor.source_edit import (
    NotRewritable,
    function_source,
    recompiled,
    replaced_diff,
    statement_blocks,
    torch_named,
)

__all__ = ["FOREACH", "ClipNormRead", "LoopRewrite", "LoopsLeft", "NotRewritable", "clip_each_source",
           "rewrite_clip_loop", "rewrite_loop"]

# in-place tensor method -> its foreach form (torch._foreach_<name>)
FOREACH = {name: f"_foreach_{name}" for name in (
    "add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_", "lerp_", "copy_", "zero_",
    "clamp_min_", "clamp_max_", "sqrt_", "neg_",
)}  # fmt: skip
_ITEMS = "__foreach_items"  # the executed copy's list; the diff names it after the loop's items


@dataclass
class LoopRewrite:
    step: Callable[..., Any]  # the step with the loops rewritten (same closure and globals)
    diff: str  # the edit of the user's own source, as a unified diff
    refused: list[str]  # why each loop of the lines left as written is left so


def rewrite_loop(step: Callable[..., Any], *lines: int) -> LoopRewrite:
    """``step`` with every ``for`` loop that holds one of source ``lines`` of its file rewritten;
    :class:`NotRewritable` where none can be."""
    return _rewritten(step, lines, _parts, _statements)


def rewrite_clip_loop(step: Callable[..., Any], *lines: int) -> LoopRewrite:
    """``step`` with every loop holding one of ``lines`` that clips one gradient at a time
    (its body one ``clip_grad_norm_`` call of the loop's tensor, result unused, behind an
    optional guard) rewritten as one pass that clips each to its own norm;
    :class:`NotRewritable` where none can be (:class:`ClipNormRead` among its ``causes`` where
    the loop reads the norms)."""
    return _rewritten(step, lines, _clip_parts, _clip_statements)


def _rewritten(step, lines, parts, statements) -> LoopRewrite:
    """``step`` with the loops holding ``lines`` rewritten: ``parts(loop)`` reads one (or raises
    :class:`NotRewritable`), ``statements(loop, guard, read, executed, taken)`` writes its
    replacement (``taken``: the names the function uses, which the edit must not reuse)."""
    function = getattr(step, "__func__", step)
    if not isinstance(function, types.FunctionType):
        raise NotRewritable(f"the step is a {type(step).__name__}, not a function")
    source, first, definition = function_source(function)
    found = [_loop_at(definition, line) for line in lines]
    refused = [_outside(n, definition) for n, f in zip(lines, found, strict=True) if not f]
    taken = {n.id for n in ast.walk(definition) if isinstance(n, ast.Name)}
    taken |= {a.arg for a in ast.walk(definition.args) if isinstance(a, ast.arg)}
    spans, causes = [], []
    for loop in dict.fromkeys(f for f in found if f):
        try:
            _refuse_read_after(definition, loop)
            guard, read = parts(loop)
        except NotRewritable as error:
            head = source[loop.lineno - first].strip()  # as the user wrote it
            refused.append(f"the loop `{head}` at line {loop.lineno} is left as written: {error}")
            causes.append(error)
            continue
        edit = torch_named(statements(loop, guard, read, False, taken), function.__globals__)
        spans.append((loop.lineno, loop.end_lineno, edit))
        block = next(b for b in statement_blocks(definition) if loop in b)
        at = block.index(loop)
        block[at : at + 1] = statements(loop, guard, read, True, taken)
    if not spans:
        raise LoopsLeft("; ".join(refused) or "no line of the step was given", causes)
    new = recompiled(function, definition)
    if isinstance(step, types.MethodType):
        new = types.MethodType(new, step.__self__)
    fromfile = function.__code__.co_filename
    return LoopRewrite(new, replaced_diff(source, first, spans, fromfile), refused)


def _refuse_read_after(definition: ast.FunctionDef, loop: ast.For) -> None:
    """:class:`NotRewritable` where the function reads a loop variable after the loop (its last
    item), which the rewrite, binding none, would leave undefined."""
    names = set(_names(loop.target))
    later = sorted((n for n in ast.walk(definition) if isinstance(n, ast.Name) and n.id in names
                    and n.lineno > (loop.end_lineno or loop.lineno)),
                   key=lambda n: (n.lineno, n.col_offset))  # fmt: skip
    first = {}
    for n in later:
        first.setdefault(n.id, n)
    read = [n for n in first.values() if isinstance(n.ctx, ast.Load)]
    if read:
        raise NotRewritable(f"line {read[0].lineno} reads {read[0].id} after the loop, which "
                            "the rewrite would leave unbound")  # fmt: skip


def _unused_name(wanted: str, taken: set[str]) -> str:
    """``wanted``, or ``wanted`` with a suffix where the function already uses that name."""
    names = itertools.chain([wanted], (f"{wanted}_{i}" for i in itertools.count(2)))
    return next(n for n in names if n not in taken)


def _outside(line: int, definition: ast.FunctionDef) -> str:
    if definition.lineno <= line <= (definition.end_lineno or definition.lineno):
        return f"line {line} is in no for loop of the step"
    return (f"line {line} is outside the step function {definition.name}() (in a function it "
            "calls): only loops written in the step itself are rewritten")


def _loop_at(definition: ast.FunctionDef, line: int) -> ast.For | None:
    loops = [node for node in ast.walk(definition) if isinstance(node, ast.For)
             and node.lineno <= line <= (node.end_lineno or node.lineno)]  # fmt: skip
    return max(loops, key=lambda node: node.lineno, default=None)  # the innermost


def _parts(loop: ast.For) -> tuple[ast.expr | None, list[ast.Call]]:
    names, guard, body = _guarded_body(loop)
    calls = [call for statement in body for call in _updates(statement, names)]
    if not calls:
        raise NotRewritable("its body makes no in-place call")
    return guard, calls


def _guarded_body(loop: ast.For) -> tuple[list[str], ast.expr | None, list[ast.stmt]]:
    """The loop's names, its guard (or None: the condition on which an item is skipped, written
    ``if ...: continue`` or as a block ``if ...:`` holding the whole body) and its statements."""
    names = _names(loop.target)
    if not names or loop.orelse:
        raise NotRewritable("only `for p in ...:` or `for e, p in ...:` without an `else:` is "
                            "rewritten")  # fmt: skip
    body, guard = list(loop.body), None
    first = body[0]
    if isinstance(first, ast.If) and not first.orelse and _is_continue(first.body):
        guard, body = first.test, body[1:]
    elif len(body) == 1 and isinstance(first, ast.If) and not first.orelse:
        guard, body = _negated(first.test), list(first.body)
    return names, guard, body


class LoopsLeft(NotRewritable):
    """No loop was rewritten; ``causes``: why each loop of the step that was read was left."""

    def __init__(self, message: str, causes: list[NotRewritable]) -> None:
        super().__init__(message)
        self.causes = causes


class ClipNormRead(NotRewritable):
    """A clip loop that reads the norms the clips return: batched as the calls run, they would
    be read before they are computed."""


_CLIP_ARGUMENTS = ("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach")


def _clip_parts(loop: ast.For) -> tuple[ast.expr | None, tuple[ast.expr, ast.expr, ast.expr | None]]:
    """The guard, and the clip's (tensor, max_norm, norm_type or None) of a loop whose body is
    one ``clip_grad_norm_`` call of one of the loop's tensors."""
    names, guard, body = _guarded_body(loop)
    statement = body[0] if len(body) == 1 else None
    call = statement.value if isinstance(statement, ast.Expr) else None
    said = "; ".join(f"`{ast.unparse(s).splitlines()[0]}`" for s in body) or "nothing"
    if not (isinstance(call, ast.Call) and _called(call).endswith("clip_grad_norm_")):
        used = any(isinstance(n, ast.Call) and _called(n).endswith("clip_grad_norm_")
                   for s in body for n in ast.walk(s))  # fmt: skip
        raise (ClipNormRead if used else NotRewritable)(
            f"its body ({said}) is not one clip_grad_norm_(...) call whose result is left unused")
    given = dict(zip(_CLIP_ARGUMENTS, call.args, strict=False))
    given |= {k.arg: k.value for k in call.keywords}
    tensor = given.get("parameters")
    if isinstance(tensor, (ast.List, ast.Tuple)) and len(tensor.elts) == 1:
        tensor = tensor.elts[0]
    check = given.get("error_if_nonfinite", ast.Constant(False))
    if (None in given or any(isinstance(a, ast.Starred) for a in call.args)
            or not isinstance(tensor, ast.Name) or tensor.id not in names
            or "max_norm" not in given or not isinstance(check, ast.Constant) or check.value
            or any(_uses(given[k], names) for k in ("max_norm", "norm_type") if k in given)):  # fmt: skip
        raise NotRewritable(f"{said} is not clip_grad_norm_ of one of the loop's tensors with a "
                            "limit and norm the same for each (and no error_if_nonfinite=True, "
                            "which checks each norm as it goes)")  # fmt: skip
    return guard, (tensor, given["max_norm"], given.get("norm_type"))


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def clip_each_source(items: str, max_norm: str, norm_type: str | None = None, *, where: str = "",
                     tensor: str = "p", torch: str = "torch", grads: str = "grads",
                     norms: str = "norms") -> str:  # fmt: skip
    """The source that clips each gradient of the tensors ``items`` (a comprehension's ``for``
    clause, say ``for p in model.parameters()``, naming each one ``tensor``; those for which
    ``where`` holds) to its own norm in one pass, with ``clip_grad_norm_``'s rule."""
    norm = f", {norm_type}" if norm_type is not None else ""
    kept = f"{tensor}.grad is not None"
    where = kept if where in ("", kept) else f"{where} and {kept}"
    return (f"{grads} = [{tensor}.grad {items} if {where}]\n"
            f"if {grads}:\n"
            f"    {norms} = {torch}.stack({torch}._foreach_norm({grads}{norm}))\n"
            f"    {torch}._foreach_mul_({grads}, ({max_norm} / ({norms} + {CLIP_EPS!r}))"
            ".clamp(max=1.0).unbind())\n")


def _clip_statements(loop: ast.For, guard: ast.expr | None, clip, executed: bool,
                     taken: set[str]) -> list[ast.stmt]:  # fmt: skip
    tensor, max_norm, norm_type = clip
    items = f"for {ast.unparse(loop.target)} in {ast.unparse(loop.iter)}"
    names = (("__clip_grads", "__clip_norms") if executed
             else (_unused_name("grads", taken), _unused_name("norms", taken)))  # fmt: skip
    source = clip_each_source(
        items, f"({ast.unparse(max_norm)})",  # parsed again: the brackets stay only if needed
        None if norm_type is None else ast.unparse(norm_type),
        where="" if guard is None else ast.unparse(_negated(guard)), tensor=tensor.id,
        torch="__import__('torch')" if executed else "torch", grads=names[0], norms=names[1],
    )
    out = ast.parse(source).body
    for statement in out:
        ast.increment_lineno(statement, loop.lineno - 1)
        for node in ast.walk(statement):
            ast.copy_location(node, loop)
    return out


def _names(target: ast.expr) -> list[str]:
    """``p`` of ``for p in``, ``e, p`` of ``for e, p in``; none for any other target."""
    elements = target.elts if isinstance(target, ast.Tuple) else [target]
    return [e.id for e in elements] if all(isinstance(e, ast.Name) for e in elements) else []


def _updates(statement: ast.stmt, names: list[str]) -> list[ast.Call]:
    """The in-place calls ``statement`` makes on the loop's tensors, each of a FOREACH method."""
    call = statement.value if isinstance(statement, ast.Expr) else _augmented(statement)
    calls = [c for link in _unchained(call) for c in _expanded(link, names)] if isinstance(
        call, ast.Call) else []  # fmt: skip
    said = f"line {statement.lineno} (`{ast.unparse(statement).splitlines()[0]}`)"
    what = " or ".join(names)
    if not calls or any(_method(c) not in FOREACH or not _uses(c.func.value, names) for c in calls):
        raise NotRewritable(f"{said} is not an in-place update of {what} (.add_(...), .mul_(...), "
                            ".lerp_(...), .clamp_(...), -= and the like), which one foreach call "
                            "makes on every item at once")  # fmt: skip
    if any(_uses(k.value, names) for c in calls for k in c.keywords) or any(
            isinstance(a, ast.Starred) for c in calls for a in c.args):  # fmt: skip
        raise NotRewritable(f"{said}: a keyword depends on {what}, where a foreach call takes one "
                            "value for every item")  # fmt: skip
    return calls


_AUGMENTED = {ast.Add: "add_", ast.Sub: "sub_", ast.Mult: "mul_", ast.Div: "div_"}


def _augmented(statement: ast.stmt) -> ast.Call | None:
    """``t -= x`` as the call it makes, ``t.sub_(x)``; None for any other statement."""
    if not isinstance(statement, ast.AugAssign) or type(statement.op) not in _AUGMENTED:
        return None
    target = ast.parse(ast.unparse(statement.target), mode="eval").body  # read, not assigned
    return _call(ast.copy_location(target, statement), _AUGMENTED[type(statement.op)],
                 [statement.value])  # fmt: skip


def _unchained(call: ast.Call) -> list[ast.Call]:
    """``e.mul_(d).add_(p)`` as ``e.mul_(d)`` then ``e.add_(p)``: an in-place call returns its
    tensor."""
    inner = call.func.value if _method(call) else None
    if not isinstance(inner, ast.Call) or not (_method(inner) or "").endswith("_"):
        return [call]
    links = _unchained(inner)
    return [*links, _call(links[-1].func.value, call.func.attr, call.args, call.keywords)]


def _expanded(call: ast.Call, names: list[str]) -> list[ast.Call]:
    """``call`` as calls of FOREACH methods: ``clamp_`` as ``clamp_min_`` and ``clamp_max_``;
    ``t.copy_(c * t + x)`` as ``t.mul_(c)`` and ``t.add_(x)``; ``t.add_(c * x)`` (or sub_) as
    ``t.add_(x, alpha=c)``, where ``c`` does not depend on the loop's names."""
    method = _method(call)
    tensor = call.func.value if method else None
    simple = len(call.args) == 1 and not call.keywords
    if method in ("clamp_", "clip_"):
        given = dict(zip(("min", "max"), call.args, strict=False))
        given |= {k.arg: k.value for k in call.keywords}
        return [_call(tensor, f"clamp_{side}_", [given[side]]) for side in ("min", "max")
                if not isinstance(given.get(side, ast.Constant(None)), ast.Constant)
                or given[side].value is not None]  # fmt: skip
    if method == "copy_" and simple and isinstance(call.args[0], ast.BinOp) and isinstance(
            call.args[0].op, ast.Add):  # fmt: skip
        sum_ = call.args[0]
        for scaled, rest in ((sum_.left, sum_.right), (sum_.right, sum_.left)):
            split = _split(scaled, names)
            read = [n.id for n in ast.walk(tensor) if isinstance(n, ast.Name)]
            if split and ast.dump(split[1]) == ast.dump(tensor) and not _uses(rest, read):
                return [_call(tensor, "mul_", [split[0]]),
                        *_expanded(_call(tensor, "add_", [rest]), names)]  # fmt: skip
    if method in ("add_", "sub_") and simple and (split := _split(call.args[0], names)):
        return [_call(tensor, method, [split[1]], [ast.keyword("alpha", split[0])])]
    return [call]


def _split(node: ast.expr, names: list[str]) -> tuple[ast.expr, ast.expr] | None:
    """(c, x) of ``c * x`` or ``x * c`` where x, not c, depends on the loop's names."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        for factor, tensor in ((node.left, node.right), (node.right, node.left)):
            if not _uses(factor, names) and _uses(tensor, names):
                return factor, tensor
    return None


def _method(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _call(tensor: ast.expr, method: str, args: list[ast.expr],
          keywords: list[ast.keyword] | None = None) -> ast.Call:  # fmt: skip
    return ast.Call(ast.Attribute(tensor, method, ast.Load()), args, keywords or [])


def _is_continue(body: list[ast.stmt]) -> bool:
    return len(body) == 1 and isinstance(body[0], ast.Continue)


def _uses(node: ast.AST, names: list[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


_CHECKS = """\
if len({{t.data_ptr() for t in {targets} if t.numel()}}) < sum(1 for t in {targets} if t.numel()):
    raise RuntimeError("the loop's tensors share memory (tied weights?): a foreach call updates "
                       "them together, the loop one after the other")
if not all(t.is_floating_point() or t.is_complex() for t in {targets}):
    raise RuntimeError("an item is an integer tensor (a BatchNorm's step counter?): foreach "
                       "arithmetic cannot write into it as the loop does")
"""


_OPPOSITE = {ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
             ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}  # fmt: skip


def _negated(guard: ast.expr) -> ast.expr:
    """``not guard`` as one writes it: ``x is not None`` for ``x is None``, ``x`` for ``not x``."""
    if isinstance(guard, ast.UnaryOp) and isinstance(guard.op, ast.Not):
        return guard.operand
    if isinstance(guard, ast.Compare) and len(guard.ops) == 1 and type(guard.ops[0]) in _OPPOSITE:
        return ast.Compare(guard.left, [_OPPOSITE[type(guard.ops[0])]()], guard.comparators)
    return ast.UnaryOp(ast.Not(), guard)


def _statements(loop: ast.For, guard: ast.expr | None, calls: list[ast.Call],
                executed: bool, taken: set[str]) -> list[ast.stmt]:  # fmt: skip
    """The loop's items taken once, then one foreach call per in-place call; ``executed``: torch
    reached without a name in the user's module (the diff says ``torch``)."""
    items = _ITEMS if executed else _unused_name("tensors", taken)
    names = _names(loop.target)
    if guard is None:
        listed = ast.Call(ast.Name("list", ast.Load()), [loop.iter], [])
    else:
        each = ast.comprehension(loop.target, loop.iter, [_negated(guard)], 0)
        listed = ast.ListComp(ast.parse(ast.unparse(loop.target), mode="eval").body, [each])
    taken = ast.Assign([ast.Name(items, ast.Store())], listed)
    torch = (ast.Call(ast.Name("__import__", ast.Load()), [ast.Constant("torch")], [])
             if executed else ast.Name("torch", ast.Load()))  # fmt: skip

    def per_item(node: ast.expr) -> ast.expr:
        if not _uses(node, names):
            return node
        if isinstance(node, ast.Name) and isinstance(loop.target, ast.Name):  # the items
            return ast.Name(items, ast.Load())
        over = ast.comprehension(loop.target, ast.Name(items, ast.Load()), [], 0)
        return ast.ListComp(node, [over])

    out: list[ast.stmt] = [taken]
    if executed:  # what one call over every item does otherwise than the loop: refused, said why
        for targets in dict.fromkeys(ast.unparse(per_item(c.func.value)) for c in calls):
            checks = ast.parse(_CHECKS.format(targets=targets))
            ast.increment_lineno(checks, loop.lineno - 1)
            out += checks.body
    for call in calls:
        foreach = ast.Attribute(torch, FOREACH[call.func.attr], ast.Load())
        args = [per_item(call.func.value), *map(per_item, call.args)]
        out.append(ast.Expr(ast.Call(foreach, args, call.keywords)))
    for statement in out:
        ast.copy_location(statement, loop)
        ast.fix_missing_locations(statement)
    return out
