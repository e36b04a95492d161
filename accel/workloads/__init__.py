"""Training workloads the notebooks optimize, one code path each, switched by a ``Flags`` dataclass.

The contract every workload module in :data:`WORKLOADS` keeps (the lab relies on nothing else;
``tests/test_workloads.py`` holds each to it):

- ``Flags``: a frozen dataclass, one field per optimization, made with
  :func:`accel.workloads.flags.flag` (or ``option``) so each carries its phase, a one-line help
  text and what it requires; ``Flags()`` is the "before".
- ``Sizes`` with ``Sizes.preset(name)`` for the ``cpu`` and ``gpu`` presets.
- ``build(flags, sizes, *, device, seed)`` returning a ``Step``: call it to run one step;
  ``step.result()`` gives the tensors that every flag must leave (near) unchanged.
- ``tolerance(flags, sizes, steps)``: per entry of ``step.result()``, how far ``flags`` may
  leave it from the baseline's after ``steps`` calls at ``sizes`` (an
  :data:`accel.workloads.compare.Tolerance`, or None where the entry is not comparable).
- ``compare_results(result, reference, flags, *, sizes, steps)``: raises an AssertionError
  naming the entry where ``result`` (of ``flags``) leaves that tolerance of ``reference`` (the
  baseline's, same seed), else returns each entry's largest difference.
"""

# The workload modules, by name under accel.workloads (imported on demand: each pulls in its own)
WORKLOADS = ("tiny_mlp", "field_trainer", "nested_optimizer", "polychromic", "vit", "advection")
