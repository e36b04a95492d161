"""The entry points, :func:`launch` and :func:`launch_series`: every argument checked and each
task built once (a ValueError before anything starts), then trained here or on torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import re
import socket
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch

from accel.distributed.checkpoint import check_loadable, latest_checkpoint
from accel.distributed.config import DEFAULT_TASK, WRAPPERS, RunConfig, RunResult
from accel.distributed.rank import make_optimizer, train
from accel.distributed.tasks import Task, build_task, load_task
from accel.distributed.torchrun import launcher_command, run_torchrun
from accel.errors import checked_count, checked_number

_RUN_FIELDS = {f.name for f in dataclasses.fields(RunConfig)}
# what the runs of one launch share: its processes' environment and its nodes
_SHARED = ("backend", "nccl_env", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id")


def gpus_present() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(
    task: str = DEFAULT_TASK,
    nprocs: int = 1,
    wrapper: Literal["none", "ddp", "fsdp2"] = "none",
    *,
    steps: int = 10,
    warmup: int = 2,
    preset: str | None = None,
    seed: int = 0,
    lr: float = 1e-3,
    scaling: Literal["strong", "weak"] = "strong",
    backend: Literal["nccl", "gloo"] | None = None,
    autocast: Literal["bf16"] | None = None,
    bucket_cap_mb: float | None = None,
    gradient_as_bucket_view: bool = False,
    static_graph: bool = False,
    reshard_after_forward: bool = True,
    mixed_precision: Literal["bf16"] | None = None,
    nccl_env: dict[str, str] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_at: int | None = None,
    checkpoint_every: int | None = None,
    load_from: str | os.PathLike | None = None,
    timeout: float = 600.0,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "accel",
    in_process: bool | None = None,
    launcher: str | Sequence[str] | None = None,
) -> RunResult:
    """Train ``task`` for ``steps`` steps on ``nprocs`` processes (one per GPU with ``nccl``,
    the default where GPUs are; ``gloo`` on the CPU) and return the measurements.

    ``scaling="strong"`` splits the task's global batch over the ranks; ``"weak"`` gives each
    rank a whole batch, as when adding GPUs. The communication settings (DDP's bucket options,
    FSDP2's ``reshard_after_forward``, ``mixed_precision="bf16"``, ``nccl_env``) are torch's
    defaults unless given (:data:`COMM_SETTINGS`: the ones the bench tries). ``checkpoint_dir``:
    a save after step ``checkpoint_at`` (default: the last), or every ``checkpoint_every`` steps into
    ``step-NNNNNN`` folders; ``load_from`` resumes from one (or the latest under it). Loading
    unpickles: only files matching the SHA-256 digests their save recorded are read, but whoever
    can write the folder can write those too: load only checkpoints you trust. ``in_process``
    (default: one process, ``wrapper="none"``) trains here, no timeout.

    Several hosts: the same call on each of ``nnodes`` with its own ``node_rank``, meeting at
    node 0's ``rdzv_endpoint`` (``"host:port"``, a free port); ``rdzv_id`` names the job. Node r
    runs ranks from ``r * nprocs`` and returns its own; ``checkpoint_dir`` must be shared::

        launch(nprocs=8, wrapper="ddp", nnodes=2, node_rank=0, rdzv_endpoint="10.0.0.1:29500")

    Raises before anything starts: TypeError or ValueError for a bad argument, a task that
    cannot be built or split over the ranks, an optimizer setting torch refuses, a checkpoint
    refused, an unwritable ``checkpoint_dir``, more processes than GPUs; :class:`LauncherNotFound`.
    After: :class:`RankFailed` (the cause first), :class:`LaunchError`, :class:`LaunchTimeout`.
    Either way, and on Ctrl-C or if this process dies, no process or temporary folder is left.
    """
    # every argument but in_process and launcher is a RunConfig field
    config = _config({k: v for k, v in locals().items() if k in _RUN_FIELDS})
    if in_process is None:  # by default, all that can train here: one process, no wrapper
        in_process = config.world_size == 1 and config.wrapper == "none"
    elif in_process and (config.wrapper != "none" or config.nnodes != 1):
        raise ValueError(
            f"in_process runs wrapper 'none' on this host only, got wrapper={config.wrapper!r}, "
            f"nnodes={config.nnodes!r}"
        )
    if in_process:
        return RunResult.from_records(config, [train(config)], output="")
    return _on_torchrun([config], launcher)[0]


def launch_series(
    runs: Mapping[str, Mapping[str, Any]],
    task: str = DEFAULT_TASK,
    nprocs: int = 1,
    *,
    launcher: str | Sequence[str] | None = None,
    **common: Any,
) -> dict[str, RunResult]:
    """Several runs trained in order by the same ranks, the launch's cost paid once. ``runs``
    maps a name to its :func:`launch` arguments over ``common``'s; all share ``nprocs``, the
    backend, ``nccl_env`` and the nodes. Returns name -> :class:`RunResult`; raises as
    :func:`launch`, naming the run."""
    if not runs:
        raise ValueError("runs must name at least one run (name -> its launch arguments)")
    _check_series_keys("launch_series", common)
    configs = []
    for name, own in runs.items():
        _check_series_keys(f"run {name!r}", own)
        with _naming(name):
            configs.append(
                _config(_LAUNCH_DEFAULTS | {"task": task} | common | dict(own) | {"nprocs": nprocs})
            )
    if len({json.dumps([getattr(c, k) for k in _SHARED], sort_keys=True) for c in configs}) > 1:
        raise ValueError(
            "the runs of one launch share its processes (NCCL reads its environment once per "
            f"process) and its nodes: their {', '.join(_SHARED)} must be equal; launch the "
            "others apart"
        )
    return dict(zip(runs, _on_torchrun(configs, launcher, labels=list(runs)), strict=True))


def _on_torchrun(
    configs: list[RunConfig], launcher: str | Sequence[str] | None, labels: list[str] | None = None
) -> list[RunResult]:
    """``configs`` checked as a rank runs them, then run on one torchrun, each in a folder."""
    command = launcher_command(launcher)
    _check_tasks(configs, labels)
    with tempfile.TemporaryDirectory(prefix="accel-distributed-") as tmp:
        placed = []
        for i, config in enumerate(configs):
            (folder := Path(tmp) / f"run{i}").mkdir()
            placed.append(dataclasses.replace(config, out_dir=str(folder)))
        return run_torchrun(placed, Path(tmp), command, labels)


@contextlib.contextmanager
def _naming(label: str | None) -> Iterator[None]:
    """An argument error raised within names the series' run ``label`` (None: a single launch)."""
    try:
        yield
    except (TypeError, ValueError) as error:
        if label is None:
            raise
        raise type(error)(f"run {label!r}: {error}") from None


# launch()'s defaults of the run's settings (RunConfig's fields), for launch_series
_LAUNCH_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(launch).parameters.items()
    if name in _RUN_FIELDS
}


def _check_series_keys(where: str, arguments: Mapping[str, Any]) -> None:
    """A series' arguments are the run settings of :func:`launch`; ``nprocs`` is the series'."""
    for key in arguments:
        if key == "nprocs":
            raise ValueError(f"{where}: 'nprocs' is the series' (its runs share the processes)")
        if key not in _LAUNCH_DEFAULTS:
            raise ValueError(
                f"{where}: unexpected argument {key!r}; expected launch()'s run settings: "
                + ", ".join(k for k in _LAUNCH_DEFAULTS if k != "nprocs")
            )


def _config(arguments: dict[str, Any]) -> RunConfig:
    """The run's config from :func:`launch`'s arguments, each checked, defaults resolved."""
    a = SimpleNamespace(**arguments)
    _check_arguments(a)
    _check_nodes(a)
    backend = _backend(a.backend, a.nprocs)
    preset = a.preset or os.environ.get("ACCEL_PRESET")
    resolved = {
        "backend": backend,
        "preset": preset or ("gpu" if backend == "nccl" else "cpu"),
        "nccl_env": dict(a.nccl_env or {}),
        "checkpoint_dir": None
        if a.checkpoint_dir is None
        else str(Path(a.checkpoint_dir).resolve()),
        "load_from": None if a.load_from is None else str(latest_checkpoint(a.load_from).resolve()),
    }
    return RunConfig(**arguments | resolved)


def _check_arguments(a: SimpleNamespace) -> None:
    """Every setting of one host's run and its checkpoints."""
    if a.wrapper not in WRAPPERS:
        raise ValueError(f"wrapper must be one of {WRAPPERS}, got {a.wrapper!r}")
    checked_count(a.nprocs, "nprocs", at_least=1)
    if a.wrapper == "none" and a.nprocs != 1:
        raise ValueError(f"wrapper 'none' trains on one process; got nprocs={a.nprocs} (use ddp)")
    checked_count(a.steps, "steps", at_least=1)
    checked_count(a.warmup, "warmup")
    checked_count(a.seed, "seed")
    load_task(a.task)  # the module found and its function there
    if a.scaling not in ("strong", "weak"):
        raise ValueError(f"scaling must be 'strong' or 'weak', got {a.scaling!r}")
    for name, value in (("autocast", a.autocast), ("mixed_precision", a.mixed_precision)):
        if value not in (None, "bf16"):
            raise ValueError(f"{name} must be None or 'bf16', got {value!r}")
    if not 0 < checked_number(a.timeout, "timeout") < math.inf:
        raise ValueError(f"timeout must be a number of seconds > 0, got {a.timeout!r}")
    if a.bucket_cap_mb is not None and not checked_number(a.bucket_cap_mb, "bucket_cap_mb") > 0:
        raise ValueError(f"bucket_cap_mb must be None or > 0, got {a.bucket_cap_mb!r}")
    env = a.nccl_env
    if env is not None and not (
        isinstance(env, Mapping) and all(isinstance(x, str) for kv in env.items() for x in kv)
    ):
        raise ValueError(f"nccl_env must map str to str (environment variables), got {env!r}")
    if (
        a.checkpoint_at is not None
        and not 1 <= checked_count(a.checkpoint_at, "checkpoint_at") <= a.steps
    ):
        raise ValueError(f"checkpoint_at must be within 1..steps={a.steps}, got {a.checkpoint_at}")
    if a.checkpoint_every is not None:
        checked_count(a.checkpoint_every, "checkpoint_every", at_least=1)
        if a.checkpoint_dir is None or a.checkpoint_at is not None:
            raise ValueError(
                "checkpoint_every needs checkpoint_dir (where the step-NNNNNN checkpoints go) and "
                "no checkpoint_at"
            )
    if a.checkpoint_dir is not None:
        _check_writable(Path(a.checkpoint_dir))


def _check_nodes(a: SimpleNamespace) -> None:
    """One host, or several meeting at ``rdzv_endpoint``: what each node needs."""
    checked_count(a.nnodes, "nnodes", at_least=1)
    checked_count(a.node_rank, "node_rank")
    if a.nnodes == 1:
        if a.node_rank != 0 or a.rdzv_endpoint is not None:
            raise ValueError(
                f"node_rank and rdzv_endpoint are for nnodes > 1; got nnodes=1, "
                f"node_rank={a.node_rank}, rdzv_endpoint={a.rdzv_endpoint!r} (one host meets "
                "itself: leave them out, or give nnodes)"
            )
        return
    if a.node_rank >= a.nnodes:
        raise ValueError(f"node_rank must be within 0..nnodes-1={a.nnodes - 1}, got {a.node_rank}")
    if a.wrapper == "none":
        raise ValueError(f"wrapper 'none' trains on one process; got nnodes={a.nnodes} (use ddp)")
    endpoint = a.rdzv_endpoint
    host, _, port = endpoint.rpartition(":") if isinstance(endpoint, str) else ("", "", "")
    if not (host.strip("[]") and port.isdigit() and 0 < int(port) < 65536):  # [v6 address]:port
        raise ValueError(
            "rdzv_endpoint must be 'host:port', the address of node 0 (which serves the "
            f"rendezvous) and a free port there, e.g. '10.0.0.1:29500'; got {endpoint!r}"
        )
    if not (isinstance(a.rdzv_id, str) and re.fullmatch(r"[\w.-]+", a.rdzv_id)):
        raise ValueError(
            f"rdzv_id must be a name of letters, digits, '_', '.' or '-' (the same on every "
            f"node), got {a.rdzv_id!r}"
        )
    if a.node_rank == 0 and not _is_this_host(host.strip("[]")):  # else it waits for no one
        raise ValueError(
            f"node 0 serves the rendezvous at rdzv_endpoint, but {host!r} is no address of this "
            "machine: run node 0 on the host at that address, or give this host's own address"
        )


def _is_this_host(host: str) -> bool:
    """Whether ``host`` names an address of this machine: one a socket can bind to here."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:  # a name that does not resolve
        return False
    for family, kind, _, _, address in found:
        with contextlib.suppress(OSError), socket.socket(family, kind) as probe:
            probe.bind((address[0], 0))
            return True
    return False


def _check_writable(directory: Path) -> None:
    """That the first save can make ``directory`` or write in it, creating nothing."""
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        why = "writable" if existing.is_dir() else "a folder"
        raise ValueError(
            f"checkpoint_dir {directory}: cannot write there ({existing} is not {why}); the run "
            "would fail at its first checkpoint"
        )


def _backend(backend: str | None, nprocs: int) -> str:
    """``backend``, or nccl where GPUs are present and gloo elsewhere; nccl needs a GPU per rank."""
    backend = backend or ("nccl" if gpus_present() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    if backend == "nccl":
        gpus = gpus_present()
        if nprocs > gpus:
            raise ValueError(
                f"asked for {nprocs} process{'es' if nprocs > 1 else ''} with one GPU each "
                f"(backend nccl), but {gpus} GPU(s) are present; "
                + (f"use nprocs <= {gpus}" if gpus else "use backend='gloo' to run on the CPU")
            )
    return backend


def _check_tasks(configs: Sequence[RunConfig], labels: Sequence[str] | None = None) -> None:
    """What every rank does first (the task built and split, its optimizer, the checkpoint to
    load), done once here: a mistake is raised before torchrun starts, not from a rank."""
    built: dict[tuple, Task] = {}
    for i, config in enumerate(configs):
        with _naming(labels[i] if labels else None):
            if config.preset == "gpu" and config.backend == "gloo":
                raise ValueError(
                    "preset 'gpu' sizes the task for a GPU, and backend 'gloo' trains on the CPU: "
                    "use preset='cpu', or backend='nccl' on a machine with GPUs"
                )
            key = (config.task, config.preset, config.seed, config.scaling)
            with torch.random.fork_rng(devices=[]):  # a task seeds torch; leave the caller's
                if key not in built:
                    built[key] = build_task(config)
                    if config.scaling == "strong":
                        try:
                            built[key].batch(0, 0, config.world_size, torch.device("cpu"))
                        except ValueError as error:  # the sizes are the preset's
                            raise ValueError(f"preset {config.preset!r}: {error}") from None
                make_optimizer(built[key].model, config)
            if config.load_from is not None:
                check_loadable(config)
