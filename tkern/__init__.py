"""tkern: Triton kernels for mixed-precision training in PyTorch."""

from tkern import amp, nn, optim
from tkern.amp import DynamicLossScaler, LogNormalLossScaler, StaticLossScaler
from tkern.functional import linear, matmul
from tkern.kernels import INTERPRET, mode
from tkern.nn import convert_network
from tkern.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "INTERPRET",
    "DynamicLossScaler",
    "LogNormalLossScaler",
    "StaticLossScaler",
    "Trainer",
    "__version__",
    "amp",
    "convert_network",
    "linear",
    "matmul",
    "mode",
    "nn",
    "optim",
]
