"""Triton kernels behind the components; import a kernel module only where Triton is installed.

Kernel modules import torch, triton, the standard library and each other, never a component:
the component checks inputs and passes what a kernel needs (``eps``, devices, shapes).
"""
