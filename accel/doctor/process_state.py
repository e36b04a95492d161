"""The process-wide state beyond torch's numerics that a doctor's run puts back: switches a step
may set for the whole process (the garbage collector, the umask, NumPy's error handling, the output
streams, the signal handlers...), the hooks it may register for every module or optimizer, and
torch.compile's caches."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import signal
import sys
import threading
from typing import Any

import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks

__all__ = ["CompiledCaches", "GlobalHooks", "ProcessSwitches", "progress_monitor"]


def _umask() -> int:
    """The process's umask, read without setting it where Linux says it (set and set back, a
    file another thread made in between would get the wrong mode)."""
    with contextlib.suppress(OSError, StopIteration, ValueError), open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    umask = os.umask(0o022)  # no getter elsewhere: read by setting it
    os.umask(umask)
    return umask


def _default_device() -> torch.device | None:
    """The device ``torch.set_default_device`` set, or None where it set none."""
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return None if context is None else context.device


def _signal_handlers() -> dict[signal.Signals, Any]:
    """Each signal's Python handler (None where one was set outside Python); not SIGCHLD's:
    torch's loader sets its handler once a process, for every loader after."""
    return {number: signal.getsignal(number) for number in signal.valid_signals()
            if number != getattr(signal, "SIGCHLD", None)}  # fmt: skip


def _set_signal_handlers(handlers: dict[signal.Signals, Any]) -> None:
    """Only those that changed, and only those Python can set (a preemption checkpoint's
    handler the step installed would save the doctor's copy)."""
    for number, handler in handlers.items():
        if handler is not None and signal.getsignal(number) != handler:
            signal.signal(number, handler)


def _set_import_path(path: list[str]) -> None:
    sys.path[:] = path  # the same list: importlib's finders hold it


def _warned_in() -> frozenset[str]:
    """The modules whose code showed a warning: Python keeps which in their
    ``__warningregistry__``, so that each shows once (one made by a doctor's run would hide the
    user's first warning after)."""
    return frozenset(name for name, module in list(sys.modules.items())
                     if "__warningregistry__" in getattr(module, "__dict__", ()))  # fmt: skip


def _forget_warned(names: frozenset[str]) -> None:
    for name in names:
        vars(sys.modules[name]).pop("__warningregistry__", None)


# (read, write) of switches of the whole process that are not torch's numerics: a step made 'fast'
# turns the garbage collector off, a debugging one makes NumPy raise, a cluster's tees the output
# into its log; the user's code runs on
_PROCESS_SWITCHES = (
    (gc.isenabled, lambda on: gc.enable() if on else gc.disable()),
    (gc.get_threshold, lambda thresholds: gc.set_threshold(*thresholds)),
    (_umask, os.umask),
    (sys.getrecursionlimit, sys.setrecursionlimit),
    (torch.is_warn_always_enabled, torch.set_warn_always),
    (_default_device, torch.set_default_device),
    (lambda: sys.stdout, lambda stream: setattr(sys, "stdout", stream)),
    (lambda: sys.stderr, lambda stream: setattr(sys, "stderr", stream)),
    (lambda: list(sys.path), _set_import_path),
    (_signal_handlers, _set_signal_handlers),
    (torch.multiprocessing.get_sharing_strategy, torch.multiprocessing.set_sharing_strategy),
    (lambda: sys.excepthook, lambda hook: setattr(sys, "excepthook", hook)),
    (lambda: sys.displayhook, lambda hook: setattr(sys, "displayhook", hook)),
    (lambda: threading.excepthook, lambda hook: setattr(threading, "excepthook", hook)),
    (_warned_in, lambda before: _forget_warned(_warned_in() - before)),
)


def _config_switches(config: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(read, write, value) of a torch config module (dynamo's, inductor's); written back only
    the entries that changed (writing a deprecated one warns)."""

    def write(kept: dict[str, Any]) -> None:
        now = config.get_config_copy()
        for name, value in kept.items():
            if now.get(name) != value:
                setattr(config, name, value)

    return config.get_config_copy, write, config.get_config_copy()


_CONFIGS = ("torch._dynamo.config", "torch._inductor.config")


class ProcessSwitches:
    """The garbage collector (on, thresholds), the umask, the recursion limit, torch's
    warn-always, default device and sharing strategy, NumPy's error handling and print options,
    ``sys.stdout`` and ``sys.stderr``, the import path, the signal handlers, the exception and
    display hooks, the warnings shown (each module's registry of them) and dynamo's and
    inductor's settings, to put back; each
    written only where it changed (a default device set again is a new mode on torch's stack)."""

    def __init__(self) -> None:
        self.kept = [(read, write, read()) for read, write in _PROCESS_SWITCHES]
        self.kept += [_config_switches(sys.modules[name]) for name in _CONFIGS
                      if name in sys.modules]  # fmt: skip  # not imported: nothing set yet
        numpy = sys.modules.get("numpy")  # imported with torch where it is installed
        if numpy is not None:
            self.kept += [
                (numpy.geterr, lambda errors: numpy.seterr(**errors), numpy.geterr()),
                (numpy.get_printoptions, lambda options: numpy.set_printoptions(**options),
                 numpy.get_printoptions()),
            ]  # fmt: skip

    def restore(self) -> None:
        for read, write, value in self.kept:
            if read() != value:
                write(value)


class GlobalHooks:
    """The hooks registered for every module or optimizer of the process
    (``register_module_forward_hook``, ``register_optimizer_step_post_hook``...), to put back: one
    the step left ran on each later forward or step of the user's, and only the step's copies held
    its handle."""

    def __init__(self) -> None:
        self.kept = {
            (where, name): copy.copy(value)
            for where in (module_hooks, optimizer_hooks)
            for name, value in vars(where).items()
            if name.startswith("_global_")
        }

    def restore(self) -> None:
        for (where, name), value in self.kept.items():
            if isinstance(value, dict):  # emptied and refilled: the handles hold the dict itself
                getattr(where, name).clear()
                getattr(where, name).update(value)
            else:
                setattr(where, name, value)


class CompiledCaches:
    """torch.compile's caches, which keep what the doctor's copies compiled alive after their run
    (the copies' tensors and, under CUDA graphs, their memory pool) until ``torch._dynamo.reset()``.
    Where the process had compiled nothing before, :meth:`restore` resets them, which puts them
    back as they were; elsewhere a reset would empty the user's own compiled functions' caches
    too, so it says what was left instead. Inductor's pools of compile workers that the copies'
    compiles started, where the process had none, are shut down."""

    LEFT = ("left what its copies compiled in torch.compile's caches, which hold those copies and "
            "their memory: torch._dynamo.reset() frees them, and empties your own compiled "
            "functions' caches")  # fmt: skip

    def __init__(self) -> None:
        self.empty = not _codes_compiled()
        self.graphs = _graphs_compiled()
        self.workers = _compile_workers()

    def tidy(self) -> None:
        """Reset now where that puts the caches back (between trials: each compiled copy's memory
        freed before the next is made)."""
        if self.empty and _graphs_compiled() != self.graphs:
            torch._dynamo.reset()
            self.graphs = _graphs_compiled()

    def restore(self) -> str | None:
        """:meth:`tidy`; where the caches held the user's compiled functions, what the copies left
        there in words (None: nothing)."""
        self.tidy()
        if not self.workers and _compile_workers():  # started by a copy's compile: ended
            _end_compile_workers()
        if not _codes_compiled():  # emptied since (examine's compile=True resets them)
            return None
        return None if _graphs_compiled() == self.graphs else self.LEFT


def _codes_compiled() -> bool:
    """Whether torch.compile has a compiled function's code in its caches."""
    frames = sys.modules.get("torch._dynamo.convert_frame")
    return frames is not None and any(code() is not None for code in frames.input_codes.seen)


def _compile_workers() -> bool:
    """Whether inductor's pools of compile workers (threads, processes) are running: kept for the
    process's later compiles once one started them."""
    compiling = sys.modules.get("torch._inductor.async_compile")
    if compiling is None:
        return False
    pools = compiling.AsyncCompile
    try:  # inductor's own names, which another torch may not have: then none seen, none ended
        return bool(compiling._pool_set) or any(
            pool.cache_info().currsize for pool in (pools.pool, pools.process_pool)
        )
    except AttributeError:
        return False


def _end_compile_workers() -> None:
    compiling = sys.modules["torch._inductor.async_compile"]
    threads = compiling.AsyncCompile.pool
    if threads.cache_info().currsize:
        threads().shutdown(wait=False)
        threads.cache_clear()
    compiling.shutdown_compile_workers()


def _graphs_compiled() -> int:
    """How many graphs torch.compile has compiled in this process."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else utils.counters["stats"]["unique_graphs"]


def progress_monitor(value: Any) -> bool:
    """tqdm's monitor thread (or its class), started with a process's first bar by any library's
    (the doctor's own, torch.compile's): not the step's, and ended where a session started it."""
    cls = value if isinstance(value, type) else type(value)
    return cls.__name__ == "TMonitor" and cls.__module__.startswith("tqdm")
