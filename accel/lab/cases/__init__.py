"""Bench cases, one module per phase, registered by name in ``accel.lab.bench.PHASES``."""
