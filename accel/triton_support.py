"""Whether Triton kernels can run here, and the kernel modules built for the mode they run in.

One place for what the components ask before they dispatch to :mod:`accel.kernels`: is Triton
installed (:func:`installed`, looked up once), is its interpreter on (:func:`interpreting`,
``TRITON_INTERPRET=1``, read at each call), and why kernels cannot run on a device
(:func:`unavailable`, None when they can). Importing this module imports no Triton.

``triton.jit`` builds a compiled or an interpreted kernel as it decorates, i.e. when a kernel
module is first imported; :func:`kernel_module` hands out the modules of ``accel.kernels`` built
for the mode the environment asks now, importing a second set beside the first when it changed.
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


# os.environ.get raises and catches a KeyError inside when the variable is unset, on every
# kernel call, which a host-bound call pays; on POSIX its backing dict of bytes, which os.environ keeps up to date, is
# read directly instead.
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
    """The kernel module ``name`` (``accel.kernels.*``, defining ``INTERPRETED``), its kernels
    and those of the kernel modules it imports built for the current ``TRITON_INTERPRET``.

    The usual import serves while every kernel module already imported has the mode wanted;
    otherwise the module is imported again, with the kernel modules it needs, apart from
    ``sys.modules`` and kept beside the first (one set per mode, never mixed).
    """
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
