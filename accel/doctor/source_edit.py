"""Editing a user's function as its source: read and parsed with the file's line numbers,
statements replaced and handed back as a unified diff of the file, the new definition compiled
with the function's own cells and globals (the attention's and the loops' rewrites share these)."""

from __future__ import annotations

import ast
import difflib
import inspect
import linecache
import re
import textwrap
import types
from typing import Any

import torch

from accel.doctor.isolation import watch_as_step

__all__ = ["NotRewritable", "function_source", "recompiled", "replaced_diff", "statement_blocks",
           "torch_named"]


class NotRewritable(ValueError):
    """The written-out attention is not in a form this rewrite reads; the message says why."""


def function_source(function: types.FunctionType) -> tuple[list[str], int, ast.FunctionDef]:
    """(its source lines, the first one's number, its definition parsed with the file's line
    numbers)."""
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError) as error:
        said = f"the source of {function.__qualname__} cannot be read ({error})"
        raise NotRewritable(said) from None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first - 1)
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef):
        raise NotRewritable(f"{function.__qualname__} is not a plain function (def)")
    return lines, first, definition


def replaced_diff(lines: list[str], first: int, spans: list[tuple[int, int, list[ast.stmt]]],
                  fromfile: str) -> str:  # fmt: skip
    """The user's edit as a unified diff of their file ``fromfile``: source ``lines`` (the first
    is line ``first`` of it) with each span of file lines ``(start, end, statements)`` replaced by
    its statements, at their indent; the context read from the whole file where it is at hand
    (a hunk at the function's end keeps the lines after it: ``patch`` applies it as it is)."""
    whole = linecache.getlines(fromfile)
    if whole[first - 1 : first - 1 + len(lines)] == lines:
        lines, first = whole, 1
    new = list(lines)
    for start, end, statements in sorted(spans, key=lambda span: -span[0]):  # last first
        at = start - first
        indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
        new[at : end - first + 1] = [indent + line + "\n" for s in statements
                                     for line in ast.unparse(s).splitlines()]  # fmt: skip
    diff = "".join(difflib.unified_diff(lines, new, fromfile=fromfile, tofile=fromfile))
    # difflib counts from the first line it was given; a patch reads the file's numbers
    return re.sub(r"^@@ -(\d+)(.*?) \+(\d+)", lambda m: f"@@ -{int(m[1]) + first - 1}{m[2]} "
                  f"+{int(m[3]) + first - 1}", diff, flags=re.M)  # fmt: skip


def recompiled(function: types.FunctionType, definition: ast.FunctionDef) -> types.FunctionType:
    """``definition`` compiled as ``function``'s code, inside a function whose arguments are its
    free variables (so that they stay free), and given ``function``'s cells, globals, defaults."""
    definition.decorator_list = []
    free = function.__code__.co_freevars
    outer = ast.FunctionDef(
        name="__rewritten",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(n) for n in free], kwonlyargs=[],
                           kw_defaults=[], defaults=[]),
        body=[definition, ast.Return(ast.Name(definition.name, ast.Load()))],
        decorator_list=[],
    )  # fmt: skip
    module = ast.Module([ast.fix_missing_locations(ast.copy_location(outer, definition))], [])
    code = compile(module, function.__code__.co_filename, "exec")
    made = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    inner = next(c for c in made.co_consts if isinstance(c, types.CodeType)
                 and c.co_name == definition.name)  # fmt: skip
    cells = dict(zip(free, function.__closure__ or (), strict=True))
    missing = [n for n in inner.co_freevars if n not in cells]
    if missing:
        raise NotRewritable(f"the rewritten code needs {missing}, which it does not close over")
    new = types.FunctionType(inner, function.__globals__, function.__name__,
                             function.__defaults__, tuple(cells[n] for n in inner.co_freevars))  # fmt: skip
    new.__kwdefaults__ = function.__kwdefaults__
    new.__dict__.update(function.__dict__)
    watch_as_step(inner, function.__code__)
    return new


def torch_named(statements: list[ast.stmt], scope: dict[str, Any]) -> list[ast.stmt]:
    """The edit's statements calling torch by the name the user's module gives it (``th``), or
    importing it first where the module gives it none."""
    names = [name for name, value in scope.items() if value is torch]
    if "torch" in names:
        return statements
    if not names:
        return [ast.copy_location(ast.Import([ast.alias("torch")]), statements[0]), *statements]
    for node in (n for s in statements for n in ast.walk(s)):
        if isinstance(node, ast.Name) and node.id == "torch":
            node.id = names[0]
    return statements


def statement_blocks(node: ast.AST):
    """Every list of statements inside ``node`` (bodies, else and finally blocks)."""
    for child in ast.walk(node):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(child, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block
