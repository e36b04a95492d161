"""Files written whole: a reader, or a crash, never sees half of one. Standard library only."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a hidden file beside ``path``, then rename it over ``path`` (atomic on
    one file system); the hidden name matches no glob of the visible ones."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
