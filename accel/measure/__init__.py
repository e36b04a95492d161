"""The measuring library: what the bench (``accel.lab``) and the doctor (``accel.doctor``) measure
with. ``timer`` (callables timed interleaved, with statistics), ``profile`` (one profiled run of a
step as DataFrames, on ``accel.profiling``'s pipeline), ``ceilings`` and ``costs`` (this
machine's copy and matmul rates, a launch's and a sync's cost), ``device`` (device, size preset,
versions), ``attention`` (SDPA's kernels timed at a user's shape), ``show`` (numbers and labels
as the tables and figures print them). It imports neither the bench nor the doctor.
"""
