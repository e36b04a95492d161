"""accel: optimized PyTorch training components, each beside its plain reference.

Components live in one module per phase (``accel.sync``, ``accel.fusion`` ...); importing one
pulls in torch and nothing else. The measuring and plotting lab is ``accel.lab`` (needs the
``notebooks`` extra).
"""

__version__ = "0.1.0"
