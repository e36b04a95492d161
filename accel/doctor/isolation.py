"""What a doctor's run gives back and what it names: the random generators put back (torch's on
every device, ``random``, NumPy's global one), the files the step writes, replaces or removes put
back as they were (:mod:`accel.doctor.kept_files`), and all of it (a file written, a connection,
a process started, an item taken from an uncopyable iterator) recorded while a :class:`Session`
is open, for the report's first line.

Files and sockets are seen through one process-wide audit hook (``sys.addaudithook``: it cannot
be removed, so it does nothing unless a session is open in the running thread), counted only
where the step's own code is on the stack, or in a thread the step started (waited for before
the files are put back). ``torch.save`` opens its file in C++, without an audit event: during a
session it raises the one ``open()`` would.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextvars
import inspect
import logging
import os
import random
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from accel.doctor.effects import Effects
from accel.doctor.kept_files import KeptFiles, TooLargeToKeep, absolute, appends_only
from accel.doctor.process_state import (
    CompiledCaches,
    GlobalHooks,
    ProcessSwitches,
    progress_monitor,
)
from accel.doctor.products import kept_backend_flags
from accel.doctor.reach import is_library
from accel.errors import UsageError

__all__ = ["Session", "put_back_files", "record", "refuse_unplain_result",
           "refuse_unplain_step", "seed_generators", "watch_as_step"]  # fmt: skip

_RECORD: contextvars.ContextVar[_Recording] = contextvars.ContextVar("accel_doctor_record")
_HOOKED: list[bool] = []  # the process's hook is installed once
# a thread the step started (an asynchronous checkpoint) -> its session's recording: all it does
# is the step's, and it starts without the session's context
_THREADS: weakref.WeakKeyDictionary[threading.Thread, _Recording] = weakref.WeakKeyDictionary()
THREAD_WAIT_S = 10.0  # on closing, how long the threads the step started are waited for
# a task the step gave a thread pool, in the worker running it (the worker may predate the step)
_TASK = threading.local()
# code that writes or connects on its own account while a step runs (caches, bytecode, a loader
# worker's batch fetched over multiprocessing's own socket): not the step's
_MACHINERY = ("torch._inductor", "torch._dynamo", "torch._functorch", "torch.utils.cpp_extension",
              "triton", "torch._logging", "multiprocessing.resource_sharer")  # fmt: skip
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def record(what: str) -> None:
    """Count ``what`` (a side effect, in words) for the open session, if any."""
    recording = _RECORD.get(None)
    if recording is not None:
        recording.found[what] += 1


class _Recording:
    def __init__(self) -> None:
        self.found: collections.Counter[str] = collections.Counter()
        self.codes: set[types.CodeType] = set()  # a file opened under one of them: the step's
        self.files = KeptFiles()
        self.folder = os.getcwd()  # where the session began: a relative path reads right there
        self.put_back: dict[str, set[str]] = {}  # what is said put back: the paths it stands for
        self.threads: list[threading.Thread] = []  # started by the step
        self.tasks: list[concurrent.futures.Future] = []  # given to a thread pool by the step
        self.exit_handlers: list[Callable[..., Any]] = []  # registered by the step
        self.monitors: list[threading.Thread] = []  # tqdm's, started while open: ended on closing


class Session:
    """While open: side effects of the step's code recorded (:meth:`effects`; the step's code is
    what :meth:`watch` is given); on closing, the random generators put back as they were when
    it opened, and so are the process-wide switches (TF32, cudnn.benchmark, determinism, anomaly
    detection, the SDPA kernels, the thread count, the float32 matmul precision, denormals
    flushed, print options, oneDNN, autograd's threads), the process's other switches
    (:class:`~accel.doctor.process_state.ProcessSwitches`), the hooks of every module and optimizer,
    torch.compile's caches (:class:`~accel.doctor.process_state.CompiledCaches`), the warnings
    filters, the working folder, the environment variables and the loggers' levels and handlers."""

    def __init__(self) -> None:
        self._recording = _Recording()

    def __enter__(self) -> Session:
        if not _HOOKED:
            sys.addaudithook(_audit)
            _HOOKED.append(True)
        self._generators = _Generators()
        self._backend_flags = kept_backend_flags()
        self._backend_flags.__enter__()
        self._warning_filters = warnings.catch_warnings()  # a step's simplefilter("ignore")
        self._warning_filters.__enter__()
        self._switches = ProcessSwitches()
        self._global_hooks = GlobalHooks()
        self._compiled = CompiledCaches()
        self._environment = dict(os.environ)
        self._recording.folder = os.getcwd()  # a step may move into its run's folder
        self._loggers = _Loggers()
        self._token = _RECORD.set(self._recording)
        self._save = _Patched(torch.serialization, "_open_zipfile_writer", _audited_save)
        self._threads = _Patched(threading.Thread, "start", _watched_start)
        self._tasks = _Patched(concurrent.futures.ThreadPoolExecutor, "submit", _watched_submit)
        self._exit_handlers = _Patched(atexit, "register", _watched_exit_handler)
        return self

    def watch(self, functions: Iterable[Any]) -> None:
        """Count what happens while one of ``functions`` runs (the step's, found by the walk):
        not what the doctor's own measuring does (a profiler's temporary file, say)."""
        self._recording.codes.update(
            f.__code__ for f in functions if isinstance(f, types.FunctionType) and not is_library(f)
        )

    def __exit__(self, *exc: Any) -> None:
        self._threads.close()
        self._tasks.close()
        self._exit_handlers.close()
        self._remove_exit_handlers()
        for monitor in self._recording.monitors:  # with the handler it registered at exit
            monitor.exit()
            atexit.unregister(getattr(monitor, "_atexit_signal", monitor.exit))
        self._wait_for_threads()
        self._save.close()
        _RECORD.reset(self._token)
        self._generators.restore()
        self._backend_flags.__exit__(None, None, None)
        self._warning_filters.__exit__(None, None, None)
        self._switches.restore()
        self._global_hooks.restore()
        left = self._compiled.restore()
        if left:
            self._recording.found[left] += 1
        _restore_environment(self._environment)
        self._loggers.restore()
        self._recording.files.put_back()  # kept by absolute path, wherever the step moved
        os.chdir(self._recording.folder)

    def _wait_for_threads(self) -> None:
        """The threads the step started finish what they write before the files are put back;
        one still running after :data:`THREAD_WAIT_S` is named."""
        deadline = time.monotonic() + THREAD_WAIT_S
        for thread in self._recording.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self._recording.found[f"left the thread {thread.name} running"] += 1
        _, running = concurrent.futures.wait(self._recording.tasks,
                                             max(0.0, deadline - time.monotonic()))  # fmt: skip
        if running:
            self._recording.found["left a task it gave a thread pool running"] += len(running)

    def _remove_exit_handlers(self) -> None:
        """What the step registered to run at exit would run the copies' code after the doctor
        put everything back (a last checkpoint saved over the user's): removed, and named."""
        for handler in self._recording.exit_handlers:
            atexit.unregister(handler)
            self._recording.found[f"registered {handler.__qualname__} to run at exit, removed"] += 1
        self._recording.exit_handlers.clear()

    def tidy_compiled(self) -> None:
        """What copies compiled so far freed, where the process had compiled nothing before."""
        self._compiled.tidy()

    def effects(self) -> Effects:
        """What the step's code did that the session could only name (files put back or not,
        connections, processes), as recorded so far; a file that could not be put back, or came
        back no longer hard-linked to its other names, is said so, and not said put back (as it
        was)."""
        recording = self._recording
        failed = recording.files.failed
        found = collections.Counter(recording.found)
        found.update(f"could not put back {path}" for path in sorted(failed))
        found.update(f"could not keep {path} (not a file), so not put back"
                     for path in sorted(recording.files.unkept))
        separated = recording.files.separated
        found.update(f"put back {path} as a separate copy, no longer hard-linked to its other "
                     "names (they hold the file as the step left it)"
                     for path in sorted(separated))  # fmt: skip
        put_back = {what for what, paths in recording.put_back.items()
                    if not paths & (failed | separated)}  # fmt: skip
        return Effects(found, put_back)


# ---- random generators -----------------------------------------------------------------------------
class _Generators:
    """The state of the process's random generators, to put back."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.seed = torch.initial_seed()
        self.cuda = _cuda_started() and torch.cuda.get_rng_state_all()
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)
        elif _cuda_started():  # started during the run: as its first use would have seeded it
            torch.cuda.manual_seed_all(self.seed)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


def _restore_environment(saved: dict[str, str]) -> None:
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


class _Loggers:
    """Each logger's level, handlers, propagation and switch (the root's included) and the
    process's ``logging.disable`` level, to put back; a handler only the step added is closed."""

    def __init__(self) -> None:
        self.disabled = logging.root.manager.disable
        self.kept = {log: _logger_state(log) for log in _loggers()}

    def restore(self) -> None:
        logging.disable(self.disabled)
        kept_handlers = {h for _, handlers, _, _ in self.kept.values() for h in handlers}
        for log, state in self.kept.items():
            if _logger_state(log) == state:
                continue
            for handler in set(log.handlers) - kept_handlers:
                handler.close()
            level, handlers, log.propagate, log.disabled = state
            log.handlers[:] = handlers
            log.setLevel(level)  # also clears the loggers' cached levels


def _loggers() -> list[logging.Logger]:
    named = logging.root.manager.loggerDict.values()
    return [logging.root, *(log for log in list(named) if isinstance(log, logging.Logger))]


def _logger_state(log: logging.Logger) -> tuple[int, list[logging.Handler], bool, bool]:
    return log.level, list(log.handlers), log.propagate, log.disabled


def seed_generators(seed: int) -> None:
    """Seed the generators a :class:`Session` puts back: torch's (every device), ``random`` and
    NumPy's global one, so that a step drawing from any of them runs the same from one start."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


def _cuda_started() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


# ---- files, sockets, processes -----------------------------------------------------------------------
def _audit(event: str, args: tuple) -> None:
    describe = _EVENTS.get(event)  # first: the hook sees every audited event of the process
    recording = None if describe is None else _open_recording()
    if recording is None or recording.files.busy:
        return
    what = describe(*args)
    walked = event in _AT_EVENTS and args[1] not in (None, -1)  # one entry of a walk (rmtree's)
    if not (what or walked) or not _steps(recording):
        return
    if not walked:  # a walk's entries are relative to its folder's descriptor, not named
        named = _where_they_are(event, args, recording.folder)
        if named is not args:
            args, what = named, describe(*named)
    try:
        _keep_what_changes(recording, event, args, what, walked)
    except TooLargeToKeep as refusal:  # the change is not made: said, whether the step goes on
        recording.found[refusal.clause] += 1
        raise


def _keep_what_changes(recording: _Recording, event: str, args: tuple, what: str | None,
                       walked: bool) -> None:  # fmt: skip
    if walked:  # named by the walk's own event, which kept the tree before it
        recording.files.keep(_at(args[0], args[1]))
        return
    if event == "os.rmdir" and recording.files.walked(args[0]):
        return  # the end of an rmtree already named
    paths = [args[i] for i in _FILE_CHANGES.get(event, ())]
    if event in ("open", "os.chmod"):  # through a link: keep where it points, not the link
        paths = [os.path.realpath(p) if isinstance(p, (str, bytes, os.PathLike)) else p
                 for p in paths]  # fmt: skip
    elif event == "sqlite3.connect":  # and the files sqlite keeps beside it while writing
        paths += [os.fsdecode(args[0]) + end for end in ("-journal", "-wal", "-shm")]
    whole = event not in ("os.chmod", "os.rmdir")  # its mode kept, not all it holds (if any)
    appends = event == "open" and appends_only(args[1], args[2])  # kept by where it ends
    kept = [recording.files.keep(path, contents=whole, appends=appends) for path in paths]
    recording.found[what] += 1  # kept first: a change refused is not made
    if event == "os.rename":
        recording.files.renamed(*paths)
    elif event == "shutil.rmtree":
        recording.files.walking(args[0])
    if paths and all(kept):
        recording.put_back.setdefault(what, set()).update(absolute(p) for p in paths)


def _where_they_are(event: str, args: tuple, folder: str) -> tuple:
    """``args`` with the relative paths of what the event changes made absolute where the step
    has moved out of ``folder``, the working folder its session began in: as written, they would
    read as paths there."""
    relative = {i for i in _FILE_CHANGES.get(event, ())
                if isinstance(args[i], (str, bytes, os.PathLike)) and not os.path.isabs(args[i])}  # fmt: skip
    if not relative or os.getcwd() == folder:
        return args
    return tuple(absolute(arg) if i in relative else arg for i, arg in enumerate(args))


def _opened(path: Any, mode: Any, flags: Any) -> str | None:
    if isinstance(path, int) or path is None:  # an open descriptor: its opening was seen
        return None
    writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & _WRITE_FLAGS)
    path = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
    if not writes or path == os.devnull or os.path.isdir(path):  # a folder: an unnamed temporary
        return None
    return f"wrote {path}"


def _removed_folder(path: Any) -> str | None:
    """None where there is no folder to remove (``rmtree(..., ignore_errors=True)``; rmtree
    refuses a link)."""
    path = os.fsdecode(path)
    return f"removed the folder {path}" if os.path.isdir(path) and not os.path.islink(path) else None


def _removed_empty_folder(path: Any) -> str | None:
    """None where ``rmdir`` will fail: no folder, or one not empty (``os.removedirs`` tries each
    parent in turn)."""
    if isinstance(path, int) or not _removed_folder(path):
        return None
    with os.scandir(path) as entries:
        return None if any(True for _ in entries) else f"removed the folder {os.fsdecode(path)}"


def _database(database: Any, *_: Any) -> str | None:
    """A database file sqlite opens (and writes from C, unseen): kept from here."""
    if not isinstance(database, (str, bytes, os.PathLike)):
        return None
    database = os.fsdecode(database)
    return None if database in ("", ":memory:") or database.startswith("file:") else (
        f"opened the database {database}")


def _made_folder(path: Any) -> str | None:
    """None where the folder is already there (``makedirs(..., exist_ok=True)``): nothing made."""
    path = os.fsdecode(path)
    return None if os.path.lexists(path) else f"made the folder {path}"


_EVENTS: dict[str, Callable[..., str | None]] = {
    "open": _opened,
    "sqlite3.connect": _database,
    "os.remove": lambda path, *_: f"removed {os.fsdecode(path)}",
    "os.rename": lambda src, dst, *_: f"renamed {os.fsdecode(src)} to {os.fsdecode(dst)}",
    "os.rmdir": lambda path, *_: _removed_empty_folder(path),
    "shutil.rmtree": lambda path, *_: _removed_folder(path),
    "os.mkdir": lambda path, *_: _made_folder(path),
    "os.truncate": lambda path, *_: f"truncated {path}",
    "os.symlink": lambda src, dst, *_: f"linked {os.fsdecode(dst)}",
    "os.link": lambda src, dst, *_: f"linked {os.fsdecode(dst)}",
    "os.chmod": lambda path, *_: f"changed the mode of {path}",
    "socket.connect": lambda sock, address: f"connected to {address}",
    "socket.sendto": lambda sock, address: f"sent to {address}",
    "socket.bind": lambda sock, address: f"listened on {address}",
    "urllib.Request": lambda url, *_: f"requested {url}",
    "subprocess.Popen": lambda executable, args, *_: f"started the process {executable}",
    "os.system": lambda command: f"ran {command}",
    "os.posix_spawn": lambda path, *_: f"started the process {os.fsdecode(path)}",
    "os.exec": lambda path, *_: f"replaced the process with {os.fsdecode(path)}",
    "os.fork": lambda: "forked the process",
    "os.kill": lambda pid, sig: f"sent signal {sig} to process {pid}",
}


# the events that change a file, and which of their arguments name it (open: where it writes)
_FILE_CHANGES = {"open": (0,), "os.remove": (0,), "os.rename": (0, 1), "os.truncate": (0,),
                 "os.symlink": (1,), "os.link": (1,), "os.mkdir": (0,), "os.rmdir": (0,),
                 "shutil.rmtree": (0,), "os.chmod": (0,), "sqlite3.connect": (0,)}  # fmt: skip
_AT_EVENTS = ("os.remove", "os.rmdir")  # (path, dir_fd): relative to dir_fd where it is given


def _at(path: Any, dir_fd: int) -> str | None:
    """``path`` relative to the open folder ``dir_fd``, as a path (None where this system cannot
    say which folder a descriptor is)."""
    try:
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fsdecode(path))
    except (OSError, TypeError, ValueError):
        return None


def put_back_files() -> None:
    """What the step's code changed on disk so far put back now, in the session open now (which
    goes on recording): each copy of the step starts from the files as the user left them."""
    recording = _RECORD.get(None)
    if recording is not None:
        recording.files.put_back()


def watch_as_step(made: types.CodeType, source: types.CodeType) -> None:
    """Code made from ``source`` (a rewrite of it, a copy compiled apart) counts as the step's
    where ``source`` does, in the session open now: what it writes is named and put back."""
    recording = _RECORD.get(None)
    if recording is not None and source in recording.codes:
        recording.codes.update(_with_nested(made))


def _with_nested(code: types.CodeType) -> list[types.CodeType]:
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return [code, *(inner for c in nested for inner in _with_nested(c))]


def _caused_by_step(codes: set[types.CodeType]) -> bool:
    """Whether the event came from the step's code (one of ``codes`` on the stack), and not
    from a compiler or the import system: neither may sit between the event and the first frame
    of code that is not a library's (a compiler's own helper package, such as the one taking its
    cache's locks, is below it)."""
    frame, in_libraries = sys._getframe(2), True
    while frame is not None:
        if in_libraries:
            module = frame.f_globals.get("__name__", "") or ""
            if module.startswith(("importlib", *_MACHINERY)):
                return False
            in_libraries = module == __name__ or is_library(frame.f_code)
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


class _Patched:
    """While open: ``owner.name`` replaced by ``wrap(original)``; left as it is where a session
    already open replaced it."""

    def __init__(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        original, self._undo = getattr(owner, name), None
        if not getattr(original, "_accel_patched", False):
            patched = wrap(original)
            patched._accel_patched = True
            setattr(owner, name, patched)
            self._undo = (owner, name, original)

    def close(self) -> None:
        if self._undo is not None:
            setattr(*self._undo)


def _watched_start(original: Callable[[threading.Thread], None]) -> Callable:
    """``Thread.start`` that makes a thread started by the step's code (or by a thread it
    started) the step's: its file writes recorded and put back (``threading`` raises no audit
    event)."""

    def start(thread: threading.Thread) -> None:
        recording, opened = _steps_recording(), _open_recording()
        if progress_monitor(thread):  # any bar's, the doctor's own or torch.compile's
            if opened is not None:
                opened.monitors.append(thread)
        elif recording is not None and not getattr(_TASK, "submitting", False):
            _THREADS[thread] = recording
            recording.threads.append(thread)
        original(thread)

    return start


def _watched_exit_handler(original: Callable[..., Any]) -> Callable[..., Any]:
    """``atexit.register`` that keeps what the step's code registers, to remove at the end."""

    def register(handler: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        recording = _steps_recording()
        if recording is None or progress_monitor(getattr(handler, "__self__", None)):
            return original(handler, *args, **kwargs)

        def at_exit() -> None:  # its own: removing it leaves the user's of the same function
            handler(*args, **kwargs)

        at_exit.__qualname__ = getattr(handler, "__qualname__", type(handler).__name__)
        recording.exit_handlers.append(at_exit)
        original(at_exit)
        return handler  # as atexit.register does: it decorates

    return register


def _open_recording() -> _Recording | None:
    """The recording of the session open in this context, or of the step's thread or pool
    task running here."""
    return (_RECORD.get(None) or _THREADS.get(threading.current_thread())
            or getattr(_TASK, "recording", None))  # fmt: skip


def _steps(recording: _Recording) -> bool:
    """Whether the code running is the step's: a thread or pool task of it, or its code on
    the stack (the walk, last: the costliest)."""
    return (threading.current_thread() in _THREADS or getattr(_TASK, "recording", None) is not None
            or _caused_by_step(recording.codes))  # fmt: skip


def _steps_recording() -> _Recording | None:
    """The open session's recording where the code running is the step's."""
    recording = _open_recording()
    return recording if recording is not None and _steps(recording) else None


def _watched_submit(original: Callable[..., concurrent.futures.Future]) -> Callable:
    """``ThreadPoolExecutor.submit`` that makes a task the step submits the step's while it
    runs, whichever worker runs it (one started before the step included); the worker itself
    is the pool's, not waited for."""

    def submit(executor: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        recording = _steps_recording()
        if recording is None:
            return original(executor, fn, *args, **kwargs)

        def task(*args: Any, **kwargs: Any) -> Any:
            _TASK.recording = recording
            try:
                return fn(*args, **kwargs)
            finally:
                _TASK.recording = None

        _TASK.submitting = True
        try:
            future = original(executor, task, *args, **kwargs)
        finally:
            _TASK.submitting = False
        recording.tasks.append(future)
        return future

    return submit


def _audited_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.save``'s writer that, given a path, raises the audit event ``open()`` raises."""

    def open_writer(name_or_buffer: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(name_or_buffer, (str, bytes, os.PathLike)):
            sys.audit("open", name_or_buffer, "wb", 0)
        return original(name_or_buffer, *args, **kwargs)

    return open_writer


# ---- a step is a plain callable that returns a result ---------------------------------------------
_NOT_PLAIN = (
    (inspect.isgeneratorfunction, "a generator function (calling it runs none of its body)"),
    (inspect.isasyncgenfunction, "an async generator function (calling it runs none of it)"),
    (inspect.iscoroutinefunction, "a coroutine function (calling it runs none of its body)"),
)


def refuse_unplain_step(step: Callable[..., Any]) -> None:
    """UsageError unless calling ``step`` runs it: a generator or coroutine function only makes
    an object that would have to be iterated or awaited."""
    call = step
    if not inspect.isfunction(step) and not inspect.ismethod(step):
        method = "forward" if isinstance(step, torch.nn.Module) else "__call__"
        call = inspect.getattr_static(type(step), method, step)
    for test, what in _NOT_PLAIN:
        if test(call) or test(step):
            raise UsageError(
                f"the step must be a plain function that runs one training step and returns its "
                f"result; {getattr(step, '__qualname__', type(step).__name__)} is {what}"
            )


def refuse_unplain_result(result: Any) -> Any:
    """``result``, or UsageError if the step handed back a generator or coroutine instead of
    running (it is closed first, so nothing warns that it was never awaited)."""
    if inspect.isgenerator(result) or inspect.iscoroutine(result) or inspect.isasyncgen(result):
        if not inspect.isasyncgen(result):  # an async generator never started warns of nothing
            result.close()
        raise UsageError(
            f"the step returned a {type(result).__name__} instead of running: it must be a plain "
            "function that runs one training step and returns its result"
        )
    if isinstance(result, tuple) and len(result) == 2 and inspect.isfunction(result[0]):
        raise UsageError(
            "the step returned (a function, ...), as a maker returns (step, batch): examine the "
            "step it makes, examine(*make()), not the maker"
        )
    return result
