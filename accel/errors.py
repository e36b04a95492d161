"""The error a user's mistake raises, apart from bugs, and the argument checks shared by the
package."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class UsageError(ValueError):
    """A mistake in how accel was called (an argument, a path, an environment variable), with a
    message that says what was expected and what came. The command line prints it in one line
    and exits with code 2; any other exception is a bug and keeps its traceback."""


def collection_of(
    values: Iterable[Any], what: str = "names", *, strings: bool = True
) -> tuple[Any, ...]:
    """``values`` as a tuple, refusing a bare string (which Python would split into letters):
    ``MetricAccumulator("lr")`` must not make the metrics "l" and "r". With ``strings``, every
    element must be a string."""
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
