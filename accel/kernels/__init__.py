"""Triton kernels behind the components; import a kernel module only where Triton is installed."""
