"""tkern: Triton kernels for mixed-precision training in PyTorch."""

from tkern import amp, nn, optim
from tkern.amp import DynamicLossScaler, LogNormalLossScaler, StaticLossScaler
from tkern.device import DeviceSpec, device_spec
from tkern.kernels import INTERPRET, mode
from tkern.kernels.float8 import to_float8
from tkern.kernels.gemm import scaled_mm
from tkern.kernels.gemm_emit import Float8Emit
from tkern.nn import Float8Linear, Float8Recipe, convert_network
from tkern.ops.cross_entropy import cross_entropy, linear_cross_entropy
from tkern.ops.linear import linear, matmul
from tkern.ops.mx import to_mx
from tkern.ops.norm import (
    add_layer_norm,
    add_rms_norm,
    layer_norm,
    layer_norm_and_residual,
    rms_norm,
    rms_norm_and_residual,
)
from tkern.ops.rotary import apply_rotary_pos_emb
from tkern.ops.swiglu import swiglu
from tkern.train import Trainer

__version__ = "0.1.0"

__all__ = [
    "INTERPRET",
    "DeviceSpec",
    "DynamicLossScaler",
    "Float8Emit",
    "Float8Linear",
    "Float8Recipe",
    "LogNormalLossScaler",
    "StaticLossScaler",
    "Trainer",
    "__version__",
    "add_layer_norm",
    "add_rms_norm",
    "amp",
    "apply_rotary_pos_emb",
    "convert_network",
    "cross_entropy",
    "device_spec",
    "layer_norm",
    "layer_norm_and_residual",
    "linear",
    "linear_cross_entropy",
    "matmul",
    "mode",
    "nn",
    "optim",
    "rms_norm",
    "rms_norm_and_residual",
    "scaled_mm",
    "swiglu",
    "to_float8",
    "to_mx",
]
