"""torch.profiler without its own log lines: Kineto writes ``USDT: ... profiler_start`` and
``profiler_stop`` (and at some log levels ``STAGE: ...``) straight to the process's stderr on
every run, at every ``KINETO_LOG_LEVEL``, and a notebook shows each as a red box under the cell.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from torch.profiler import profile

_KINETO_LINE = re.compile(rb"^(USDT|STAGE):\S* \S+ \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def quiet_profile(**kwargs: Any) -> Iterator[profile]:
    """``torch.profiler.profile(**kwargs)`` with Kineto's lines kept off stderr; every other
    line written to stderr meanwhile (a warning from the profiled code) is passed on after."""
    with _without_kineto_lines(), profile(**kwargs) as prof:
        yield prof


@contextlib.contextmanager
def _without_kineto_lines() -> Iterator[None]:
    # Kineto is C++ and writes to file descriptor 2: only swapping the descriptor catches it.
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(True) if not _KINETO_LINE.match(line)]
            if kept:
                sys.stderr.write(b"".join(kept).decode(errors="replace"))
                sys.stderr.flush()
