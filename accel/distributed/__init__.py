"""Training on several processes with PyTorch's own engine: DDP and FSDP2, launched by torchrun.

    from accel import distributed
    run = distributed.launch("accel.distributed:toy_task", nprocs=2, wrapper="ddp", steps=20)
    run.steps    # rank 0's rows, one dict per step: loss (mean over ranks), step_ms, samples/s
    run.ranks    # one dict per rank: throughput, peak memory, parameter + optimizer bytes

What a rank trains is a :class:`Task`, built identically on every rank from ``(preset, seed)`` by
a factory named ``"module:function"``. :func:`launch` checks its arguments, then runs
``python -m torch.distributed.run`` (torchrun) as a subprocess, ``--standalone`` on one host, or
on each of ``nnodes`` hosts meeting at node 0's ``rdzv_endpoint`` (see :func:`launch`); every
rank runs :func:`run_rank` (``python -m accel.distributed --config FILE``) and writes its metrics
as JSON to a temporary folder, or, if it raises, its traceback, which :func:`launch` raises as
:class:`RankFailed` once torchrun has ended the other ranks. One process with ``wrapper="none"``
(the reference every wrapper must match) runs in this process by default, with the same metrics.
:func:`launch_series` trains several runs on one launch, each rank running them in order, so
torchrun's start and the ranks' imports are paid once.

Modules, one job each: ``config`` (RunConfig, RunResult, the tuned settings), ``tasks`` (Task, the
toy task), ``costs`` (the byte cost model), ``launcher`` (:func:`launch`, its checks),
``torchrun`` (a run on torchrun, read back), ``failures`` (the cause of a failed run),
``processes`` (ending a run's processes; the watchdog that ends them if the launching process
dies), ``errors``, ``rank`` (what every rank runs), ``wrappers`` (DDP, FSDP2), ``checkpoint``
(DCP saves: N ranks save, M load; the digests of their files, checked before a load unpickles
anything), ``__main__`` (one rank's command line). They import torch and the standard library
only; ``torch.distributed`` is imported when a run needs it.
"""

from accel.distributed.checkpoint import META, checkpoint_meta, latest_checkpoint
from accel.distributed.config import (
    DEFAULT_TASK,
    TUNED_COMM,
    WRAPPERS,
    WRITEUP_NCCL_ENV,
    RunConfig,
    RunResult,
    Scaling,
    Wrapper,
)
from accel.distributed.costs import allreduce_bytes, fsdp_bytes, state_bytes_per_rank
from accel.distributed.errors import LauncherNotFound, LaunchError, LaunchTimeout, RankFailed
from accel.distributed.launcher import gpus_present, launch, launch_series
from accel.distributed.processes import process_alive
from accel.distributed.rank import run_rank
from accel.distributed.tasks import (
    TOY_SIZES,
    Task,
    ToyBlock,
    ToyModel,
    ToySizes,
    broken_toy_task,
    load_task,
    toy_task,
)
from accel.distributed.torchrun import launcher_command
from accel.distributed.wrappers import fsdp_units

__all__ = [
    "DEFAULT_TASK",
    "META",
    "TOY_SIZES",
    "TUNED_COMM",
    "WRAPPERS",
    "WRITEUP_NCCL_ENV",
    "LaunchError",
    "LaunchTimeout",
    "LauncherNotFound",
    "RankFailed",
    "RunConfig",
    "RunResult",
    "Scaling",
    "Task",
    "ToyBlock",
    "ToyModel",
    "ToySizes",
    "Wrapper",
    "allreduce_bytes",
    "broken_toy_task",
    "checkpoint_meta",
    "fsdp_bytes",
    "fsdp_units",
    "gpus_present",
    "latest_checkpoint",
    "launch",
    "launch_series",
    "launcher_command",
    "load_task",
    "process_alive",
    "run_rank",
    "state_bytes_per_rank",
    "toy_task",
]
