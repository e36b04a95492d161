"""Every ATen operator one call of a step runs, with the line of the user's code that ran it.

A ``TorchDispatchMode`` sees each operator below autograd, forward and backward, with its real
tensors; for each it notes the first frame of the caller's own code, the torch functions in
between, and whether backward ran it. Each runs in a profiler range named by its index, which
joins the profiler's time to the record. Printing a tensor reads it without an operator the mode
sees, so the formatting and exporting tensor methods are watched too.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PRODUCTS", "OpRecord", "Recording", "Site", "TensorInfo", "record_step"]

MARK = "accel.doctor.op"
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DOCTOR_DIR = os.path.dirname(__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
# the doctor's own example models and scripts are user code
_USER_CODE_IN_DOCTOR = (_DOCTOR_DIR + "zoo.py", _DOCTOR_DIR + "ladder" + os.sep)
# tensor methods that read values on the host without an operator the mode sees
_WATCHED = ("__repr__", "__str__", "__format__", "tolist", "numpy")
# torch's own dispatch machinery between an operator and the code that called it: not news
_PLUMBING = ("_dynamo/", "_compile.py", "utils/_python_dispatch.py", "_ops.py")
PRODUCTS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})


@dataclass(frozen=True)
class Site:
    """A line of the user's code."""

    file: str
    line: int
    function: str

    @property
    def text(self) -> str:
        return linecache.getline(self.file, self.line).strip()

    def __str__(self) -> str:
        return f"{self.file.removeprefix(os.getcwd() + os.sep)}:{self.line} ({self.function})"


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    nbytes: int
    pinned: bool  # host memory that is page-locked (always False on a device)

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorInfo:
        pinned = t.device.type == "cpu" and torch.cuda.is_available() and _is_pinned(t)
        return cls(tuple(t.shape), t.dtype, t.device.type, t.numel() * t.element_size(), pinned)


def _is_pinned(t: torch.Tensor) -> bool:
    try:
        return t.is_pinned()
    except RuntimeError:  # a tensor without storage (meta, some views)
        return False


@dataclass
class OpRecord:
    index: int
    op: str  # "aten::mm"
    site: Site | None  # None: no user frame (autograd's worker thread on CUDA)
    library: tuple[str, ...]  # torch functions between the op and the user's line
    backward: bool
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    scalars: tuple[Any, ...]  # the non-tensor arguments (dims, flags)
    api: str = ""  # the torch function the user called that ran it ("scaled_dot_product_attention")
    facts: tuple[str, ...] = ()  # what its values showed: ("causal mask",)
    time_us: float = 0.0  # the device's kernels in the op (CUDA) or the host's time (CPU)

    @property
    def nbytes(self) -> int:
        """The bytes it reads and writes."""
        return sum(t.nbytes for t in (*self.inputs, *self.outputs))


@dataclass(frozen=True)
class HostRead:
    """A tensor's values read on the host without an operator: printed, formatted, exported."""

    method: str
    site: Site | None
    device: str
    library: tuple[str, ...] = ()  # torch functions between the read and the user's line


@dataclass
class Recording:
    ops: list[OpRecord] = field(default_factory=list)
    host_reads: list[HostRead] = field(default_factory=list)
    device: str = "cpu"


class _Frames:
    """Which frames are the user's, decided once per code object."""

    def __init__(self):
        self._internal: dict[types.CodeType, bool] = {}

    def internal(self, code: types.CodeType) -> bool:
        known = self._internal.get(code)
        if known is None:
            name = code.co_filename
            installed = "-packages" + os.sep in name  # user packages may live under stdlib
            known = (
                name.startswith((_TORCH_DIR, "<frozen"))
                or (name.startswith(_STDLIB_DIR) and not installed)
                or (name.startswith(_DOCTOR_DIR) and not name.startswith(_USER_CODE_IN_DOCTOR))
            )
            self._internal[code] = known
        return known

    def caller(self, start: types.FrameType | None) -> tuple[Site | None, tuple[str, ...]]:
        """The first user frame above ``start``, and the torch functions below it."""
        library: list[str] = []
        frame = start
        while frame is not None:
            code = frame.f_code
            if not self.internal(code):
                return Site(code.co_filename, frame.f_lineno, code.co_name), tuple(library)
            if code.co_filename.startswith(_TORCH_DIR):
                where = code.co_filename[len(_TORCH_DIR) :]
                if not where.startswith(_PLUMBING):
                    library.append(f"{where}:{code.co_name}")
            frame = frame.f_back
        return None, tuple(library)


class _Calls(TorchFunctionMode):
    """The torch function the user's code is inside (the mode is off while its handler runs, so
    this is the outermost one: ``scaled_dot_product_attention``, not the ``bmm`` of its math path)."""

    def __init__(self):
        super().__init__()
        self.current = ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.current = getattr(func, "__name__", "")
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = ""


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: Recording, frames: _Frames, calls: _Calls):
        super().__init__()
        self.recording, self.frames, self.calls = recording, frames, calls
        self._range = getattr(torch._C._profiler, "_RecordFunctionFast", None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = len(self.recording.ops)
        with self._range(f"{MARK}{index}") if self._range else contextlib.nullcontext():
            out = func(*args, **kwargs)
        site, library = self.frames.caller(sys._getframe(1))
        leaves = tree_leaves((args, kwargs))
        self.recording.ops.append(OpRecord(
            index=index,
            op=_op_name(func),
            site=site,
            library=library[:12],
            backward=torch._C._current_autograd_node() is not None,
            inputs=tuple(TensorInfo.of(a) for a in leaves if isinstance(a, torch.Tensor)),
            outputs=tuple(TensorInfo.of(o) for o in tree_leaves(out) if isinstance(o, torch.Tensor)),
            scalars=tuple(a for a in leaves if isinstance(a, (int, float, bool, str)))[:32],
            api=self.calls.current,
            facts=_facts(func, args),
        ))
        return out


def _facts(func, args: tuple) -> tuple[str, ...]:
    """Values worth knowing beside the shapes: a mask that is exactly causal (query i sees keys up
    to i), which SDPA's ``is_causal`` replaces (reading it is one sync, in this recorded step
    only); the backend settings a product or convolution ran under, as the step had them."""
    name = _op_name(func)
    if "convolution" in name:
        cudnn = torch.backends.cudnn
        return ("tf32",) * cudnn.allow_tf32 + ("cudnn.benchmark",) * cudnn.benchmark
    if name in PRODUCTS:
        return ("tf32",) if torch.backends.cuda.matmul.allow_tf32 else ()
    if name in ("aten::add", "aten::add_") and len(args) >= 2:
        a, b = args[:2]
        return ("causal mask",) * (_additive_causal(a, b) or _additive_causal(b, a))
    if name not in ("aten::masked_fill", "aten::masked_fill_") or len(args) < 2:
        return ()
    mask = args[1]
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() < 2:
        return ()
    rows, cols = mask.shape[-2:]
    if rows != cols:
        return ()
    future = _future(mask.new_empty((rows, cols)))
    return ("causal mask",) if bool((mask == future).all()) else ()  # every sequence's, not one's


def _future(square: torch.Tensor) -> torch.Tensor:
    """The keys after each query of a (rows, cols) mask: what a causal mask hides."""
    rows, cols = square.shape
    return torch.ones(rows, cols, dtype=torch.bool, device=square.device).triu(1)


def _additive_causal(scores, mask) -> bool:
    """Whether ``mask``, added to larger ``scores``, is one (S, S) float mask of -inf after each
    query and 0 elsewhere (reading it is two syncs, once per mask in the recorded step)."""
    if not all(isinstance(t, torch.Tensor) for t in (scores, mask)) or mask.dim() < 2:
        return False
    rows, cols = mask.shape[-2:]
    one = mask.numel() == rows * cols and scores.numel() > mask.numel()
    if not (one and rows == cols >= 2 and mask.is_floating_point()):
        return False
    square = mask.reshape(rows, cols)
    future = _future(square)
    return torch.equal(torch.isneginf(square), future) and not square.masked_fill(future, 0).any()


def _op_name(func) -> str:
    packet = getattr(func, "_schema", None)
    name = packet.name if packet is not None else str(func)
    return name if "::" in name else f"aten::{name}"


@contextlib.contextmanager
def _watching_host_reads(recording: Recording, frames: _Frames) -> Iterator[None]:
    originals = {name: getattr(torch.Tensor, name) for name in _WATCHED}
    busy = [False]  # a read inside a watched method (format calls item) is the same read

    def watched(name: str, original: Callable) -> Callable:
        def read(self, *args, **kwargs):
            if busy[0] or not isinstance(self, torch.Tensor):
                return original(self, *args, **kwargs)
            site, library = frames.caller(sys._getframe(1))
            recording.host_reads.append(HostRead(name, site, self.device.type, library[:12]))
            busy[0] = True
            try:
                return original(self, *args, **kwargs)
            finally:
                busy[0] = False

        return read

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, watched(name, original))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def record_step(call: Callable[[], object], device: torch.device) -> Recording:
    """Run ``call`` once under the recorder and the profiler; every op with its line and time."""
    from accel.profiling import device_profile

    with device_profile(device) as prof, _recorded(device) as recording:
        call()
    times = _range_times(prof, device.type == "cuda")
    for record in recording.ops:
        record.time_us = times.get(record.index, 0.0)
    return recording


def record_calls(call: Callable[[], object], device: torch.device, calls: int) -> list[Recording]:
    """``call`` run ``calls`` more times under the recorder, untimed: what a step does only on
    some calls (a read every few steps) shows in some of them."""
    recordings = []
    for _ in range(calls):
        with _recorded(device) as recording:
            call()
        recordings.append(recording)
    return recordings


@contextlib.contextmanager
def _recorded(device: torch.device) -> Iterator[Recording]:
    """While inside, every operator and host read recorded with the user's line."""
    recording, frames, api = Recording(device=device.type), _Frames(), _Calls()
    # eager while recording: a compiled forward that dynamo meets under a dispatch mode is
    # skipped for the rest of the process, the user's own compiled model then running eagerly
    with torch.compiler.set_stance("force_eager"), _watching_host_reads(recording, frames), api, \
            _Recorder(recording, frames, api):  # fmt: skip
        yield recording


def _range_times(prof, cuda: bool) -> dict[int, float]:
    times: dict[int, float] = {}
    for e in prof.events():
        if e.name.startswith(MARK):
            index = int(e.name[len(MARK) :])
            times[index] = e.device_time_total if cuda else e.cpu_time_total
    return times
