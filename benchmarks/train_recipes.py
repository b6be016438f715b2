"""bench_train.py's recipes: how each one (torch fp32, autocast, compiled, torchao's fp8,
tkern's recipes and memory modes) builds its model, optimizer and scaler from a base
model (:data:`RECIPES`, :class:`Built`), the master weights each keeps, and the Trainer
every recipe's step goes through (also the step ledger's).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import HFLM  # noqa: E402

import tkern  # noqa: E402

STEPS, WARMUP = 30, 5
LR = 1e-4
BASELINE = "torch fp32 (no tf32)"
FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
#: torchao's MXFP8 training recipe, the peer of ``tkern fp8 mxfp8``
TORCHAO_MX = "torchao mxfp8 compiled"


class RefusedError(Exception):
    """A recipe this device cannot run (MXFP8 off Blackwell): its row is skipped with the reason."""


@contextlib.contextmanager
def tf32(allowed: bool):
    """TF32 tensor cores for fp32 matmuls and convolutions on or off, restored after."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def fp8_filter(name: str, module: nn.Module) -> bool:
    """The layers an fp8 recipe converts (tkern's and torchao's alike): both
    features multiples of 16, as the fp8 GEMMs need (``weight.shape`` holds them
    for ``nn.Linear`` and GPT-2's ``Conv1D`` alike)."""
    return all(d % 16 == 0 for d in module.weight.shape)


@dataclass(frozen=True)
class Built:
    """One recipe's parts, ready for a Trainer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: object = None
    autocast: torch.dtype | None = None
    cuda_graph: bool | str = False  # Trainer(cuda_graph=...)
    tf32: bool = False


def _tkern(
    base: nn.Module,
    device: torch.device,
    *,
    whole_step: bool | str = "auto",
    dtype: torch.dtype = torch.float16,
    compiled: bool = False,
    **opt_options,
) -> Built:
    """tkern's fp16 recipe; ``whole_step``: Trainer(cuda_graph=...), the Trainer's default
    ``"auto"`` unless asked; ``dtype`` bf16: no loss scale; ``compiled``: the converted
    model under ``torch.compile`` (default mode: tkern's own CUDA graphs stay the
    optimizer's); ``opt_options`` go to FusedAdamW (``cuda_graph=False``: its step eager;
    ``master``, ``state_dtype``: the memory modes). A language model (:class:`HFLM`)
    computes its loss with tkern's fused loss (:func:`_converted`)."""
    model = _converted(base, dtype)
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=LR, **opt_options)
    scaler = tkern.DynamicLossScaler() if dtype == torch.float16 else None
    return Built(torch.compile(model) if compiled else model, opt, scaler, cuda_graph=whole_step)


def _converted(base: nn.Module, dtype: torch.dtype, **options) -> nn.Module:
    """``convert_network`` of a copy of ``base``; a language model (:class:`HFLM`) with
    ``fused_loss=True`` and called in its ``fused_loss`` mode, as a tkern user trains one:
    the loss by :func:`tkern.linear_cross_entropy`, no (tokens x vocabulary) logits."""
    lm = isinstance(base, HFLM)
    model = tkern.convert_network(copy.deepcopy(base), dtype, fused_loss=lm, **options)
    if lm:
        model.fused_loss = True
    return model


def fp8_body_filter(name: str, module: nn.Module) -> bool:
    """:func:`fp8_filter` without the LM head, the layers tkern's fp8 recipes convert: under
    the fused loss the head's weight feeds :func:`tkern.linear_cross_entropy` (bf16) and its
    own forward never runs, so an fp8 head would sit unused."""
    return fp8_filter(name, module) and not name.endswith("lm_head")


def mx_device_check(device: torch.device) -> None:
    """Raise :class:`RefusedError` unless ``device`` multiplies MX formats natively (Blackwell
    sm_100, MI355X gfx950, or the interpreter), the reason tkern's MX GEMM gives."""
    from tkern.kernels.gemm_mx import check_mx_device

    try:
        check_mx_device(device)
    except RuntimeError as exc:
        raise RefusedError(str(exc)) from None


def _tkern_fp8(base: nn.Module, device: torch.device, recipe: str) -> Built:
    if recipe == "mxfp8":
        mx_device_check(device)
    layers = mx_filter if recipe == "mxfp8" else fp8_body_filter
    model = _converted(base, torch.bfloat16, float8=recipe, float8_filter=layers)
    return Built(model, tkern.optim.FusedAdamW(model.parameters(), lr=LR))


def _torch_adamw(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, **({"fused": True} if device.type == "cuda" else {}))


def _torch(
    base: nn.Module, device: torch.device, *, autocast=None, compiled=False, allow_tf32=False, fused=False
) -> Built:
    model = fused_eager(base) if fused else copy.deepcopy(base)
    opt = _torch_adamw(model, device)
    scaler = torch.amp.GradScaler(device.type) if autocast == torch.float16 else None
    return Built(torch.compile(model) if compiled else model, opt, scaler, autocast, tf32=allow_tf32)


class ShiftedLoss(nn.Module):
    """A language model (:class:`HFLM`) whose forward returns its next-token loss
    (:func:`bench_models.lm_loss`'s quantity) from its logits without copying them: one
    ``F.cross_entropy`` over the view ``logits[:, :-1]`` (classes on dim 1) with the labels
    ``ids[:, 1:]``. ``logits_model``: the model whose output is the logits (the step ledger's
    loss phase starts after it)."""

    def __init__(self, lm: HFLM) -> None:
        super().__init__()
        self.logits_model = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.logits_model(ids)
        return nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:])


#: transformers' tanh-GELU modules (several elementwise kernels each way in eager)
TANH_GELUS = ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh")


def fused_eager(base: nn.Module) -> nn.Module:
    """A copy of ``base`` as a fair eager baseline (issue 54 item 6): each tanh GELU one
    ``F.gelu(approximate="tanh")`` (``nn.GELU``), and a language model's loss taken on the
    shifted labels without a copy of the logits (:class:`ShiftedLoss`)."""
    model = copy.deepcopy(base)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in TANH_GELUS:
                setattr(parent, name, nn.GELU(approximate="tanh"))
    return ShiftedLoss(model) if isinstance(model, HFLM) else model


def conv1d_as_linear(model: nn.Module) -> nn.Module:
    """transformers' GPT-2 ``Conv1D`` layers (weight (in, out)) replaced in place by
    ``nn.Linear`` layers computing the same function, so that converters that
    only know ``nn.Linear`` (torchao's) reach GPT-2's GEMMs as tkern's does."""
    for name, child in list(model.named_children()):
        if type(child).__name__ == "Conv1D":
            n_in, n_out = child.weight.shape
            linear = nn.Linear(n_in, n_out, device=child.weight.device, dtype=child.weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(child.weight.t())
                linear.bias.copy_(child.bias)
            setattr(model, name, linear)
        else:
            conv1d_as_linear(child)
    return model


def _torchao_fp8(base: nn.Module, device: torch.device, *, smoke: bool, fp32_master: bool = False) -> Built:
    """torchao's Float8Linear training, compiled as torchao documents it; its params
    bf16 (no master: torchao's documented recipe) or, with ``fp32_master``, fp32
    params under bf16 autocast (an fp32 master as tkern's recipes have)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = conv1d_as_linear(copy.deepcopy(base))
    if not fp32_master:
        model = model.to(torch.bfloat16)
    convert_to_float8_training(
        model, config=Float8LinearConfig(emulate=smoke), module_filter_fn=lambda m, name: fp8_filter(name, m)
    )
    # autocast bf16 casts the fp32 batch (and torch ops outside the fp8 layers) as a bf16 user's would
    return Built(
        model if smoke else torch.compile(model), _torch_adamw(model, device), autocast=torch.bfloat16
    )


def _torchao_mx(base: nn.Module, device: torch.device, *, smoke: bool) -> Built:
    """torchao 0.18's MXFP8 training (``quantize_`` with ``MXFP8TrainingOpConfig``: each
    converted Linear's weight wrapped so its GEMMs cast to MXFP8, RCEIL scales, e4m3) on
    bf16 params, the same module filter less the LM head as tkern's, under ``torch.compile``
    as torchao documents it; in smoke mode eager and emulated (``KernelPreference.EMULATED``).
    RefusedError off Blackwell: its GEMMs are cuBLAS's MXFP8."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common import KernelPreference

    if not smoke:
        mx_device_check(device)
    model = conv1d_as_linear(copy.deepcopy(base)).to(torch.bfloat16)
    kernels = KernelPreference.EMULATED if smoke else KernelPreference.AUTO
    quantize_(
        model,
        MXFP8TrainingOpConfig(kernel_preference=kernels),
        filter_fn=lambda m, name: isinstance(m, nn.Linear) and mx_filter(name, m),
    )
    return Built(
        model if smoke else torch.compile(model), _torch_adamw(model, device), autocast=torch.bfloat16
    )


def mx_filter(name: str, module: nn.Module) -> bool:
    """The layers the MXFP8 recipes convert (tkern's and torchao's): both features multiples
    of 32 (every GEMM's K holds whole MX blocks), the LM head aside (:func:`fp8_body_filter`)."""
    return all(d % 32 == 0 for d in module.weight.shape) and not name.endswith("lm_head")


TORCHAO_FP32_MASTER = "torchao float8 tensorwise compiled, fp32 master"
#: bf16 autocast under torch.compile: the fp8 recipes' compiled 16-bit peer
BF16_COMPILED = "torch autocast bf16 compiled"
#: autocast with one tanh GELU kernel and the loss on a view of the logits: the eager baseline
FUSED_EAGER = "torch autocast fused"
#: tkern's memory modes (FusedAdamW's ``master`` and ``state_dtype``; issue 45 item 4)
#: (``master="split"`` keeps the master as the bf16 param plus 16 low bits: bf16 params only)
MEMORY_MODES = {
    "tkern state bf16": {"state_dtype": torch.bfloat16},
    "tkern state 8-bit": {"state_dtype": torch.uint8},
    "tkern bf16 master=split": {"dtype": torch.bfloat16, "master": "split"},
    "tkern bf16 split + 8-bit state": {
        "dtype": torch.bfloat16,
        "master": "split",
        "state_dtype": torch.uint8,
    },
}

#: recipe -> builder(base, device, smoke); each makes its own copy of ``base``.
#: Baselines first: a run cut by its time limit keeps what tkern is compared with.
RECIPES: dict[str, Callable[[nn.Module, torch.device, bool], Built]] = {
    BASELINE: lambda b, d, s: _torch(b, d),
    "torch autocast": lambda b, d, s: _torch(b, d, autocast=torch.float16),
    "torch autocast compiled": lambda b, d, s: _torch(b, d, autocast=torch.float16, compiled=True),
    FUSED_EAGER: lambda b, d, s: _torch(b, d, autocast=torch.float16, fused=True),
    "torch autocast bf16": lambda b, d, s: _torch(b, d, autocast=torch.bfloat16),
    BF16_COMPILED: lambda b, d, s: _torch(b, d, autocast=torch.bfloat16, compiled=True),
    "torchao float8 tensorwise compiled": lambda b, d, s: _torchao_fp8(b, d, smoke=s),
    TORCHAO_FP32_MASTER: lambda b, d, s: _torchao_fp8(b, d, smoke=s, fp32_master=True),
    TORCHAO_MX: lambda b, d, s: _torchao_mx(b, d, smoke=s),
    "torch fp32 tf32": lambda b, d, s: _torch(b, d, allow_tf32=True),
    "tkern": lambda b, d, s: _tkern(b, d),
    "tkern bf16": lambda b, d, s: _tkern(b, d, dtype=torch.bfloat16),
    "tkern compiled": lambda b, d, s: _tkern(b, d, compiled=True),
    "tkern opt eager": lambda b, d, s: _tkern(b, d, whole_step=False, cuda_graph=False),
    "tkern whole-step graph": lambda b, d, s: _tkern(b, d, whole_step=True),
    **{name: (lambda b, d, s, o=options: _tkern(b, d, **o)) for name, options in MEMORY_MODES.items()},
    **{f"tkern fp8 {r}": (lambda b, d, s, r=r: _tkern_fp8(b, d, r)) for r in FP8_RECIPES},
}
#: what a smoke run leaves out: torch.compile of a whole model takes minutes on a CPU
SMOKE_SKIPS = ("torch autocast compiled", BF16_COMPILED, "tkern compiled")
#: the master weights each recipe keeps (a row's ``master``): torchao's documented recipe
#: trains bf16 params with no fp32 copy, which its fp32-master row adds
MASTERS = {
    "torchao float8 tensorwise compiled": "none (bf16 params)",
    TORCHAO_FP32_MASTER: "fp32 params",
    TORCHAO_MX: "none (bf16 params)",
    "tkern bf16 master=split": "split",
    "tkern bf16 split + 8-bit state": "split",
}
#: the recipes a smoke run takes through GPT-2 (its Conv1D and embedding paths); the
#: MLP runs every recipe. Each tkern step of the tiny GPT-2 is seconds of interpreter.
SMOKE_GPT2_RECIPES = ("tkern", "tkern fp8 tensorwise", "torchao float8 tensorwise compiled", BASELINE)


def trainer_for(built: Built, loss_fn: Callable) -> tkern.Trainer:
    """The Trainer every recipe's step goes through (also the step ledger's)."""
    return tkern.Trainer(
        built.model,
        built.optimizer,
        loss_fn,
        built.scaler,
        autocast_dtype=built.autocast,
        progress=False,
        cuda_graph=built.cuda_graph,
    )


def release(device: torch.device) -> None:
    """What a recipe left behind, freed before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def master_of(recipe: str) -> str:
    """The master weights a recipe keeps (a row's ``master``)."""
    return MASTERS.get(recipe, "fp32 params" if recipe.startswith("torch") else "fp32")
