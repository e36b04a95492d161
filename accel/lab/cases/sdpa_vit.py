"""The sdpa phase's ViT rows: the ViT training step with every flag but compile and with all,
each configuration checked equal to the baseline before it is timed, interleaved against it.
"""

from __future__ import annotations

import dataclasses

import torch

from accel.lab.bench import BenchContext, Row
from accel.lab.cases.sdpa_measure import (
    PHASE,
    TARGET_VIT,
    BenchSizes,
    release_memory,
    which_backend,
)
from accel.measure.timer import compare
from accel.workloads import vit
from accel.workloads.flags import all_on, label


def vit_configs(device: torch.device) -> dict[str, vit.Flags]:
    """The baseline, every flag but compile (notebook 05's panel ends there), all."""
    everything = all_on(vit.Flags, device)
    configs = {"baseline": vit.Flags()}
    no_compile = dataclasses.replace(everything, compile=False)
    configs["all but compile"] = no_compile
    if everything != no_compile:
        configs["all flags"] = everything
    return configs


def vit_rows(ctx: BenchContext, sizes: BenchSizes, judged: bool, check_steps: int = 3) -> list[Row]:
    vit_sizes = vit.Sizes.preset(ctx.preset)
    steps, checks = {}, {}
    reference = None
    for name, flags in vit_configs(ctx.device).items():
        step = vit.build(flags, vit_sizes, device=ctx.device, seed=0)
        for _ in range(check_steps):  # correctness before timing
            step()
        result = step.result()
        if reference is None:
            reference = result
        checks[name] = _equal(result, reference, flags, vit_sizes, check_steps)
        steps[name] = step
    timing = compare(
        steps, baseline="baseline", warmup=3, repeats=sizes.vit_repeats, device=ctx.device
    )
    top = "all flags" if "all flags" in steps else "all but compile"
    ran = which_backend(steps[top], ctx.device)["backend"]
    rows = []
    for name, step in steps.items():
        speedup = timing.speedup(name)
        ok, how = checks[name]
        target = met = None
        if name == "all flags" or (name == top and not judged):
            target, met = f">= {TARGET_VIT}x and equal", (speedup >= TARGET_VIT and ok)
        note = f"{label(step.flags)}; result {'equal' if ok else 'DIFFERS'} ({how})"
        if name == top:
            note += f"; attention ran {ran}"
        rows.append(
            Row(
                PHASE,
                f"vit step: {name}",
                "time per training step",
                "ms",
                timing.timings[name].median_ms,
                baseline=timing.timings["baseline"].median_ms,
                target=target or "",
                met=met if judged and target else None,
                note=note,
            )
        )
    compiled = steps.get("all flags")
    if compiled is not None and compiled.flags.compile:
        rows.append(
            Row(
                PHASE,
                "vit compile: all flags",
                "first forward + backward (compile), outside every step time",
                "s",
                compiled.compile_seconds,
                note="torch.compile default mode",
            )
        )
    del steps
    release_memory(ctx.device)
    return rows


def _equal(
    result: dict, reference: dict, flags: vit.Flags, sizes: vit.Sizes, steps: int
) -> tuple[bool, str]:
    """Whether ``result`` is within ``vit.tolerance``, and the largest difference or what failed."""
    try:
        errors = vit.compare_results(result, reference, flags, sizes=sizes, steps=steps)
    except AssertionError as failed:
        return False, str(failed).splitlines()[0]
    return True, f"largest difference {max(errors.values()):.2g} of the entry's largest value"
