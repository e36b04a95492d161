"""The error a user's mistake raises, apart from bugs, the argument checks shared by the
package, and its warnings given once per process (:func:`warn_once`)."""

from __future__ import annotations

import reprlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any


class UsageError(ValueError):
    """A mistake in how accel was called (an argument, a path, an environment variable), with a
    message that says what was expected and what came. The command line prints it in one line
    and exits with code 2; any other exception is a bug and keeps its traceback."""


def collection_of(
    values: Iterable[Any], what: str = "names", *, strings: bool = True
) -> tuple[Any, ...]:
    """``values`` as a tuple, refusing a bare string (which Python would split into letters);
    with ``strings``, every element must be a string."""
    if isinstance(values, (str, bytes)):
        raise TypeError(
            f"expected a collection of {what} such as [{values!r}], got the string {values!r}"
        )
    items = tuple(values)
    if strings:
        for item in items:
            if not isinstance(item, str):
                raise TypeError(f"{what} must be strings, got {item!r} ({type(item).__name__})")
    return items


def checked_count(value: Any, name: str, *, at_least: int = 0) -> int:
    """``value`` as an int if it is a whole number >= ``at_least``, else a TypeError (not a whole
    number; a bool is not a count) or a ValueError, either naming ``name``."""
    expected = f"{name} must be an int >= {at_least}"
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{expected}, got {reprlib.repr(value)} ({type(value).__name__})")
    if value < at_least:
        raise ValueError(f"{expected}, got {value}")
    return int(value)


def checked_number(value: Any, name: str) -> float:
    """``value`` (a Python number, or a one-element tensor) as a float, else a TypeError naming
    ``name``: a string or a bool is refused though ``float`` would take it."""
    if not isinstance(value, (bool, str, bytes)):
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"{name} must be a number, got {reprlib.repr(value)} ({type(value).__name__})")


def checked_callable(value: Any, name: str) -> Callable:
    """``value`` if it can be called, else a TypeError naming ``name`` (``"peak_memory(fn)"``)."""
    if not callable(value):
        raise TypeError(
            f"{name}: expected a function to call, got {reprlib.repr(value)} "
            f"({type(value).__name__}); pass the function itself, not its result"
        )
    return value


def checked_instance(value: Any, kind: type, name: str, kind_name: str = "") -> Any:
    """``value`` if it is a ``kind``, else a TypeError naming ``name`` and ``kind_name``."""
    if not isinstance(value, kind):
        raise TypeError(
            f"{name} must be a {kind_name or kind.__name__}, got {reprlib.repr(value)} "
            f"({type(value).__name__})"
        )
    return value


_warned: set[str] = set()


def warn_once(key: str, message: str, category: type[Warning], *, stacklevel: int) -> None:
    """``warnings.warn`` the first time ``key`` comes in this process (a fallback is said once,
    not at every call); ``stacklevel`` as ``warnings.warn`` counts it from the caller."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, category, stacklevel=stacklevel + 1)
