"""tkern: Triton kernels for mixed-precision training in PyTorch."""

import importlib
import importlib.abc
import importlib.util
import sys

from tkern import amp, nn, optim
from tkern.amp import DynamicLossScaler, LogNormalLossScaler, StaticLossScaler
from tkern.kernels import INTERPRET, mode
from tkern.kernels.float8 import to_float8
from tkern.kernels.gemm import scaled_mm
from tkern.nn import Float8Linear, Float8Recipe, convert_network
from tkern.ops.cross_entropy import cross_entropy, linear_cross_entropy
from tkern.ops.linear import linear, matmul
from tkern.ops.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from tkern.ops.swiglu import swiglu
from tkern.train import MOVED as _MOVED
from tkern.train import Trainer


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the training layer's old module names (``tkern.trainer``,
    ``tkern.demo``, ...) give their modules in :mod:`tkern.train`, the same objects,
    imported only when asked for."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module):
        pass  # already executed under its own name


sys.meta_path.append(_MovedModules())

__version__ = "0.1.0"

__all__ = [
    "INTERPRET",
    "DynamicLossScaler",
    "Float8Linear",
    "Float8Recipe",
    "LogNormalLossScaler",
    "StaticLossScaler",
    "Trainer",
    "__version__",
    "add_layer_norm",
    "add_rms_norm",
    "amp",
    "convert_network",
    "cross_entropy",
    "layer_norm",
    "linear",
    "linear_cross_entropy",
    "matmul",
    "mode",
    "nn",
    "optim",
    "rms_norm",
    "scaled_mm",
    "swiglu",
    "to_float8",
]
