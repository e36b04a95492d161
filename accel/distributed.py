"""Training on several processes with PyTorch's own engine: DDP and FSDP2, launched by torchrun.

    from accel import distributed
    run = distributed.launch("accel.distributed:toy_task", nprocs=2, wrapper="ddp", steps=20)
    run.steps    # rank 0's rows, one per step: loss (mean over ranks), step_ms, samples/s
    run.ranks    # one row per rank: throughput, peak memory, parameter + optimizer bytes

What a rank trains is a :class:`Task`, built identically on every rank from ``(preset, seed)`` by
a factory named ``"module:function"``. :func:`launch` checks its arguments, then runs
``python -m torch.distributed.run --standalone`` (torchrun) as a subprocess; every rank runs
:func:`run_rank` (``python -m accel.distributed --config FILE``) and writes its metrics as JSON to
a temporary folder, or, if it raises, its traceback, which :func:`launch` raises as
:class:`RankFailed` once torchrun has ended the other ranks. One process with ``wrapper="none"``
(the reference every wrapper must match) runs in this process by default, with the same metrics.

Wrappers: ``none`` (plain module, one process), ``ddp`` (every rank holds the whole model, gradients
are all-reduced in buckets during the backward), ``fsdp2`` (``fully_shard`` on every block of each
``nn.ModuleList`` and on the root: parameters, gradients and optimizer state are split over the
ranks and gathered block by block). Checkpoints go through ``torch.distributed.checkpoint`` with
``get_state_dict``/``set_state_dict``, which name tensors by their unwrapped names: a save on N
ranks loads on M, and a DDP save loads into FSDP2 and back.

This module imports torch, the standard library and :mod:`accel.processes` (which ends a run's
processes) only; ``torch.distributed`` and pandas are imported when a run needs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from accel.processes import end_run
from accel.processes import process_alive as process_alive  # public here too

Wrapper = Literal["none", "ddp", "fsdp2"]
WRAPPERS: tuple[str, ...] = ("none", "ddp", "fsdp2")
Scaling = Literal["strong", "weak"]

# The write-up's "Phase 1" NCCL settings (scripts/vast_launch.py). Within one NVLink host only
# NCCL_MIN_NCHANNELS can change anything: the socket settings are for TCP transport between hosts,
# and P2P/IB "disable=0" are NCCL's defaults already.
WRITEUP_NCCL_ENV: dict[str, str] = {
    "NCCL_NSOCKS_PERTHREAD": "4",
    "NCCL_SOCKET_NTHREADS": "2",
    "NCCL_MIN_NCHANNELS": "4",
    "NCCL_P2P_DISABLE": "0",
    "NCCL_IB_DISABLE": "0",
}
# The communication settings, all at once: ``launch(..., **TUNED_COMM)``. Each wrapper uses its own.
TUNED_COMM: dict[str, Any] = {
    "bucket_cap_mb": 100,  # DDP: fewer, larger all-reduces (default 25 MB)
    "gradient_as_bucket_view": True,  # DDP: gradients live in the buckets, no copy in or out
    "static_graph": True,  # DDP: the same parameters get gradients every step
    "reshard_after_forward": False,  # FSDP2: keep gathered blocks for the backward (more memory)
    "mixed_precision": "bf16",  # DDP: bf16 gradients (CUDA); FSDP2: bf16 parameter gathers
    "nccl_env": WRITEUP_NCCL_ENV,
}
DEFAULT_TASK = "accel.distributed:toy_task"


@dataclass
class Task:
    """What a rank trains: built identically on every rank from (preset, seed)."""

    model: torch.nn.Module  # on CPU, seeded init (same on every rank)
    batch: Callable[[int, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]
    #       (step, rank, world_size, device) -> (inputs, targets) of this rank's share
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (model(inputs), targets) -> scalar
    validate: Callable[[torch.nn.Module, torch.device], float] | None = None  # held-out error


# ---------------------------------------------------------------------------------------------
# The built-in toy task: a residual MLP over tokens, learning a fixed random function.


@dataclass(frozen=True)
class ToySizes:
    features: int
    width: int
    depth: int
    tokens: int
    batch: int  # global batch, split evenly over the ranks
    outputs: int


TOY_SIZES = {
    "cpu": ToySizes(features=16, width=32, depth=2, tokens=4, batch=8, outputs=4),
    # 67M parameters, 16k tokens per step: tens of milliseconds of bf16 work per GPU
    "gpu": ToySizes(features=256, width=1024, depth=8, tokens=512, batch=32, outputs=256),
}


class ToyBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class ToyModel(nn.Module):
    def __init__(self, sizes: ToySizes):
        super().__init__()
        self.embed = nn.Linear(sizes.features, sizes.width)
        self.blocks = nn.ModuleList(ToyBlock(sizes.width) for _ in range(sizes.depth))
        self.head = nn.Linear(sizes.width, sizes.outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, features) -> (B, T, outputs)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def toy_task(preset: str, seed: int) -> Task:
    """A small residual MLP fitting ``sin(x @ W)`` for a fixed random ``W``; data from (seed, step)."""
    if preset not in TOY_SIZES:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(TOY_SIZES)}")
    sizes = TOY_SIZES[preset]
    torch.manual_seed(seed)
    model = ToyModel(sizes)
    # scaled so that x @ teacher has unit variance: a smooth function, learnable in tens of steps
    teacher = torch.randn(sizes.features, sizes.outputs, generator=_generator(seed, -1))
    teacher /= sizes.features**0.5

    def examples(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # drawn from (seed, step) on the given device: every rank draws the same global batch
        g = _generator(seed, step, device)
        x = torch.randn(sizes.batch, sizes.tokens, sizes.features, generator=g, device=device)
        return x, torch.sin(x @ teacher.to(device))

    def batch(step: int, rank: int, world: int, device: torch.device):
        if sizes.batch % world:
            raise ValueError(f"global batch {sizes.batch} does not split over {world} ranks")
        x, y = examples(step, device)
        share = sizes.batch // world
        return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]

    def validate(model: nn.Module, device: torch.device) -> float:
        x, y = examples(10**9, device)  # a step no run reaches: held out
        with torch.no_grad():
            error = torch.linalg.vector_norm(model(x).float() - y) / torch.linalg.vector_norm(y)
        return error.item()  # sync: once, after training

    return Task(model, batch, torch.nn.functional.mse_loss, validate)


def broken_toy_task(preset: str, seed: int) -> Task:
    """:func:`toy_task` whose rank 1 raises at step 1 (rank 0 then waits in a collective): shows
    how a failing rank surfaces."""
    task = toy_task(preset, seed)
    healthy = task.batch

    def batch(step: int, rank: int, world: int, device: torch.device):
        if rank == 1 and step == 1:
            raise ValueError("broken_toy_task: rank 1 fails on purpose at step 1")
        return healthy(step, rank, world, device)

    return dataclasses.replace(task, batch=batch)


def _generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + step + 1)


def load_task(name: str) -> Callable[[str, int], Task]:
    """The factory named ``"module:function"``."""
    module, function = _split_task_name(name)
    factory = getattr(importlib.import_module(module), function, None)
    if not callable(factory):
        raise ValueError(f"task {name!r}: module {module!r} has no function {function!r}")
    return factory


def _split_task_name(name: str) -> tuple[str, str]:
    module, sep, function = str(name).partition(":")
    if not (sep and module and function):
        raise ValueError(f"task must be named 'module:function', got {name!r}")
    return module, function


# ---------------------------------------------------------------------------------------------
# The cost model the notebook teaches with.


def allreduce_bytes(grad_bytes: float, world: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``grad_bytes``: a
    reduce-scatter then an all-gather, each moving (N-1)/N of the buffer."""
    return 2 * (world - 1) / world * grad_bytes


def fsdp_bytes(param_bytes: float, world: int, *, reshard_after_forward: bool = True) -> float:
    """Bytes each rank sends per FSDP step: all-gather the parameters for the forward (and again
    for the backward if they were resharded), reduce-scatter the gradients; (N-1)/N each."""
    passes = (2 if reshard_after_forward else 1) + 1
    return passes * (world - 1) / world * param_bytes


def state_bytes_per_rank(
    param_count: int,
    world: int,
    wrapper: str,
    *,
    bytes_per_value: int = 4,
    optimizer_values: int = 2,
    grads: bool = False,
) -> float:
    """Parameters + optimizer state (AdamW: two moments per value) [+ gradients] held by each
    rank: all of it under DDP, 1/N of it under FSDP2."""
    total = param_count * bytes_per_value * (1 + optimizer_values + int(grads))
    return total / world if wrapper == "fsdp2" else total


# ---------------------------------------------------------------------------------------------
# Launching


class LaunchError(RuntimeError):
    """The run could not start, or ended without results."""


class LauncherNotFound(LaunchError):
    """Neither torchrun nor ``torch.distributed.run`` can be run here."""


class LaunchTimeout(LaunchError):
    """The run took longer than ``timeout``; every process of it was killed."""


class RankFailed(LaunchError):
    """A rank raised (or died): ``rank``, its ``traceback``, and the launcher's ``output``."""

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


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs, written as JSON for the ranks to read."""

    task: str = DEFAULT_TASK
    wrapper: str = "none"
    nprocs: int = 1
    steps: int = 10
    warmup: int = 2
    preset: str = "cpu"
    seed: int = 0
    lr: float = 1e-3
    scaling: str = "strong"
    backend: str = "gloo"
    autocast: str | None = None
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    reshard_after_forward: bool = True
    mixed_precision: str | None = None
    nccl_env: dict[str, str] = field(default_factory=dict)
    checkpoint_dir: str | None = None
    checkpoint_at: int | None = None
    checkpoint_every: int | None = None
    load_from: str | None = None
    validate: bool = True
    timeout: float = 600.0
    out_dir: str = ""

    @property
    def comm_tuned(self) -> bool:
        """Whether any communication setting differs from torch's defaults."""
        default = RunConfig()
        return any(getattr(self, k) != getattr(default, k) for k in TUNED_COMM)


@dataclass
class RunResult:
    """A finished run. ``steps``: rank 0's per-step rows (a DataFrame); ``ranks``: every rank's
    summary (a DataFrame, one row per rank)."""

    config: RunConfig
    steps: Any
    ranks: Any
    output: str = ""
    pids: tuple[int, ...] = ()

    @property
    def summary(self) -> dict[str, Any]:
        """Rank 0's summary."""
        return self.ranks.iloc[0].to_dict()


def gpus_present() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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
    ``warmup`` first steps are left out of the throughput. ``in_process`` (default: for one
    process with ``wrapper="none"``) trains in this process, with the same metrics and no
    ``timeout``.

    Raises before launching: ValueError for bad arguments, a task that cannot be built with this
    preset or split over ``nprocs`` ranks (it is built once here to check), an unwritable
    ``checkpoint_dir`` or more processes than GPUs; :class:`LauncherNotFound`. After:
    :class:`RankFailed` with the first failing rank's error in its first line, then its
    traceback; :class:`LaunchTimeout` after ``timeout`` seconds. Either way, and on Ctrl-C, every
    process of the run (ranks and what they started) is gone when it returns or raises.
    """
    if wrapper not in WRAPPERS:
        raise ValueError(f"wrapper must be one of {WRAPPERS}, got {wrapper!r}")
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if wrapper == "none" and nprocs != 1:
        raise ValueError(f"wrapper 'none' trains on one process; got nprocs={nprocs} (use ddp)")
    if steps < 1 or warmup < 0:
        raise ValueError(f"expected steps >= 1 and warmup >= 0, got {steps=} {warmup=}")
    if scaling not in ("strong", "weak"):
        raise ValueError(f"scaling must be 'strong' or 'weak', got {scaling!r}")
    for name, value in (("autocast", autocast), ("mixed_precision", mixed_precision)):
        if value not in (None, "bf16"):
            raise ValueError(f"{name} must be None or 'bf16', got {value!r}")
    if checkpoint_at is not None and not 1 <= checkpoint_at <= steps:
        raise ValueError(f"checkpoint_at must be within 1..steps={steps}, got {checkpoint_at}")
    if checkpoint_every is not None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        if checkpoint_dir is None or checkpoint_at is not None:
            raise ValueError(
                "checkpoint_every needs checkpoint_dir (where the step-NNNNNN checkpoints go) and "
                "no checkpoint_at"
            )
    if checkpoint_dir is not None:
        _check_writable(Path(checkpoint_dir))
    module, _ = _split_task_name(task)
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        raise ValueError(f"task {task!r}: module {module!r} cannot be found")
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
    if load_from is not None:
        load_from = latest_checkpoint(load_from)
    config = RunConfig(
        task=task,
        wrapper=wrapper,
        nprocs=nprocs,
        steps=steps,
        warmup=warmup,
        preset=preset or os.environ.get("ACCEL_PRESET") or ("gpu" if backend == "nccl" else "cpu"),
        seed=seed,
        lr=lr,
        scaling=scaling,
        backend=backend,
        autocast=autocast,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        reshard_after_forward=reshard_after_forward,
        mixed_precision=mixed_precision,
        nccl_env=dict(nccl_env or {}),
        checkpoint_dir=None if checkpoint_dir is None else str(Path(checkpoint_dir).resolve()),
        checkpoint_at=checkpoint_at,
        checkpoint_every=checkpoint_every,
        load_from=None if load_from is None else str(Path(load_from).resolve()),
        validate=validate,
        timeout=timeout,
    )
    if in_process is None:
        in_process = nprocs == 1 and wrapper == "none"
    if in_process:
        if wrapper != "none":
            raise ValueError(f"in_process runs wrapper 'none' only, got {wrapper!r}")
        record = _train(config, rank=0, world=1, local_rank=0, distributed=False)
        return _result(config, [record], output="")
    command = launcher_command(launcher)
    _check_task(config)
    with tempfile.TemporaryDirectory(prefix="accel-distributed-") as tmp:
        config = dataclasses.replace(config, out_dir=tmp)
        return _run_torchrun(config, command)


def _check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ValueError(
            f"checkpoint_dir {directory}: cannot write there ({e.strerror or e}); the run would "
            "fail at its first checkpoint"
        ) from None


def _check_task(config: RunConfig) -> None:
    """What every rank will do first, done once here: a mistake in the task, its preset or its
    split over the ranks is raised before torchrun starts, not from inside a rank."""
    if config.preset == "gpu" and config.backend == "gloo":
        raise ValueError(
            "preset 'gpu' sizes the task for a GPU, and backend 'gloo' trains on the CPU: use "
            "preset='cpu', or backend='nccl' on a machine with GPUs"
        )
    with torch.random.fork_rng(devices=[]):  # a task seeds torch; leave the caller's alone
        task = _build_task(config)
        if config.scaling == "strong":
            task.batch(0, 0, config.nprocs, torch.device("cpu"))


def _build_task(config: RunConfig) -> Task:
    task = load_task(config.task)(config.preset, config.seed)
    if not isinstance(task, Task):
        raise TypeError(
            f"task factory {config.task!r} must return accel.distributed.Task, "
            f"got {type(task).__name__}"
        )
    return task


def _run_torchrun(config: RunConfig, command: list[str]) -> RunResult:
    out = Path(config.out_dir)
    config_path = out / "config.json"
    config_path.write_text(json.dumps(dataclasses.asdict(config)))
    command = [
        *command,
        "--standalone",
        "--nproc-per-node",
        str(config.nprocs),
        "-m",
        "accel.distributed",
        "--config",
        str(config_path),
    ]
    env = dict(os.environ)
    env.update(config.nccl_env)
    # Ranks must import accel and the task's module as this process does.
    paths = [str(Path(__file__).resolve().parents[1]), os.getcwd(), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # torchrun would set 1 and print a banner about it; share the cores instead
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.nprocs)))
    env["PYTHONUNBUFFERED"] = "1"
    log_path = out / "launcher.log"
    with open(log_path, "wb") as log:
        # Its own session: on a timeout the whole group is killed, torchrun and all.
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            exitcode = proc.wait(timeout=config.timeout)
        except subprocess.TimeoutExpired:
            end_run(proc, str(config_path), _rank_pids(out).values())
            raise LaunchTimeout(
                f"{config.wrapper} x{config.nprocs} of {config.task} ran past timeout="
                f"{config.timeout:g} s; every process was killed. Output ends with:\n"
                + _tail(log_path)
            ) from None
        except BaseException:  # e.g. KeyboardInterrupt in a notebook: leave nothing behind
            end_run(proc, str(config_path), _rank_pids(out).values())
            raise
    # torchrun ends the other ranks when one fails; make sure nothing of the run is left
    pids = _rank_pids(out)
    end_run(proc, str(config_path), _rank_pids(out).values())
    output = log_path.read_text(errors="replace")
    paths = [out / f"rank{rank}.json" for rank in range(config.nprocs)]
    finished = all(p.is_file() for p in paths) and not any(out.glob("rank*.error.json"))
    if exitcode != 0 and not finished:
        raise _rank_failure(config, out, output, exitcode, pids)
    if not finished:
        missing = [p.stem for p in paths if not p.is_file()]
        raise LaunchError(
            f"torchrun exited 0 but {', '.join(missing)} wrote no results; output:\n{output[-4000:]}"
        )
    if exitcode != 0:  # every rank had written its results: a crash on the way out
        warnings.warn(
            f"torchrun exited {exitcode} after every rank wrote its results; they are returned. "
            f"Output ends with:\n{output[-1500:]}",
            stacklevel=3,
        )
    records = [json.loads(p.read_text()) for p in paths]
    return _result(config, records, output=output, pids=tuple(pids.values()))


def _rank_failure(
    config: RunConfig, out: Path, output: str, exitcode: int, pids: dict[int, int]
) -> RankFailed:
    """The failing rank's error, its cause in the first line: a rank that died without a Python
    error (killed, out of memory, crashed) when torchrun saw one first, else the first rank that
    raised; the other ranks' errors, mostly consequences, after."""
    errors = sorted(
        (json.loads(p.read_text()) for p in out.glob("rank*.error.json")), key=lambda e: e["time"]
    )
    what = f"{config.wrapper} x{config.nprocs} of {config.task}"
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
        f"rank {e['rank']}: {e['type']}: {e['message'].splitlines()[0][:200] if e['message'] else ''}"
        for e in errors
    ]
    if not errors or killed:
        who = f"rank {died} of {config.nprocs}" if died is not None else "a rank"
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
        f"rank {first['rank']} of {config.nprocs} raised {first['type']}"
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


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _rank_pids(out: Path) -> dict[int, int]:
    pids = {}
    for path in out.glob("rank*.pid"):
        try:
            pids[int(path.stem.removeprefix("rank"))] = int(path.read_text())
        except ValueError:
            continue  # written as we read it: that rank started after the end, never ran
    return dict(sorted(pids.items()))


def _result(
    config: RunConfig, records: list[dict], *, output: str, pids: tuple[int, ...] = ()
) -> RunResult:
    import pandas as pd

    steps = pd.DataFrame(records[0]["steps"])
    ranks = pd.DataFrame([r["summary"] for r in records])
    return RunResult(config, steps, ranks, output=output, pids=pids)


# ---------------------------------------------------------------------------------------------
# What every rank runs


def run_rank(config: RunConfig) -> dict:
    """One rank's whole run under torchrun (reads RANK, WORLD_SIZE, LOCAL_RANK); writes its
    record, or its traceback, to ``config.out_dir``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(config.out_dir)
    _write_atomic(out / f"rank{rank}.pid", str(os.getpid()))
    try:
        record = _train(
            config,
            rank=rank,
            world=world,
            local_rank=int(os.environ["LOCAL_RANK"]),
            distributed=True,
        )
    except BaseException as error:
        failure = {
            "rank": rank,
            "time": time.time(),
            "pid": os.getpid(),
            "type": type(error).__name__,
            "message": str(error),
            "traceback": traceback.format_exc(),
        }
        _write_atomic(out / f"rank{rank}.error.json", json.dumps(failure))
        raise
    _write_atomic(out / f"rank{rank}.json", json.dumps(record))
    return record


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def _train(config: RunConfig, *, rank: int, world: int, local_rank: int, distributed: bool) -> dict:
    device = torch.device("cuda", local_rank) if config.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import torch.distributed as dist

    if distributed:
        dist.init_process_group(config.backend, timeout=datetime.timedelta(seconds=config.timeout))
    record = _train_steps(config, rank, world, device, distributed)
    if distributed:  # only after success: with a collective in flight it could wait forever
        dist.destroy_process_group()
    return record


def _train_steps(
    config: RunConfig, rank: int, world: int, device: torch.device, distributed: bool
) -> dict:
    task = _build_task(config)
    model, notes = _wrap(task.model.to(device), config, device, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    start = _load(model, optimizer, config) if config.load_from else 0
    save_at = (
        (config.checkpoint_at or config.steps)
        if config.checkpoint_dir and not config.checkpoint_every
        else None
    )
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if config.autocast == "bf16"
        else nullcontext()
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batches = _staged_batches(task, config, rank, world, start, device)
    clock = _Clock(device)
    losses, samples = [], []
    for i, (host_inputs, host_targets) in enumerate(batches):
        step = start + i
        clock.start()
        inputs = host_inputs.to(device, non_blocking=True)
        targets = host_targets.to(device, non_blocking=True)
        with autocast:
            loss = task.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.stop()
        losses.append(loss.detach().float())
        samples.append(inputs.shape[0])
        if save_at == i + 1:
            _save(model, optimizer, config, step + 1, rank, world, Path(config.checkpoint_dir))
        elif config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            directory = Path(config.checkpoint_dir) / f"step-{step + 1:06d}"
            _save(model, optimizer, config, step + 1, rank, world, directory)
    step_ms = clock.times_ms()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else math.nan
    param_count = sum(p.numel() for p in model.parameters())  # DTensors count globally
    allreduce_ms = _time_allreduce(param_count, device) if distributed and world > 1 else math.nan
    local_loss = torch.stack(losses)
    mean_loss, global_samples = local_loss.clone(), torch.tensor(samples, device=device)
    if distributed and world > 1:
        import torch.distributed as dist

        dist.all_reduce(mean_loss)  # means of equal shares: their mean is the global mean
        mean_loss /= world
        dist.all_reduce(global_samples)
    validation = math.nan
    if config.validate and task.validate is not None:
        # DDP: the plain module, no collectives. FSDP2: every rank runs it (it gathers weights).
        plain = model.module if config.wrapper == "ddp" else model
        validation = float(task.validate(plain, device))
    mean_loss, local_loss = mean_loss.tolist(), local_loss.tolist()  # sync: once, at the end
    global_samples = global_samples.tolist()
    timed = slice(config.warmup, None) if config.steps > config.warmup else slice(None)
    median_ms = statistics.median(step_ms[timed])
    samples_per_step = statistics.median(global_samples[timed])
    # Throughput over the whole timed window, gaps between steps included: a rank that waits
    # for a slower one (its collectives do) shows it here, where a median step could hide it.
    window_ms = clock.span_ms(timed.start or 0)
    samples_per_s = sum(global_samples[timed]) / (window_ms / 1e3) if window_ms > 0 else math.nan
    params, optim = _state_bytes(model, optimizer)
    rows = [
        {
            "step": start + i,
            "loss": mean_loss[i],
            "local_loss": local_loss[i],
            "step_ms": step_ms[i],
            "samples": global_samples[i],
            "samples_per_s": global_samples[i] / (step_ms[i] / 1e3) if step_ms[i] > 0 else math.nan,
            "warmup": i < config.warmup and config.steps > config.warmup,
        }
        for i in range(config.steps)
    ]
    summary = {
        "rank": rank,
        "world_size": world,
        "wrapper": config.wrapper,
        "backend": config.backend if distributed else "none",
        "device": _device_name(device),
        "scaling": config.scaling,
        "comm_tuned": config.comm_tuned,
        "steps": config.steps,
        "start_step": start,
        "median_step_ms": median_ms,
        "samples_per_step": samples_per_step,
        "window_ms": window_ms,
        "samples_per_s": samples_per_s,
        "final_loss": mean_loss[-1],
        "validation_error": validation,
        "param_count": param_count,
        "param_bytes": params,
        "optimizer_bytes": optim,
        "state_bytes": params + optim,
        "peak_memory_bytes": peak,
        # one all-reduce of every gradient (fp32), alone: what DDP would wait for unoverlapped
        "allreduce_ms": allreduce_ms,
        "allreduce_gb_s": allreduce_bytes(4 * param_count, world) / allreduce_ms / 1e6,
        "max_rss_bytes": _max_rss_bytes(),
        "notes": "; ".join(notes),
        "pid": os.getpid(),
    }
    return {"summary": summary, "steps": rows}


class _Clock:
    """Per-step times: CUDA events on a GPU (read once, at the end), the host clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def _mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    start = stop = _mark

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
        return [self._ms(a, b) for a, b in zip(self.marks[::2], self.marks[1::2], strict=True)]

    def span_ms(self, first_step: int) -> float:
        """From the start of step ``first_step`` to the end of the last step (call after
        :meth:`times_ms`, which waits for the device)."""
        return self._ms(self.marks[2 * first_step], self.marks[-1])


def _staged_batches(
    task: Task, config: RunConfig, rank: int, world: int, start: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's batch, made on the host before the first step (in pinned memory on a GPU,
    copied in each step without blocking): what a loader that keeps up delivers. Made inside
    the loop, a rank's sample generation (milliseconds on the CPU) would stall the others at
    the next collective and be counted as communication (seen on two H200s: DDP at 1.17x)."""
    host = torch.device("cpu")
    batches = []
    for i in range(config.steps):
        step = start + i
        if config.scaling == "weak":  # every rank a whole batch of its own
            pair = task.batch(step * world + rank, 0, 1, host)
        else:
            pair = task.batch(step, rank, world, host)
        if device.type == "cuda":
            pair = tuple(t.pin_memory() for t in pair)
        batches.append(pair)
    return batches


def _time_allreduce(numel: int, device: torch.device, repeats: int = 5) -> float:
    """Median time of an all-reduce of ``numel`` fp32 values, after one warm-up."""
    import torch.distributed as dist

    buffer = torch.ones(numel, device=device)
    dist.all_reduce(buffer)  # connections and NCCL channels are set up on first use
    clock = _Clock(device)
    for _ in range(repeats):
        clock.start()
        dist.all_reduce(buffer)
        clock.stop()
    return statistics.median(clock.times_ms())


def _wrap(
    model: nn.Module, config: RunConfig, device: torch.device, world: int
) -> tuple[nn.Module, list[str]]:
    notes: list[str] = []
    if config.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        options: dict[str, Any] = {
            "gradient_as_bucket_view": config.gradient_as_bucket_view,
            "static_graph": config.static_graph,
        }
        if config.bucket_cap_mb is not None:
            options["bucket_cap_mb"] = config.bucket_cap_mb
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **options)
        if config.mixed_precision == "bf16":
            if config.backend == "nccl":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
            else:
                notes.append("bf16 gradient all-reduce skipped: torch's hook needs NCCL")
                warnings.warn(
                    "DDP mixed_precision='bf16' skipped: the bf16 all-reduce hook needs NCCL "
                    f"on CUDA; this run uses {config.backend}, gradients go in fp32",
                    stacklevel=2,
                )
        return ddp, notes
    if config.wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if config.mixed_precision == "bf16"
            else MixedPrecisionPolicy()
        )
        options = {
            "mesh": mesh,
            "reshard_after_forward": config.reshard_after_forward,
            "mp_policy": policy,
        }
        units = fsdp_units(model)
        for unit in units:
            fully_shard(unit, **options)
        fully_shard(model, **options)
        notes.append(f"fully_shard on {len(units)} blocks + root")
        return model, notes
    return model, notes


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: every element of every ``nn.ModuleList`` (the
    transformer blocks), innermost first; what is left is sharded with the root."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            found += [(name.count(".") + 1, child) for child in module]
    return [m for _, m in sorted(found, key=lambda pair: -pair[0])]


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    return local.numel() * local.element_size()


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes this rank holds of the parameters and of the optimizer state."""
    params = sum(_local_bytes(p) for p in model.parameters())
    optim = sum(
        _local_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return params, optim


def _max_rss_bytes() -> float:
    try:
        import resource
    except ImportError:
        return math.nan
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---------------------------------------------------------------------------------------------
# Checkpoints: DCP, named by the unwrapped module's names, so N ranks save and M ranks load.

META = "accel-meta.json"


def _save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: RunConfig,
    step: int,
    rank: int,
    world: int,
    directory: Path,
) -> None:
    """A DCP checkpoint into ``directory``; its meta file, written last, marks it complete."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    if rank == 0:
        meta = {
            "task": config.task,
            "preset": config.preset,
            "seed": config.seed,
            "wrapper": config.wrapper,
            "world_size": world,
            "step": step,
        }
        _write_atomic(directory / META, json.dumps(meta))


def _load(model: nn.Module, optimizer: torch.optim.Optimizer, config: RunConfig) -> int:
    """Load ``config.load_from`` into the (wrapped) model and optimizer; returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = checkpoint_meta(config.load_from)
    for key in ("task", "preset"):
        if meta[key] != getattr(config, key):
            raise ValueError(
                f"checkpoint {config.load_from} was saved by {key} {meta[key]!r}; this run has "
                f"{key} {getattr(config, key)!r}"
            )
    model_state, optim_state = get_state_dict(model, optimizer)  # shapes and shards to fill
    state = {"model": model_state, "optim": optim_state}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=config.load_from)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(meta["step"])


def latest_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` if it is a complete checkpoint, else the complete ``step-NNNNNN`` checkpoint
    under it with the highest step (one interrupted while saving has no meta file yet)."""
    path = Path(path)
    if (path / ".metadata").is_file() and (path / META).is_file():
        return path
    steps = [p for p in path.glob("step-*") if (p / ".metadata").is_file() and (p / META).is_file()]
    if not steps:
        raise ValueError(
            f"load_from={str(path)!r} holds no complete DCP checkpoint (no .metadata and {META}, "
            "there or in a step-NNNNNN directory under it)"
        )
    return max(steps, key=lambda p: checkpoint_meta(p)["step"])


def checkpoint_meta(path: str | os.PathLike) -> dict:
    """What saved a checkpoint: task, preset, seed, wrapper, world_size and step."""
    meta = Path(path) / META
    if not meta.is_file():
        raise ValueError(f"{path} was not saved by accel.distributed (no {META})")
    return json.loads(meta.read_text())


@contextlib.contextmanager
def _single_process_quiet():
    # DCP warns that it assumes one process when no process group exists: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="one rank of accel.distributed.launch")
    parser.add_argument("--config", required=True, help="the run's config.json")
    args = parser.parse_args(argv)
    # Run the importable module's code, not this __main__ copy: tasks build accel.distributed.Task.
    from accel import distributed

    fields = json.loads(Path(args.config).read_text())
    try:
        distributed.run_rank(distributed.RunConfig(**fields))
        code = 0
    except BaseException:
        traceback.print_exc()  # into torchrun's output too; the error file has it already
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: the results are written, and gloo's worker threads can
    # abort it ("terminate called without an active exception", SIGABRT) after a clean run.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
