import math

import pytest

from accel.measure.ceilings import CEILING_SIZES, Ceilings, CeilingSizes, measure_ceilings


def test_measured_ceilings_are_positive_and_finite(device):
    c = measure_ceilings(device, CeilingSizes(copy_bytes=8 << 20, matmul_n=256, repeats=3))
    assert math.isfinite(c.copy_gb_s) and c.copy_gb_s > 0
    assert math.isfinite(c.matmul_tflop_s) and c.matmul_tflop_s > 0
    assert c.matmul_dtype == ("bfloat16" if device.type == "cuda" else "float32")


def test_gpu_copy_buffer_is_far_larger_than_l2():
    assert CEILING_SIZES["gpu"].copy_bytes >= 16 * 60 * 2**20  # H200 L2: 60 MB


CEIL = Ceilings(
    "test",
    copy_gb_s=1000.0,
    matmul_tflop_s=100.0,
    matmul_dtype="bfloat16",
    copy_bytes=1,
    matmul_n=1,
)


def test_floor_is_the_larger_of_bytes_and_flops():
    assert CEIL.floor_ms(bytes_moved=1e9) == pytest.approx(1.0)  # 1 GB at 1000 GB/s
    assert CEIL.floor_ms(flops=1e12) == pytest.approx(10.0)  # 1 TFLOP at 100 TFLOP/s
    assert CEIL.floor_ms(flops=1e12, bytes_moved=1e9) == pytest.approx(10.0)


def test_fractions_of_the_ceilings():
    assert CEIL.bandwidth_fraction(bytes_moved=5e8, ms=1.0) == pytest.approx(0.5)
    assert CEIL.compute_fraction(flops=5e10, ms=1.0) == pytest.approx(0.5)
