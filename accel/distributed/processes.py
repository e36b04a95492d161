"""Every process of a launched run, found and ended: the launcher (torchrun) in a session of its
own, the ranks it starts in sessions of theirs, and whatever a rank starts. Linux reads /proc;
elsewhere the launcher's group and the ranks' recorded pids are killed. A watchdog process ends
them too, and removes the launch's folder, if the process that launched them dies first (a
notebook's kernel killed, out of memory): nothing of a run outlives its launcher.

Standard library only: the watchdog runs this file as a script (``python -I processes.py PID``),
without importing torch.
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
from dataclasses import dataclass
from pathlib import Path


def process_alive(pid: int, marker: str | None = None) -> bool:
    """Whether ``pid`` runs (a zombie does not count); with ``marker``, only if its command line
    contains it (so a reused pid is never taken for a rank)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        if marker is not None:
            return marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        return True
    except (OSError, IndexError):
        if not Path("/proc").is_dir():  # not Linux: ask the kernel directly
            try:
                os.kill(pid, 0)
            except OSError:
                return False
            return True
        return False


@dataclass(frozen=True)
class _Process:
    pid: int
    ppid: int
    session: int
    zombie: bool


def _process_table() -> list[_Process]:
    """Every process, from /proc (empty where there is none)."""
    table = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table.append(_Process(int(entry.name), int(fields[1]), int(fields[3]), fields[0] == "Z"))
    return table


def run_processes(root: int | None, marker: str) -> set[int]:
    """The live processes of one run: torchrun (``root``, leader of its own session; None once
    it has been reaped, when its pid may belong to another process) and its descendants, every
    rank (torchrun starts each in a session of its own; its command line carries ``marker``) and
    everything in a rank's session or below a rank, even a process that left the session."""
    table = [p for p in _process_table() if not p.zombie and p.pid != os.getpid()]
    found = set() if root is None else {root}
    for p in table:
        if p.pid in found:
            continue
        try:
            if marker in (Path(f"/proc/{p.pid}/cmdline").read_bytes().decode(errors="replace")):
                found.add(p.pid)
        except OSError:
            continue
    sessions = {p.session for p in table if p.pid in found}
    found |= {p.pid for p in table if p.session in sessions}
    children: dict[int, list[int]] = {}
    for p in table:
        children.setdefault(p.ppid, []).append(p.pid)
    stack = list(found)
    while stack:  # descendants
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return {pid for pid in found if any(p.pid == pid for p in table)}


def rank_pids(out: Path) -> dict[int, int]:
    """rank -> pid, from the ``rank{N}.pid`` files every rank writes into the launch's folder."""
    pids = {}
    for path in out.glob("rank*.pid"):
        try:
            pids[int(path.stem.removeprefix("rank"))] = int(path.read_text())
        except ValueError:
            continue  # written as we read it: that rank started after the end, never ran
    return dict(sorted(pids.items()))


def kill_until_gone(
    find: Callable[[], set[int]],
    first: int | None = None,
    grace: float = 10.0,
    after_kill: Callable[[], None] = lambda: None,
) -> set[int]:
    """SIGKILL every process ``find()`` returns (``first`` before the others), again and again
    until it returns none, or for ``grace`` seconds: what is still running then (empty if
    nothing is)."""
    deadline = time.monotonic() + grace
    while True:
        running = find()
        if not running:
            return set()
        for pid in sorted(running, key=lambda pid: pid != first):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        after_kill()
        if time.monotonic() > deadline:
            return find()
        time.sleep(0.02)


def end_run(
    proc: subprocess.Popen, marker: str, recorded: Iterable[int] = (), grace: float = 10.0
) -> None:
    """Kill every process of the run and wait until none is left. The whole tree is found
    before anything is killed (a killed rank's children would lose their parent), torchrun's
    agent dies first (it cannot start a rank after that), and the search repeats until it finds
    nothing, for a rank that was still starting. ``marker`` is in every rank's command line;
    ``recorded`` are the ranks' own pids, used where there is no /proc."""
    if not Path("/proc").is_dir():  # elsewhere: torchrun's group, then the ranks it recorded
        _kill_without_proc(proc.pid, recorded)
        proc.wait()
        return

    def reap() -> None:  # torchrun once killed: reaped, so that its pid is not searched again
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)

    left = kill_until_gone(
        lambda: run_processes(proc.pid if proc.poll() is None else None, marker),
        first=proc.pid,
        grace=grace,
        after_kill=reap,
    )
    if left:
        warnings.warn(
            f"processes {sorted(left)} of the run did not end within {grace:g} s of SIGKILL "
            "(a process stuck in the kernel, e.g. in a GPU driver call)",
            RuntimeWarning,
            stacklevel=3,
        )
    proc.wait()


def _kill_without_proc(torchrun: int | None, recorded: Iterable[int]) -> None:
    if torchrun is not None:
        with contextlib.suppress(OSError):
            os.killpg(torchrun, signal.SIGKILL)
    for pid in recorded:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def ended_with_this_process(marker: str, folder: Path) -> Iterator[Callable[[int], None]]:
    """Within the block, a watchdog (this file run as a script, in a session of its own so that
    a signal to this process's group spares it) waits on a pipe from this process: if the pipe
    closes before the block ends (this process died: killed, out of memory), it kills every
    process of the run (``marker`` in their command lines, as :func:`end_run`) and removes
    ``folder``, the launch's. Yields a function that tells it torchrun's pid, which it needs
    where there is no /proc."""
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
    """The watchdog's loop: lines from the launcher until "done" (the launcher ended the run
    itself), or the end of the pipe or a new parent (the launcher died): then the run ended."""
    run: dict | None = None
    torchrun = None
    pending = b""
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
    folder = Path(run["folder"])
    if Path("/proc").is_dir():
        kill_until_gone(lambda: run_processes(None, run["marker"]), first=torchrun)
    else:
        _kill_without_proc(torchrun, rank_pids(folder).values())
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
