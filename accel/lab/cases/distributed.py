"""Bench phase ``distributed`` (notebook 08): one GPU against DDP and FSDP2 on every GPU present,
with torch's default communication settings, launched one after another; on GPUs, each DDP
setting away from the defaults alone against them. Rows for N >= 2 GPUs (fewer: rows saying what
was skipped): each configuration's throughput against one GPU, its parameter + optimizer-state
memory per GPU (FSDP2's against DDP's) and its peak memory; weak scaling on GPUs (each trains the
whole ``gpu`` batch). Targets: ``TARGETS``.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from accel import distributed
from accel.distributed import COMM_SETTINGS, RunResult
from accel.lab.bench import BenchContext, Row

CONFIGS: dict[str, dict[str, Any]] = {
    "one": {"wrapper": "none"},
    "ddp": {"wrapper": "ddp"},
    "fsdp2": {"wrapper": "fsdp2"},
}
# The settings DDP reads, each measured alone against DDP's defaults (GPUs only: a series of
# seven runs)
DDP_SETTINGS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "mixed_precision",
                "nccl_env")  # fmt: skip
PLAIN_DDP = ("ddp defaults", "ddp defaults again")  # first and last of the series
MiB = 2**20
_row = functools.partial(Row, "distributed")


@dataclass(frozen=True)
class Targets:
    speedup: float  # DDP throughput over one GPU's, at least
    memory: float  # FSDP2's parameter + optimizer memory per GPU over DDP's, at most


TARGETS = {2: Targets(speedup=1.8, memory=0.6), 4: Targets(speedup=3.4, memory=0.35)}


@dataclass(frozen=True)
class BenchSizes:
    steps: int
    warmup: int
    scaling: str
    autocast: str | None


BENCH_SIZES = {
    # one process's step time swings by a quarter between stretches of steps: a short window
    # picks one stretch and cannot resolve the 1.8x target
    "gpu": BenchSizes(steps=120, warmup=20, scaling="weak", autocast="bf16"),
    "cpu": BenchSizes(steps=8, warmup=2, scaling="strong", autocast=None),
}
# Notebook 08's window on GPUs: half the bench's, for a notebook that answers in a couple of
# minutes; it prints the bench's recorded figure beside its own.
NOTEBOOK_GPU_SIZES = BenchSizes(steps=60, warmup=10, scaling="weak", autocast="bf16")


def pick_task() -> tuple[str, str]:
    """The task the phase trains, and a note saying what it is."""
    return "accel.workloads.advection:distributed_task", "the neural-operator workload"


def measure(
    task: str,
    nprocs: int,
    *,
    preset: str,
    sizes: BenchSizes,
    configs: dict[str, dict[str, Any]] | None = None,
    one_in_process: bool = False,
    series: bool = False,
    on_run: Callable[[str, RunResult], None] | None = None,
    **options: Any,
) -> dict[str, RunResult]:
    """Every configuration launched (``"one"`` on one process, the rest on ``nprocs``) one after
    another, or with ``series`` those of equal NCCL settings on one launch; ``options`` go to
    every launch. Returns the runs in the order of ``configs``."""
    configs = configs or CONFIGS
    common = {
        "steps": sizes.steps,
        "warmup": sizes.warmup,
        "preset": preset,
        "scaling": sizes.scaling,
        "autocast": sizes.autocast,
        **options,
    }
    runs: dict[str, RunResult] = {}
    groups: dict[str, dict[str, dict[str, Any]]] = {}  # a series' runs, by NCCL settings
    for label, config in configs.items():
        if series and config["wrapper"] != "none":
            groups.setdefault(json.dumps(config.get("nccl_env"), sort_keys=True), {})[label] = (
                config
            )
            continue
        one = config["wrapper"] == "none"
        where = {"in_process": one_in_process} if one else {}
        runs[label] = distributed.launch(task, 1 if one else nprocs, **common, **where, **config)
        if on_run is not None:
            on_run(label, runs[label])
    for group in groups.values():
        for label, run in distributed.launch_series(group, task, nprocs, **common).items():
            runs[label] = run
            if on_run is not None:
                on_run(label, run)
    return {label: runs[label] for label in configs}


def to_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """A run's plain rows (``RunResult.steps`` or ``.ranks``) as a DataFrame, one row each."""
    return pd.DataFrame(rows)


def table(runs: dict[str, RunResult]) -> pd.DataFrame:
    """One row per configuration: throughput, speedup and scaling efficiency against ``one``,
    memory per rank (the largest over ranks), loss and validation error."""
    one = runs["one"].summary["samples_per_s"] if "one" in runs else math.nan
    rows = []
    for label, run in runs.items():
        s, n, ranks = run.summary, run.config.nprocs, to_frame(run.ranks)
        rows.append(
            {
                "config": label,
                "wrapper": run.config.wrapper,
                "nprocs": n,
                "samples_per_s": s["samples_per_s"],
                "speedup": s["samples_per_s"] / one,
                "scaling_efficiency": s["samples_per_s"] / (n * one),
                "median_step_ms": s["median_step_ms"],
                "state_mib_per_rank": ranks["state_bytes"].max() / MiB,
                "peak_mib_per_rank": ranks["peak_memory_bytes"].max() / MiB,
                "final_loss": s["final_loss"],
                "validation_error": s["validation_error"],
                "notes": s["notes"],
            }
        )
    return pd.DataFrame(rows)


def rows(runs: dict[str, RunResult], *, judged: bool, where: str) -> list[Row]:
    """Bench rows from :func:`measure`'s runs: one process's throughput, then each wrapped
    configuration's throughput (DDP's judged), then its state memory per rank (FSDP2's judged
    against DDP's) and, on GPUs, its peak memory."""
    frame = table(runs).set_index("config")
    one, wrapped = frame.loc["one"], frame.drop(index="one")
    n = int(wrapped["nprocs"].max())
    target = TARGETS.get(n)
    first = next(iter(runs.values())).config
    note = (
        f"{where}; {first.scaling} scaling, preset {first.preset}, autocast {first.autocast}; "
        f"{first.steps - first.warmup} steps after {first.warmup} warm-up, samples over the "
        "window of rank 0's clock (CUDA events on a GPU), batches staged on the host; "
        "launches one after another"
    )
    out = [_row("one_gpu throughput", "training throughput on one process", "samples/s",
                one["samples_per_s"], note=note)]  # fmt: skip
    for label, r in wrapped.iterrows():
        judge_ddp = target is not None and r["wrapper"] == "ddp"
        out.append(
            _row(
                f"{label} x{n} throughput",
                f"training throughput on {n} ranks against one",
                "samples/s",
                r["samples_per_s"],
                baseline=one["samples_per_s"],
                higher_is_better=True,
                target=f">= {target.speedup}x" if judge_ddp else "",
                met=bool(r["samples_per_s"] / one["samples_per_s"] >= target.speedup)
                if judged and judge_ddp
                else None,
                note=note + (f"; {r['notes']}" if r["notes"] else ""),
            )
        )
    ddp_state = frame.loc["ddp", "state_mib_per_rank"] if "ddp" in frame.index else math.nan
    for label, r in wrapped.iterrows():
        fsdp = r["wrapper"] == "fsdp2"
        judge_fsdp = target is not None and fsdp
        state = r["state_mib_per_rank"]
        out.append(
            _row(
                f"{label} x{n} state_memory",
                "parameter + optimizer-state memory per rank"
                + (" against DDP's" if fsdp else " against one rank's"),
                "MiB",
                state,
                baseline=ddp_state if fsdp else one["state_mib_per_rank"],
                target=f"<= {target.memory}x (speedup >= {1 / target.memory:.2f})"
                if judge_fsdp
                else "",
                met=bool(state / ddp_state <= target.memory) if judged and judge_fsdp else None,
                note=f"{where}; bytes of each rank's own parameter and AdamW-state tensors "
                "(FSDP2: its shards); largest over ranks",
            )
        )
        if not math.isnan(r["peak_mib_per_rank"]):
            out.append(
                _row(
                    f"{label} x{n} peak_memory",
                    "peak allocated memory per GPU during training against one GPU's",
                    "MiB",
                    r["peak_mib_per_rank"],
                    baseline=one["peak_mib_per_rank"],
                    note=f"{where}; torch.cuda.max_memory_allocated, largest over ranks",
                )
            )
    return out


def skipped_rows(present: int, *, reason: str) -> list[Row]:
    """A row per target that needs more GPUs than ``present``, saying so."""
    return [
        _row(
            f"ddp x{n} throughput",
            f"training throughput on {n} GPUs against one",
            "samples/s",
            math.nan,
            target=f">= {t.speedup}x; FSDP2 state memory <= {t.memory}x DDP's",
            note=f"skipped: needs {n} GPUs; {reason}. The same run is written for any N",
        )
        for n, t in TARGETS.items()
        if n > present
    ]


def parts() -> list[str]:
    """The parts ``--only`` can pick: the wrappers against one GPU at each count, and on GPUs
    each DDP setting alone (each within one ten-minute GPU command)."""
    return ["wrappers", "settings"]


def run(ctx: BenchContext) -> list[Row]:
    task, which = pick_task()
    on_gpu = ctx.device.type == "cuda"
    gpus = torch.cuda.device_count() if on_gpu else 0
    if on_gpu and gpus < 2:
        return skipped_rows(gpus, reason=f"{gpus} GPU present; DDP and FSDP2 need two or more")
    sizes, t0 = BENCH_SIZES["gpu" if on_gpu else "cpu"], time.perf_counter()

    def say(label: str, run: RunResult) -> None:  # launches take minutes: say where it is
        print(f"distributed {time.perf_counter() - t0:5.0f} s: {label} on "
              f"{run.config.nprocs} ranks, {run.summary['samples_per_s']:,.0f} samples/s")  # fmt: skip

    def launch(nprocs: int, configs: dict[str, dict[str, Any]], **how: Any) -> dict[str, RunResult]:
        return measure(task, nprocs, preset=ctx.preset, sizes=sizes, configs=configs, on_run=say,
                       **how)  # fmt: skip

    trained = f"task {task} ({which})"
    out = wrapper_rows(ctx, launch, gpus, trained) if ctx.selected("wrappers") else []
    if on_gpu and ctx.selected("settings"):  # at the largest count: communication weighs most
        alone = launch(gpus, setting_configs(), series=True)
        out += setting_rows(alone, where=f"{gpus} GPUs, nccl, {trained}")
    return out + (skipped_rows(gpus, reason=f"{gpus} GPUs present") if on_gpu else [])


def wrapper_rows(ctx: BenchContext, launch: Callable[..., dict[str, RunResult]], gpus: int,
                 task: str) -> list[Row]:  # fmt: skip
    """Each wrapper against one process at every rank count."""
    on_gpu = gpus > 0
    # One process's throughput varies by launch: run before and after, the faster is the baseline
    single = {"one": CONFIGS["one"]}
    wrapped = {k: v for k, v in CONFIGS.items() if k != "one"}
    before = launch(1, single)["one"]
    by_count = {n: launch(n, wrapped) for n in (rank_counts(gpus) if on_gpu else [2])}
    after = launch(1, single)["one"]
    faster = max(before, after, key=lambda run: run.summary["samples_per_s"])
    first, last = (run.summary["samples_per_s"] for run in (before, after))
    spread = (
        f"; one process launched before and after the others: {first:,.0f} and {last:,.0f} "
        "samples/s, the faster is the baseline"
    )
    out: list[Row] = []
    for nprocs, runs in by_count.items():
        where = (
            f"{nprocs} GPUs, nccl, {task}"
            if ctx.judged
            else f"not judged: the targets are for GPUs with the gpu preset, this is {nprocs} "
            f"{'GPU' if on_gpu else 'gloo CPU'} processes with preset {ctx.preset}; {task}"
        )
        found = rows({"one": faster, **runs}, judged=ctx.judged, where=where + spread)
        out += [r for r in found if not out or r.case != "one_gpu throughput"]  # once
    return out


def setting_configs() -> dict[str, dict[str, Any]]:
    """DDP with its defaults, with each of :data:`DDP_SETTINGS` alone, and with its defaults
    again (the first runs of a launch can be slower: the faster of the two is the baseline)."""
    alone = {f"ddp {key} alone": {"wrapper": "ddp", key: COMM_SETTINGS[key]} for key in DDP_SETTINGS}
    first, last = PLAIN_DDP
    return {first: {"wrapper": "ddp"}, **alone, last: {"wrapper": "ddp"}}


def setting_rows(runs: dict[str, RunResult], *, where: str) -> list[Row]:
    """What each DDP setting buys alone: its throughput against DDP's defaults on as many ranks,
    trained in the same launch unless the setting changes NCCL's environment (read once per
    process, so that one has a launch of its own)."""
    first, last = (runs[k].summary["samples_per_s"] for k in PLAIN_DDP)
    n, base = runs[PLAIN_DDP[0]].config.nprocs, max(first, last)
    out = []
    for key in DDP_SETTINGS:
        run = runs[f"ddp {key} alone"]
        # NCCL reads its environment once a process: that setting's run has a launch of its own
        launch = "another launch" if key == "nccl_env" else "the same launch"
        extra = f"; {run.summary['notes']}" if run.summary["notes"] else ""
        out.append(
            _row(
                f"ddp {key} alone x{n} throughput",
                f"training throughput on {n} ranks, DDP with this setting alone against its "
                "defaults",
                "samples/s",
                run.summary["samples_per_s"],
                baseline=base,
                higher_is_better=True,
                note=f"{where}; {key}={COMM_SETTINGS[key]!r}; against DDP's defaults trained in "
                f"{launch}, first and last of its series: {first:,.0f} and {last:,.0f} samples/s, "
                f"the faster is the baseline{extra}",
            )
        )
    return out


def rank_counts(gpus: int) -> list[int]:
    """The numbers of ranks the bench runs on ``gpus`` GPUs: the targets' counts (2, 4) that fit,
    and all of them."""
    return sorted({n for n in TARGETS if n <= gpus} | {gpus})
