"""Triton kernels launched through their compiled handle, at a few microseconds of host time.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument, builds a cache key
and looks the compiled kernel up on every call: tens of microseconds of Python before the launch,
more than many small kernels take on the GPU. A :class:`Launcher` does that once per launch
signature and keeps the compiled kernel; later calls with that signature go straight to its
C launcher, as torch.compile's generated code does.

The caller names the signature (``key``): everything Triton specializes a compiled kernel on
besides the constexprs, i.e. the integer arguments' values, the tensors' dtypes and whether each
pointer is 16-byte aligned. Where a direct launch cannot be made (Triton's interpreter, a launch
hook set, a Triton whose compiled kernel has no such handle) every call takes
``kernel[grid](...)``: the same kernel and the same result, only more host time.

    launch = Launcher(_my_kernel)
    launch(key, (blocks,), (x, out, n), {"BLOCK": 1024, "num_warps": 4})
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # a Triton without knobs: no direct launches
    _knobs = None


class Launcher:
    """The launches of one ``triton.jit`` kernel (or autotuned kernel), direct once seen."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self._direct: dict[tuple, _Direct] = {}

    def __call__(
        self,
        key: tuple | int | None,
        grid: tuple[int, ...] | Callable[[dict], tuple[int, ...]],
        args: tuple,
        constexprs: Mapping[str, Any],
    ) -> None:
        """``kernel[grid](*args, **constexprs)``: positional runtime arguments, then every
        constexpr (and launch option) by keyword. ``key=None`` launches without caching."""
        if key is not None and not hooked():
            device = torch._C._cuda_getDevice()
            direct = self._direct.get((key, device))
            if direct is not None:
                if direct.tensors:  # their addresses: Triton's launcher asks the driver about
                    args = list(args)  # each tensor it is given, not about an address
                    for i in direct.tensors:
                        args[i] = args[i].data_ptr()
                direct.launch(device, args)
                return
        compiled = self.kernel[grid](*args, **constexprs)
        if key is not None and not hooked():
            direct = _Direct.of(self.kernel, compiled, grid, args, constexprs)
            if direct is not None:
                self._direct[(key, torch._C._cuda_getDevice())] = direct

    def direct(self, key: tuple | int) -> _Direct | None:
        """The direct launch of ``key`` on the current device, once a call has made one."""
        return self._direct.get((key, torch._C._cuda_getDevice()))

    def direct_launches(self) -> int:
        """How many signatures launch directly now."""
        return len(self._direct)


def hooked() -> bool:
    """A launch hook is set (a profiler's, say): it wants Triton's own launch path. Otherwise
    the direct launch passes no hooks (an empty hook chain would be called for nothing). A hook
    is a function, or a hook chain (Triton 3.5 and later) with a function in its ``calls``."""
    if _knobs is None:
        return True
    runtime = _knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        leave is not None and bool(getattr(leave, "calls", True))
    )


class _Direct:
    """A compiled kernel's C launcher, its grid and its constexpr values (``Launcher`` calls
    ``run`` with the stream, the arguments and these)."""

    __slots__ = ("function", "grid", "packed", "run", "tail", "tensors")

    def __init__(self, compiled: Any, grid: tuple[int, int, int], tail: tuple, tensors: tuple):
        self.run, self.function, self.packed = (
            compiled.run,
            compiled.function,
            compiled.packed_metadata,
        )
        self.grid, self.tail = grid, tail
        self.tensors = tensors  # positions of the tensor arguments

    def launch(self, device: int, args) -> None:
        """The kernel on ``device``'s current stream; ``args`` are the runtime arguments, with
        addresses (ints) where the kernel takes pointers."""
        self.run(*self.grid, torch._C._cuda_getCurrentRawStream(device), self.function,
                 self.packed, None, None, None, *args, *self.tail)  # fmt: skip

    @classmethod
    def of(cls, kernel, compiled, grid, args: tuple, constexprs: Mapping) -> _Direct | None:
        """The direct launch of what ``kernel[grid](*args, **constexprs)`` just compiled, or
        None where Triton gives no handle for it."""
        autotuned = hasattr(kernel, "configs")  # a triton.autotune wrapper around a jit function
        jit = kernel.fn if autotuned else kernel
        config = kernel.best_config if autotuned else None
        chosen = dict(constexprs) | (config.all_kwargs() if config is not None else {})
        names = getattr(jit, "arg_names", None)
        if names is None or any(n not in chosen for n in names[len(args) :]):
            return None
        if callable(grid):
            grid = grid(dict(zip(names, args, strict=False)) | chosen)
        grid = (*grid, 1, 1)[:3]
        try:
            compiled._init_handles()
            tail = tuple(chosen[n] for n in names[len(args) :])
            tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            return cls(compiled, grid, tail, tensors)
        except AttributeError:  # the interpreter's result, or another Triton's
            return None


def row_alignment(x: torch.Tensor) -> int:
    """Elements of each row of ``x`` (..., D) a kernel may load at once that Triton cannot see
    for itself: the largest power of 2, up to 16 bytes, dividing D, every other stride and the
    start. Triton marks an integer argument 16-aligned only when it is a multiple of 16, so rows
    of 100 float32 (16-byte aligned) or 300 float16 (8) would load one element at a time; a
    kernel takes this as its ``ALIGN`` and rounds D and the strides to multiples of it where the
    compiler sees them. 1 where Triton sees 16 elements already, or the rows are strided."""
    if x.dim() == 0 or x.stride(-1) != 1 or x.data_ptr() % 16:
        return 1  # a start off 16 bytes: Triton assumes no alignment at all
    values = (x.shape[-1], *x.stride()[:-1])  # all of them: the kernel rounds each it is given
    if all(v % 16 == 0 for v in values):
        return 1
    align = 16 // x.element_size()
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


__all__ = ["Launcher", "hooked", "row_alignment"]
