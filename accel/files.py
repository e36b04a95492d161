"""Files written whole, and only where asked: a reader, or a crash, never sees half of one, and no
write follows a link planted beside the target. Standard library only."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from accel.errors import UsageError

WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


def check_writable(path: str | os.PathLike, what: str = "") -> Path:
    """The real file ``path`` names (a link followed to its target), or a :class:`UsageError`
    (``what``, e.g. ``"--out"``, in front of the path) saying why text cannot be written there:
    a folder at that name, what is not a regular file (a pipe, a device: replaced, it would be
    gone), a read-only file (its mode asks that it not change: it is refused, never rewritten
    with another mode), or a folder above it that is a file or where no file can be made (tried:
    /proc's permissions allow it). Leaves nothing behind, so a command checks its destinations
    before its work."""
    name = f"{what} {path}" if what else str(path)
    if str(path).endswith((os.sep, "/")):  # a Path drops the slash and would write a file there
        raise UsageError(f"{name}: expected a file to write, found a folder name")
    real = Path(os.path.realpath(path))
    if real.is_dir():
        raise UsageError(f"{name}: expected a file to write, found a folder")
    if real.exists() and not real.is_file():
        raise UsageError(f"{name}: expected a regular file to write, found {_kind(real)}")
    if real.exists():
        mode = stat.S_IMODE(real.stat().st_mode)
        if not mode & WRITE_BITS or not os.access(real, os.W_OK):
            raise UsageError(
                f"{name} is read-only (mode {mode:#o}): expected a file accel may rewrite "
                "(make it writable to let it)"
            )
    folder = next(p for p in real.parents if p.exists())
    if not folder.is_dir():
        raise UsageError(f"{name}: cannot write there, {folder} is a file")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{name}: cannot write there, the folder {folder} is not writable")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise UsageError(f"{name}: cannot write there, no file can be made in {folder} "
                         f"({error.strerror or error})") from None  # fmt: skip
    return real


def _kind(path: Path) -> str:
    mode = os.stat(path).st_mode
    kinds = ((stat.S_ISFIFO, "a pipe"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
             (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((said for test, said in kinds if test(mode)), "no regular file")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole: into a new file of an unpredictable name, opened
    exclusively in the real target's folder (so a link planted at a temporary name is never
    followed), then renamed over the target (atomic on one file system). A link at ``path`` is
    written through and stays a link; a rewritten file keeps its mode; what
    :func:`check_writable` refuses is refused. A failed write leaves the target as it was and no
    temporary file. Its folder must exist."""
    real = check_writable(path)
    if not real.parent.is_dir():
        raise UsageError(f"{path}: cannot write there, the folder {real.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
            _take_mode(file.fileno(), real)
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _take_mode(fd: int, target: Path) -> None:
    """The target's mode and owner for its replacement (mkstemp's file is private); a new file
    gets the mode ``open`` would give it."""
    try:
        old = target.stat()
    except FileNotFoundError:
        umask = os.umask(0o022)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        return
    os.fchmod(fd, stat.S_IMODE(old.st_mode))
    with contextlib.suppress(PermissionError):
        os.fchown(fd, old.st_uid, old.st_gid)
