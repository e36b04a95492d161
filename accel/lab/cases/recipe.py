"""Bench phase ``recipe`` (notebook 07): the physics-transformer recipe's single-GPU phases on the
neural operator, each alone and cumulatively, measured: per configuration time per step,
throughput (a larger batch counts), peak memory, compile time (apart) and the validation error
after the same number of steps from the same seed (one-sided: at most ``TARGET_QUALITY`` times
the baseline's). Each timing sample is whole loader epochs (the worker restart and the
inverse-loss schedule inside it), configurations interleaved. Only the baseline and the whole
recipe are trained that far: the gpu preset's operator sits on a plateau for its first ~1,300
steps, so the comparison needs 3,000. One training's error moves with its seed as much as with
the recipe, so part ``quality`` trains both from ``SEEDS`` seeds, a row per seed (``quality 2``:
one seed, for a GPU command too short for all), and :func:`quality_summary` judges the mean
ratio's confidence interval over the seeds recorded."""

from __future__ import annotations

import dataclasses
import itertools
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pandas as pd
import torch

from accel import memory
from accel.errors import collection_of
from accel.lab.bench import BenchContext, Row, release_memory
from accel.lab.cases import recipe_adopted, recipe_float8
from accel.measure.timer import compare
from accel.workloads import advection as op
from accel.workloads.flags import label

PHASE = "recipe"
TARGET_SPEEDUP = 2.5
TARGET_QUALITY = 1.03  # recipe validation error <= 1.03 x the baseline's, after equal steps
VALIDATION_CASE = "recipe: validation error after equal steps"
QUALITY_CASE = "quality seed {seed}: validation error over the baseline's"  # one row per seed
QUALITY_PATTERN = r"^quality seed \d+: "
SEEDS = 5  # trainings of the baseline and of the recipe, each pair from one seed
# Student's t at 0.975 by degrees of freedom (seeds - 1): a mean's two-sided 95% interval
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


@dataclass(frozen=True)
class BenchSizes:
    repeats: int  # timing samples per configuration, each ``epochs_per_sample`` loader epochs
    train_steps: int  # steps every validated configuration has trained when its error is read
    epochs_per_sample: int = 1
    reads: int = 1  # validation errors averaged: at train_steps and every read_every before
    read_every: int = 1


BENCH_SIZES = {
    # the gpu preset leaves its plateau after ~1,300 steps (module docstring)
    "gpu": BenchSizes(repeats=6, train_steps=3000, reads=3, read_every=250),
    # 150 steps: the cpu preset has learnt something by then (error ~0.3-0.7; 1.0 = predicting 0)
    "cpu": BenchSizes(repeats=3, train_steps=150, reads=3, read_every=25),
}


# ---- the configurations ------------------------------------------------------------------------
def loader_flags(device: torch.device | str) -> dict:
    """Phase 4's loader settings: workers kept across epochs, pinned and non-blocking on a GPU."""
    on_gpu = torch.device(device).type == "cuda"
    return dict(loader_workers=4 if on_gpu else 2, persistent_workers=True, pin_memory=on_gpu,
                non_blocking=True)  # fmt: skip


def progression(device: torch.device | str) -> dict[str, op.Flags]:
    """Baseline, then each recipe phase added to the ones before (those that cannot run on
    ``device`` left out: ``op.unavailable``), by the recipe's numbers, in its order but for compile
    (its phase 1), last: every row after it would need a compile of its own."""
    off = op.unavailable(device)
    steps: list[tuple[str, dict]] = [
        ("2 checkpointing, 2x batch", dict(activation_checkpointing=True, batch_multiplier=2)),
        ("3 inverse loss every 4th, half the queries", dict(aux_loss_every=4, query_subsample=2)),
        ("4 DataLoader settings", loader_flags(device)),
        ("5 CPU offload optimizer", dict(cpu_offload_optimizer=True)),
        ("6 bf16 autocast", dict(precision="bf16")),
        ("8 fused AdamW", dict(fused_adamw=True)),
        ("1 compile (reduce-overhead)", dict(compile="reduce-overhead")),
    ]
    configs = {"baseline": op.Flags()}
    current = op.Flags()
    for name, change in steps:
        if any(k in off and v != op.flag_default(k) for k, v in change.items()):
            continue
        current = dataclasses.replace(current, **change)
        configs[f"+ {name}"] = current
    return configs


def alone(device: torch.device | str) -> dict[str, op.Flags]:
    """Baseline and each phase alone (precision as float16 with a scaler and as bfloat16; compile's
    max-autotune, minutes of autotuning, only in the notebook's panel)."""
    off = op.unavailable(device)
    candidates = {
        "compile reduce-overhead": op.Flags(compile="reduce-overhead"),
        "checkpointing (same batch)": op.Flags(activation_checkpointing=True),
        "checkpointing, 2x batch": op.Flags(activation_checkpointing=True, batch_multiplier=2),
        "inverse loss every 4th": op.Flags(aux_loss_every=4),
        "inverse loss on half the queries": op.Flags(query_subsample=2),
        "DataLoader settings": op.Flags(**loader_flags(device)),
        "CPU offload optimizer": op.Flags(cpu_offload_optimizer=True),
        "fp16 + gradient scaler": op.Flags(precision="fp16+scaler"),
        "bf16 autocast": op.Flags(precision="bf16"),
        "fused AdamW": op.Flags(fused_adamw=True),
    }
    configs = {"baseline": op.Flags()}
    for name, flags in candidates.items():
        if not any(getattr(flags, k) != op.flag_default(k) for k in off):
            configs[name] = flags
    return configs


def autotune(device: torch.device | str) -> dict[str, op.Flags]:
    """The whole recipe with compile's reduce-overhead, then with max-autotune (minutes of
    autotuning, in the row's compile time); empty where compile cannot run."""
    if "compile" in op.unavailable(device):
        return {}
    recipe = list(progression(device).values())[-1]
    return {"recipe (reduce-overhead)": recipe,
            "recipe with max-autotune": dataclasses.replace(recipe, compile="max-autotune")}  # fmt: skip


# ---- cost model ----------------------------------------------------------------------------------
def step_flops(sizes: op.Sizes, flags: op.Flags | None = None) -> dict[str, float]:
    """Matrix-product FLOPs of one training step, averaged over the inverse-loss schedule, by
    part: ``encoder``, ``decoder``, ``inverse`` and ``total`` (per sample: ``per_sample``).

    A self-attention block of n tokens costs per token 2 d^2 (4 + 2 r) in its projections and
    MLP (q, k, v, out: 4 d^2; MLP: 2 r d^2) plus 4 n d in attention; backward is twice the
    forward; checkpointing adds one more forward of every block."""
    flags = flags or op.Flags()
    d, r = sizes.dim, sizes.mlp_ratio
    g, q = sizes.grid, sizes.queries
    aux_q = max(1, q // flags.query_subsample)
    batch = sizes.batch * flags.batch_multiplier * flags.grad_accumulation
    passes = 4 if flags.activation_checkpointing else 3
    encoder = sizes.depth * g * (2 * d * d * (4 + 2 * r) + 4 * g * d)
    # cross-attention: q, out and MLP on the queries, k and v on the grid tokens
    decoder = sizes.decoder_depth * (q * (2 * d * d * (2 + 2 * r) + 4 * g * d) + g * 4 * d * d)
    inverse = sizes.inverse_depth * aux_q * (2 * d * d * (4 + 2 * r) + 4 * aux_q * d)
    parts = {
        "encoder": passes * batch * encoder,
        "decoder": passes * batch * decoder,
        "inverse": passes * batch * inverse / flags.aux_loss_every,
    }
    parts["total"] = sum(parts.values())
    parts["per_sample"] = parts["total"] / batch
    return parts


# ---- measuring -----------------------------------------------------------------------------------
def measure(
    configs: dict[str, op.Flags], sizes: op.Sizes, device: torch.device | str, *,
    repeats: int = 3, train_steps: int = 40, epochs_per_sample: int = 1, reads: int = 1,
    read_every: int = 1, validate: Collection[str] | None = None, seed: int = 0,
    on_progress: Callable[[str], None] | None = None,
) -> pd.DataFrame:  # fmt: skip
    """Build and time (interleaved) every configuration, then train those named in ``validate``
    (all by default) to ``train_steps`` steps; one row per configuration: ``config``, ``flags``,
    ``batch``, ``step_ms``, ``iqr_ms``, ``samples_per_s``, ``speedup`` and ``val_vs_baseline``
    (over the first configuration's), ``peak_mib``, ``compile_s``, ``val_error`` (the mean of
    ``reads`` reads ``read_every`` steps apart up to ``train_steps``; NaN where not validated),
    ``aux_calls``, ``train_steps``. ``on_progress`` hears each stage as it begins."""
    if validate is not None:  # before anything reads the other arguments
        validate = collection_of(validate, "configuration names")
    names = list(configs)
    per_sample = sizes.epoch_batches * epochs_per_sample
    reads_at = _read_steps(train_steps, reads, read_every)
    validate = _check_measure(configs, per_sample, repeats, reads_at[0], validate)
    dev = torch.device(device)
    say = on_progress or (lambda stage: None)
    steps, peaks = {}, {}
    try:
        for name in names:
            say(f"building {name}")
            steps[name], peaks[name] = _build_and_footprint(configs[name], sizes, dev, seed)
        say("timing")
        timing = compare(steps, baseline=names[0], warmup=per_sample, repeats=repeats,
                         calls_per_sample=per_sample, device=dev)  # fmt: skip
        rows = []
        for name, step in steps.items():
            error = math.nan
            if name in validate:
                say(f"training {name}")
                error = _validation_error(step, reads_at)
            t = timing.timings[name]
            rows.append({
                "config": name, "flags": label(step.flags), "batch": step.samples_per_step,
                "step_ms": t.median_ms, "iqr_ms": t.iqr_ms,
                "samples_per_s": step.samples_per_step * 1e3 / t.median_ms,
                "peak_mib": peaks[name] / memory.MiB, "compile_s": step.compile_seconds,
                "val_error": error, "aux_calls": step.aux_calls, "train_steps": step.count,
            })  # fmt: skip
    finally:
        for step in steps.values():
            step.close()
        steps.clear()
        release_memory(dev)
    say("done")
    frame = pd.DataFrame(rows)
    frame["speedup"] = frame["samples_per_s"] / frame["samples_per_s"].iloc[0]
    frame["val_vs_baseline"] = frame["val_error"] / frame["val_error"].iloc[0]
    return frame


def progress_bar(configs: dict[str, op.Flags]) -> Callable[[str], None]:
    """An ``on_progress`` for :func:`measure` of ``configs``: a tqdm bar of its stages."""
    from tqdm.auto import tqdm

    bar = tqdm(total=2 * len(configs) + 1)
    stages: list[str] = []

    def tick(stage: str) -> None:
        if stages:  # the stage before this one has ended
            bar.update()
        stages.append(stage)
        bar.set_description_str(stage)
        if stage == "done":
            bar.close()

    return tick


def _check_measure(configs: dict[str, op.Flags], per_sample: int, repeats: int, first_read: int,
                   validate: Collection[str] | None) -> set[str]:  # fmt: skip
    """Check :func:`measure`'s arguments against each other; the names to validate."""
    names = list(configs)
    cycle = math.lcm(per_sample, *(f.aux_loss_every for f in configs.values()))
    if cycle != per_sample:
        raise ValueError(
            f"a timing sample of {per_sample} steps does not hold whole inverse-loss cycles "
            f"({cycle}); use epochs_per_sample so that it does"
        )
    timed_steps = 2 + per_sample * (1 + repeats)  # 2 for memory, 1 sample of warm-up
    if first_read < timed_steps:
        raise ValueError(
            f"the first validation read, at step {first_read}, comes before the {timed_steps} "
            "steps timing takes: raise train_steps or read fewer times"
        )
    validate = set(names if validate is None else validate)
    if names[0] not in validate or not validate <= set(names):
        raise ValueError(
            f"validate must name the baseline {names[0]!r} and configurations of {names}, "
            f"got {sorted(validate)}"
        )
    return validate


def seed_errors(
    configs: dict[str, op.Flags], sizes: op.Sizes, device: torch.device | str, *,
    seeds: Sequence[int], train_steps: int, reads: int = 1, read_every: int = 1,
    processes: int = 1, devices: Sequence[torch.device | str] = (),
) -> pd.DataFrame:  # fmt: skip
    """Every configuration trained from every seed to ``train_steps`` steps: one row per seed and
    configuration with its ``val_error`` (as :func:`measure` reads it). With ``processes`` > 1
    the trainings run that many at once, each in its own process (a host-bound step leaves the
    GPU room, and an error does not depend on how fast it was reached), dealt in turn to
    ``devices`` where given (the GPUs of one host), else all on ``device``."""
    reads_at = _read_steps(train_steps, reads, read_every)
    where = [str(d) for d in devices] or [str(device)]
    # configuration by configuration, so that the slow one's trainings spread over the devices
    pairs = list(itertools.product(configs, seeds))
    # trainings at once share the host's cores: each process takes its share (oversubscribed,
    # they crawl); one at a time, this process's setting is left as it is
    threads = max(1, (os.cpu_count() or 1) // min(processes, len(pairs))) if processes > 1 else None
    jobs = [(configs[name], sizes, where[i % len(where)], seed, reads_at, threads)
            for i, (name, seed) in enumerate(pairs)]  # fmt: skip
    if processes > 1:
        spawn = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
        with ProcessPoolExecutor(min(processes, len(jobs)), mp_context=spawn) as pool:
            errors = list(pool.map(_trained_error, jobs))
    else:
        errors = [_trained_error(job) for job in jobs]
    frame = pd.DataFrame(pairs, columns=["config", "seed"]).assign(val_error=errors)
    return frame.sort_values("seed", kind="stable")[["seed", "config", "val_error"]].reset_index(
        drop=True
    )


def _trained_error(job: tuple) -> float:
    flags, sizes, device, seed, reads_at, threads = job
    if threads is not None:
        torch.set_num_threads(threads)  # a pool's process, which ends with its trainings
    start = time.perf_counter()
    step = op.build(flags, sizes, device=torch.device(device), seed=seed)

    def say(what: str) -> None:  # a training takes minutes on a GPU: say where each one is
        print(f"quality seed {seed} ({device}, {label(flags)}): {what} at "
              f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip

    say("built")
    try:
        error = _validation_error(step, reads_at, say=say)
    finally:
        step.close()
    say("trained")
    return error


def quality_rows(errors: pd.DataFrame, configs: dict[str, op.Flags], *,
                 train_steps: int) -> list[Row]:  # fmt: skip
    """Seed by seed, the last configuration's validation error over the first's: one row each,
    judged together by :func:`quality_summary` (a seed rerun replaces its own row)."""
    baseline, recipe = next(iter(configs)), list(configs)[-1]
    by_seed = errors.pivot(index="seed", columns="config", values="val_error")
    return [
        Row(PHASE, QUALITY_CASE.format(seed=seed), "recipe's validation error over the "
            f"baseline's after {train_steps} steps from one seed", "ratio",
            float(errors_of[recipe] / errors_of[baseline]),
            note=f"baseline {errors_of[baseline]:.4g}, recipe {errors_of[recipe]:.4g}; "
                 f"{label(configs[recipe])}")
        for seed, errors_of in by_seed.iterrows()
    ]  # fmt: skip


def quality_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Recorded seed rows as one row per device: the mean ratio with its interval (``T_975``), the
    target judged on the interval (met when all of it is at most the target) once ``SEEDS``
    seeds are recorded, computed each time (a stored mean would go stale when a seed is rerun)."""
    seeds = rows[(rows["phase"] == PHASE) & rows["case"].str.match(QUALITY_PATTERN)]
    out = []
    for device, group in seeds.groupby("device"):
        ratios = group["optimized"].astype(float)
        n, mean = len(ratios), float(ratios.mean())
        half = T_975[n - 1] * float(ratios.std(ddof=1)) / math.sqrt(n) if n > 1 else math.inf
        out.append({"device": device, "seeds": n, "mean ratio": round(mean, 3),
                    "95% interval": (round(mean - half, 3), round(mean + half, 3)),
                    "target": f"95% interval <= {TARGET_QUALITY}",
                    "met": (mean + half <= TARGET_QUALITY) if n >= SEEDS else None})  # fmt: skip
    return pd.DataFrame(out)


def _read_steps(train_steps: int, reads: int, read_every: int) -> range:
    """The steps the validation error is read at: ``reads`` of them, the last at ``train_steps``."""
    return range(train_steps - (reads - 1) * read_every, train_steps + 1, read_every)


def _validation_error(
    step: op.Step, reads_at: range, say: Callable[[str], None] = lambda what: None
) -> float:
    """Train ``step`` on, reading its validation error at each step of ``reads_at``; the mean."""
    errors = []
    for at in reads_at:
        while step.count < at:
            step()
        errors.append(step.validation_error())
        say(f"step {at}, validation error {errors[-1]:.4g}")
    return sum(errors) / len(errors)


def _build_and_footprint(
    flags: op.Flags, sizes: op.Sizes, device: torch.device, seed: int
) -> tuple[op.Step, int]:
    """The built step after two training steps, and its peak device memory: on CUDA all it
    allocated at its highest; on a CPU its resident bytes plus a step's peak above them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step = op.build(flags, sizes, device=device, seed=seed)
        step(), step()
        torch.cuda.synchronize(device)
        return step, torch.cuda.max_memory_allocated(device) - before
    step = op.build(flags, sizes, device=device, seed=seed)
    step()
    peak = memory.peak_memory(step, device=device)
    return step, step.resident_bytes() + peak


def aux_call_counts(sizes: op.Sizes, steps: int, every: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """Inverse-loss passes in ``steps`` training steps for each ``aux_loss_every``: counted on
    built steps (tiny, on the CPU), not computed."""
    counts = {}
    for k in every:
        step = op.build(op.Flags(aux_loss_every=k), sizes)
        for _ in range(steps):
            step()
        counts[k] = step.aux_calls
    return counts


class Epoch:
    """One loader epoch of training steps per call (``sizes.epoch_batches``): what the panel
    times, so every sample holds the epoch's worker restart and whole inverse-loss cycles."""

    def __init__(self, step: op.Step):
        self.step, self.flags = step, step.flags

    def __call__(self) -> None:
        for _ in range(self.step.sizes.epoch_batches):
            self.step()


# ---- the bench phase -----------------------------------------------------------------------------
def rows(frame: pd.DataFrame, group: str, *, judged: bool, target: str | None = None) -> list[Row]:
    """One throughput row per configuration; ``target`` names the one judged."""
    base = frame.iloc[0]
    out = []
    for _, r in frame.iterrows():
        note = (
            f"{r['flags']}; {r['step_ms']:.3g} ms/step at batch {r['batch']}; peak "
            f"{r['peak_mib']:,.0f} MiB; validation error {r['val_error']:.4g} after "
            f"{r['train_steps']} steps ({r['val_vs_baseline'] - 1:+.1%} vs baseline)"
        )
        if r["compile_s"]:
            note += f"; compile {r['compile_s']:.1f} s (not in the step time)"
        is_target = r["config"] == target
        if is_target:  # one seed's validation error cannot judge its target: the seed rows do
            note += f"; validation error <= {TARGET_QUALITY}x judged over seeds (quality rows)"
        met = r["speedup"] >= TARGET_SPEEDUP
        goal = f">= {TARGET_SPEEDUP}x"
        out.append(Row(
            PHASE, f"{group}: {r['config']}", "training throughput", "samples/s",
            r["samples_per_s"], baseline=base["samples_per_s"], higher_is_better=True,
            target=goal if is_target else "", met=bool(met) if is_target and judged else None,
            note=note,
        ))  # fmt: skip
    return out


def parts() -> list[str]:
    """The parts ``--only`` can pick (each within one ten-minute GPU command; ``quality``
    takes every seed, ``quality 2`` one of them)."""
    return ["cumulative", "alone", "autotune", *(f"quality {s}" for s in range(1, SEEDS + 1)),
            "adopted", "float8"]


def run(ctx: BenchContext) -> list[Row]:
    sizes, bench = op.Sizes.preset(ctx.preset), BENCH_SIZES[ctx.preset]
    t0 = time.perf_counter()
    kwargs = dataclasses.asdict(bench) | {  # the phase takes minutes on a GPU: say where it is
        "on_progress": lambda what: print(f"recipe {time.perf_counter() - t0:5.0f} s: {what}")
    }
    out = []
    if ctx.selected("cumulative"):
        configs = progression(ctx.device)
        first, last = next(iter(configs)), list(configs)[-1]
        cumulative = measure(configs, sizes, ctx.device, validate=(first, last), **kwargs)
        out += rows(cumulative, "cumulative", judged=ctx.judged, target=last)
        out.append(_validation_row(ctx, cumulative, bench, time.perf_counter() - t0))
    if ctx.selected("alone"):
        configs = alone(ctx.device)
        alone_frame = measure(configs, sizes, ctx.device, validate=(next(iter(configs)),), **kwargs)
        out += rows(alone_frame, "alone", judged=ctx.judged)
    if ctx.selected("autotune") and (configs := autotune(ctx.device)):
        frame = measure(configs, sizes, ctx.device, validate=(next(iter(configs)),), **kwargs)
        out += rows(frame, "autotune", judged=ctx.judged)
    if seeds := [s for s in range(1, SEEDS + 1) if ctx.selected(f"quality {s}")]:
        configs = progression(ctx.device)
        configs = {k: configs[k] for k in (next(iter(configs)), list(configs)[-1])}
        cuda = ctx.device.type == "cuda"
        gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if cuda else []
        errors = seed_errors(configs, sizes, ctx.device, seeds=seeds,
                             train_steps=bench.train_steps, reads=bench.reads,
                             read_every=bench.read_every, devices=gpus,
                             processes=len(seeds) * len(configs) if cuda else 1)  # fmt: skip
        out += quality_rows(errors, configs, train_steps=bench.train_steps)
    if ctx.selected("adopted"):
        out += recipe_adopted.rows(ctx)
    if ctx.selected("float8"):
        out += recipe_float8.rows(ctx)
    return ctx.judge(out)


def _validation_row(
    ctx: BenchContext, cumulative: pd.DataFrame, bench: BenchSizes, seconds: float
) -> Row:
    """The whole recipe's validation error against the baseline's, after equal steps."""
    left_out = op.unavailable(ctx.device)
    note = f"the progression took {seconds:.0f} s"
    if left_out:
        note += "; left out here: " + "; ".join(f"{k}: {v}" for k, v in left_out.items())
    return Row(
        PHASE, VALIDATION_CASE, f"relative L2 error of the field after {bench.train_steps} steps "
        f"(mean of {bench.reads} reads, {bench.read_every} steps apart)", "",
        cumulative["val_error"].iloc[-1], baseline=cumulative["val_error"].iloc[0],
        target=f"<= {TARGET_QUALITY}x baseline, judged over seeds (quality rows)", met=None,
        note=f"{cumulative['flags'].iloc[-1]}; one seed; speedup = baseline error / recipe error; "
        + note,
    )  # fmt: skip
