import math

import pytest
import torch
from conftest import requires_cuda

from accel.measure import ceilings
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


def test_the_copy_in_probe_copies_at_most_its_cap():
    assert ceilings.copy_in_probe_bytes(1 << 30) == ceilings.COPY_IN_PROBE_BYTES
    assert ceilings.copy_in_probe_bytes(4096) == 4096
    assert ceilings.copy_in_probe_bytes(0) == 1


@pytest.mark.parametrize("pinned", [True, False])
def test_copy_in_probe_refuses_a_cpu(pinned):
    with pytest.raises(ValueError, match="CUDA"):
        ceilings.measure_copy_in_gb_s("cpu", 4096, pinned=pinned)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("pinned", [True, False])
def test_gpu_copy_in_probe_gives_a_rate_and_leaves_nothing_allocated(pinned):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    rate = ceilings.measure_copy_in_gb_s("cuda", 8 << 20, pinned=pinned)
    assert math.isfinite(rate) and rate > 0
    assert torch.cuda.memory_allocated() == before


def test_measuring_the_ceilings_leaves_the_random_generators_as_they_were():
    """The doctor measures them on a user's behalf: their random state stays theirs."""
    before = torch.get_rng_state()
    ceilings.measure_ceilings("cpu", "cpu")
    assert torch.equal(torch.get_rng_state(), before)
