"""A Python loop that changes tensors in place one at a time, rewritten as one foreach call per
statement in a copy of the step function, and handed to the user as a diff of their own step::

    for p in model.parameters():
        if p.grad is None:                      # an optional guard first
            continue
        p.data.add_(p.grad, alpha=-lr)          # in-place calls of FOREACH's methods, or
                                                # p -= lr * p.grad (+=, -=, *=, /=)

becomes, over the loop's items taken once::

    tensors = [p for p in model.parameters() if not p.grad is None]
    torch._foreach_add_([p.data for p in tensors], [p.grad for p in tensors], alpha=-lr)

(``p -= lr * p.grad`` becomes ``torch._foreach_sub_(tensors, [p.grad for p in tensors],
alpha=lr)``.) Each statement runs for every item before the next statement starts, which is what the loop
computes wherever the items are distinct tensors (the trial checks it against the step as
written). Anything else raises :class:`NotRewritable` naming the statement.
"""

from __future__ import annotations

import ast
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accel.doctor.rewrite import (
    NotRewritable,
    function_source,
    recompiled,
    replaced_diff,
    statement_blocks,
)

__all__ = ["FOREACH", "LoopRewrite", "NotRewritable", "rewrite_loop"]

# in-place tensor method -> its foreach form (torch._foreach_<name>)
FOREACH = {name: f"_foreach_{name}" for name in (
    "add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_", "lerp_", "copy_", "zero_",
    "clamp_min_", "clamp_max_", "sqrt_", "neg_",
)}  # fmt: skip
_ITEMS = "__foreach_items"  # the executed copy's list; the diff names it after the loop's items


@dataclass
class LoopRewrite:
    step: Callable[..., Any]  # the step with the loop rewritten (same closure and globals)
    diff: str  # the edit of the user's own source, as a unified diff


def rewrite_loop(step: Callable[..., Any], line: int) -> LoopRewrite:
    """``step`` with the ``for`` loop that holds source line ``line`` of its file rewritten."""
    function = getattr(step, "__func__", step)
    if not isinstance(function, types.FunctionType):
        raise NotRewritable(f"the step is a {type(step).__name__}, not a function")
    lines, first, definition = function_source(function)
    loop = _loop_at(definition, line)
    items, guard, calls = _parts(loop)
    shown = _statements(loop, items, guard, calls, executed=False)
    block = next(b for b in statement_blocks(definition) if loop in b)
    at = block.index(loop)
    block[at : at + 1] = _statements(loop, items, guard, calls, executed=True)
    new = recompiled(function, definition)
    if isinstance(step, types.MethodType):
        new = types.MethodType(new, step.__self__)
    fromfile = f"{function.__code__.co_filename}:{first}"
    diff = replaced_diff(lines, first, loop.lineno, loop.end_lineno, shown, fromfile,
                         "with foreach calls")  # fmt: skip
    return LoopRewrite(new, diff)


def _loop_at(definition: ast.FunctionDef, line: int) -> ast.For:
    loops = [node for node in ast.walk(definition) if isinstance(node, ast.For)
             and node.lineno <= line <= (node.end_lineno or node.lineno)]  # fmt: skip
    if not loops:
        raise NotRewritable(f"no for loop of the step holds line {line}")
    return max(loops, key=lambda node: node.lineno)  # the innermost


def _parts(loop: ast.For) -> tuple[str, ast.expr | None, list[ast.Call]]:
    if not isinstance(loop.target, ast.Name) or loop.orelse:
        raise NotRewritable("the loop is not `for name in items:` without an else")
    name, body, guard = loop.target.id, list(loop.body), None
    first = body[0]
    if isinstance(first, ast.If) and not first.orelse and _is_continue(first.body):
        guard, body = first.test, body[1:]
    calls = []
    for statement in body:
        call = statement.value if isinstance(statement, ast.Expr) else _in_place(statement, name)
        method = call.func.attr if isinstance(call, ast.Call) and isinstance(
            call.func, ast.Attribute) else None  # fmt: skip
        if method not in FOREACH or not _uses(call.func.value, name):
            raise NotRewritable(f"line {statement.lineno} is not an in-place call "
                                f"({', '.join(FOREACH)}, or +=, -=, *=, /=) on the loop's "
                                f"{name}")  # fmt: skip
        if any(_uses(k.value, name) for k in call.keywords) or any(
                isinstance(a, ast.Starred) for a in call.args):  # fmt: skip
            raise NotRewritable(f"line {statement.lineno}: a keyword depends on {name}")
        calls.append(call)
    if not calls:
        raise NotRewritable("the loop's body has no in-place call")
    return name, guard, calls


_AUGMENTED = {ast.Add: "add_", ast.Sub: "sub_", ast.Mult: "mul_", ast.Div: "div_"}


def _in_place(statement: ast.stmt, name: str) -> ast.Call | None:
    """``t -= c * x`` as the call it makes, ``t.sub_(x, alpha=c)`` (``t.sub_(v)`` without a
    factor that does not depend on ``name``); None for any other statement."""
    if not isinstance(statement, ast.AugAssign) or type(statement.op) not in _AUGMENTED:
        return None
    target, value = statement.target, statement.value
    method = _AUGMENTED[type(statement.op)]
    target = ast.copy_location(type(target)(**{**vars(target), "ctx": ast.Load()}), target)
    args, keywords = [value], []
    if method in ("add_", "sub_") and isinstance(value, ast.BinOp) and isinstance(
            value.op, ast.Mult):  # fmt: skip
        factor, tensor = (value.left, value.right) if not _uses(value.left, name) else (
            value.right, value.left)  # fmt: skip
        if not _uses(factor, name) and _uses(tensor, name):
            args, keywords = [tensor], [ast.keyword("alpha", factor)]
    return ast.Call(ast.Attribute(target, method, ast.Load()), args, keywords)


def _is_continue(body: list[ast.stmt]) -> bool:
    return len(body) == 1 and isinstance(body[0], ast.Continue)


def _uses(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _statements(loop: ast.For, name: str, guard: ast.expr | None, calls: list[ast.Call],
                executed: bool) -> list[ast.stmt]:  # fmt: skip
    """The loop's items taken once, then one foreach call per statement; ``executed``: torch
    reached without a name in the user's module (the diff says ``torch``)."""
    items = _ITEMS if executed else "tensors"
    if guard is None:
        listed = ast.Call(ast.Name("list", ast.Load()), [loop.iter], [])
    else:
        each = ast.comprehension(ast.Name(name, ast.Store()), loop.iter,
                                 [ast.UnaryOp(ast.Not(), guard)], 0)  # fmt: skip
        listed = ast.ListComp(ast.Name(name, ast.Load()), [each])
    taken = ast.Assign([ast.Name(items, ast.Store())], listed)
    torch = (ast.Call(ast.Name("__import__", ast.Load()), [ast.Constant("torch")], [])
             if executed else ast.Name("torch", ast.Load()))  # fmt: skip
    def per_item(node: ast.expr) -> ast.expr:
        if not _uses(node, name):
            return node
        if isinstance(node, ast.Name):  # the items themselves
            return ast.Name(items, ast.Load())
        over = ast.comprehension(ast.Name(name, ast.Store()), ast.Name(items, ast.Load()), [], 0)
        return ast.ListComp(node, [over])

    out: list[ast.stmt] = [taken]
    for call in calls:
        foreach = ast.Attribute(torch, FOREACH[call.func.attr], ast.Load())
        args = [per_item(call.func.value), *map(per_item, call.args)]
        out.append(ast.Expr(ast.Call(foreach, args, call.keywords)))
    for statement in out:
        ast.copy_location(statement, loop)
        ast.fix_missing_locations(statement)
    return out
