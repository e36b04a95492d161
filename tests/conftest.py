import pytest
import torch

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; this machine has none")


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test, printed on failure, so random inputs differ between tests."""
    value = abs(hash(request.node.nodeid)) % (2**31)
    torch.manual_seed(value)
    return value


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if CUDA else "cpu")
