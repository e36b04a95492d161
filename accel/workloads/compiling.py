"""What the workloads share about torch.compile: a function copy whose compiled graphs are its own."""

from __future__ import annotations

import types
from collections.abc import Callable


def own_code(fn: Callable, suffix: str = "") -> Callable:
    """A copy of ``fn`` with a code object of its own (named ``<name>_<suffix>`` if ``suffix``).

    Dynamo keeps compiled graphs, and its limit of recompilations (``recompile_limit``, 8), per
    code object, whatever the torch.compile call: past it, the code runs eagerly. Copies that
    compile apart (a Step each, or another set of compile options) keep apart budgets this way.
    """
    name = f"{fn.__name__}_{suffix}" if suffix else fn.__name__
    code = fn.__code__.replace(co_name=name)
    copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return copy
