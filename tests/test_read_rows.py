"""The lab's read ceiling (accel.kernels.read_rows) against its reference, in Triton's
interpreter on a CPU (compiled on a GPU)."""

import pytest
import torch

from accel import triton_support

MODULE = "accel.kernels.read_rows"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def read_rows(kdev):
    return triton_support.kernel_module(MODULE)


@pytest.mark.parametrize(
    ("batch", "n", "d"), [(5, 2, 7), (3, 33, 40), (17, 3, 130), (2, 64, 16), (1, 1, 1)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("tile", ["16K", "4K"])
def test_the_sum_of_the_held_rows_equals_the_reference(
    read_rows, kdev, batch, n, d, dtype, ragged, tile
):
    device = kdev
    gen = torch.Generator(device).manual_seed(batch * n + d)
    x = torch.randn((batch, n, d), device=device, generator=gen).to(dtype)
    counts = None
    if ragged:  # out of range both ways: clamped, as the diversity kernels clamp
        counts = torch.randint(-1, n + 2, (batch,), device=device, generator=gen)
    tile_bytes = int(tile[:-1]) << 10
    assert tile_bytes in read_rows.TILE_BYTES_TRIED
    got = read_rows.sum_rows_partials(x, counts, tile_bytes=tile_bytes).sum(dim=1)
    torch.testing.assert_close(got, read_rows.sum_rows_reference(x, counts), rtol=1e-5, atol=1e-4)


def test_a_strided_batch_is_read_through_its_strides(read_rows, kdev):
    device = kdev
    x = torch.randn((6, 40, 5), device=device).transpose(1, 2)  # (6, 5, 40), not contiguous
    counts = torch.tensor([0, 1, 2, 5, 3, 4], device=device)
    got = read_rows.sum_rows_partials(x, counts).sum(dim=1)
    torch.testing.assert_close(got, read_rows.sum_rows_reference(x, counts), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("n", "d", "itemsize"), [(2, 256, 2), (64, 2048, 4), (3, 64, 4)])
@pytest.mark.parametrize("tile_bytes", [16 << 10, 4 << 10])
def test_each_program_loads_the_tile_asked_for_where_the_set_allows(
    read_rows, n, d, itemsize, tile_bytes
):
    sets, rows, block_d = read_rows.launch_shape(n, d, itemsize, tile_bytes)
    assert rows <= read_rows.ROWS_PER_PROGRAM and all(
        v & (v - 1) == 0 for v in (sets, rows, block_d)
    )
    assert sets * rows * block_d * itemsize == tile_bytes
