"""The entry point, :func:`launch`: every argument checked and the task built once here (bad input
is a ValueError before anything starts), then the run trained in this process or on torchrun
(:mod:`accel.distributed.torchrun`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from accel.distributed.checkpoint import check_loadable, latest_checkpoint
from accel.distributed.config import (
    DEFAULT_TASK,
    WRAPPERS,
    RunConfig,
    RunResult,
    Scaling,
    Wrapper,
)
from accel.distributed.rank import make_optimizer, train
from accel.distributed.tasks import Task, build_task, split_task_name
from accel.distributed.torchrun import launcher_command, run_torchrun


def gpus_present() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(
    task: str = DEFAULT_TASK,
    nprocs: int = 1,
    wrapper: Wrapper = "none",
    *,
    steps: int = 10,
    warmup: int = 2,
    preset: str | None = None,
    seed: int = 0,
    lr: float = 1e-3,
    scaling: Scaling = "strong",
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
    validate: bool = True,
    timeout: float = 600.0,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "accel",
    in_process: bool | None = None,
    launcher: str | Sequence[str] | None = None,
) -> RunResult:
    """Train ``task`` for ``steps`` steps on ``nprocs`` processes (one per GPU with ``nccl``,
    the default when GPUs are present; ``gloo`` on the CPU) and return the measurements.

    ``scaling="strong"`` splits the task's global batch over the ranks (N ranks compute what one
    process computes); ``"weak"`` gives every rank a whole batch (rank r of N takes the task's
    batch of step ``step * N + r``), so the global batch grows with N, as when adding GPUs.
    Communication settings (defaults are torch's; :data:`TUNED_COMM` has them all on): DDP's
    ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``; FSDP2's
    ``reshard_after_forward``; ``mixed_precision="bf16"`` (DDP: bf16 gradient all-reduce, CUDA
    only; FSDP2: parameters gathered and used in bf16, gradients reduced in fp32); ``nccl_env``.
    ``autocast="bf16"`` runs forward and loss under bf16 autocast. ``checkpoint_dir`` saves model
    and optimizer after step ``checkpoint_at`` (default: the last), or with ``checkpoint_every=k``
    after every k-th step into ``checkpoint_dir/step-NNNNNN``; ``load_from`` resumes from such a
    checkpoint at its step (given the directory of several, from the latest complete one).
    Loading a checkpoint unpickles its files, which can run any code: ``load_from`` takes only a
    checkpoint this package saved, every file as its save wrote it (the SHA-256 digests in its
    ``accel-meta.json``), and refuses any other before reading it; anyone able to write a folder
    can write a matching ``accel-meta.json`` too, so load only checkpoints you trust.
    ``warmup`` first steps are left out of the throughput. ``in_process`` (default: for one
    process with ``wrapper="none"``) trains in this process, with the same metrics and no
    ``timeout``. Several hosts (torchrun's names): the same call on each of ``nnodes`` hosts with
    its own ``node_rank``; ``rdzv_endpoint="host:port"``, node 0's address and a free port there
    (it serves the rendezvous); ``rdzv_id``, the job's name. Each host runs ``nprocs`` ranks
    (from ``node_rank * nprocs``; the strong split is over all) and returns its own ranks'
    :class:`RunResult` (losses: means over all ranks; node 0's: rank 0's rows); ``checkpoint_dir``
    must be seen by all hosts at one path. Two hosts, this on 10.0.0.1, node_rank=1 on the other::

        launch(nprocs=8, wrapper="ddp", nnodes=2, node_rank=0, rdzv_endpoint="10.0.0.1:29500")

    Raises before launching, having created nothing: ValueError for bad arguments, a task that
    cannot be built with this preset or split over all ranks, an optimizer setting torch refuses
    (the task and its optimizer are built once here to check), a checkpoint to load that is
    refused or another task's, an unwritable ``checkpoint_dir`` or more processes than GPUs;
    :class:`LauncherNotFound`. After: :class:`RankFailed` with the first failing rank's error
    first, then its traceback; :class:`LaunchError` with torchrun's, if no rank started;
    :class:`LaunchTimeout` after ``timeout`` seconds. Either way, and on Ctrl-C, every process of
    the run (ranks and what they started) is gone when it returns or raises, and so is the
    launch's temporary folder (its TMPDIR); a watchdog ends them if this process dies first.
    """
    arguments = locals()  # every argument but in_process and launcher is a RunConfig field
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    config = _config({k: v for k, v in arguments.items() if k in fields})
    if _in_process(config, in_process):
        return RunResult.from_records(config, [train(config)], output="")
    command = launcher_command(launcher)
    _check_tasks([config])
    with tempfile.TemporaryDirectory(prefix="accel-distributed-") as tmp:
        return run_torchrun([dataclasses.replace(config, out_dir=tmp)], Path(tmp), command)[0]


def _in_process(config: RunConfig, asked: bool | None) -> bool:
    """Whether :func:`launch` trains in this process: as ``asked``, by default for one process
    with ``wrapper="none"``, which is all it can train here."""
    if asked is None:
        return config.world_size == 1 and config.wrapper == "none"
    if asked and (config.wrapper != "none" or config.nnodes != 1):
        raise ValueError(
            f"in_process runs wrapper 'none' on this host only, got wrapper={config.wrapper!r}, "
            f"nnodes={config.nnodes!r}"
        )
    return asked


def launch_series(
    runs: Mapping[str, Mapping[str, Any]],
    task: str = DEFAULT_TASK,
    nprocs: int = 1,
    *,
    launcher: str | Sequence[str] | None = None,
    **common: Any,
) -> dict[str, RunResult]:
    """Several runs on one torchrun launch: every rank trains them in order in one process
    group, so the launch's cost (torchrun and each rank importing torch, the group's setup) is
    paid once. ``runs`` maps a name to that run's :func:`launch` arguments, which update
    ``common``'s; all share ``nprocs``, the backend and ``nccl_env`` (NCCL reads its environment
    once per process: runs with other settings need a launch of their own), and the nodes
    (``nnodes``, ``node_rank``, ``rdzv_endpoint``, ``rdzv_id``: give them in ``common``).

    Returns name -> :class:`RunResult`, in the order of ``runs``. Raises as :func:`launch` does,
    before anything starts for a bad argument (naming the run); a failed run's error names it,
    and the runs after it do not start.
    """
    if not runs:
        raise ValueError("runs must name at least one run (name -> its launch arguments)")
    _check_series_keys("launch_series", common)
    configs = []
    for name, own in runs.items():
        _check_series_keys(f"run {name!r}", own)
        arguments = _LAUNCH_DEFAULTS | {"task": task} | common | dict(own) | {"nprocs": nprocs}
        try:
            configs.append(_config(arguments))
        except ValueError as error:
            raise ValueError(f"run {name!r}: {error}") from None
    shared = {json.dumps(_shared_settings(c), sort_keys=True) for c in configs}
    if len(shared) > 1:
        raise ValueError(
            "the runs of one launch share its processes (NCCL reads its environment once per "
            f"process) and its nodes: their {', '.join(_shared_settings(configs[0]))} must be "
            "equal; launch the others apart"
        )
    command = launcher_command(launcher)
    _check_tasks(configs, labels=list(runs))
    with tempfile.TemporaryDirectory(prefix="accel-distributed-") as tmp:
        folders = [Path(tmp) / f"run{i}" for i in range(len(configs))]
        for folder in folders:
            folder.mkdir()
        placed = [
            dataclasses.replace(c, out_dir=str(f)) for c, f in zip(configs, folders, strict=True)
        ]
        results = run_torchrun(placed, Path(tmp), command, labels=list(runs))
    return dict(zip(runs, results, strict=True))


def _shared_settings(config: RunConfig) -> dict[str, Any]:
    """What the runs of one launch share: its processes' environment and its nodes."""
    names = ("backend", "nccl_env", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id")
    return {name: getattr(config, name) for name in names}


# launch()'s defaults of the run's settings (RunConfig's fields), for launch_series
_LAUNCH_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(launch).parameters.items()
    if name in {f.name for f in dataclasses.fields(RunConfig)}
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
    """The run's config from :func:`launch`'s arguments, each checked, defaults resolved: the
    backend (nccl where GPUs are), the preset (``ACCEL_PRESET``, else by backend), paths."""
    _check_arguments(**arguments)
    _check_nodes(**arguments)
    _check_checkpoints(**arguments)
    _check_task_module(arguments["task"])
    backend = _backend(arguments["backend"], arguments["nprocs"])
    preset = arguments["preset"] or os.environ.get("ACCEL_PRESET")
    checkpoint_dir, load_from = arguments["checkpoint_dir"], arguments["load_from"]
    if load_from is not None:
        load_from = latest_checkpoint(load_from)
    resolved = {
        "backend": backend,
        "preset": preset or ("gpu" if backend == "nccl" else "cpu"),
        "nccl_env": dict(arguments["nccl_env"] or {}),
        "checkpoint_dir": None if checkpoint_dir is None else str(Path(checkpoint_dir).resolve()),
        "load_from": None if load_from is None else str(Path(load_from).resolve()),
    }
    return RunConfig(**arguments | resolved)


def _check_arguments(
    *,
    wrapper: str,
    nprocs: int,
    steps: int,
    warmup: int,
    seed: int,
    scaling: str,
    autocast: str | None,
    mixed_precision: str | None,
    timeout: float,
    bucket_cap_mb: float | None,
    nccl_env: dict[str, str] | None,
    **_: Any,
) -> None:
    if wrapper not in WRAPPERS:
        raise ValueError(f"wrapper must be one of {WRAPPERS}, got {wrapper!r}")
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if wrapper == "none" and nprocs != 1:
        raise ValueError(f"wrapper 'none' trains on one process; got nprocs={nprocs} (use ddp)")
    _check_int("steps", steps, minimum=1)
    _check_int("warmup", warmup, minimum=0)
    _check_int("seed", seed)
    if scaling not in ("strong", "weak"):
        raise ValueError(f"scaling must be 'strong' or 'weak', got {scaling!r}")
    for name, value in (("autocast", autocast), ("mixed_precision", mixed_precision)):
        if value not in (None, "bf16"):
            raise ValueError(f"{name} must be None or 'bf16', got {value!r}")
    if not (_is_number(timeout) and 0 < timeout < math.inf):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if bucket_cap_mb is not None and not (_is_number(bucket_cap_mb) and bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be None or > 0, got {bucket_cap_mb!r}")
    if nccl_env is not None and not (
        isinstance(nccl_env, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in nccl_env.items())
    ):
        raise ValueError(f"nccl_env must map str to str (environment variables), got {nccl_env!r}")


def _check_nodes(
    *,
    wrapper: str,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
    rdzv_id: str,
    **_: Any,
) -> None:
    """One host (``nnodes=1``, torchrun's standalone rendezvous) or several meeting at
    ``rdzv_endpoint``: what each node needs, checked before its agent starts."""
    _check_int("nnodes", nnodes, minimum=1)
    _check_int("node_rank", node_rank, minimum=0)
    if nnodes == 1:
        if node_rank != 0 or rdzv_endpoint is not None:
            raise ValueError(
                f"node_rank and rdzv_endpoint are for nnodes > 1; got nnodes=1, "
                f"node_rank={node_rank}, rdzv_endpoint={rdzv_endpoint!r} (one host meets "
                "itself: leave them out, or give nnodes)"
            )
        return
    if node_rank >= nnodes:
        raise ValueError(f"node_rank must be within 0..nnodes-1={nnodes - 1}, got {node_rank}")
    if wrapper == "none":
        raise ValueError(f"wrapper 'none' trains on one process; got nnodes={nnodes} (use ddp)")
    _check_endpoint(rdzv_endpoint)
    if not (isinstance(rdzv_id, str) and re.fullmatch(r"[\w.-]+", rdzv_id)):
        raise ValueError(
            f"rdzv_id must be a name of letters, digits, '_', '.' or '-' (the same on every "
            f"node), got {rdzv_id!r}"
        )


def _check_endpoint(endpoint: Any) -> None:
    """``"host:port"`` (``"[v6 address]:port"``), the port within 1..65535."""
    host, _, port = endpoint.rpartition(":") if isinstance(endpoint, str) else ("", "", "")
    if not (host.strip("[]") and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(
            "rdzv_endpoint must be 'host:port', the address of node 0 (which serves the "
            f"rendezvous) and a free port there, e.g. '10.0.0.1:29500'; got {endpoint!r}"
        )


def _check_int(name: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        expected = f"an int >= {minimum}" if minimum is not None else "an int"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_checkpoints(
    *,
    steps: int,
    checkpoint_dir: str | os.PathLike | None,
    checkpoint_at: int | None,
    checkpoint_every: int | None,
    **_: Any,
) -> None:
    if checkpoint_at is not None:
        _check_int("checkpoint_at", checkpoint_at)
        if not 1 <= checkpoint_at <= steps:
            raise ValueError(f"checkpoint_at must be within 1..steps={steps}, got {checkpoint_at}")
    if checkpoint_every is not None:
        _check_int("checkpoint_every", checkpoint_every)
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        if checkpoint_dir is None or checkpoint_at is not None:
            raise ValueError(
                "checkpoint_every needs checkpoint_dir (where the step-NNNNNN checkpoints go) and "
                "no checkpoint_at"
            )
    if checkpoint_dir is not None:
        _check_writable(Path(checkpoint_dir))


def _check_writable(directory: Path) -> None:
    """That the first save can make ``directory`` (or write into it), creating nothing: a
    refused launch leaves no folder behind."""
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        why = f"{existing} is not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable"
    else:
        return
    raise ValueError(
        f"checkpoint_dir {directory}: cannot write there ({why}); the run would fail at its "
        "first checkpoint"
    )


def _check_task_module(task: str) -> None:
    module, _ = split_task_name(task)
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        raise ValueError(f"task {task!r}: module {module!r} cannot be found")


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
    """What every rank will do first, done once here: a mistake in the task, its preset, its
    split over the ranks, the optimizer's settings or the checkpoint to load is raised before
    torchrun starts, not from inside a rank (a series' error names its run)."""
    built: dict[tuple, Task] = {}
    for i, config in enumerate(configs):
        try:
            _check_task(config, built)
        except ValueError as error:
            if labels is None:
                raise
            raise ValueError(f"run {labels[i]!r}: {error}") from None


def _check_task(config: RunConfig, built: dict[tuple, Task]) -> None:
    """One run's :func:`_check_tasks`; ``built`` keeps the tasks built so far, by their key."""
    if config.preset == "gpu" and config.backend == "gloo":
        raise ValueError(
            "preset 'gpu' sizes the task for a GPU, and backend 'gloo' trains on the CPU: use "
            "preset='cpu', or backend='nccl' on a machine with GPUs"
        )
    key = (config.task, config.preset, config.seed, config.scaling)
    with torch.random.fork_rng(devices=[]):  # a task seeds torch; leave the caller's alone
        if key not in built:
            built[key] = build_task(config)
            if config.scaling == "strong":
                built[key].batch(0, 0, config.world_size, torch.device("cpu"))
        make_optimizer(built[key].model, config)
    if config.load_from is not None:
        check_loadable(config)
