"""A transformer neural operator for 1-D advection, trained on data generated on the fly.

The workload of the training recipe (notebook 07). Each sample is one solution
of ``u_t + c u_x = 0`` on the periodic interval [0, 1): a random smooth initial condition
``u0(x) = sum_k (a_k sin 2 pi k x + b_k cos 2 pi k x) / k`` (a few modes, a and b standard
normal) and a random speed ``c`` in [-1, 1]; the exact solution is ``u(x, t) = u0(x - c t)``.
The model sees ``u0`` on a grid of ``grid`` points (with the coordinates and ``c``) and is asked
for ``u`` at ``queries`` random points ``(x, t)``, t in [0, 1]:

- an encoder (``depth`` self-attention blocks over the grid tokens);
- a decoder (``decoder_depth`` blocks whose query tokens cross-attend into the encoded grid);
  a query token carries Fourier features of x and of the characteristic coordinate x - c t;
- the auxiliary "inverse" loss: a second transformer (``inverse_depth`` self-attention blocks)
  reads the *predicted* field at a subsample of the query points and recovers ``c`` and the
  Fourier coefficients of ``u0`` from it. Its attention is quadratic in the queries it sees,
  which makes it a large share of a step at the presets (its rows: results/recipe-notes.md).

The data come through a real ``torch.utils.data.DataLoader`` over :class:`AdvectionDataset`,
whose samples are computed on the CPU when asked for (tens of microseconds each): a function
of ``(seed, index)`` only, so every loader setting and every rank sees the same samples.

``Flags()`` is the step as first written: eager, every activation stored, the inverse loss on
every step over every query, the batches generated in the training loop and copied with a
blocking copy, float32, AdamW's default (foreach) step with its state on the device.

Modules: ``settings`` (Flags, Sizes, what cannot run where), ``data`` (samples, dataset, loader),
``model`` (the networks and losses), ``step`` (the training step, its tolerances), ``task`` (the
distributed task). The package exports the workload's contract and the data and model functions
the notebooks and the bench use.
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
from accel.workloads.advection.step import Step, build, compare_results, tolerance
from accel.workloads.advection.task import distributed_task

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
