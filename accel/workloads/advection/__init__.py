"""A transformer neural operator for 1-D advection, trained on data generated on the fly.

The workload of the training recipe (notebook 07). Each sample is one solution of
``u_t + c u_x = 0`` on the periodic interval [0, 1): a random smooth initial condition ``u0`` (a
few Fourier modes) and a random speed ``c`` in [-1, 1]; the exact solution is ``u0(x - c t)``.
The model sees ``u0`` on ``grid`` points and is asked for ``u`` at ``queries`` random ``(x, t)``:
an encoder over the grid tokens, a decoder whose query tokens (Fourier features of x and of the
characteristic x - c t) cross-attend into it, and an auxiliary "inverse" loss: a second
transformer reads the *predicted* field at some queries and recovers ``c`` and ``u0``'s
coefficients, with attention quadratic in the queries it sees.

Samples come through a real ``DataLoader``, computed on the CPU when asked for, a function of
``(seed, index)`` only: every loader setting and every rank sees the same samples. ``Flags()``
is the step as first written: eager, every activation stored, the inverse loss on every step
over every query, batches made in the loop and copied blocking, float32, AdamW's default step.

Modules: ``settings`` (Flags, Sizes, what cannot run where), ``data``, ``model``, ``step`` (the
step, its tolerances, the distributed task); the package exports the contract and what the
notebooks and the bench use.
"""

from accel.workloads.advection.data import (
    CHANNELS,
    batch_of,
    exact_solution,
    grid_points,
    initial_condition,
    make_sample,
    rank_batch,
)
from accel.workloads.advection.model import init_model
from accel.workloads.advection.settings import Flags, Sizes, flag_default, unavailable
from accel.workloads.advection.step import (
    Step,
    build,
    compare_results,
    distributed_task,
    tolerance,
)

__all__ = [
    "CHANNELS",
    "Flags",
    "Sizes",
    "Step",
    "batch_of",
    "build",
    "compare_results",
    "distributed_task",
    "exact_solution",
    "flag_default",
    "grid_points",
    "init_model",
    "initial_condition",
    "make_sample",
    "rank_batch",
    "tolerance",
    "unavailable",
]
