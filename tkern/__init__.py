"""tkern: Triton kernels for mixed-precision training in PyTorch."""

from tkern import nn, optim
from tkern.functional import linear, matmul
from tkern.kernels import INTERPRET, mode

__version__ = "0.1.0"

__all__ = ["INTERPRET", "__version__", "linear", "matmul", "mode", "nn", "optim"]
