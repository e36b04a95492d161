"""What :func:`accel.distributed.launch` raises besides ValueError for bad arguments, and what it
says: what the launch ran, and the cause first (torchrun's own error, or the failing rank's, read
from the ranks' error files and torchrun's failure summary)."""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Sequence
from pathlib import Path

from accel.distributed.config import RunConfig


class LaunchError(RuntimeError):
    """The run could not start, or ended without results."""


class LauncherNotFound(LaunchError):
    """Neither torchrun nor ``torch.distributed.run`` can be run here."""


class LaunchTimeout(LaunchError):
    """The run took longer than ``timeout``; every process of it was killed."""


class RankFailed(LaunchError):
    """A rank raised (or died): ``rank``, its ``traceback``, the launcher's ``output``, its
    ``exitcode`` and the ranks' ``pids``."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        traceback: str,
        output: str,
        exitcode: int | None,
        pids: tuple[int, ...] = (),
    ):
        super().__init__(message)
        self.rank, self.traceback, self.output = rank, traceback, output
        self.exitcode, self.pids = exitcode, pids


def describe(configs: Sequence[RunConfig], labels: Sequence[str] | None = None) -> str:
    """What a launch runs: ``ddp x2 of TASK``, or its runs' names."""
    first = configs[0]
    where = f" on node {first.node_rank} of {first.nnodes}" if first.nnodes > 1 else ""
    if len(configs) == 1:
        return f"{first.wrapper} x{first.nprocs}{where} of {first.task}"
    names = labels or [describe([c]) for c in configs]
    return f"the runs {', '.join(map(str, names))} x{first.nprocs}{where} on one launch"


def nodes_hint(config: RunConfig) -> str:
    """What to check on a run of several nodes that failed to meet, or "" on one host."""
    if config.nnodes == 1:
        return ""
    return (
        f" The {config.nnodes} nodes meet at rdzv_endpoint={config.rdzv_endpoint!r}: node 0 "
        "listens on its port (is it free there?), every other node connects to it (can it "
        "reach it?), and each node must launch once, with the same nnodes, nprocs and rdzv_id."
    )


def agent_failure(config: RunConfig, output: str, exitcode: int, what: str) -> LaunchError:
    """torchrun's own error, its last line first: on several nodes mostly the rendezvous."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    cause = lines[-1][:300] if lines else f"exit code {exitcode}"
    return LaunchError(
        f"torchrun ended before starting any rank ({what}): {cause}.{nodes_hint(config)}"
        f"\n\nIts output ends with:\n{output[-4000:]}"
    )


def rank_failure(
    config: RunConfig, output: str, exitcode: int, pids: tuple[int, ...], what: str
) -> RankFailed:
    """The failing rank's error, its cause in the first line: a rank that died without a Python
    error (killed, out of memory, crashed), else the first rank that raised; the other ranks'
    errors, mostly consequences, after."""
    errors = sorted(
        (json.loads(p.read_text()) for p in Path(config.out_dir).glob("rank*.error.json")),
        key=lambda e: e["time"],
    )
    raised = {e["rank"] for e in errors}
    # torchrun ends the other ranks with SIGTERM, a consequence: a rank killed otherwise is the
    # cause, then a rank that raised, then a SIGTERM if nothing else is known
    killed = {
        r: why
        for r, why in _killed_ranks(output).items()
        if r not in raised and not (errors and "SIGTERM" in why)
    }
    consequences = [
        f"rank {e['rank']}: {e['type']}: {_first_line(e['message'], 200)}" for e in errors
    ]
    if killed or not errors:
        rank, cause = min(
            killed.items(),
            key=lambda item: ("SIGTERM" in item[1], item[0]),
            default=(None, f"torchrun exit code {exitcode}"),
        )
        who = "a rank" if rank is None else f"rank {rank} of {config.world_size}"
        head = f"{who} died without a Python error: {cause} ({what}; killed, out of memory, "
        head += "or crashed)"
        traceback, later = "", consequences
        tail = f"The launcher's output ends with:\n{output[-6000:]}"
    else:
        first = errors[0]
        rank, traceback, later, tail = first["rank"], first["traceback"], consequences[1:], ""
        message = _first_line(first["message"], 300)
        head = f"rank {rank} of {config.world_size} raised {first['type']}"
        head += f"{': ' + message if message else ''} ({what})"
    then = f"then, as a consequence: {'; '.join(later)}" if later else ""
    parts = [f"{head}; torchrun ended the other ranks.", traceback.rstrip(), then, tail]
    return RankFailed(
        "\n\n".join(part for part in parts if part),
        rank=rank,
        traceback=traceback,
        output=output,
        exitcode=exitcode,
        pids=pids,
    )


def _first_line(text: str | None, chars: int) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0][:chars] if lines else ""


def _killed_ranks(output: str) -> dict[int, str]:
    """Ranks that torchrun's failure summary shows ended by a signal, with the signal, e.g.
    {1: "Signal 9 (SIGKILL) received by PID 1234"}."""
    killed: dict[int, str] = {}
    rank = None
    for line in output.rpartition("ChildFailedError")[2].splitlines():
        key, _, value = (part.strip() for part in line.strip().partition(":"))
        if key == "rank" and value.split() and value.split()[0].isdigit():
            rank = int(value.split()[0])
        elif key == "exitcode" and rank is not None and value.startswith("-"):
            number = int(value.split()[0])
            with contextlib.suppress(ValueError):
                killed.setdefault(rank, f"{signal.Signals(-number).name} (exit code {number})")
        elif key == "traceback" and rank in killed and value.startswith("Signal"):
            killed[rank] = value
    return killed
