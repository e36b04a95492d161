"""Files and folders as they were before a step's code first changed them, put back when the
doctor's session closes: a file's bytes and mode, a link as a link, a folder with everything it
held (where the step removes or renames it) or its mode alone (where it changes that). A file
too large to keep (over :data:`KEEP_BYTES`, past :data:`KEEP_TOTAL_BYTES` kept in all, or past
the free space where the copies go) is not let be changed: :class:`TooLargeToKeep` is raised
before the change. A file the step only appends to is kept by where it ended, with no copy and
no size limit, and cut back to that end in place; changed otherwise later, it is copied then as
it was before the appends. A hard-linked file is held (by a link of the doctor's, or open) and
linked back, so that its other names share it again. Putting back never writes through a link the step
left, and what cannot be put back, or comes back no longer shared, is said, not hidden.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import secrets
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["KEEP_BYTES", "KEEP_TOTAL_BYTES", "KeptFiles", "TooLargeToKeep", "appends_only"]

KEEP_BYTES = 2**30  # a file the step changes is kept to put back up to this size
KEEP_TOTAL_BYTES = 8 * 2**30  # and the files of one session up to this total
FREE_AFTER_BYTES = 2**30  # a copy leaves at least this much free where the copies go
# the last bytes before an appended file's old end, kept to check that an append handle's
# unseen truncate left them (a file no longer than this is written back from them whole)
KEPT_END_BYTES = 2**16
HELD_OPEN = 128  # hard-linked files held open at most (a process may often open only 1024 files)
_OPEN_FILES = "/proc/self/fd"  # where an open file has a name (Linux)


class TooLargeToKeep(PermissionError):
    """A change of a file the doctor cannot keep to put back, refused before it is made (a
    permission error, as the step would meet one)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"the doctor did not let the step change {path}: {why}; examine a step "
                         "that leaves it as it is, or move it out of the step's way first")
        self.clause = f"did not let the step change {path}: {why}"


class _Link(NamedTuple):
    """A link kept as a link: what it pointed at, and its own times."""

    target: str
    times_ns: tuple[int, int]


class _Inode(NamedTuple):
    """A kept file's inode; a hard-linked one's (``linked``) held under a name of the doctor's
    own (``held``: a link, or an open descriptor's name; None where neither could be had, or the
    file had one name): put back under the name the step replaced or removed."""

    device: int
    number: int
    linked: bool
    held: str | None


class _Appended(NamedTuple):
    """A file the step only appended to, kept by where it ended (``size``; its last bytes,
    ``end``), its mode, times and inode: cut back to that end in place."""

    size: int
    end: bytes
    mode: int
    times_ns: tuple[int, int]
    device: int
    number: int


class _Folder(NamedTuple):
    """A folder that was there, kept with its mode, its times and, kept whole, the names it held
    (each entry kept on its own)."""

    mode: int
    times_ns: tuple[int, int]
    names: frozenset[str] | None = None


_NOT_KEPT = object()


class KeptFiles:
    """Files as they were before the step's code first changed them (None: there was none, nor
    a folder the step made; a :class:`_Link` for a link; a :class:`_Folder` for a folder), to
    put back when the session closes."""

    def __init__(self) -> None:
        self.kept: dict[str, str | _Link | _Folder | _Appended | None] = {}
        self.refused: set[str] = set()  # not kept at first: never kept as a later state
        self.failed: set[str] = set()  # kept, and not put back (the reason is the step's doing)
        self.unkept: set[str] = set()  # there, and not a file (a pipe, a device): lost if changed
        self.separated: set[str] = set()  # hard-linked, put back as a file its other names are not
        self._inodes: dict[str, _Inode] = {}  # kept files
        self._held_open: list[int] = []  # descriptors holding hard-linked files, closed when back
        self._renamed: list[tuple[str, str]] = []  # folders the step renamed, to rename back
        self._walked: set[str] = set()  # folders an rmtree removed (its last rmdir is its own)
        self._times: dict[str, tuple[int, int]] = {}  # of each folder a kept path is in
        self._folder: str | None = None
        self._copies = itertools.count()  # names of the copies in the folder
        self._bytes = 0  # kept so far
        # one keep at a time: a thread of the step's that writes a file another is copying
        # waits for the copy (its write comes after the audit event that asked for the keep)
        self._lock = threading.RLock()
        self._copying = threading.local()

    @property
    def busy(self) -> bool:
        """Whether this thread is copying a file: its own opens are no step's."""
        return getattr(self._copying, "on", False)

    def keep(self, path: Any, *, contents: bool = True, appends: bool = False) -> bool:
        """Whether ``path`` is kept (now or before; a folder with all it holds, or with its mode
        alone where not ``contents``; a file by where it ends where the step ``appends`` only);
        not a descriptor, nor what is not a file or folder. A file over a budget raises
        :class:`TooLargeToKeep`."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            return False
        with self._lock:
            return self._keep(absolute(path), contents, appends)

    def renamed(self, source: Any, target: Any) -> None:
        """The step renames ``source``, a folder, to ``target``: named back when put back."""
        if isinstance(source, (str, bytes, os.PathLike)) and isinstance(target, (str, bytes, os.PathLike)):
            source = absolute(source)
            if os.path.isdir(source) and not os.path.islink(source):
                self._renamed.append((source, absolute(target)))

    def walking(self, path: Any) -> None:
        """An rmtree of ``path`` starts (so the rmdir ending it is not named again)."""
        self._walked.add(absolute(path))

    def walked(self, path: Any) -> bool:
        return absolute(path) in self._walked

    def _keep(self, path: str, contents: bool = True, appends: bool = False) -> bool:
        kept = self.kept.get(path, _NOT_KEPT)
        if isinstance(kept, _Appended):  # its mode is kept; a change of its bytes needs a copy
            return appends or not contents or self._copy_appended(path, kept)
        if kept is not _NOT_KEPT and not (contents and isinstance(kept, _Folder) and kept.names is None):
            return True  # kept before (a folder kept for its mode alone is kept whole now)
        if self._inside_new(path):  # it was not there either, whatever the step put there since
            self.kept[path] = None
            return True
        self._keep_times(os.path.dirname(path))  # a name made or removed in it changes them
        if path not in self.refused and os.path.islink(path):
            self.kept[path] = _Link(os.readlink(path), _times(path))
            return True
        if path not in self.refused and os.path.isdir(path):
            mode = kept.mode if isinstance(kept, _Folder) else stat.S_IMODE(os.stat(path).st_mode)
            self.kept[path] = _Folder(mode, _times(path))
            if not contents:
                return True
            with os.scandir(path) as entries:
                inside = [entry.path for entry in entries]
            self.kept[path] = _Folder(mode, _times(path), frozenset(os.path.basename(p) for p in inside))
            return all([self._keep(p) for p in inside])  # every one kept, refused or not
        if path in self.refused or (os.path.lexists(path) and not os.path.isfile(path)):
            self.refused.add(path)
            if os.path.lexists(path):
                self.unkept.add(path)
            return False
        if appends and os.path.lexists(path):  # nothing before its end changes: no copy
            self.kept[path] = _appended(path)
            return True
        copy = None
        if os.path.lexists(path):
            self._copying.on = True
            try:
                size = os.path.getsize(path)
                self._bytes += _within_budget(path, size, self._bytes, self._copies_folder())
                copy = self._copy_name()
                shutil.copy2(path, copy)
                self._keep_inode(path, copy, os.stat(path))
            finally:
                self._copying.on = False
        self.kept[path] = copy
        return True

    def _copy_appended(self, path: str, kept: _Appended) -> bool:
        """The file at ``path``, which the step appended to and now changes otherwise, copied
        as it was before its appends (its first ``kept.size`` bytes: the rest are the step's),
        to be put back whole. False where its old bytes are no longer there to copy (changed
        unseen, through a handle: said when put back)."""
        try:
            source = open(path, "rb")  # noqa: SIM115 - closed below
        except OSError:  # gone, or no longer a file
            return False
        with source:
            found = os.fstat(source.fileno())
            whole = len(kept.end) == kept.size  # all of it kept: copied from there
            if (found.st_dev, found.st_ino) != (kept.device, kept.number) or not (
                whole or _ends_as_kept(source.fileno(), kept)
            ):
                return False
            self._bytes += _within_budget(path, kept.size, self._bytes, self._copies_folder())
            self._copying.on = True
            try:
                copy = self._copy_name()
                with open(copy, "xb") as out:
                    _copy_start(source, out, kept.size - len(kept.end))
                    out.write(kept.end)
                os.chmod(copy, kept.mode)
                os.utime(copy, ns=kept.times_ns)
                self._keep_inode(path, copy, found)
            finally:
                self._copying.on = False
        self.kept[path] = copy
        return True

    def _keep_times(self, folder: str) -> None:
        if folder not in self._times and os.path.isdir(folder) and not self._inside_new(folder):
            self._times[folder] = _times(folder)

    def _copies_folder(self) -> str:
        self._folder = self._folder or tempfile.mkdtemp(prefix="accel-doctor-kept-")
        return self._folder

    def _copy_name(self) -> str:
        return os.path.join(self._copies_folder(), str(next(self._copies)))

    def _keep_inode(self, path: str, copy: str, found: os.stat_result) -> None:
        """The inode of the file at ``path``, written back in place while still there (its
        other names and open handles see it); a hard-linked one held."""
        linked = found.st_nlink > 1
        held = self._hold(path, copy) if linked else None
        self._inodes[path] = _Inode(found.st_dev, found.st_ino, linked, held)

    def _hold(self, path: str, copy: str) -> str | None:
        """A name of the doctor's own for the hard-linked file at ``path``: a link beside its
        ``copy``, or, where the copies are on another file system, the name of a descriptor held
        open on it (writing nothing where the file is); None where neither can be had."""
        try:
            os.link(path, copy + ".inode", follow_symlinks=False)
        except OSError:
            if len(self._held_open) >= HELD_OPEN or not os.path.isdir(_OPEN_FILES):
                return None
            try:
                self._held_open.append(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)))
            except OSError:
                return None
            return os.path.join(_OPEN_FILES, str(self._held_open[-1]))
        return copy + ".inode"

    def _inside_new(self, path: str) -> bool:
        """Whether a folder above ``path`` was not there when first kept."""
        parent = os.path.dirname(path)
        while parent != path:
            if parent in self.kept and self.kept[parent] is None:
                return True
            path, parent = parent, os.path.dirname(parent)
        return False

    def put_back(self) -> None:
        """Everything kept made as it was; what cannot be is added to :attr:`failed`. A file
        cut back to where it ended stays kept so: a handle the step left open (a log handler it
        added) appends on, and is cut back again."""
        appended: dict[str, _Appended] = {}
        for source, target in reversed(self._renamed):  # the folder under its name again
            if os.path.isdir(target) and not os.path.islink(target):
                self._attempt(source, _renamed_back, target, source)
        folders = [p for p, kept in self.kept.items() if isinstance(kept, _Folder)]
        for path in sorted(folders, key=len):  # a folder before its subfolders
            self._attempt(path, _folder_back, path, self.kept[path].mode)
        for path, copy in reversed(self.kept.items()):
            if isinstance(copy, _Folder):
                continue
            if isinstance(copy, _Appended):
                if self._attempt(path, _cut_back, path, copy):
                    appended[path] = copy
            elif copy is not None:
                back = self._attempt(path, _file_back, path, copy, self._inodes.get(path))
                if back is False:  # back, but no longer the file its other names are
                    self.separated.add(path)
            elif os.path.isfile(path) or os.path.islink(path):
                self._attempt(path, os.remove, path)  # a link is removed itself, never its target
        whole = [(p, kept.names) for p, kept in self.kept.items()
                 if isinstance(kept, _Folder) and kept.names is not None]  # fmt: skip
        for path, names in sorted(whole, key=lambda item: -len(item[0])):
            self._attempt(path, _only, path, names)
        made = [path for path, copy in self.kept.items() if copy is None and os.path.isdir(path)]
        for path in sorted(made, key=len, reverse=True):  # a folder's subfolders before it
            with contextlib.suppress(OSError):  # left where something else is in it now
                os.rmdir(path)
        times = {**self._times, **{p: kept.times_ns for p, kept in self.kept.items()
                                   if isinstance(kept, (_Folder, _Link))}}  # fmt: skip
        changed = {os.path.dirname(p) for p in self.failed | self.unkept}  # not as it was
        for path, kept_times in times.items():  # last: putting back changed the folders' times
            if path in changed:
                continue
            with contextlib.suppress(OSError):  # gone, or not the user's to set: as it is
                os.utime(path, ns=kept_times, follow_symlinks=False)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder = None  # made again by the next keep (the trial after this one)
        for descriptor in self._held_open:
            os.close(descriptor)
        self._held_open.clear()
        self.kept.clear()
        self.kept.update(appended)
        self.refused.clear()
        self._renamed.clear()
        self._walked.clear()
        self._times.clear()
        self._inodes.clear()
        self._bytes = 0

    def _attempt(self, path: str, action: Callable[..., Any], *args: Any) -> Any:
        """What ``action`` returns; None where it failed (``path`` added to :attr:`failed`)."""
        try:
            return action(*args)
        except OSError:
            self.failed.add(path)
            return None


def _within_budget(path: str, size: int, kept_bytes: int, folder: str) -> int:
    """``size``, the bytes to copy of the file at ``path`` beside ``kept_bytes`` in ``folder``;
    raises :class:`TooLargeToKeep` where it is over a budget."""
    if size > KEEP_BYTES:
        raise TooLargeToKeep(path, f"{_bytes(size)}, over the {_bytes(KEEP_BYTES)} the doctor "
                                   "keeps of a file to put it back")  # fmt: skip
    if kept_bytes + size > KEEP_TOTAL_BYTES:
        raise TooLargeToKeep(path, f"{_bytes(size)}, past the {_bytes(KEEP_TOTAL_BYTES)} the "
                                   "doctor keeps in all to put files back")  # fmt: skip
    if shutil.disk_usage(folder).free - size < FREE_AFTER_BYTES:
        raise TooLargeToKeep(path, f"{_bytes(size)}, more than a copy in {folder} leaves free")
    return size


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def appends_only(mode: Any, flags: int) -> bool:
    """Whether an ``open`` with ``mode`` (``open``'s; None for ``os.open``) or ``flags`` writes
    only past the file's end: "a", "ab", "a+" (its writes append too), or O_APPEND without
    O_TRUNC."""
    if isinstance(mode, str):
        return "a" in mode
    return bool(flags & os.O_APPEND) and not flags & os.O_TRUNC


def _appended(path: str) -> _Appended:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        found = os.fstat(fd)
        start = max(0, found.st_size - KEPT_END_BYTES)
        end = os.pread(fd, found.st_size - start, start)
    finally:
        os.close(fd)
    return _Appended(found.st_size, end, stat.S_IMODE(found.st_mode),
                     (found.st_atime_ns, found.st_mtime_ns), found.st_dev, found.st_ino)  # fmt: skip


def _ends_as_kept(fd: int, kept: _Appended) -> bool:
    """Whether the file open at ``fd`` still holds the last of its old bytes where they were:
    an append handle can cut its file, unseen (``truncate`` raises no audit event)."""
    return os.pread(fd, len(kept.end), kept.size - len(kept.end)) == kept.end


def _copy_start(source: Any, out: Any, size: int) -> None:
    while size > 0 and (chunk := source.read(min(size, 2**20))):
        out.write(chunk)
        size -= len(chunk)


def _cut_back(path: str, kept: _Appended) -> bool:
    """The file the step appended to cut back to its old end in place (the same file: its
    other names and open handles see it), its mode and times as they were; one no longer than
    the bytes kept of its end is written back whole. OSError where it is another file now, or
    its old bytes changed unseen: not put back."""
    fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    try:
        found = os.fstat(fd)
        if (found.st_dev, found.st_ino) != (kept.device, kept.number):
            raise OSError(errno.ESTALE, "no longer the file kept", path)
        if not _ends_as_kept(fd, kept):
            if len(kept.end) < kept.size:
                raise OSError(errno.EIO, "its old bytes changed through a handle", path)
            os.pwrite(fd, kept.end, 0)
        os.ftruncate(fd, kept.size)
    finally:
        os.close(fd)
    os.chmod(path, kept.mode)
    os.utime(path, ns=kept.times_ns)
    return True


def _times(path: str) -> tuple[int, int]:
    found = os.lstat(path)
    return found.st_atime_ns, found.st_mtime_ns


def absolute(path: Any) -> str:
    return os.path.abspath(os.fsdecode(path))


def _folder_back(path: str, mode: int) -> None:
    """The folder at ``path`` again: a link or file the step left in its place removed (the
    link itself, never written through), then made, with its mode."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.remove(path)
    if not os.path.lexists(path):
        os.mkdir(path)
    if stat.S_IMODE(os.stat(path).st_mode) != mode:
        os.chmod(path, mode)


def _gone(path: str) -> None:
    """What the step left at ``path`` removed: a folder with all in it, a link itself."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _renamed_back(target: str, source: str) -> None:
    """A folder the step renamed to ``target`` named ``source`` again, over what the step left
    there since (``source`` was kept whole when renamed: what is there now is the step's)."""
    _gone(source)
    os.rename(target, source)


def _only(path: str, names: frozenset[str]) -> None:
    """A folder kept whole holds only what it held: what the step added since goes."""
    if os.path.isdir(path) and not os.path.islink(path):
        for name in set(os.listdir(path)) - names:
            _gone(os.path.join(path, name))


def _file_back(path: str, kept: str | _Link, inode: _Inode | None = None) -> bool:
    """A folder the step made in the file's place goes, with all in it (the step's: the path
    was a file). The file still there (the same one, not a link) is written back in place, so
    that its other names and the handles open on it (a user's log handler) see it; a
    hard-linked one is linked back where the step replaced or removed it. False where a
    hard-linked file came back as a file of its own (not held, or its hold not linkable)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    if inode is not None and not os.path.islink(path) and os.path.isfile(path):
        found = os.stat(path)
        if (found.st_dev, found.st_ino) == (inode.device, inode.number):
            _write_in_place(path, kept)
            return True
    if inode is not None and inode.held is not None:
        try:
            _replace(path, kept, inode.held)
            return True
        except OSError:  # an open file whose other names the step removed too cannot be linked
            pass  # (none is left to share it), nor a read-only one written: a copy of its own
    _replace(path, kept)
    return inode is None or not inode.linked


def _write_in_place(path: str, kept: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "wb") as out, open(kept, "rb") as source:
        shutil.copyfileobj(source, out)
    shutil.copystat(kept, path)


def _replace(path: str, kept: str | _Link, held: str | None = None) -> None:
    """``path`` made the kept file or link again (the file ``held`` names, where given): made
    whole under a new name beside it, then renamed over what the step left there, so a link
    left at ``path`` is replaced, never written through."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):  # the step removed its folder: named, not made again
        return
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(8)}.kept")
    try:
        if isinstance(kept, _Link):
            os.symlink(kept.target, tmp)
        elif held is not None:  # the file its other names still are, written as it was
            _link_held(held, tmp)
            _write_in_place(tmp, kept)
        else:  # made here (O_EXCL), so nothing at the temporary's name is written through
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out, open(kept, "rb") as source:
                shutil.copyfileobj(source, out)
            shutil.copystat(kept, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _link_held(held: str, name: str) -> None:
    """``name`` made a name of the file ``held`` names. An open descriptor's name is followed
    only by linkat, which ``os.link`` calls where given a folder's descriptor (link(2) would
    link the name in /proc itself, and fail)."""
    if not held.startswith(_OPEN_FILES + os.sep):
        os.link(held, name)
        return
    folder = os.open(os.path.dirname(name), os.O_RDONLY)
    try:
        os.link(held, os.path.basename(name), dst_dir_fd=folder)
    finally:
        os.close(folder)
