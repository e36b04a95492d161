"""Bench phase ``ceilings``: the machine's copy bandwidth and matrix-product rate."""

from __future__ import annotations

from accel.lab.bench import BenchContext, Row


def run(ctx: BenchContext) -> list[Row]:
    c = ctx.ceilings
    return [
        Row("ceilings", "copy", "bandwidth (read + write)", "GB/s", c.copy_gb_s,
            higher_is_better=True, fraction_of_ceiling=1.0,
            note=f"{c.copy_bytes / 2**20:.0f} MiB buffer copied on the device, random data"),
        Row("ceilings", f"matmul {c.matmul_dtype} {c.matmul_n}^3", "rate", "TFLOP/s",
            c.matmul_tflop_s, higher_is_better=True, fraction_of_ceiling=1.0,
            note="torch.mm on random data"),
    ]  # fmt: skip
