"""Every process of a launched run found (Linux: /proc; elsewhere torchrun's group and the ranks'
recorded pids) and ended, by a watchdog too, with the launch's folder, if the launching process
dies first. Standard library only: the watchdog runs this file (``python -I processes.py PID``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

KILL_GRACE_S = 10.0  # how long killed processes get to be gone (one stuck in a driver call stays)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not count)."""
    if not Path("/proc").is_dir():  # not Linux: ask the kernel
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent, session) of every live process but this one, from /proc."""
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            state, parent, _, session = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, IndexError, ValueError):
            continue
        if state != "Z" and int(entry.name) != os.getpid():
            table[int(entry.name)] = (int(parent), int(session))
    return table


def run_processes(root: int | None, marker: str) -> set[int]:
    """The live processes of one run: torchrun (``root``; None once reaped), every process whose
    command line carries ``marker`` (the ranks), everything in their sessions or below them."""
    table = _process_table()
    found = {pid for pid in table if pid == root or marker in _command_line(pid)}
    sessions = {table[pid][1] for pid in found}
    found |= {pid for pid, (_, session) in table.items() if session in sessions}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    stack = list(found)
    while stack:  # descendants
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def rank_pids(out: Path) -> dict[int, int]:
    """rank -> pid, from the ``rank{N}.pid`` files every rank writes into the launch's folder."""
    pids = {}
    for path in out.glob("rank*.pid"):
        with contextlib.suppress(ValueError):  # being written: that rank started after the end
            pids[int(path.stem.removeprefix("rank"))] = int(path.read_text())
    return dict(sorted(pids.items()))


def kill_until_gone(find: Callable[[], set[int]], first: int | None) -> set[int]:
    """SIGKILL what ``find()`` returns (``first`` first: torchrun then starts no rank) until it
    finds none (a rank was still starting) or for :data:`KILL_GRACE_S`; what still runs then."""
    deadline = time.monotonic() + KILL_GRACE_S
    while running := find():
        for pid in sorted(running, key=lambda pid: pid != first):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return find()
        time.sleep(0.02)
    return set()


def end_run(proc: subprocess.Popen, marker: str, recorded: Iterable[int] = ()) -> None:
    """Kill every process of the run torchrun ``proc`` started and wait until none is left."""
    # proc's pid is searched until poll() reaps it: until then no other process can have it
    root = lambda: proc.pid if proc.poll() is None else None  # noqa: E731
    if left := _kill_run(proc.pid, marker, recorded, root):
        warnings.warn(
            f"processes {sorted(left)} of the run did not end within {KILL_GRACE_S:g} s of SIGKILL "
            "(a process stuck in the kernel, e.g. in a GPU driver call)",
            RuntimeWarning,
            stacklevel=3,
        )
    proc.wait()


def _kill_run(
    torchrun: int | None,
    marker: str,
    recorded: Iterable[int],
    root: Callable[[], int | None] = lambda: None,
) -> set[int]:
    """Every process of the run killed (``marker`` in the ranks' command lines, ``root()``
    torchrun while it may be searched); where there is no /proc, torchrun's group and the
    ranks' ``recorded`` pids (torchrun starts each rank in a session of its own). What still
    runs."""
    if Path("/proc").is_dir():
        return kill_until_gone(lambda: run_processes(root(), marker), torchrun)
    if torchrun is not None:
        with contextlib.suppress(OSError):
            os.killpg(torchrun, signal.SIGKILL)
    for pid in recorded:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return set()


@contextlib.contextmanager
def ended_with_this_process(marker: str, folder: Path) -> Iterator[Callable[[int], None]]:
    """Within the block, a watchdog (in a session of its own: a signal to this process's group
    spares it) reads a pipe from this process; if it closes first (this process died), it
    kills the run's processes and removes ``folder``. Yields a function telling torchrun's pid."""
    watchdog = subprocess.Popen(
        [sys.executable, "-I", str(Path(__file__).resolve()), str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    assert watchdog.stdin is not None

    def tell(line: str) -> None:
        with contextlib.suppress(OSError):  # the watchdog was killed: the run goes on without
            watchdog.stdin.write(line.encode() + b"\n")
            watchdog.stdin.flush()

    tell(json.dumps({"marker": marker, "folder": str(folder)}))
    try:
        yield lambda pid: tell(str(pid))
    finally:
        tell("done")
        with contextlib.suppress(OSError):
            watchdog.stdin.close()
        watchdog.wait()


def _watch(launcher: int) -> None:
    """The watchdog's loop: lines from the launcher until "done" (it ended the run itself), or
    the end of the pipe or a new parent (it died): then the run is ended."""
    run, torchrun, pending = None, None, b""
    while True:
        if select.select([sys.stdin.fileno()], [], [], 0.5)[0]:
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line == b"done":
                    return
                if line.isdigit():
                    torchrun = int(line)
                else:
                    run = json.loads(line)
        elif os.getppid() != launcher:
            break
    if run is None:  # died before naming its run: nothing was started
        return
    _kill_run(torchrun, run["marker"], rank_pids(Path(run["folder"])).values())
    shutil.rmtree(run["folder"], ignore_errors=True)


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
