"""Training on several processes with PyTorch's own engine: DDP and FSDP2, launched by torchrun.

    from accel import distributed
    run = distributed.launch("accel.distributed:toy_task", nprocs=2, wrapper="ddp", steps=20)
    run.steps    # rank 0's rows, one dict per step: loss (mean over ranks), step_ms, samples/s
    run.ranks    # one dict per rank: throughput, peak memory, parameter + optimizer bytes

A rank trains a :class:`Task`, built alike on every rank from ``(preset, seed)`` by a factory
named ``"module:function"``. :func:`launch` checks every argument, then runs torchrun; a rank's
error is raised here as :class:`RankFailed`. One process with ``wrapper="none"``, the reference
every wrapper must match, trains in this process; :func:`launch_series` trains several runs on
one launch.
"""

from accel.distributed.checkpoint import checkpoint_meta, latest_checkpoint
from accel.distributed.config import COMM_SETTINGS, RunConfig, RunResult
from accel.distributed.costs import allreduce_bytes, fsdp_bytes, state_bytes_per_rank
from accel.distributed.launcher import gpus_present, launch, launch_series
from accel.distributed.processes import process_alive
from accel.distributed.rank import fsdp_units
from accel.distributed.tasks import Task, broken_toy_task, load_task, toy_task
from accel.distributed.torchrun import LauncherNotFound, LaunchError, LaunchTimeout, RankFailed

__all__ = [
    "COMM_SETTINGS",
    "LaunchError",
    "LaunchTimeout",
    "LauncherNotFound",
    "RankFailed",
    "RunConfig",
    "RunResult",
    "Task",
    "allreduce_bytes",
    "broken_toy_task",
    "checkpoint_meta",
    "fsdp_bytes",
    "fsdp_units",
    "gpus_present",
    "latest_checkpoint",
    "launch",
    "launch_series",
    "load_task",
    "process_alive",
    "state_bytes_per_rank",
    "toy_task",
]
