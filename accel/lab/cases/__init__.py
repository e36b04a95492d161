"""Bench cases, one module per phase, registered by name in ``accel.phases.PHASES``; a large
phase keeps its parts in modules named after it (``sdpa_flex`` ...), re-exported by the phase's."""
