"""What a failed run raises: :class:`RankFailed` naming the rank that caused the failure, read from
the ranks' error files and torchrun's failure summary."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

from accel.distributed.config import RunConfig
from accel.distributed.errors import LaunchError, RankFailed


def agent_failed(output: str, ranks_started: bool) -> bool:
    """Whether torchrun's agent itself failed, before any rank ran: no rank started, and no
    failure summary of ranks (torchrun prints one, ChildFailedError, when a rank fails)."""
    return not ranks_started and "ChildFailedError" not in output


def agent_failure(config: RunConfig, output: str, exitcode: int, what: str) -> LaunchError:
    """torchrun's own error, its last line first: on several nodes mostly the rendezvous (node
    0's port taken, node 0 not reachable from another node)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    cause = lines[-1][:300] if lines else f"exit code {exitcode}"
    return LaunchError(
        f"torchrun ended before starting any rank ({what}): {cause}.{nodes_hint(config)}"
        f"\n\nIts output ends with:\n{output[-4000:]}"
    )


def nodes_hint(config: RunConfig) -> str:
    """What to check on a run of several nodes that failed to meet, or "" on one host."""
    if config.nnodes == 1:
        return ""
    return (
        f" The {config.nnodes} nodes meet at rdzv_endpoint={config.rdzv_endpoint!r}: node 0 "
        "listens on its port (is it free there?), every other node connects to it (can it "
        "reach it?), and each node must launch once, with the same nnodes, nprocs and rdzv_id."
    )


def rank_failure(
    config: RunConfig,
    out: Path,
    output: str,
    exitcode: int,
    pids: dict[int, int],
    *,
    what: str | None = None,
) -> RankFailed:
    """The failing rank's error, its cause in the first line: a rank that died without a Python
    error (killed, out of memory, crashed) when torchrun saw one first, else the first rank that
    raised; the other ranks' errors, mostly consequences, after."""
    errors = sorted(
        (json.loads(p.read_text()) for p in out.glob("rank*.error.json")), key=lambda e: e["time"]
    )
    what = what or f"{config.wrapper} x{config.nprocs} of {config.task}"
    raised = {e["rank"] for e in errors}
    killed = {r: why for r, why in _killed_ranks(output).items() if r not in raised}
    # torchrun ends the other ranks with SIGTERM, a consequence: a rank killed otherwise (SIGKILL,
    # SIGSEGV, ...) is the cause, then a rank that raised, then a SIGTERM if nothing else is known
    if errors:
        killed = {r: why for r, why in killed.items() if "SIGTERM" not in why}
    died, cause = (
        min(killed.items(), key=lambda item: ("SIGTERM" in item[1], item[0]))
        if killed
        else (None, "")
    )
    consequences = [
        f"rank {e['rank']}: {e['type']}: "
        + (e["message"].splitlines()[0][:200] if e["message"] else "")
        for e in errors
    ]
    if not errors or killed:
        who = f"rank {died} of {config.world_size}" if died is not None else "a rank"
        return RankFailed(
            f"{who} died without a Python error: {cause or f'torchrun exit code {exitcode}'} "
            f"({what}; killed, out of memory, or crashed); torchrun ended the other ranks."
            + (f"\n\nthen, as a consequence: {'; '.join(consequences)}" if errors else "")
            + f"\n\nThe launcher's output ends with:\n{output[-6000:]}",
            rank=died,
            traceback="",
            output=output,
            exitcode=exitcode,
            pids=tuple(pids.values()),
        )
    first, later = errors[0], errors[1:]
    message_lines = (first["message"] or "").strip().splitlines()
    message = (
        f"rank {first['rank']} of {config.world_size} raised {first['type']}"
        f"{': ' + message_lines[0][:300] if message_lines else ''} ({what}); torchrun ended the "
        f"other ranks.\n\n{first['traceback'].rstrip()}"
    )
    if later:
        message += "\n\nthen, as a consequence: " + "; ".join(consequences[1:])
    return RankFailed(
        message,
        rank=first["rank"],
        traceback=first["traceback"],
        output=output,
        exitcode=exitcode,
        pids=tuple(pids.values()),
    )


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
