"""Every process of a launched run, found and ended: the launcher (torchrun) in a session of its
own, the ranks it starts in sessions of theirs, and whatever a rank starts. Linux reads /proc;
elsewhere the launcher's group and the ranks' recorded pids are killed.

Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import warnings
from collections.abc import Iterable
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


def end_run(
    proc: subprocess.Popen, marker: str, recorded: Iterable[int] = (), grace: float = 10.0
) -> None:
    """Kill every process of the run and wait until none is left. The whole tree is found
    before anything is killed (a killed rank's children would lose their parent), torchrun's
    agent dies first (it cannot start a rank after that), and the search repeats until it finds
    nothing, for a rank that was still starting. ``marker`` is in every rank's command line;
    ``recorded`` are the ranks' own pids, used where there is no /proc."""
    deadline = time.monotonic() + grace
    if not Path("/proc").is_dir():  # elsewhere: torchrun's group, then the ranks it recorded
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in recorded:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return
    while True:
        running = run_processes(proc.pid if proc.poll() is None else None, marker)
        if not running:
            break
        for pid in sorted(running, key=lambda pid: pid != proc.pid):  # torchrun first
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
        if time.monotonic() > deadline:
            left = run_processes(None, marker)
            if left:
                warnings.warn(
                    f"processes {sorted(left)} of the run did not end within {grace:g} s of "
                    "SIGKILL (a process stuck in the kernel, e.g. in a GPU driver call)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            break
        time.sleep(0.02)
    proc.wait()
