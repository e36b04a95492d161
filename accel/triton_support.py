"""Whether Triton kernels can run here (:func:`installed`, :func:`interpreting`,
:func:`unavailable`). Importing this module imports no Triton.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

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
