"""Every check on one step's evidence, its findings ranked. Importing a check module registers its
checks (``findings.check``), so this module imports them all and nothing imports it but the
examination."""

from __future__ import annotations

from accel.doctor import (  # noqa: F401 - importing a check module registers its checks
    check_attention,
    check_compile,
    check_compute,
    check_host,
    check_kernels,
    check_memory,
)
from accel.doctor.findings import CHECKS, Evidence, Finding

__all__ = ["detect"]


def detect(evidence: Evidence, *, only: tuple[str, ...] | None = None) -> list[Finding]:
    """Every registered check on ``evidence``; findings ranked by predicted saving (those
    without a prediction last, in the checks' order)."""
    found: list[Finding] = []
    for name, fn in CHECKS.items():
        if only is None or name in only:
            found += fn(evidence)
    return sorted(found, key=lambda f: -(f.saved_us if f.saved_us is not None else -1.0))
