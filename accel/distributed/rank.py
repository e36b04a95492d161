"""What every rank runs (:func:`run_rank` under torchrun, :func:`train` in the launching process):
its model wrapped (``ddp``: every rank holds the whole model, gradients all-reduced in buckets
during the backward; ``fsdp2``: ``fully_shard`` on every block of each ``nn.ModuleList`` and the
root, parameters, gradients and optimizer state split over the ranks), the timed steps and the
rank's measurements, a record of plain JSON ``{"summary", "steps"}``."""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel.distributed.checkpoint import load, save
from accel.distributed.config import RunConfig
from accel.distributed.costs import allreduce_bytes
from accel.distributed.tasks import Task, build_task
from accel.files import write_text_atomic


def run_rank(configs: Sequence[RunConfig], out: Path) -> list[dict]:
    """One rank's runs in one process group: each run's record (or error) written to its
    ``out_dir``, this process's pid to ``out``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    write_text_atomic(out / f"rank{rank}.pid", str(os.getpid()))
    device = _device(configs[0], int(os.environ["LOCAL_RANK"]))
    import torch.distributed as dist

    records, config = [], configs[0]
    try:
        if world != config.world_size:  # before the group: every node fails at once, none waits
            raise ValueError(
                f"this node launched nnodes={config.nnodes} x nprocs={config.nprocs} ranks, but "
                f"torchrun made a world of {world}: every node must launch the same nnodes and "
                "nprocs"
            )
        timeout = datetime.timedelta(seconds=max(c.timeout for c in configs))
        dist.init_process_group(config.backend, timeout=timeout)
        for config in configs:
            records.append(_train_steps(config, rank, world, device, distributed=True))
            write_text_atomic(Path(config.out_dir) / f"rank{rank}.json", json.dumps(records[-1]))
    except BaseException as error:
        failure = dict(rank=rank, time=time.time(), pid=os.getpid(), type=type(error).__name__)
        failure |= dict(message=str(error), traceback=traceback.format_exc())
        write_text_atomic(Path(config.out_dir) / f"rank{rank}.error.json", json.dumps(failure))
        raise
    # only after success: with a collective in flight it could wait forever
    dist.destroy_process_group()
    return records


def train(config: RunConfig) -> dict:
    """One plain process's run, here: the record a rank would write."""
    return _train_steps(config, 0, 1, _device(config, 0), distributed=False)


def make_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    """The run's optimizer (the launcher builds one to have torch check its settings)."""
    return torch.optim.AdamW(model.parameters(), lr=config.lr)


def _device(config: RunConfig, local_rank: int) -> torch.device:
    """This rank's GPU with nccl (made current), else the CPU."""
    if config.backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def _train_steps(
    config: RunConfig, rank: int, world: int, device: torch.device, *, distributed: bool
) -> dict:
    """The task built, wrapped and loaded if asked, trained for ``config.steps`` steps, measured."""
    task = build_task(config)
    model, notes = wrap(task.model.to(device), config, device, world)
    optimizer = make_optimizer(model, config)
    start = load(model, optimizer, config) if config.load_from else 0
    clock, losses, samples = _run_steps(
        task, model, optimizer, config, start=start, rank=rank, world=world, device=device
    )
    step_ms = clock.times_ms()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else math.nan
    param_count = sum(p.numel() for p in model.parameters())  # DTensors count globally
    local_loss = torch.stack(losses)
    mean_loss, global_samples = local_loss.clone(), torch.tensor(samples, device=device)
    allreduce_ms = math.nan
    if world > 1:
        import torch.distributed as dist

        allreduce_ms = _time_allreduce(param_count, device)
        dist.all_reduce(mean_loss)  # means of equal shares: their mean is the global mean
        mean_loss /= world
        dist.all_reduce(global_samples)
    validation = _validation(task, model, config, device)
    per_step = {  # sync: once, at the end
        "loss": mean_loss.tolist(),
        "local_loss": local_loss.tolist(),
        "step_ms": step_ms,
        "samples": global_samples.tolist(),
    }
    params, optim = _state_bytes(model, optimizer)
    summary = {
        "rank": rank,
        "world_size": world,
        "wrapper": config.wrapper,
        "backend": config.backend if distributed else "none",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "scaling": config.scaling,
        "steps": config.steps,
        "start_step": start,
        **_throughput(config, clock, step_ms, per_step["samples"]),
        "final_loss": per_step["loss"][-1],
        "validation_error": validation,
        "param_count": param_count,
        "param_bytes": params,
        "optimizer_bytes": optim,
        "state_bytes": params + optim,
        "peak_memory_bytes": peak,
        # one all-reduce of every gradient (fp32), alone: what DDP would wait for unoverlapped
        "allreduce_ms": allreduce_ms,
        "allreduce_gb_s": allreduce_bytes(4 * param_count, world) / allreduce_ms / 1e6,
        "notes": "; ".join(notes),
        "pid": os.getpid(),
    }
    return {"summary": summary, "steps": _step_rows(config, start, per_step)}


def wrap(
    model: nn.Module, config: RunConfig, device: torch.device, world: int
) -> tuple[nn.Module, list[str]]:
    """``model`` wrapped as ``config.wrapper`` says, and notes on what was done or skipped."""
    if config.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        bucket = {} if config.bucket_cap_mb is None else {"bucket_cap_mb": config.bucket_cap_mb}
        ddp = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=config.gradient_as_bucket_view,
            static_graph=config.static_graph,
            **bucket,
        )
        if config.mixed_precision == "bf16" and config.backend == "nccl":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif config.mixed_precision == "bf16":
            warnings.warn(
                "DDP mixed_precision='bf16' skipped: the bf16 all-reduce hook needs NCCL "
                f"on CUDA; this run uses {config.backend}, gradients go in fp32",
                stacklevel=2,
            )
            return ddp, ["bf16 gradient all-reduce skipped: torch's hook needs NCCL"]
        return ddp, []
    if config.wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if config.mixed_precision == "bf16"
            else MixedPrecisionPolicy()
        )
        mesh = init_device_mesh(device.type, (world,))
        units = fsdp_units(model)
        for unit in [*units, model]:  # the blocks, then the root
            fully_shard(
                unit,
                mesh=mesh,
                reshard_after_forward=config.reshard_after_forward,
                mp_policy=policy,
            )
        return model, [f"fully_shard on {len(units)} blocks + root"]
    return model, []


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: every element of every ``nn.ModuleList`` (the
    transformer blocks), innermost first; what is left is sharded with the root."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            found += [(name.count(".") + 1, child) for child in module]
    return [m for _, m in sorted(found, key=lambda pair: -pair[0])]


def _run_steps(
    task: Task,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: RunConfig,
    *,
    start: int,
    rank: int,
    world: int,
    device: torch.device,
) -> tuple[_Clock, list[torch.Tensor], list[int]]:
    """The timed steps, saving checkpoints as asked: the clock, each step's loss (on the
    device, not read yet) and samples."""
    one_save = config.checkpoint_dir and not config.checkpoint_every
    save_at = (config.checkpoint_at or config.steps) if one_save else None
    bf16 = config.autocast == "bf16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batches = _staged_batches(task, config, rank, world, start, device)
    clock = _Clock(device)
    losses, samples = [], []
    for i, (host_inputs, host_targets) in enumerate(batches):
        step = start + i
        clock.mark()
        inputs = host_inputs.to(device, non_blocking=True)
        targets = host_targets.to(device, non_blocking=True)
        with autocast:
            loss = task.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.mark()
        losses.append(loss.detach().float())
        samples.append(inputs.shape[0])
        every, done = config.checkpoint_every, step + 1
        if save_at == i + 1 or (every and done % every == 0):
            folder = Path(config.checkpoint_dir) / ("" if save_at else f"step-{done:06d}")
            save(model, optimizer, config, done, rank, world, folder)
    return clock, losses, samples


def _validation(task: Task, model: nn.Module, config: RunConfig, device: torch.device) -> float:
    """The task's held-out error after training, if it has one."""
    if task.validate is None:
        return math.nan
    # DDP: the plain module, no collectives. FSDP2: every rank runs it (it gathers weights).
    plain = model.module if config.wrapper == "ddp" else model
    return float(task.validate(plain, device))


def _throughput(
    config: RunConfig, clock: _Clock, step_ms: list[float], global_samples: list[int]
) -> dict[str, float]:
    """The median step, and samples per second over the timed steps (after the warm-up)."""
    timed = slice(config.warmup, None) if config.steps > config.warmup else slice(None)
    # Over the whole timed window, gaps between steps included: a rank that waits for a slower
    # one (its collectives do) shows it here, where a median step could hide it.
    window_ms = clock.span_ms(timed.start or 0)
    rate = sum(global_samples[timed]) / (window_ms / 1e3) if window_ms > 0 else math.nan
    return {
        "median_step_ms": statistics.median(step_ms[timed]),
        "window_ms": window_ms,
        "samples_per_s": rate,
    }


def _step_rows(config: RunConfig, start: int, per_step: dict[str, list]) -> list[dict[str, Any]]:
    """One row per step: the loss over ranks and this rank's own, time and throughput."""
    columns = zip(*per_step.values(), strict=True)
    rows = [dict(zip(per_step, values, strict=True)) for values in columns]
    for i, row in enumerate(rows):
        ms = row["step_ms"]
        row["samples_per_s"] = row["samples"] / (ms / 1e3) if ms > 0 else math.nan
        row["warmup"] = i < config.warmup and config.steps > config.warmup
    return [{"step": start + i, **row} for i, row in enumerate(rows)]


class _Clock:
    """Per-step times: CUDA events on a GPU (read once, at the end), the host clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:  # a step's start, then its end
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
        return [self._ms(a, b) for a, b in zip(self.marks[::2], self.marks[1::2], strict=True)]

    def span_ms(self, first_step: int) -> float:  # after times_ms, which waits for the device
        """From the start of step ``first_step`` to the end of the last."""
        return self._ms(self.marks[2 * first_step], self.marks[-1])


def _staged_batches(
    task: Task, config: RunConfig, rank: int, world: int, start: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's batch, made on the host before the first step (pinned on a GPU), as a loader
    that keeps up delivers: made in the loop, one rank's sample generation would stall the
    others at the next collective, counted as communication."""
    weak = config.scaling == "weak"  # every rank a whole batch of its own
    batches = []
    for step in range(start, start + config.steps):
        which = (step * world + rank, 0, 1) if weak else (step, rank, world)
        pair = task.batch(*which, torch.device("cpu"))
        batches.append(tuple(t.pin_memory() for t in pair) if device.type == "cuda" else pair)
    return batches


def _time_allreduce(numel: int, device: torch.device, repeats: int = 5) -> float:
    """Median time of an all-reduce of ``numel`` fp32 values, after one warm-up."""
    import torch.distributed as dist

    buffer = torch.ones(numel, device=device)
    dist.all_reduce(buffer)  # connections and NCCL channels are set up on first use
    clock = _Clock(device)
    for _ in range(repeats):
        clock.mark()
        dist.all_reduce(buffer)
        clock.mark()
    return statistics.median(clock.times_ms())


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
