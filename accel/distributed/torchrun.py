"""A launch on torchrun, watched until it exits or times out, every process of it ended, and
what the ranks left read back as :class:`RunResult` or raised, its cause first (torchrun's own
error, or the failing rank's). Several hosts meet at torchrun's static rendezvous, the backend
that honours ``--node-rank`` (c10d's numbers nodes by host name), so node 0 runs rank 0."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from accel.distributed.config import RunConfig, RunResult
from accel.distributed.processes import end_run, ended_with_this_process, rank_pids


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


# What every rank runs: this package's __main__, which reads the config file and calls run_rank.
RANK_MODULE = "accel.distributed"


def _torch_run_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and importlib.util.find_spec("torch.distributed.run") is not None


def launcher_command(launcher: str | Sequence[str] | None = None) -> list[str]:
    """The command that starts torchrun: ``python -m torch.distributed.run`` by default, or the
    program named by ``launcher`` (e.g. ``"torchrun"``), checked before any launch."""
    if launcher is None:
        if not _torch_run_available():
            raise LauncherNotFound(
                "torch.distributed.run cannot be imported: this torch build has no distributed "
                f"support (torch {torch.__version__}); install a build with it, or pass launcher="
            )
        return [sys.executable, "-m", "torch.distributed.run"]
    command = [launcher] if isinstance(launcher, str) else list(launcher)
    if not command or shutil.which(command[0]) is None:
        raise LauncherNotFound(
            f"launcher {command[0] if command else command!r} not found on PATH; expected "
            "torchrun (installed with torch) or launcher=None for python -m torch.distributed.run"
        )
    return command


def run_torchrun(
    configs: Sequence[RunConfig],
    out: Path,
    command: list[str],
    labels: Sequence[str] | None = None,
) -> list[RunResult]:
    """``configs`` run in order on one torchrun started by ``command``, in the fresh folder
    ``out`` (each run's ``out_dir`` inside), ``labels`` naming them in errors; every process of
    the launch has ended when it returns or raises."""
    config_path = out / "config.json"
    config_path.write_text(json.dumps([dataclasses.asdict(c) for c in configs]))
    command = _torchrun_command(command, configs, config_path)
    exitcode, pids = _run_and_end(configs, out, command, labels)
    output = (out / "launcher.log").read_text(errors="replace")
    # no rank started and no summary of failed ranks (ChildFailedError): torchrun itself failed,
    # on several nodes mostly at the rendezvous; its last line says why
    if exitcode != 0 and not pids and "ChildFailedError" not in output:
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        raise LaunchError(
            f"torchrun ended before starting any rank ({describe(configs, labels)}): "
            f"{lines[-1][:300] if lines else f'exit code {exitcode}'}.{nodes_hint(configs[0])}"
            f"\n\nIts output ends with:\n{output[-4000:]}"
        )
    for i, config in enumerate(configs):  # the first run that did not finish failed the launch
        if exitcode != 0 and not _finished(config):
            what = describe([config]) + (f" (run {labels[i]!r})" if labels else "")
            raise rank_failure(config, output, exitcode, pids, what)
    results = []
    for config in configs:  # a loop, not a comprehension: _collect's warning names our caller
        results.append(_collect(config, exitcode, pids, output))
    return results


def _finished(config: RunConfig) -> bool:
    """Every rank of this node wrote the run's record and none its error."""
    out = Path(config.out_dir)
    written = all((out / f"rank{rank}.json").is_file() for rank in config.local_ranks)
    return written and not any(out.glob("rank*.error.json"))


def _torchrun_command(
    command: list[str], configs: Sequence[RunConfig], config_path: Path
) -> list[str]:
    first = configs[0]
    if first.nnodes == 1:
        meeting = ["--standalone"]
    else:
        meeting = [
            *("--nnodes", str(first.nnodes), "--node-rank", str(first.node_rank)),
            *("--rdzv-backend", "static", "--rdzv-endpoint", str(first.rdzv_endpoint)),
            *("--rdzv-id", first.rdzv_id),
        ]
    rank = ["-m", RANK_MODULE, "--config", str(config_path)]
    return [*command, *meeting, "--nproc-per-node", str(first.nprocs), *rank]


def _environment(first: RunConfig, tmp: Path) -> dict[str, str]:
    env = os.environ | first.nccl_env | {"PYTHONUNBUFFERED": "1"}
    env["TMPDIR"] = str(tmp)  # torchrun's torchelastic_* folder and the ranks' files go there
    # Ranks must import accel and the task's module as this process does.
    paths = [str(Path(__file__).resolve().parents[2]), os.getcwd(), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # torchrun would set 1 and print a banner about it; share the cores instead
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // first.nprocs)))
    return env


def _run_and_end(
    configs: Sequence[RunConfig], out: Path, command: list[str], labels: Sequence[str] | None
) -> tuple[int, tuple[int, ...]]:
    """torchrun's exit code and the ranks' pids, once it exits and what is left of the launch
    is ended (at once past the runs' timeouts summed, or on any exception, e.g. Ctrl-C)."""
    marker = str(out / "config.json")  # in every rank's command line
    timeout = sum(c.timeout for c in configs)
    log_path = out / "launcher.log"
    (out / "tmp").mkdir()
    with open(log_path, "wb") as log, ended_with_this_process(marker, out) as watched:
        # Its own session: on a timeout the whole group is killed, torchrun and all.
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_environment(configs[0], out / "tmp"),
            start_new_session=True,
        )
        watched(proc.pid)
        try:
            exitcode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            exitcode = None
        finally:  # torchrun ends the other ranks when one fails; make sure nothing is left
            pids = tuple(rank_pids(out).values())
            end_run(proc, marker, pids)
    if exitcode is None:
        raise LaunchTimeout(
            f"{describe(configs, labels)} ran past timeout={timeout:g} s; every process was "
            f"killed.{nodes_hint(configs[0])} Output ends with:\n"
            + log_path.read_text(errors="replace")[-4000:]
        )
    return exitcode, pids


def _collect(config: RunConfig, exitcode: int, pids: tuple[int, ...], output: str) -> RunResult:
    """One run's records from every rank (a failed rank was raised before)."""
    paths = [Path(config.out_dir) / f"rank{rank}.json" for rank in config.local_ranks]
    if not _finished(config):
        missing = [p.stem for p in paths if not p.is_file()]
        raise LaunchError(
            f"torchrun exited 0 but {', '.join(missing)} wrote no results; output:\n"
            + output[-4000:]
        )
    if exitcode != 0:  # every rank had written its results: a crash on the way out
        warnings.warn(
            f"torchrun exited {exitcode} after every rank wrote its results; they are returned. "
            f"Output ends with:\n{output[-1500:]}",
            stacklevel=5,  # launch's caller (through _on_torchrun and run_torchrun)
        )
    records = [json.loads(p.read_text()) for p in paths]
    return RunResult.from_records(config, records, output=output, pids=pids)


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
