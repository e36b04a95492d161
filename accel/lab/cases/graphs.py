"""Bench phase ``graphs`` (notebook 04): CUDA graphs against the best eager code, with
``torch.compile(mode="reduce-overhead")`` timed beside each (its compile time apart): the
field-trainer window, its replay against its kernels' time and a small launch-bound model's
whole step. Off a GPU there is nothing to capture: the rows say so and time only the eager
forms."""

from __future__ import annotations

import dataclasses
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from accel import graphs
from accel.lab.bench import BenchContext, Row, speedup_row
from accel.measure.costs import CostModel, measure_costs
from accel.measure.profile import profile_step
from accel.measure.timer import Comparison, compare
from accel.workloads import field_trainer as ft
from accel.workloads import nested_optimizer as no
from accel.workloads.flags import through_phase

EAGER_WINDOW = through_phase(ft.Flags, "memory")  # the optimized eager window: phases 1-3 on
GRAPHED_WINDOW = dataclasses.replace(EAGER_WINDOW, cuda_graph=True)
# Each step compiled (fewer, longer kernels: fewer gaps in a replay), then also built for
# back-to-back replay (PDL, combo kernels): the last kind is judged against its kernels.
_COMPILED_WINDOW = dataclasses.replace(EAGER_WINDOW, compiled_step=True)
REPLAYED_WINDOWS = {  # the eager and graphed windows of each kind, by label
    kind: (eager, dataclasses.replace(eager, cuda_graph=True))
    for kind, eager in (
        ("", EAGER_WINDOW),
        (", compiled step", _COMPILED_WINDOW),
        (", overlapped launches", dataclasses.replace(_COMPILED_WINDOW, overlapped_launches=True)),
    )
}
# The nested optimizer with every fusion and memory flag that keeps gradients in place.
EAGER_STEP = dataclasses.replace(through_phase(no.Flags, "fusion"), preallocated_buffers=True)
# A small model whose step is launch-bound: ~700 kernels of microseconds each.
SMALL = {
    "gpu": no.Sizes(layers=4, width=256, heads=4, context=128, batch=8),
    "cpu": no.Sizes.preset("cpu"),
}
TARGETS = {"window": 1.6, "whole_step": 3.0, "replay_vs_kernels": 1.15}


@dataclass
class Compiled:
    """A ``torch.compile(mode="reduce-overhead")`` variant: the callable, or why there is none."""

    fn: Callable[[], object] | None
    compile_s: float = float("nan")
    error: str = ""

    def add_to(self, steps: dict[str, Callable[[], object]]) -> None:
        """Time it beside ``steps`` as "compile", if it exists."""
        if self.fn is not None:
            steps["compile"] = self.fn

    def note(self, timing: Comparison | None = None) -> str:
        if self.fn is None:
            return f"compile reduce-overhead: not run ({self.error})"
        ms = timing.timings["compile"].median_ms if timing is not None else math.nan
        return f"compile reduce-overhead {ms:.3g} ms (compiling took {self.compile_s:.0f} s)"


def compile_reduce_overhead(
    make: Callable[[], Callable[[], object]], device, *, enabled: bool = True
) -> Compiled:
    """Build a reduce-overhead variant with ``make()`` and run it until it is compiled and its
    CUDA graphs recorded; CUDA only (on a CPU the mode has no graphs to add)."""
    if not enabled:
        return Compiled(None, error="not asked")
    if torch.device(device).type != "cuda":
        return Compiled(None, error="CUDA only: reduce-overhead is compile plus CUDA graphs")
    start = time.perf_counter()
    try:
        fn = make()
        for _ in range(3):  # compile, record, replay
            fn()
        torch.cuda.synchronize(device)
    except Exception as exc:  # report, never break the bench
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Compiled(None, error=last[:300])
    return Compiled(fn, time.perf_counter() - start)


def _step_begin(fn: Callable[..., object]) -> Callable[..., object]:
    """Each call a new step for compile's CUDA-graph trees (no output is kept past the next)."""

    def call(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return fn(*args)

    return call


# ---- the field-trainer window --------------------------------------------------------------------
def window_variants(
    sizes: ft.Sizes, device, *, with_compile: bool = True, progress: bool = False
) -> dict:
    """Eager (phases 1-3), hand-graphed and compile-reduce-overhead field-trainer steps, warmed
    up and checked equal to the eager one: {"steps": {label: step}, "compiled": ...}.
    ``progress`` draws a bar of the four stages."""
    from tqdm.auto import tqdm

    stages = tqdm(total=4, desc="building the windows", disable=not progress)
    kinds = REPLAYED_WINDOWS if device.type == "cuda" else {"": REPLAYED_WINDOWS[""]}
    steps = {}  # on a CPU the compiled steps would only add minutes
    for kind, (eager, graphed) in kinds.items():
        steps[f"eager{kind}"] = ft.build(eager, sizes, device=device)
        steps[f"graphed{kind}"] = ft.build(graphed, sizes, device=device)
    _next_stage(stages, "warm-up and capture")
    for _ in range(4):  # graphed: two eager warm-ups, the capture, a replay
        for step in steps.values():
            step()
    _next_stage(stages, "each checked against eager")
    for step in steps.values():
        reference = steps["eager"].result()
        ft.compare_results(step.result(), reference, step.flags, sizes=sizes, steps=step.windows)
    _next_stage(stages, "compile reduce-overhead")
    compiled = compile_reduce_overhead(
        lambda: _compiled_window(sizes, device), device, enabled=with_compile
    )
    compiled.add_to(steps)
    _next_stage(stages, "done")
    stages.close()
    return {"steps": steps, "compiled": compiled}


def _next_stage(bar, description: str) -> None:
    bar.update()
    bar.set_description_str(description)


def _compiled_window(sizes: ft.Sizes, device) -> Callable[[], None]:
    """The eager window with each step (``Step.advance``, not the whole window: that would unroll
    its steps) under compile reduce-overhead; the fixed tensors marked static, so compile's
    graphs read them in place instead of copying them in on every call."""
    step = ft.build(EAGER_WINDOW, sizes, device=device)
    for t in (step.C, step.keys, step.values, step.g0, step.planes, step.theta, step.target):
        torch._dynamo.mark_static_address(t)
    # A window's 64 calls chain outputs into inputs: one "step" of compile's graph trees is the
    # window (marked before it), so no output is overwritten while the next call reads it.
    step.advance = torch.compile(step.advance, mode="reduce-overhead")
    step.window = _step_begin(step.run_window)
    return step


def launch_model(eager_ms: float, kernel_ms: float, launches: float, cost: CostModel) -> dict:
    """What a graph can gain: the eager window costs at least its launches' host time and at least
    its kernels' device time; a replay costs about the kernels alone."""
    return {
        "host_launch_ms": launches * cost.launch_us / 1e3,
        "kernel_ms": kernel_ms,
        "predicted_speedup": eager_ms / kernel_ms if kernel_ms > 0 else float("nan"),
    }


def window_rows(ctx: BenchContext, cost: CostModel) -> list[Row]:
    sizes = ft.Sizes.preset(ctx.preset)
    cuda = ctx.device.type == "cuda"
    variants = window_variants(sizes, ctx.device, with_compile=cuda)
    steps, compiled = variants["steps"], variants["compiled"]
    timing = compare(steps, warmup=2, repeats=30, device=ctx.device)
    eager_report = profile_step(steps["eager"], steps=3, device=ctx.device)
    kernel_ms = float(eager_report.kernels["total_us"].sum()) / eager_report.steps / 1e3
    model = launch_model(
        timing.timings["eager"].median_ms, kernel_ms, eager_report.launches_per_step, cost
    )
    graph = steps["graphed"].window
    graphed_state = (
        f"{graph.graphs} graph, pool {graph.pool_bytes / 2**20:.1f} MiB"
        if isinstance(graph, graphs.GraphedStep) and graph.reason is None
        else f"eager fallback ({getattr(graph, 'reason', 'no graph')})"
    )
    rows = [speedup_row(
        ctx, "graphs", "field_trainer_window",
        f"time per {sizes.steps_per_window}-step window, phases 1-3 eager vs graphed", timing,
        "graphed", TARGETS["window"], f"{graphed_state}; {eager_report.launches_per_step:.0f} "
        f"launches per eager window, their kernels {kernel_ms:.2f} ms: the launch model "
        f"predicted {model['predicted_speedup']:.2f}x; {compiled.note(timing)}", baseline="eager",
    )]  # fmt: skip
    label, replay = list(replay_accounts(steps, ctx.device, eager_report=eager_report).items())[-1]
    rows.append(Row(
        "graphs", "replay_vs_kernel_time",
        f"graphed window time over the summed time of its kernels (profiled eager window), {label}",
        "ms", replay.replay_ms, baseline=replay.kernels_ms,
        target=f"<= {TARGETS['replay_vs_kernels']}x the kernels",
        met=replay.ratio <= TARGETS["replay_vs_kernels"] if ctx.judged and cuda else None,
        note=f"{ctx.where}; {replay.note()}; replays timed among the graphed windows",
    ))  # fmt: skip
    return rows


@dataclass
class ReplayAccount:
    """A graphed window's replay against the kernels of the same window run eagerly, and against
    its own kernels profiled inside the graph: what is left above those is the gaps."""

    replay_ms: float
    kernels_ms: float  # summed kernel time of the eager window
    kernels: float  # kernels a window, eager
    inside_ms: float  # summed kernel time inside the replay
    inside_kernels: float

    @property
    def ratio(self) -> float:
        return self.replay_ms / self.kernels_ms if self.kernels_ms > 0 else math.nan

    @property
    def gap_us(self) -> float:
        """Replay time not covered by a kernel, per kernel (negative where kernels overlap)."""
        return (self.replay_ms - self.inside_ms) * 1e3 / max(self.inside_kernels, 1)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self) | {"ratio": self.ratio, "gap_us": self.gap_us}

    def note(self) -> str:
        return (
            f"ratio {self.ratio:.3f} ({self.replay_ms:.3f} ms over {self.kernels:.0f} kernels "
            f"of {self.kernels_ms:.3f} ms), inside the replay {self.inside_kernels:.0f} kernels "
            f"of {self.inside_ms:.3f} ms ({self.inside_ms / self.kernels_ms:.3f}x their eager "
            f"time), {self.gap_us:.2f} us of gap a kernel"
        )


def replay_accounts(
    steps: dict[str, Callable[[], object]], device, *, eager_report=None, repeats: int = 30
) -> dict[str, ReplayAccount]:
    """A :class:`ReplayAccount` per graphed window of :func:`window_variants`, the replays timed
    back to back among themselves (between host-bound eager windows they would run slower), each
    replay profiled (the profiler sees its kernels). ``eager_report``: ``steps["eager"]``'s
    profile, already taken."""
    graphed = {label: step for label, step in steps.items() if label.startswith("graphed")}
    timing = compare(graphed, warmup=2, repeats=repeats, device=device)
    accounts = {}
    for label, step in graphed.items():
        eager_label = "eager" + label.removeprefix("graphed")
        if eager_label == "eager" and eager_report is not None:
            report = eager_report
        else:
            report = profile_step(steps[eager_label], steps=3, device=device)
        inside = profile_step(step, steps=3, device=device)
        accounts[label] = ReplayAccount(
            timing.timings[label].median_ms,
            float(report.kernels["total_us"].sum()) / report.steps / 1e3,
            report.launches_per_step,
            float(inside.kernels["total_us"].sum()) / inside.steps / 1e3,
            float(inside.kernels["count"].sum()) / inside.steps,
        )
    return accounts


# ---- a whole training step of a small model ---------------------------------------------------
def whole_step_variants(sizes: no.Sizes, device, *, with_compile: bool = True) -> dict:
    """Eager, hand-graphed (forward, backward, controller, clipping, AdamW in one graph) and
    compile-reduce-overhead (the model compiled; the optimizer part eager) training steps."""
    eager = no.build(EAGER_STEP, sizes, device=device)
    whole = dataclasses.replace(EAGER_STEP, cuda_graph="whole_step")
    graphed = no.build(whole, sizes, device=device)
    for _ in range(6):
        eager()
        graphed()
    no.compare_results(graphed.result(), eager.result(), EAGER_STEP, sizes=sizes, steps=6)
    steps = {"eager": eager, "graphed": graphed}
    compiled = compile_reduce_overhead(
        lambda: _compiled_step(sizes, device), device, enabled=with_compile
    )
    compiled.add_to(steps)
    return {"steps": steps, "compiled": compiled}


def _compiled_step(sizes: no.Sizes, device) -> Callable[[], None]:
    # Gradients to None each step: under compile's CUDA graphs they are outputs of the backward
    # graph, which the next step's replay overwrites; zeroing them in place would touch them.
    flags = dataclasses.replace(EAGER_STEP, set_to_none_grads=True)
    step = no.build(flags, sizes, device=device)
    step.model = torch.compile(step.model, mode="reduce-overhead")
    return _step_begin(step)


def whole_step_rows(ctx: BenchContext) -> list[Row]:
    sizes = SMALL[ctx.preset]
    if ctx.device.type != "cuda":
        return [_not_run("whole_step_small_model", "whole training step graphed", ctx.where)]
    v = whole_step_variants(sizes, ctx.device)
    timing = compare(v["steps"], warmup=3, repeats=40, device=ctx.device)
    graph = v["steps"]["graphed"].graphed_step
    return [speedup_row(
        ctx, "graphs", "whole_step_small_model", f"training step of a {sizes.layers}-layer "
        f"width-{sizes.width} GPT (batch {sizes.batch} x {sizes.context}), eager vs one graph",
        timing, "graphed", TARGETS["whole_step"], "forward, backward, controller, clipping and "
        f"fused capturable AdamW in {graph.graphs} graph(s), pool {graph.pool_bytes / 2**20:.1f} "
        f"MiB; {v['compiled'].note(timing)}", baseline="eager",
    )]  # fmt: skip


def _not_run(case: str, what: str, where: str) -> Row:
    note = f"{where}; not run: CUDA graphs need a CUDA GPU"
    return Row("graphs", case, what, "ms", math.nan, note=note)


def run(ctx: BenchContext) -> list[Row]:
    cost = measure_costs(ctx.device)
    return [*window_rows(ctx, cost), *whole_step_rows(ctx)]
