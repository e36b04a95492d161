"""Training workloads the notebooks optimize, one code path each, switched by a ``Flags`` dataclass.

The contract every workload keeps (the lab relies on nothing else):

- ``Flags``: a frozen dataclass, one field per optimization, made with :func:`flag` so each carries
  its phase and a one-line help text; ``Flags()`` is the "before".
- ``Sizes`` with ``Sizes.preset(name)`` for the ``cpu`` and ``gpu`` presets.
- ``build(flags, sizes, device=..., seed=...)`` returning a :class:`Step`: call it to run one step;
  ``step.result()`` gives the tensors that every flag must leave (near) unchanged.
"""
