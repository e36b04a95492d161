"""Whether Triton kernels can run here (:func:`installed`, :func:`interpreting`,
:func:`unavailable`), and the kernel modules built for the mode they run in: ``triton.jit``
builds a compiled or an interpreted kernel as a module is imported, so :func:`kernel_module`
imports a second set when ``TRITON_INTERPRET`` changed. Importing this module imports no Triton.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types

import torch

KERNELS = "accel.kernels"
INSTALL_HINT = "pip install 'accel[kernels]'"


@functools.cache
def installed() -> bool:
    """Triton can be imported (looked up once: the lookup searches the import path)."""
    return importlib.util.find_spec("triton") is not None


# os.environ.get raises and catches a KeyError when the variable is unset, on every kernel call;
# on POSIX its backing dict of bytes (kept up to date by os.environ) is read directly instead.
_ENVIRON_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: kernels run in Triton's interpreter, on any device's tensors."""
    if _ENVIRON_BYTES is not None:
        return _ENVIRON_BYTES.get(b"TRITON_INTERPRET") == b"1"
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(device: torch.device | str) -> str | None:
    """Why Triton kernels cannot run on tensors on ``device``; None if they can."""
    if not installed():
        return f"Triton is not installed ({INSTALL_HINT})"
    device = torch.device(device)
    if device.type != "cuda" and not interpreting():
        return (
            f"the tensors are on {device.type} and Triton compiles for CUDA only "
            "(set TRITON_INTERPRET=1 to run the kernels through its interpreter)"
        )
    return None


# mode (interpreted or not) -> the accel.kernels modules imported for it apart from sys.modules
_apart: dict[bool, dict[str, types.ModuleType]] = {}
_modules: dict[tuple[str, bool], types.ModuleType] = {}


def kernel_module(name: str) -> types.ModuleType:
    """The kernel module ``name`` (``accel.kernels.*``, defining ``INTERPRETED``) built for the
    current ``TRITON_INTERPRET``: the usual import while every kernel module imported has that
    mode, else one imported apart from ``sys.modules`` (one set per mode, never mixed)."""
    mode = interpreting()
    if (name, mode) not in _modules:
        loaded = [m for k, m in sys.modules.items() if k.startswith(f"{KERNELS}.")]
        if all(getattr(m, "INTERPRETED", mode) == mode for m in loaded):
            module = importlib.import_module(name)
        else:
            module = _import_apart(name, mode)
        assert mode == module.INTERPRETED, (name, mode)
        _modules[(name, mode)] = module
    return _modules[(name, mode)]


def _import_apart(name: str, mode: bool) -> types.ModuleType:
    """``name`` imported (decorated now, under the current environment) with the kernel modules
    of ``mode`` in ``sys.modules`` for the while; the usual ones are put back afterwards."""
    package = importlib.import_module(KERNELS)
    ours = [k for k in sys.modules if k.startswith(f"{KERNELS}.")]
    saved = {k: sys.modules.pop(k) for k in ours}
    sys.modules.update(_apart.get(mode, {}))
    try:
        module = importlib.import_module(name)
        _apart[mode] = {k: m for k, m in sys.modules.items() if k.startswith(f"{KERNELS}.")}
    finally:
        for k in [k for k in sys.modules if k.startswith(f"{KERNELS}.")]:
            del sys.modules[k]
            vars(package).pop(k.rsplit(".", 1)[1], None)
        sys.modules.update(saved)
        for k, m in saved.items():
            setattr(package, k.rsplit(".", 1)[1], m)
    return module
