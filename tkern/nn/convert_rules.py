"""The rules of :func:`tkern.convert_network`, as data: :data:`RULES` (asked in order for
each module: the first that returns True converts it, and its children are not
visited), :data:`POST_RULES` (run on a module after its children: the fusions) and
:data:`BACK_RULES` (``convert_network(model, torch.float32)``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tkern.nn.casting import CastInputs, cast_own, cast_tree, remove_cast_hooks, run_in_fp32
from tkern.nn.float8 import Float8Linear, Float8Recipe, float8_conv1d_class
from tkern.nn.float8_emit import remove_float8_emit, route_float8_emit
from tkern.nn.float8_norm import remove_float8_norm, route_float8_norm
from tkern.nn.fusion import FusedMLPForward, FusedSequentialForward, route_fusion, route_mlp
from tkern.nn.hf_loss import install_fused_loss, remove_fused_loss
from tkern.nn.linear import Linear, conv1d_class, hf_conv1d
from tkern.nn.loss import LinearCrossEntropy
from tkern.nn.norm import LayerNorm, RMSNorm
from tkern.nn.projections import SplitAttentionForward, route_split
from tkern.nn.residual import FusedDecoderForward, route_decoder
from tkern.nn.rotary import RotaryAttentionForward, route_rotary
from tkern.nn.rotary_tables import RotaryTablesForward, route_rotary_tables
from tkern.ops.float8 import float8_weight_cache

__all__ = [
    "BACK_RULES",
    "CASTABLE_TYPES",
    "NORM_TYPES",
    "POST_RULES",
    "RULES",
    "Conversion",
    "is_hf_rms_norm",
    "keep_in_fp32_patterns",
    "remove_tkern_hooks",
]

#: Normalization layers: kept in fp32 (parameters and running statistics), run
#: on their input cast to fp32, their output cast back (the apex/fastai rule).
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LayerNorm,
    nn.GroupNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

#: Modules with parameters or buffers that run correctly once cast to fp16/bf16.
#: Their floating-point inputs are cast to that dtype first, as autocast would.
CASTABLE_TYPES: tuple[type[nn.Module], ...] = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.modules.conv._ConvNd,
    nn.PReLU,
    nn.MultiheadAttention,
)


# --------------------------------------------------------------------------- the rules


@dataclass
class Conversion:
    """One :func:`convert_network` call's settings, as the rules see them."""

    dtype: torch.dtype
    recipe: Float8Recipe | None = None
    float8_filter: Callable[[str, nn.Module], bool] | None = None
    fuse_activations: bool = True
    fused_loss: bool = False
    #: keep every param fp32; tkern's layers compute in ``dtype`` (FSDP2's mixed precision)
    keep_fp32_params: bool = False
    #: nn.LayerNorm / nn.RMSNorm / transformers' RMSNorms -> tkern's norm modules
    norms: bool = True
    #: the LayerNorm / RMSNorm params' dtype: fp32 (the default) or ``dtype`` (FSDP2's
    #: one dtype per ``fully_shard`` unit)
    norm_dtype: torch.dtype = torch.float32
    #: module types kept in fp32 for want of a rule -> their paths (for the warning)
    kept: dict[type, list[str]] = field(default_factory=dict)
    #: transformers' ``_keep_in_fp32_modules`` (see :func:`keep_in_fp32_patterns`)
    keep_fp32: tuple[tuple[str, ...], ...] = ()
    #: module types kept in fp32 because the model asks -> their paths (for the warning)
    kept_asked: dict[type, list[str]] = field(default_factory=dict)
    #: (block type, why) -> paths of the MLP blocks left eager (for the warning)
    eager_blocks: dict[tuple[type, str], list[str]] = field(default_factory=dict)
    #: (attention type, why) -> paths of the attention modules whose rotary runs as torch ops
    eager_rotary: dict[tuple[type, str], list[str]] = field(default_factory=dict)
    #: ids of params more than one module holds (tied weights), when the recipe's fp8
    #: all-gather would replace a weight Parameter (and so untie it)
    tied: frozenset[int] = frozenset()
    #: the layers left out of fp8 for that reason (for the warning)
    kept_tied: list[str] = field(default_factory=list)

    def wants_float8(self, module: nn.Module, path: str) -> bool:
        """Whether ``module`` (a Linear or GPT-2 Conv1D) becomes an fp8 layer: a recipe is
        given, both features are multiples of 16 (32 under "mxfp8": each is some GEMM's K,
        in blocks of 32), the filter (if any) agrees, and with the recipe's fp8 all-gather
        its weight is tied to no other module's."""
        # features from the weight: (out, in) for a Linear, (in, out) for a Conv1D
        align = 32 if self.recipe is not None and self.recipe.scaling == "mxfp8" else 16
        wanted = (
            self.recipe is not None
            and module.weight.shape[0] % align == 0
            and module.weight.shape[1] % align == 0
            and (self.float8_filter is None or bool(self.float8_filter(path, module)))
        )
        if wanted and id(module.weight) in self.tied and not isinstance(module, Float8Linear):
            self.kept_tied.append(path)
            return False
        return wanted


#: A rule: ``(module, path, conversion) -> handled``.
Rule = Callable[[nn.Module, str, Conversion], bool]


def keep_in_fp32_patterns(model: nn.Module, dtype: torch.dtype) -> tuple[tuple[str, ...], ...]:
    """The module paths (as tuples of names) transformers keeps in fp32 in ``model`` for
    ``dtype``, as ``from_pretrained`` does: each module's ``_keep_in_fp32_modules`` for
    fp16 (bf16 has fp32's range), ``_keep_in_fp32_modules_strict`` for fp16 and bf16,
    each entry read under that module's own path (a sub-model's entries too)."""
    patterns = set()
    for prefix, module in model.named_modules():
        names = list(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            names += list(getattr(module, "_keep_in_fp32_modules", None) or ())
        base = tuple(prefix.split(".")) if prefix else ()
        patterns.update((*base, "*", *name.split(".")) for name in names if isinstance(name, str))
    return tuple(sorted(patterns))


def _asked_fp32(path: str, patterns: tuple[tuple[str, ...], ...]) -> bool:
    """Whether the module at ``path`` is one a pattern names: the pattern's names end the
    path (``wo`` names ``encoder.block.0.layer.1.DenseReluDense.wo``), under its base."""
    parts = tuple(path.split("."))
    for pattern in patterns:
        star = pattern.index("*")
        base, tail = pattern[:star], pattern[star + 1 :]
        if (
            parts[:star] == base
            and len(parts) >= star + len(tail)
            and parts[len(parts) - len(tail) :] == tail
        ):
            return True
    return False


def _keep_in_fp32_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    """A module transformers' ``_keep_in_fp32_modules`` names (T5's ``wo``: fp16 overflows
    there) keeps fp32 params and computes in fp32 on its inputs cast to fp32; its output
    stays fp32, as with ``from_pretrained(dtype=torch.float16)`` (the model's code expects
    that: T5 adds it to the residual in fp32)."""
    if not conv.keep_fp32 or not path or not _asked_fp32(path, conv.keep_fp32):
        return False
    _back_tree(module)
    run_in_fp32(module, None)
    conv.kept_asked.setdefault(type(module), []).append(path)
    return True


def _float8_linear_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    if type(module) in (nn.Linear, Float8Linear) and conv.wants_float8(module, path):
        module.__class__ = Float8Linear
        cast_own(module, conv.dtype, buffers=False)  # delayed scaling's histories stay fp32
        module.set_recipe(conv.recipe)
        return True
    if isinstance(module, Float8Linear):
        cast_own(module, conv.dtype, buffers=False)
        return True
    return False


def _set_precision(module: nn.Module, conv: Conversion) -> None:
    """A GEMM layer's params in ``conv.dtype``, or kept fp32 and cast per forward
    (``keep_fp32_params``: its ``compute_dtype``)."""
    cast_own(module, torch.float32 if conv.keep_fp32_params else conv.dtype)
    module.compute_dtype = conv.dtype if conv.keep_fp32_params else None


def _linear_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    if type(module) is nn.Linear:
        module.__class__ = Linear
        module.activation = None
    elif not isinstance(module, Linear):
        return False
    _set_precision(module, conv)
    return True


def _conv1d_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    """transformers' GPT-2 ``Conv1D`` -> ``tkern.nn.Conv1D`` or ``Float8Conv1D``."""
    f8_class = float8_conv1d_class(create=False)
    if not (type(module) is hf_conv1d() or type(module) in (conv1d_class(create=False), f8_class)):
        return False
    if conv.wants_float8(module, path):
        module.__class__ = float8_conv1d_class()
        cast_own(module, conv.dtype, buffers=False)
        module.set_recipe(conv.recipe)
    elif type(module) is not f8_class:
        module.__class__ = conv1d_class()
        _set_precision(module, conv)
    else:
        cast_own(module, conv.dtype, buffers=False)
    return True


def _linear_cross_entropy_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    """tkern.nn.LinearCrossEntropy: the head's weight and bias in ``dtype`` (tkern's GEMM),
    its class weights (a buffer) in fp32."""
    if not isinstance(module, LinearCrossEntropy):
        return False
    cast_own(module, conv.dtype, buffers=False)
    return True


def _fused_loss_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    """With ``fused_loss``: a transformers causal LM computes its loss with
    tkern.linear_cross_entropy (tkern/nn/hf_loss.py decides which, or warns). Declines in
    any case (returns False), so that the model's children are converted by the other rules."""
    if conv.fused_loss:
        install_fused_loss(module)
    return False


def _rotary_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    """With ``fuse_activations``: a transformers attention module of a family in
    ``rotary.ROTARY_RULES`` runs its rotary embedding on tkern's kernel (tkern/nn/rotary.py),
    one that calls a rotary function tkern has no rule for is reported. Declines in any case,
    so that the module's children are converted by the other rules."""
    why = route_rotary(module) if conv.fuse_activations else None
    if why is not None:
        conv.eager_rotary.setdefault((type(module), why), []).append(path or "the model")
    return False


def _split_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    """With ``fuse_activations``: a transformers attention module of a family in
    ``projections.SPLIT_RULES`` (GPT-2's) runs its packed projection and its split into q, k, v
    as one autograd node, no concatenation of their gradients in backward
    (tkern/nn/projections.py). Declines in any case, so that the module's children are
    converted by the other rules."""
    if conv.fuse_activations:
        route_split(module)
    return False


def _rotary_tables_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    """With ``fuse_activations``: a transformers rotary embedding of a family in
    ``rotary_tables.ROTARY_TABLES_RULES`` computes its (cos, sin) on tkern's kernel, its
    buffers untouched (fp32) and its input not cast; one whose rope type recomputes
    ``inv_freq`` per call runs HF's forward in fp32 and is reported."""
    if not conv.fuse_activations:
        return False
    routed, why = route_rotary_tables(module)
    if why is not None:
        conv.eager_rotary.setdefault((type(module), why), []).append(path or "the model")
        run_in_fp32(module, conv.dtype)
        return True
    return routed


def _castable_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    if not isinstance(module, CASTABLE_TYPES):
        return False
    if conv.keep_fp32_params:  # left as it is: it runs in whatever dtype its params arrive in
        return True
    cast_tree(module, conv.dtype)
    module.register_forward_pre_hook(CastInputs(conv.dtype), with_kwargs=True)
    return True


def is_hf_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers-style RMSNorm (``LlamaRMSNorm`` and kin:
    a class named ``...RMSNorm`` with a 1-D ``weight`` Parameter and a float
    ``variance_epsilon``), computing ``weight * x / sqrt(mean(x^2) + eps)`` over the
    last dimension. Gemma's ``(1 + weight)`` form has ``eps``, not ``variance_epsilon``."""
    weight = module._parameters.get("weight")
    return (
        type(module).__name__.endswith("RMSNorm")
        and not isinstance(module, nn.RMSNorm)
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and not any(True for _ in module.children())
    )


def _is_16bit_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a norm whose params ``norm_dtype`` may make 16-bit: a
    LayerNorm / RMSNorm, torch's, tkern's or transformers'."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or is_hf_rms_norm(module)


def _norm_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    """``nn.LayerNorm`` / ``nn.RMSNorm`` / a transformers RMSNorm -> ``tkern.nn.LayerNorm``
    / ``RMSNorm``: the same Parameter objects (in ``conv.norm_dtype``: fp32 unless asked),
    names and eps; the norm then reads its 16-bit input directly (fp32 statistics and
    weight gradients inside the kernel, whatever the weight's storage).

    With ``norms=False`` and a 16-bit ``norm_dtype``, torch's LayerNorm / RMSNorm and
    transformers' RMSNorms are cast to that dtype and get their inputs cast to it (they
    compute in fp32 inside for 16-bit input, as under autocast)."""
    if not conv.norms:  # a norm converted earlier goes back to torch's
        _norm_back(module)
        if conv.norm_dtype == torch.float32 or not _is_16bit_norm(module):
            return False  # then run in fp32 by _fp32_norm_rule (or kept, if unknown)
        cast_own(module, conv.norm_dtype)
        module.register_forward_pre_hook(CastInputs(conv.norm_dtype), with_kwargs=True)
        return True
    if type(module) is nn.LayerNorm:
        module.__class__ = LayerNorm
    elif type(module) is nn.RMSNorm:
        module.__class__ = RMSNorm
    elif is_hf_rms_norm(module):
        eps = module.__dict__.pop("variance_epsilon")
        module.__class__ = RMSNorm
        module.normalized_shape = tuple(module.weight.shape)
        module.eps = eps
        module.elementwise_affine = True
    elif not isinstance(module, (LayerNorm, RMSNorm)):
        return False
    cast_own(module, conv.norm_dtype)
    return True


def _fp32_norm_rule(module: nn.Module, path: str, conv: Conversion) -> bool:
    if not isinstance(module, NORM_TYPES):
        return False
    run_in_fp32(module, conv.dtype)
    return True


#: The forward rules, asked in order; the first that returns True converts the module.
RULES: list[Rule] = [
    _fused_loss_rule,
    _rotary_rule,
    _split_rule,
    _keep_in_fp32_rule,
    _rotary_tables_rule,
    _float8_linear_rule,
    _linear_rule,
    _conv1d_rule,
    _linear_cross_entropy_rule,
    _castable_rule,
    _norm_rule,
    _fp32_norm_rule,
]


def _linear_back(module: nn.Module) -> bool:
    if type(module) is not Linear:
        return False
    del module.activation
    module.__dict__.pop("compute_dtype", None)
    module.__class__ = nn.Linear
    return True


def _float8_back(module: nn.Module) -> bool:
    f8_conv1d = float8_conv1d_class(create=False)
    if type(module) not in (Float8Linear, f8_conv1d):
        return False
    module.set_recipe(Float8Recipe())  # drops delayed scaling's histories
    float8_weight_cache(module.weight, register=False)
    del module.recipe
    module.__class__ = nn.Linear if type(module) is Float8Linear else f8_conv1d.__bases__[1]
    return True


def _conv1d_back(module: nn.Module) -> bool:
    c = conv1d_class(create=False)
    if c is None or type(module) is not c:
        return False
    module.__dict__.pop("compute_dtype", None)
    module.__class__ = c.__bases__[0]
    return True


def _norm_back(module: nn.Module) -> bool:
    if type(module) not in (LayerNorm, RMSNorm):
        return False
    module.__class__ = nn.LayerNorm if type(module) is LayerNorm else nn.RMSNorm
    return True


#: The rules of ``convert_network(model, torch.float32)``: ``module -> handled``.
BACK_RULES: list[Callable[[nn.Module], bool]] = [_linear_back, _float8_back, _conv1d_back, _norm_back]


def remove_tkern_hooks(module: nn.Module) -> None:
    """Remove the hooks and the fused forward a previous convert_network put on
    ``module`` (and only those)."""
    remove_cast_hooks(module)
    if isinstance(
        module.__dict__.get("forward"),
        (
            FusedSequentialForward,
            FusedMLPForward,
            RotaryAttentionForward,
            RotaryTablesForward,
            FusedDecoderForward,
            SplitAttentionForward,
        ),
    ):
        del module.forward
    remove_float8_norm(module)
    remove_float8_emit(module)
    remove_fused_loss(module)


def _back_tree(module: nn.Module) -> None:
    """:data:`BACK_RULES` on ``module`` and every module below it, tkern's hooks removed (a
    module converted by an earlier call that a later one keeps in fp32 is torch's again)."""
    for m in module.modules():
        remove_tkern_hooks(m)
        if not (type(m) is Linear and m.activation is not None):  # nn.Linear cannot express it
            any(rule(m) for rule in BACK_RULES)


#: Run on each module after its children, with ``fuse_activations``: ``module -> why a
#: block was left eager (for the warning), or None``. The fusions (tkern/nn/fusion.py):
#: an ``nn.Sequential``'s Linear + activation, and transformers' MLP blocks by family
#: (``fusion.MLP_RULES``); and the norms that write their fp8 consumers' input, by block
#: family (tkern/nn/float8_norm.py, ``FLOAT8_NORM_RULES``), and the fp8 GEMMs that write the
#: next one's input, by fused MLP family (tkern/nn/float8_emit.py, ``FLOAT8_EMIT_RULES``).
POST_RULES: list[Callable[[nn.Module], str | None]] = [
    route_fusion, route_mlp, route_float8_norm, route_float8_emit, route_decoder,
]  # fmt: skip
