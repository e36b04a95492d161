"""Attention written out by hand, rewritten as one ``scaled_dot_product_attention`` call in a
copy of the module that runs it (or in a plain function, swapped in while a copy's step runs),
and handed to the user as a diff of their own ``forward`` (or function).

Between the recorded lines of the scores' and the values' products, the statements must read as
a chain on one variable, each kind at most once::

    att = (q @ k.transpose(-2, -1)) * scale          # or / scale, or torch.matmul(...)
    att = att.masked_fill(cond, float("-inf"))        # or att + additive_mask; either may sit
                                                      # under `if mask is not None:`
    att = F.softmax(att, dim=-1)                      # or att.softmax(-1), torch.softmax, of
                                                      # att.float() and cast back (.type_as(q))
    att = self.attn_dropout(att)                      # a dropout module or F.dropout
    y = att @ v                                       # or inside an expression, or returned:
                                                      # return (att @ v).transpose(1, 2)

which is ``F.scaled_dot_product_attention(q, k, v, attn_mask=~cond, scale=scale)`` (an exactly
causal mask, filled in or added, becomes ``is_causal=True``). Anything else raises
:class:`NotRewritable` naming the statement.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import types
from dataclasses import dataclass

from torch import nn

from accel.doctor.own_scope import copies_of, over_own_names
from accel.doctor.source_edit import (
    NotRewritable,
    function_source,
    recompiled,
    replaced_diff,
    statement_blocks,
    torch_named,
)

__all__ = ["AttentionRewrite", "NotRewritable", "rewrite_attention"]

_SDPA = "torch.nn.functional.scaled_dot_product_attention"
_SOFTMAX_NAMES = ("softmax", "_softmax")
_CASTS = ("to", "type", "type_as", "float", "half", "bfloat16")  # casts around a softmax
_TARGETS = (ast.Name, ast.Attribute, ast.Subscript)  # what the attention's output may be kept in


@dataclass(frozen=True)
class AttentionRewrite:
    """A module class's ``forward``, or a plain function, with its written-out attention
    replaced by SDPA."""

    holder: type | types.FunctionType  # the module class, or the function itself
    function: types.FunctionType  # the new forward (unbound) or function
    diff: str  # the user's edit, as a unified diff of their forward or function

    def apply(self, models: list[nn.Module], contexts: list) -> int:
        """Bind the new forward on every submodule of ``models`` of this class, or add to
        ``contexts`` the function's swap for the copy's step (:meth:`swapped`); how many."""
        if not isinstance(self.holder, type):
            contexts.append(self.swapped)
            return 1
        matching = [m for model in models for m in model.modules() if isinstance(m, self.holder)]
        for module in matching:  # subclasses: rebuilt
            module.forward = types.MethodType(over_own_names(self.function), module)
        return len(matching)

    @contextlib.contextmanager
    def swapped(self):
        """The function, and the copies compiled copies call, run the new code while the copy's
        step runs (their callers look it up by name, so it is not replaced), their own after."""
        functions = [self.holder, *copies_of(self.holder)]
        own = [function.__code__ for function in functions]
        for function in functions:
            function.__code__ = self.function.__code__
        try:
            yield
        finally:
            for function, code in zip(functions, own, strict=True):
                function.__code__ = code


def rewrite_attention(models: list[nn.Module], scores_line: tuple[str, int],
                      values_line: tuple[str, int], causal: bool) -> AttentionRewrite:  # fmt: skip
    """The rewrite of the ``forward`` (of a submodule class of ``models``), or of the plain
    function their modules see, that holds the lines ``(file, line)`` of the scores' and the
    values' products."""
    holder = _owner(models, *scores_line)
    forward = holder.forward if isinstance(holder, type) else holder
    lines, first, function = function_source(forward)
    body, start, stop = _chain_span(function, scores_line[1], values_line[1])
    replaced = body[start : stop + 1]
    statement = _sdpa_statement(replaced, causal, _from_arguments(function))
    _refuse_lost_reads(function, replaced, statement)
    calls = [ast.fix_missing_locations(s) for s in torch_named(
        [ast.copy_location(statement, replaced[0])], forward.__globals__)]  # fmt: skip
    body[start : stop + 1] = calls
    fromfile = inspect.getsourcefile(forward)
    diff = replaced_diff(lines, first, [(replaced[0].lineno, replaced[-1].end_lineno, calls)],
                         fromfile)
    new = recompiled(forward, function)
    if not isinstance(holder, type) and new.__code__.co_freevars != forward.__code__.co_freevars:
        raise NotRewritable(f"{holder.__name__}'s rewritten code closes over other variables")
    return AttentionRewrite(holder, new, diff)


def _owner(models: list[nn.Module], file: str, line: int) -> type | types.FunctionType:
    """The class, among the models' submodules, whose ``forward`` spans ``file:line``; else a
    plain function that does, in the namespace of a submodule class's module."""
    classes = list(dict.fromkeys(type(m) for model in models for m in model.modules()))
    for cls in classes:
        if _spans(getattr(cls.forward, "__code__", None), file, line):
            return cls
    for cls in classes:  # the namespace its forward runs in (a script run by path is in none)
        for value in list(getattr(cls.forward, "__globals__", {}).values()):
            if isinstance(value, types.FunctionType) and _spans(value.__code__, file, line):
                return value
    raise NotRewritable(f"no module's forward or function they see holds {file}:{line}")


def _spans(code: types.CodeType | None, file: str, line: int) -> bool:
    if code is None or code.co_filename != file:
        return False
    lines = [n for _, _, n in code.co_lines() if n is not None]
    return bool(lines) and min(lines) <= line <= max(lines)


def _refuse_lost_reads(function: ast.FunctionDef, replaced: list[ast.stmt], statement: ast.stmt):
    """NotRewritable where a variable the chain assigns and the SDPA call does not (the weights)
    is read after the chain (returned for a loss or a plot)."""
    lost = _assigned(replaced) - _assigned([statement])
    end = replaced[-1].end_lineno
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in lost \
                and node.lineno > end:  # fmt: skip
            raise NotRewritable(f"{node.id}, which SDPA does not compute, is read after the "
                                f"values' product (line {node.lineno})")


def _assigned(statements: list[ast.stmt]) -> set[str]:
    return {n.id for s in statements for n in ast.walk(s)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}  # fmt: skip


def _chain_span(function: ast.FunctionDef, first: int, last: int) -> tuple[list, int, int]:
    """(the statement list, index of the scores' statement, index of the values') in the
    innermost block of ``function`` that holds both lines (an attention inside an ``else:``)."""
    spans = []
    for block in statement_blocks(function):
        at = [i for i, s in enumerate(block) if s.lineno <= first <= s.end_lineno]
        end = [i for i, s in enumerate(block) if s.lineno <= last <= s.end_lineno]
        if at and end:
            size = block[end[0]].end_lineno - block[at[0]].lineno
            spans.append((size, block, at[0], end[0]))
    if not spans:
        raise NotRewritable("the scores' and values' products are not in one block of the forward")
    _, block, start, stop = min(spans, key=lambda span: span[0])
    return block, start, stop


def _from_arguments(function: ast.FunctionDef) -> set[str]:
    """The names in ``function`` whose values come from its arguments' values (not their shapes:
    ``B, T, C = x.size()`` does not), ``self`` aside: a mask of them may change with the batch."""
    given = function.args
    names = {a.arg for a in (*given.posonlyargs, *given.args, *given.kwonlyargs)} - {"self"}
    names |= {a.arg for a in (given.vararg, given.kwarg) if a is not None}
    grew = True
    while grew:
        grew = False
        for node in ast.walk(function):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For)):
                value = node.iter if isinstance(node, ast.For) else node.value
                targets = getattr(node, "targets", None) or [node.target]
                if value is None or not _reads_values(value, names):
                    continue
                new = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                grew, names = grew or bool(new - names), names | new
    return names


_SHAPE_READS = ("shape", "size", "dim", "ndim", "dtype", "device")


def _reads_values(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` reads the values of one of ``names`` (not only its shape or dtype)."""
    if isinstance(node, ast.Attribute) and node.attr in _SHAPE_READS:
        return False
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len":
        return False
    if isinstance(node, ast.Name):
        return node.id in names
    return any(_reads_values(child, names) for child in ast.iter_child_nodes(node))


def _sdpa_statement(statements: list[ast.stmt], causal: bool, varying: set[str]) -> ast.stmt:
    """The chain ``statements`` as one assignment of the SDPA call; a mask that reads ``varying``
    names stays a mask though it was causal where recorded (the next batch's may not be)."""
    chain = _Chain()
    for statement in statements:
        if isinstance(statement, ast.Return) and statement is statements[-1] and statement.value:
            chain.read(None, statement.value)  # ``return att @ v``: the values' product returned
            continue
        condition = None
        if isinstance(statement, ast.If) and not statement.orelse and len(statement.body) == 1:
            condition, statement = statement.test, statement.body[0]  # a mask, when one is given
        targets = statement.targets if isinstance(statement, ast.Assign) else ()
        if len(targets) != 1 or not isinstance(targets[0], _TARGETS):
            raise NotRewritable(f"not one assignment: {ast.unparse(statement)}")
        chain.read(statement.targets[0], statement.value, condition)
    mask = chain.cond if chain.cond is not None else chain.additive
    return chain.statement(causal and not (mask is not None and _reads_values(mask, varying)))


class _Chain:
    """What the chain's statements said, read one at a time."""

    def __init__(self):
        self.name: str | None = None  # the scores' variable
        self.q = self.k = self.v = self.scale = self.cond = self.fill = self.additive = None
        self.mask_if: ast.expr | None = None  # the mask is applied only where this holds
        self.dropout: ast.expr | None = None
        self.softmax = False
        self.target: ast.expr | None = None  # where the values' product goes (None: returned)
        self.done = False
        # the values' statement, and its product (the statement itself, or a part of it:
        # ``(att @ v).transpose(1, 2)``) that the SDPA call replaces
        self.values: ast.expr | None = None
        self.product: ast.expr | None = None

    def read(self, target: ast.expr | None, value: ast.expr, condition: ast.expr | None = None) -> None:
        if condition is not None:
            self._conditional(target, value, condition)
        elif self.name is None:
            self._scores(target, value)
        elif self.done:
            raise NotRewritable(f"a statement after the values' product: {ast.unparse(value)}")
        elif (product := self._values_product(value)) is not None:
            self.target, self.values, self.product, self.done = target, value, product, True
        elif target is None:
            raise NotRewritable(f"returned before the values' product: {ast.unparse(value)}")
        else:
            self._step(target, value)

    def _scores(self, target: ast.expr, value: ast.expr) -> None:
        if not isinstance(target, ast.Name):
            said = ast.unparse(target) if target is not None else f"return {ast.unparse(value)}"
            raise NotRewritable(f"the scores are not kept in a variable: {said}")
        self.name = target.id
        product, scale = value, None
        if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)):
            if _product(value.left) is not None:
                product, scale = value.left, value.right
            elif isinstance(value.op, ast.Mult) and _product(value.right) is not None:
                product, scale = value.right, value.left
        operands = _product(product)
        if operands is None and any(_product(node) is not None for node in ast.walk(value)):
            raise NotRewritable("the scores, their mask and softmax are written as one "
                                f"expression, which the rewrite does not read apart: "
                                f"{ast.unparse(value)}; give each its own statement")  # fmt: skip
        if operands is None:
            raise NotRewritable(f"the scores are not q @ k^T: {ast.unparse(value)}")
        self.q, kt = operands
        self.k = _untransposed(kt, three_d=_attribute(getattr(product, "func", None)) == "bmm")
        if scale is not None and isinstance(value.op, ast.Div):
            scale = ast.BinOp(ast.Constant(1.0), ast.Div(), scale)
        self.scale = scale

    def _conditional(self, target: ast.expr | None, value: ast.expr, condition: ast.expr) -> None:
        """A mask applied under ``if condition:``, the chain's only step that may be: SDPA gets
        ``attn_mask=<mask> if condition else None``."""
        masks = (self.cond, self.additive)
        if self.name is None or self.softmax or target is None:
            raise NotRewritable(f"a step under a condition: if {ast.unparse(condition)}: ...")
        self._step(target, value)
        if (self.cond, self.additive) == masks or self.mask_if is not None:
            raise NotRewritable(f"not one mask under a condition: if {ast.unparse(condition)}: ...")
        self.mask_if = condition

    def _values_product(self, value: ast.expr) -> ast.expr | None:
        """The product of the scores and the values in ``value`` (after the softmax), if any."""
        if not self.softmax:
            return None
        operands = _product(value)
        if operands is not None and not _is_name(operands[0], self.name):
            said = ast.unparse(value)
            raise NotRewritable(f"the values' product does not read the scores: {said}")
        found = [n for n in ast.walk(value)
                 if (pair := _product(n)) is not None and _is_name(pair[0], self.name)]  # fmt: skip
        if not found:
            return None
        reads = [n for n in ast.walk(value) if _is_name(n, self.name)]
        if len(reads) > 1:
            said = ast.unparse(value)
            raise NotRewritable(f"the scores are read besides the values' product: {said}")
        self.v = _product(found[0])[1]
        return found[0]

    def _step(self, target: ast.expr, value: ast.expr) -> None:
        if not isinstance(target, ast.Name):
            raise NotRewritable(f"the chain leaves its variable: {ast.unparse(target)}")
        self._read_step(value)
        self.name = target.id  # a step may rename the scores (probs = softmax(scores))

    def _read_step(self, value: ast.expr) -> None:
        if self.softmax:
            self._after_softmax(value)
        elif isinstance(value, ast.Call) and _attribute(value.func) == "masked_fill":
            if self.cond is not None or not _is_name(value.func.value, self.name):
                raise NotRewritable(f"a second or foreign mask: {ast.unparse(value)}")
            if not _minus_infinity(value.args[1] if len(value.args) > 1 else None):
                raise NotRewritable(f"a mask filled with a finite value: {ast.unparse(value)}")
            self.cond, self.fill = value.args[0], value.args[1]
        elif isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
            other = _other_operand(value, self.name)
            if other is None or self.additive is not None:
                raise NotRewritable(f"not scores + mask: {ast.unparse(value)}")
            self.additive = other
        elif self._rescaled(value):
            pass
        elif _is_softmax(value, self.name):
            self.softmax = True
        else:
            said = ast.unparse(value)
            raise NotRewritable(f"a step of the chain the rewrite does not read: {said}")

    def _rescaled(self, value: ast.expr) -> bool:
        """``att = att / s`` or ``att * s`` before any mask: the scale, once."""
        if not (isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div))):
            return False
        if not _is_name(value.left, self.name) or self.scale is not None:
            return False
        if self.cond is not None or self.additive is not None:
            return False
        by = value.right
        self.scale = (
            ast.BinOp(ast.Constant(1.0), ast.Div(), by) if isinstance(value.op, ast.Div) else by
        )
        return True

    def _after_softmax(self, value: ast.expr) -> None:
        call = value if isinstance(value, ast.Call) else None
        if call is None or self.dropout is not None:
            raise NotRewritable(f"after the softmax, not one dropout: {ast.unparse(value)}")
        name = _attribute(call.func) or ""
        if "drop" not in name.lower() or not call.args or not _is_name(call.args[0], self.name):
            raise NotRewritable(f"after the softmax, not a dropout: {ast.unparse(value)}")
        if _functional_dropout(call.func):  # F.dropout(att, p, training)
            p = _keyword(call, "p", 1) or ast.Constant(0.5)
            training = _keyword(call, "training", 2) or ast.Constant(True)
        else:  # a dropout module
            p = ast.Attribute(call.func, "p", ast.Load())
            training = ast.Attribute(call.func, "training", ast.Load())
        zero = isinstance(p, ast.Constant) and p.value == 0
        self.dropout = ast.Constant(0.0) if zero else ast.IfExp(training, p, ast.Constant(0.0))

    def _finite_fill(self) -> bool:
        """The scores hidden with a finite number (``torch.finfo(att.dtype).min``, ``-1e9``), and
        the query a name to read the dtype from."""
        text = ast.unparse(self.fill).replace(" ", "") if self.fill is not None else ""
        return isinstance(self.q, ast.Name) and text not in _MINUS_INFINITY

    def statement(self, causal: bool) -> ast.stmt:
        if not self.done or not self.softmax:
            raise NotRewritable("the chain has no softmax and values' product where expected")
        keywords = []
        if self.cond is not None and self.additive is not None:
            raise NotRewritable("both a masked_fill and an additive mask")
        mask = None
        causal = causal and self.mask_if is None  # a mask only sometimes given stays a mask
        if self.cond is not None and not causal and self._finite_fill():
            # added, not filled: a row hiding every key then averages the values, as there; half
            # the lowest number, which a kernel scaling the mask by log2(e) would make -inf
            mask = ast.parse(f"torch.where({ast.unparse(self.cond)}, torch.finfo({self.q.id}"
                             f".dtype).min / 2, 0.0).to({self.q.id}.dtype)", mode="eval").body
        elif self.cond is not None and not causal:  # SDPA's boolean mask keeps what fill hid
            hidden = self.cond
            inverted = isinstance(hidden, ast.UnaryOp) and isinstance(hidden.op, ast.Invert)
            mask = hidden.operand if inverted else ast.UnaryOp(ast.Invert(), hidden)
        elif self.additive is not None and not causal:
            mask = self.additive
        if mask is not None and self.mask_if is not None and not _given(self.mask_if, mask):
            mask = ast.IfExp(self.mask_if, mask, ast.Constant(None))
        if mask is not None:
            keywords.append(ast.keyword("attn_mask", mask))
        if self.dropout is not None and not isinstance(self.dropout, ast.Constant):
            keywords.append(ast.keyword("dropout_p", self.dropout))
        if causal and (self.cond is not None or self.additive is not None):
            keywords.append(ast.keyword("is_causal", ast.Constant(True)))
        keywords.append(ast.keyword("scale", self.scale or ast.Constant(1.0)))
        call = ast.Call(ast.parse(_SDPA, mode="eval").body, [self.q, self.k, self.v], keywords)
        value = _Replaced(self.product, call).visit(self.values)
        return ast.Return(value) if self.target is None else ast.Assign([self.target], value)


# where dropout is a function (F.dropout, torch.dropout): anything else calls a dropout module
_FUNCTIONAL = frozenset({"F", "functional", "nn.functional", "torch.nn.functional", "torch"})


def _functional_dropout(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):  # from torch.nn.functional import dropout
        return func.id == "dropout"
    return (isinstance(func, ast.Attribute) and func.attr == "dropout"
            and ast.unparse(func.value) in _FUNCTIONAL)  # fmt: skip


def _given(condition: ast.expr, mask: ast.expr) -> bool:
    """``condition`` is ``mask is not None``: then ``mask`` is already None where it does not hold."""
    return (isinstance(condition, ast.Compare) and isinstance(condition.ops[0], ast.IsNot)
            and len(condition.ops) == 1 and ast.dump(condition.left) == ast.dump(mask)
            and isinstance(condition.comparators[0], ast.Constant)
            and condition.comparators[0].value is None)  # fmt: skip


class _Replaced(ast.NodeTransformer):
    """An expression with one of its nodes (that very object) replaced."""

    def __init__(self, old: ast.AST, new: ast.AST):
        self.old, self.new = old, new

    def visit(self, node: ast.AST) -> ast.AST:
        return self.new if node is self.old else super().visit(node)


def _product(node: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    """(a, b) of ``a @ b``, ``torch.matmul(a, b)`` or ``a.matmul(b)`` (bmm alike)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return node.left, node.right
    if not (isinstance(node, ast.Call) and _attribute(node.func) in ("matmul", "bmm")):
        return None
    if len(node.args) == 2:
        return node.args[0], node.args[1]
    if len(node.args) == 1 and isinstance(node.func, ast.Attribute):  # a tensor's method
        return node.func.value, node.args[0]
    return None


def _untransposed(node: ast.expr, three_d: bool = False) -> ast.expr:
    """``k`` of ``k.transpose(-2, -1)``, ``k.transpose(2, 3)`` (``(1, 2)`` where ``three_d``,
    as bmm's operands are), ``k.mT``."""
    last_two = ([-2, -1], [2, 3], [1, 2]) if three_d else ([-2, -1], [2, 3])
    if isinstance(node, ast.Attribute) and node.attr == "mT":
        return node.value
    if isinstance(node, ast.Call) and _attribute(node.func) == "transpose" and len(node.args) == 2:
        dims = [_constant(a) for a in node.args]
        if sorted(d for d in dims if d is not None) in last_two:
            return node.func.value
    raise NotRewritable(f"the keys are not transposed in the last two dims: {ast.unparse(node)}")


def _constant(node: ast.expr) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _constant(node.operand)
        return -inner if inner is not None else None
    return None


def _attribute(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _is_name(node: ast.expr, name: str | None) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _other_operand(node: ast.BinOp, name: str | None) -> ast.expr | None:
    if _is_name(node.left, name):
        return node.right
    return node.left if _is_name(node.right, name) else None


def _is_softmax(value: ast.expr, name: str | None) -> bool:
    """A softmax of ``name`` over its last dim, maybe of the scores upcast and cast back
    (``softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)``, Llama's
    ``softmax(scores.float(), dim=-1).type_as(xq)``: SDPA's own softmax accumulates in float32)."""
    value = _uncast(value)
    if not isinstance(value, ast.Call) or _attribute(value.func) not in _SOFTMAX_NAMES:
        return False
    method = isinstance(value.func, ast.Attribute) and _is_name(_uncast(value.func.value), name)
    argument = bool(value.args) and _is_name(_uncast(value.args[0]), name)
    dim = _keyword(value, "dim", 0 if method else 1)
    return (method or argument) and dim is not None and _constant(dim) in (-1, 3)


def _uncast(value: ast.expr) -> ast.expr:
    """``x`` of ``x.float()``, ``x.to(q.dtype)``, ``x.type_as(q)`` (any number of them)."""
    while (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
           and value.func.attr in _CASTS):  # fmt: skip
        value = value.func.value
    return value


def _keyword(call: ast.Call, name: str, position: int) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    return call.args[position] if len(call.args) > position else None


_MINUS_INFINITY = ("float('-inf')", '-float("inf")', "-float('inf')", "-math.inf", "-torch.inf",
                   'float("-inf")')  # fmt: skip


def _minus_infinity(node: ast.expr | None) -> bool:
    """``float('-inf')``, ``-float('inf')``, ``-math.inf``, ``-torch.inf``, or a finite
    value at least 1e4 in size (``-1e9``, ``torch.finfo(...).min``), which softmax turns to 0."""
    if node is None:
        return False
    text = ast.unparse(node).replace(" ", "")
    if text in _MINUS_INFINITY or ".finfo(" in text:
        return True
    try:
        return float(ast.literal_eval(node)) <= -1e4
    except (ValueError, TypeError, SyntaxError):
        return False
