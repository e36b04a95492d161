"""The field trainer: a windowed, two-phase contrastive trainer without autograd [Trainer2 guide].

One call of the step runs one window of ``steps_per_window`` steps: a free phase, then a phase
nudged toward the window's target pattern. Each step computes a scalar curvature ``R_sc`` of the
field, a retrieval over a memory bank (cost of each entry under the metric ``g0``, weights
``softmax(-beta * cost)``, values mixed by them), the speed ``spd = sqrt(g0(v, v) + eps)``, Givens
rotations of the velocity ``v`` in ``rotor_k`` planes per layer, the LIoR loss ``R_sc * spd``, the
field update, and metric accumulators (LIoR, R, spd) with a progress read-out every
``progress_every`` steps. Every ``nudge_every_windows`` windows the rotor angles move with the
difference between the phases' statistics, plane by plane.

``Flags()`` is the "before", written the way such code usually is; each flag removes one cost.
Launch-bound at the ``gpu`` preset: the home of phases 1-4. ``cuda_graph`` captures
:meth:`Step.run_window` (the device work, on tensors allocated once) and needs
``batched_progress`` (an ``.item()`` inside fails the capture: the window then runs eagerly, with
a warning naming it); host work (progress, the rotor schedule) stays outside.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from accel import graphs, sync
from accel.workloads.compare import make_compare_results
from accel.workloads.compiling import own_code
from accel.workloads.field_dynamics import (  # the step's math, public here too (ft.*)
    accumulating_step,
    field_step,
    metric_cost,  # noqa: F401
    retrieve,  # noqa: F401
)
from accel.workloads.flags import Presets, check_int, check_sizes, flag

METRICS = ("lior", "R", "spd")
# Flags keep results within this of the baseline's: some sum in another order or update in float32
# where the loop used Python floats; the dynamics are damped, so differences do not grow.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@dataclass(frozen=True)
class Flags:
    batched_progress: bool = flag(
        "progress read-outs recorded on the device and copied to the host once per window, "
        "instead of three .item() syncs per read-out",
        "sync",
    )
    vectorized_rotor: bool = flag(
        "rotor rotations and angle updates as batched index ops, instead of Python loops over "
        "planes that read each index and value with .item()",
        "sync",
    )
    fused_lior: bool = flag(
        "compute the quadratic form g0(v, v) once per step for both LIoR and the speed", "fusion"
    )
    compiled_step: bool = flag(
        "each step (with inplace_accumulate, its accumulation too) through torch.compile: its "
        "many small kernels, the retrieval's included, fused into a few, so fewer launches",
        "fusion",
        adopted=False,
    )
    inplace_accumulate: bool = flag(
        "accumulate metrics and velocity in place instead of a fresh tensor each step", "memory"
    )
    cuda_graph: bool = flag(
        "the window's device work captured once as a CUDA graph and replayed: one launch per "
        "window instead of one per kernel (needs batched_progress: no host reads inside)",
        "graphs",
        requires="cuda",
    )
    overlapped_launches: bool = flag(
        "the compiled step (needs compiled_step) built for back-to-back replay: programmatic "
        "dependent launch and combo kernels shrink the gaps between a graph's kernels",
        "graphs",
        requires="cuda",
        adopted=False,
    )


@dataclass(frozen=True)
class Sizes(Presets):
    """Sizes and settings. Validated on creation: a bad value names its field and range."""

    batch: int = 64  # field points
    dim: int = 64  # coordinates per point
    bank: int = 256  # memory-bank entries
    steps_per_window: int = 64  # half free phase, half nudged
    progress_every: int = 8  # read-out every this many steps of a phase; 0: none
    rotor_layers: int = 2
    rotor_k: int = 6  # disjoint planes per layer
    nudge_every_windows: int = 1
    metric: Literal["full", "diag"] = "full"
    patterns: int = 4  # target patterns, one per window in turn
    beta: float = 2.0  # retrieval sharpness (cost is per coordinate)
    nudge: float = 0.5
    dt: float = 0.1
    damping: float = 0.1
    rotor_lr: float = 0.5
    eps: float = 1e-6

    def __post_init__(self):
        check_sizes(self, ("batch", "bank", "rotor_layers", "nudge_every_windows", "patterns"))
        check_sizes(self, positive=("beta", "dt", "rotor_lr", "eps"))
        check_int("dim", self.dim, 2)
        check_int("steps_per_window", self.steps_per_window, 2)
        if self.steps_per_window % 2:
            raise ValueError(
                f"Sizes.steps_per_window must be even (a free and a nudged phase "
                f"of equal length), got {self.steps_per_window}"
            )
        why = "(steps of a phase between read-outs; 0 turns them off)"
        check_int("progress_every", self.progress_every, 0, self.steps_per_phase, why)
        why = f"(disjoint planes per layer in {self.dim} coordinates)"
        check_int("rotor_k", self.rotor_k, 1, self.dim // 2, why)
        if self.metric not in ("full", "diag"):
            raise ValueError(f"Sizes.metric must be 'full' or 'diag', got {self.metric!r}")
        if not 0 <= self.damping < 1:
            raise ValueError(f"Sizes.damping must be in [0, 1), got {self.damping}")
        if self.nudge < 0:
            raise ValueError(f"Sizes.nudge must be >= 0, got {self.nudge}")

    @property
    def steps_per_phase(self) -> int:
        return self.steps_per_window // 2

    @property
    def readouts_per_window(self) -> int:
        return 2 * (self.steps_per_phase // self.progress_every) if self.progress_every else 0


Sizes.PRESETS = {
    "cpu": Sizes(batch=8, dim=16, bank=16, steps_per_window=16, progress_every=4, rotor_k=3),
    "gpu": Sizes(),  # the plain trainer's defaults; small tensors: launch-bound
}


# Inductor options of ``overlapped_launches``, off by default; PDL needs compute capability 9.0+.
OVERLAPPED_LAUNCHES = {"triton.enable_pdl": True, "combo_kernels": True}
# One torch.compile per step function and launch style, per process.
_COMPILED_STEPS: dict[tuple[Callable, bool], Callable] = {}


def check_metric(g0: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    """``g0`` as float32 after checking it is a metric: (dim, dim) symmetric positive definite
    for ``metric='full'``, (dim,) positive for ``'diag'``."""
    diag = sizes.metric == "diag"
    shape = (sizes.dim,) if diag else (sizes.dim, sizes.dim)
    g0 = torch.as_tensor(g0).detach().to("cpu", torch.float64)
    if g0.shape != shape:
        raise ValueError(f"g0: a {sizes.metric} metric needs shape {shape}, got {tuple(g0.shape)}")
    if diag and not bool((g0 > 0).all()):
        raise ValueError(f"g0: a diagonal metric needs every entry > 0, got min {g0.min():.3g}")
    if diag:
        return g0.float()
    if not torch.allclose(g0, g0.T, rtol=1e-6, atol=1e-8):
        raise ValueError(
            f"g0 must be symmetric (a metric); got max |g0 - g0.T| = {(g0 - g0.T).abs().max():.3g}"
        )
    smallest = torch.linalg.eigvalsh(g0)[0].item()
    if smallest <= 0:
        raise ValueError(
            f"g0 must be positive definite (g(v, v) > 0 for v != 0): its eigenvalues "
            f"must be > 0, smallest is {smallest:.3g}"
        )
    return g0.float()


def apply_batched_progress(flags: Flags, sizes: Sizes, device: torch.device) -> Any:
    """``batched_progress``: a :class:`accel.sync.ProgressLog` that records the read-outs on the
    device and copies them to the host once per window; None for the "before" (``.item()``)."""
    if not flags.batched_progress:
        return None
    return sync.ProgressLog(METRICS, max(sizes.readouts_per_window, 1), device=device)


def apply_compiled_step(step: Step) -> Callable | None:
    """``compiled_step``: the step (:func:`accumulating_step` with ``inplace_accumulate``, else
    :func:`field_step`) through torch.compile (for back-to-back replay with
    ``overlapped_launches``), one compilation per process, checked against eager here for both
    phases (so it compiles outside any timed window). None without the flag, or, with a
    warning, where it cannot run."""
    f = step.flags
    if not f.compiled_step:
        if f.overlapped_launches:
            warnings.warn(
                "overlapped_launches changes how the compiled step is built: without "
                "compiled_step it does nothing",
                RuntimeWarning,
                stacklevel=3,  # the caller of build()
            )
        return None
    fn = accumulating_step if f.inplace_accumulate else field_step
    key = (fn, f.overlapped_launches)
    if key not in _COMPILED_STEPS:
        source = own_code(fn, "overlapped") if f.overlapped_launches else fn
        options = OVERLAPPED_LAUNCHES if f.overlapped_launches else None
        _COMPILED_STEPS[key] = torch.compile(source, dynamic=False, options=options)
    compiled = _COMPILED_STEPS[key]
    options = step._step_options()

    def call(x, v, nudge, *accumulators):
        return compiled(x, v, nudge, *accumulators, *step._fixed(), **options)

    try:
        _check_compiled_step(step, fn, call, options)
    except Exception as exc:  # no compiler, no Triton, a mismatch...
        _warn_eager("compiled_step", exc, "step")
        return None
    return call


def _warn_eager(flag: str, exc: Exception, what: str) -> None:
    detail = " ".join(line.strip() for line in str(exc).splitlines()[:4])
    warnings.warn(
        f"{flag}: torch.compile cannot run here or differs from eager "
        f"({type(exc).__name__}: {detail}); using the eager {what}",
        RuntimeWarning,
        stacklevel=4,  # the caller of build()
    )


def _copy(a: Any) -> Any:
    return a.clone() if isinstance(a, torch.Tensor) else a


def _check_compiled_step(step: Step, fn: Callable, call: Callable, options: dict) -> None:
    """``call`` (compiled) against ``fn`` (eager) on copies of the state, for both phases."""
    extra = (step._acc, step._vel_acc) if step.flags.inplace_accumulate else ()
    for nudge in (0.0, step.sizes.nudge):
        args = (step.x, step.v, nudge, *extra)
        want = fn(*[_copy(a) for a in args], *step._fixed(), **options)
        got = call(*[_copy(a) for a in args])
        torch.testing.assert_close(got, want, **TOLERANCE)


def apply_cuda_graph(run_window: Callable[[], None], flags: Flags, device: torch.device):
    """``cuda_graph``: the window's device work captured as a CUDA graph and replayed. It reads
    and writes only tensors allocated at build, in place, so a replay is the window. Off a GPU
    it warns once and runs eagerly."""
    if not flags.cuda_graph:
        return run_window
    return graphs.GraphedStep(run_window, warmup=2, device=device, name="run_window")


class Step:
    """One window per call. Public state lives in tensors allocated once and updated in place.
    ``g0`` (a tensor) and ``planes`` (rotor index pairs) override the seeded metric and planes."""

    def __init__(self, flags=Flags(), sizes=Sizes(), *, device="cpu", seed=0, g0=None, planes=None):
        device = torch.device(device)
        self.flags, self.sizes, self.device = flags, sizes, device
        self._init_field(seed, g0, planes)
        self.metrics = torch.zeros(2, len(METRICS), device=device)  # (phase, metric) means
        self.v_mean = torch.zeros(2, sizes.dim, device=device)  # mean velocity per phase
        self._acc = torch.zeros(len(METRICS), device=device)  # in-place accumulators
        self._vel_acc = torch.zeros(sizes.batch, sizes.dim, device=device)
        self._host_rows: list[dict[str, float]] = []
        self.windows = 0
        self.log = apply_batched_progress(flags, sizes, device)
        self._compiled_step = apply_compiled_step(self)
        self.window: Callable[[], None] = apply_cuda_graph(self.run_window, flags, device)

    def _init_field(self, seed: int, g0: torch.Tensor | None, planes: Any) -> None:
        """The field, bank, patterns, curvature form, metric and rotor from ``seed`` (``g0`` and
        ``planes`` where given), in this order, the same on every device and flag."""
        device = self.device
        s, d = self.sizes, self.sizes.dim
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(device)

        self.x = randn(s.batch, d)
        self.v = randn(s.batch, d, scale=0.5)
        self.keys, self.values = randn(s.bank, d), randn(s.bank, d)
        self.targets = randn(s.patterns, s.batch, d)
        # this window's pattern, a static buffer, set before the compiled step's check reads it
        self.target = self.targets[0].clone()
        a = torch.randn(d, d, generator=gen) / math.sqrt(d)
        self.C = ((a + a.T) / 2).to(device)  # symmetric: a curvature form
        if g0 is None:
            b = torch.randn(d, d, generator=gen) / math.sqrt(d)
            g0 = (
                b @ b.T + 0.5 * torch.eye(d)
                if s.metric == "full"
                else 0.5 + torch.rand(d, generator=gen)
            )
        self.g0 = check_metric(g0, s).to(device)
        if planes is None:
            perms = [
                torch.randperm(d, generator=gen)[: 2 * s.rotor_k] for _ in range(s.rotor_layers)
            ]
            planes = torch.stack(perms).view(s.rotor_layers, s.rotor_k, 2)
        host_planes = sync.check_planes(planes, d)
        self.planes = host_planes.to(device)
        self.host_planes = host_planes  # the loop reference reads plain ints, no device sync
        angles = torch.rand(host_planes.shape[:2], generator=gen) * 2 - 1
        self.theta = (angles * math.pi).to(device)

    def __call__(self) -> None:
        if self.log is not None:
            self.log.collect()  # rows of earlier windows that have landed; never waits
        self.target.copy_(self.targets[self.windows % self.sizes.patterns])
        self.window()
        if self.log is not None and self.flags.cuda_graph:
            # a replay wrote the window's rows on the device without running record()
            self.log.assume_recorded(self.sizes.readouts_per_window)
        if (self.windows + 1) % self.sizes.nudge_every_windows == 0:
            self.update_rotor()
        if self.log is not None:
            self.log.flush()
        self.windows += 1

    def run_window(self) -> None:
        """The device work of one window: both phases; writes ``metrics`` and ``v_mean``."""
        s, f = self.sizes, self.flags
        x, v = self.x, self.v
        for phase, nudge in enumerate((0.0, s.nudge)):
            if f.inplace_accumulate:
                self._acc.zero_()
                self._vel_acc.zero_()
                lior_acc, R_acc, spd_acc = self._acc.unbind()
                vel_acc = self._vel_acc
            else:
                lior_acc = R_acc = spd_acc = torch.zeros((), device=self.device)
                vel_acc = torch.zeros_like(v)
            step = self._compiled_step or self.advance
            fused = self._compiled_step is not None and f.inplace_accumulate
            for t in range(1, s.steps_per_phase + 1):
                if fused:  # the compiled step adds to _acc (lior_acc... are its views) itself
                    x, v = step(x, v, nudge, self._acc, self._vel_acc)
                else:
                    x, v, dlior, R_sc, spd = step(x, v, nudge)
                    if f.inplace_accumulate:
                        lior_acc.add_(dlior.mean())
                        R_acc.add_(R_sc.mean())
                        spd_acc.add_(spd.mean())
                        vel_acc.add_(v)
                    else:  # a fresh tensor per accumulation
                        lior_acc = lior_acc + dlior.mean()
                        R_acc = R_acc + R_sc.mean()
                        spd_acc = spd_acc + spd.mean()
                        vel_acc = vel_acc + v
                if s.progress_every and t % s.progress_every == 0:
                    self._progress(lior_acc, R_acc, spd_acc, 1.0 / t)
            n = s.steps_per_phase
            torch.stack([lior_acc, R_acc, spd_acc], out=self.metrics[phase]).div_(n)
            torch.mean(vel_acc, 0, out=self.v_mean[phase]).div_(n)
        self.x.copy_(x)
        self.v.copy_(v)

    def advance(
        self, x: torch.Tensor, v: torch.Tensor, nudge: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of the field: the new ``x`` and ``v`` and the step's LIoR, curvature and
        speed per point. A pure function of its arguments and the step's fixed tensors."""
        return field_step(x, v, nudge, *self._fixed(), **self._step_options())

    def _fixed(self) -> tuple[torch.Tensor, ...]:
        return (self.C, self.keys, self.g0, self.values, self.theta, self.target)

    def _step_options(self) -> dict[str, Any]:
        s, f = self.sizes, self.flags
        vectorized = f.vectorized_rotor
        return dict(
            planes=self.planes if vectorized else self.host_planes,
            rotate_fn=sync.apply_givens if vectorized else sync.apply_givens_reference,
            fused_lior=f.fused_lior,
            **{name: getattr(s, name) for name in ("beta", "eps", "damping", "dt")},
        )

    def _progress(self, lior: torch.Tensor, R: torch.Tensor, spd: torch.Tensor, inv_t: float):
        if self.log is not None:
            self.log.record({"lior": lior, "R": R, "spd": spd}, scale=inv_t)
        else:  # the "before": three .item() per read-out, three syncs
            scaled = {"lior": lior * inv_t, "R": R * inv_t, "spd": spd * inv_t}
            self._host_rows.append(sync.read_scalars_reference(scaled))

    def update_rotor(self) -> None:
        """Move the rotor angles with the nudged-minus-free statistics, plane by plane."""
        v_diff = self.v_mean[1] - self.v_mean[0]
        lior_diff = self.metrics[1, 0] - self.metrics[0, 0]
        fast = self.flags.vectorized_rotor
        update = sync.update_rotor_angles if fast else sync.update_rotor_angles_reference
        update(self.theta, self.planes, v_diff, lior_diff, self.sizes.rotor_lr)

    def progress(self) -> list[dict[str, float]]:
        """Every progress read-out so far, in order (waits for copies still in flight)."""
        return self.log.collect(wait=True) if self.log is not None else self._host_rows

    def result(self) -> dict[str, torch.Tensor]:
        """What every flag must leave unchanged: the last window's metrics per phase, its progress
        read-outs, the rotor angles and the field."""
        n = self.sizes.readouts_per_window
        rows = self.progress()[-n:] if n and self.windows else []
        progress = torch.tensor([[r[m] for m in METRICS] for r in rows], dtype=torch.float32)
        return {
            "metrics": self.metrics.clone(),
            "progress": progress.reshape(-1, len(METRICS)),
            "theta": self.theta.clone(),
            "field": self.x.clone(),
        }


build = Step  # build(flags, sizes, *, device, seed, ...): the contract's name for the step


def tolerance(flags: Flags, sizes: Sizes, steps: int) -> dict[str, dict[str, float]]:
    """:data:`TOLERANCE` for every entry, flag, size and number of windows (damped dynamics)."""
    return dict.fromkeys(("metrics", "progress", "theta", "field"), TOLERANCE)


compare_results = make_compare_results(tolerance)
