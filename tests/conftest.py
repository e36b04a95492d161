import collections
import functools
import gc
import getpass
import importlib.util
import os
import shutil
import tempfile

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Triton decorates its own language functions (tl.zeros ...) for the mode it sees when it is
    # first imported; the kernel tests run through the interpreter here, so whichever test
    # imports triton first (torch.compile does) must already see TRITON_INTERPRET=1.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist workers compiling the same kernel share torch.compile's cache, where one can load
# a library another is still writing ("file too short"): each worker gets its own
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR",
        os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{_WORKER}"),
    )
# xdist's workers share the cores: each, and what it starts (a notebook's kernel, a torchrun rank),
# gets its share of them as torch's threads, not a pool as large as the machine (oversubscribed,
# each waits on the others' threads)
if _WORKER:
    _THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Inductor's pool of compile workers can keep a finished process alive for minutes at exit
# (torch 2.11, after a cold start), and an xdist worker then never ends: the tests' graphs are
# small enough to compile in the process itself.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; this machine has none")


def chromium() -> str | None:
    """The Chromium the browser test drives: ``ACCEL_CHROMIUM``, else Debian's on the PATH."""
    return (
        os.environ.get("ACCEL_CHROMIUM")
        or shutil.which("chromium")
        or shutil.which("chromium-browser")
    )


def browser_missing() -> str | None:
    """Why the browser test cannot run here, or None where it can."""
    if importlib.util.find_spec("jupyterlab") is None:
        return "the notebook stack is not installed"
    if importlib.util.find_spec("playwright") is None:
        return "Playwright is not installed"
    if chromium() is None:
        return "no Chromium found (install Debian's chromium or set ACCEL_CHROMIUM)"
    return None


# What decides that a test's behaviour depends on whether Triton is installed (marker `triton`,
# which CI runs again with Triton): the fixtures that run the kernels, and a notebook that asks
# for Triton's interpreter. Tests that check a fallback or a reason are marked where they stand.
TRITON_FIXTURES = {"kdev", "triton_here"}
TRITON_NOTEBOOK = "interpret_triton=True"


def pytest_configure(config):
    """pytest-xdist's ``--dist loadfile`` hands out the files with the most tests first; the
    slowest file, the browser test (every notebook, one after another), has few tests, so it
    started late and one worker ran on alone. Collection order instead, the browser test first."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Marks first (before ``-m`` selects), then, on what was selected, each notebook once, and
    the browser test first (see ``pytest_configure``)."""
    for item in items:
        if TRITON_FIXTURES & set(getattr(item, "fixturenames", ())) or _asks_for_triton(item.path):
            item.add_marker(pytest.mark.triton)
    yield
    _one_run_per_notebook(config, items)
    items.sort(key=lambda item: item.get_closest_marker("browser") is None)


@functools.cache
def _asks_for_triton(path) -> bool:
    return path.suffix == ".ipynb" and TRITON_NOTEBOOK in path.read_text()


def _one_run_per_notebook(config, items):
    """Each notebook runs once per session. Where the browser test runs (it runs every cell of
    every notebook in JupyterLab and fails on a traceback), nbval's run of the same notebooks is
    left out; elsewhere (no browser here, or ``-m "not browser"``) nbval runs them."""
    if not any(item.get_closest_marker("browser") for item in items) or browser_missing():
        return
    nbval = [item for item in items if item.path.suffix == ".ipynb"]
    if nbval:
        config.hook.pytest_deselected(items=nbval)
        items[:] = [item for item in items if item.path.suffix != ".ipynb"]


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test, printed on failure, so random inputs differ between tests."""
    value = abs(hash(request.node.nodeid)) % (2**31)
    torch.manual_seed(value)
    return value


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if CUDA else "cpu")


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of tiny tensors: a second thread only adds hand-offs, and on
    a busy 2-core machine it stalls (seen here: 8 s instead of 1 s for the diversity bench test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def count_host_reads():
    """``count(fn, skip=None)``: how often ``fn`` reads tensor values on the host (a device sync
    on a GPU, visible on a CPU too): ``.item()``, ``.tolist()``, ``bool(t)``, by method.
    ``skip(t)`` exempts tensors (e.g. optimizer step counters, which live on the CPU)."""

    def count(fn, skip=None) -> collections.Counter:
        counts: collections.Counter = collections.Counter()
        originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__")}

        def counting(name):
            def read(t, *args, **kwargs):
                if skip is None or not skip(t):
                    counts[name] += 1
                return originals[name](t, *args, **kwargs)

            return read

        try:
            for name in originals:
                setattr(torch.Tensor, name, counting(name))
            fn()
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        return counts

    return count


@pytest.fixture
def kdev(monkeypatch) -> str:
    """Where Triton kernels run: compiled on a CUDA GPU, else Triton's interpreter on the CPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    if CUDA:
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer):
    """A training step that touches nothing but its model and optimizer."""

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def pytest_collection_finish(session):
    """What importing and collecting made (torch, the notebook stack, every test module) moved
    out of the garbage collector's sight (``gc.freeze``): the doctor looks for every model and
    optimizer of the process among the objects it tracks, at a cost in proportion to their
    number, in every test; each test's own objects are made after, and seen."""
    gc.collect()
    gc.freeze()
