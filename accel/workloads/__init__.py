"""Training workloads the notebooks optimize, one code path each, switched by a ``Flags`` dataclass.

The contract every module of :data:`WORKLOADS` keeps (``tests/test_workloads.py`` holds each to it):
``Flags``, a frozen dataclass of :func:`accel.workloads.flags.flag` and ``option`` fields, each
with its phase, help and requirement (``Flags()`` is the "before"); ``Sizes`` with
``Sizes.preset(name)`` for ``cpu`` and ``gpu``; ``build(flags, sizes, *, device, seed)``, a step
to call, whose ``result()`` holds the tensors every flag must leave (near) unchanged;
``tolerance(flags, sizes, steps)``, per entry of the result how far it may move from the
baseline's (an :data:`accel.workloads.compare.Tolerance`, None where not comparable); and
``compare_results(result, reference, flags, *, sizes, steps)``, an AssertionError naming the
entry beyond it, else each entry's largest difference.
"""

# The workload modules, by name under accel.workloads (imported on demand: each pulls in its own)
WORKLOADS = ("tiny_mlp", "field_trainer", "nested_optimizer", "polychromic", "vit", "advection")
