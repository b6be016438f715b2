"""``convert_network``: a model converted in place for mixed-precision training, by a
table of small per-module rules (:data:`RULES`, :data:`BACK_RULES`).

Each rule looks at one module and either converts it (returns True: its children
are not visited) or declines (False: the next rule is asked). A module no rule takes
is a container or a module of unknown kind: its children are converted and, if it
owns tensors itself, they stay fp32 (one warning per type).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tkern.kernels._common import HALF_DTYPES
from tkern.kernels.float8 import check_fp8_device
from tkern.nn.float8 import Float8Linear, Float8Recipe, float8_conv1d_class
from tkern.nn.fusion import FusedSequentialForward, route_fusion
from tkern.nn.hf_loss import install_fused_loss, remove_fused_loss
from tkern.nn.linear import Linear, conv1d_class, hf_conv1d
from tkern.nn.loss import LinearCrossEntropy
from tkern.nn.norm import LayerNorm, RMSNorm
from tkern.ops.float8 import float8_weight_cache

__all__ = ["BACK_RULES", "CASTABLE_TYPES", "NORM_TYPES", "RULES", "Conversion", "convert_network"]

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


# --------------------------------------------------------------------------- casting hooks


def _cast_floats(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor in it (nested in tuples,
    lists and dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class CastInputs:
    """Forward pre-hook: cast the floating-point positional and keyword inputs to
    ``dtype``. A module-level class, so converted models pickle and deepcopy."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        return _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)

    def __repr__(self) -> str:
        return f"tkern.nn.CastInputs({self.dtype})"


class CastOutput:
    """Forward hook: cast the floating-point outputs to ``dtype`` (picklable)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module, args, output):
        return _cast_floats(output, self.dtype)

    def __repr__(self) -> str:
        return f"tkern.nn.CastOutput({self.dtype})"


def remove_tkern_hooks(module: nn.Module) -> None:
    """Remove the hooks and the fused forward a previous convert_network put on
    ``module`` (and only those)."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, h in hooks.items() if isinstance(h, (CastInputs, CastOutput))]:
            del hooks[key]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs"):
                getattr(module, extra, {}).pop(key, None)
    if isinstance(module.__dict__.get("forward"), FusedSequentialForward):
        del module.forward
    remove_fused_loss(module)


def cast_own(module: nn.Module, dtype: torch.dtype, buffers: bool = True) -> None:
    """Cast ``module``'s own floating-point parameters and (with ``buffers``) buffers
    (not its children's) to ``dtype`` in place: each Parameter stays the same object,
    so parameters shared with other modules (tied weights) stay shared."""
    for p in module._parameters.values():
        if p is not None and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
    for name, b in module._buffers.items() if buffers else ():
        if b is not None and b.is_floating_point() and b.dtype != dtype:
            module._buffers[name] = b.to(dtype)


def cast_tree(module: nn.Module, dtype: torch.dtype) -> None:
    """:func:`cast_own` on ``module`` and every module below it."""
    for m in module.modules():
        cast_own(m, dtype)


def run_in_fp32(module: nn.Module, dtype: torch.dtype) -> None:
    """Keep ``module`` in fp32: its inputs are cast to fp32 and its outputs to ``dtype``."""
    cast_tree(module, torch.float32)
    module.register_forward_pre_hook(CastInputs(torch.float32), with_kwargs=True)
    module.register_forward_hook(CastOutput(dtype))


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
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
    #: ids of params more than one module holds (tied weights), when the recipe's fp8
    #: all-gather would replace a weight Parameter (and so untie it)
    tied: frozenset[int] = frozenset()
    #: the layers left out of fp8 for that reason (for the warning)
    kept_tied: list[str] = field(default_factory=list)

    def wants_float8(self, module: nn.Module, path: str) -> bool:
        """Whether ``module`` (a Linear or GPT-2 Conv1D) becomes an fp8 layer: a recipe is
        given, both features are multiples of 16, the filter (if any) agrees, and with the
        recipe's fp8 all-gather its weight is tied to no other module's."""
        # features from the weight: (out, in) for a Linear, (in, out) for a Conv1D
        wanted = (
            self.recipe is not None
            and module.weight.shape[0] % 16 == 0
            and module.weight.shape[1] % 16 == 0
            and (self.float8_filter is None or bool(self.float8_filter(path, module)))
        )
        if wanted and id(module.weight) in self.tied and not isinstance(module, Float8Linear):
            self.kept_tied.append(path)
            return False
        return wanted


#: A rule: ``(module, path, conversion) -> handled``.
Rule = Callable[[nn.Module, str, Conversion], bool]


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
    """With ``fused_loss``: a transformers causal LM (GPT-2, Llama, Gemma 2) computes its loss with
    tkern.linear_cross_entropy (tkern/nn/hf_loss.py). Declines in any case (returns
    False), so that the model's children are converted by the other rules."""
    if conv.fused_loss:
        install_fused_loss(module)
    return False


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


def _check_convertible_back(model: nn.Module) -> None:
    for path, m in model.named_modules():
        if isinstance(m, Linear) and m.activation is not None:
            raise ValueError(
                f"convert_network(model, torch.float32): {path or 'the model'} is a tkern.nn.Linear with "
                f"activation={m.activation!r} fused in, which nn.Linear cannot express; nothing was changed"
            )


def _convert_back(module: nn.Module) -> None:
    """Undo :func:`convert_network`: plain fp32 modules, tkern's hooks removed."""
    for m in module.modules():
        remove_tkern_hooks(m)
        any(rule(m) for rule in BACK_RULES)
    cast_tree(module, torch.float32)


def _convert(module: nn.Module, path: str, conv: Conversion) -> None:
    remove_tkern_hooks(module)  # converting again replaces, never stacks, the hooks
    if any(rule(module, path, conv) for rule in RULES):
        return
    children = list(module.named_children())
    if _owns_tensors(module):
        conv.kept.setdefault(type(module), []).append(path or "the model")
        if not children:
            run_in_fp32(module, conv.dtype)
            return
        cast_own(module, torch.float32)
    for name, child in children:
        _convert(child, f"{path}.{name}" if path else name, conv)
    if conv.fuse_activations:
        route_fusion(module)


def _warn_kept(kept: dict[type, list[str]], dtype: torch.dtype) -> None:
    for cls, paths in kept.items():
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        verb = "is" if len(paths) == 1 else "are"
        warnings.warn(
            f"convert_network: {shown} ({cls.__name__}) {verb} not a type tkern knows to run in {dtype}; "
            "its own parameters and buffers are kept in fp32 (a leaf module runs on its inputs cast "
            "to fp32, a module with children has its children converted)",
            stacklevel=3,
        )


def _checked_conversion(
    model: nn.Module,
    dtype: torch.dtype,
    float8: str | Float8Recipe | None,
    float8_filter: Callable[[str, nn.Module], bool] | None,
    fuse_activations: bool,
    fused_loss: bool,
    keep_fp32_params: bool,
    norms: bool,
    norm_dtype: torch.dtype | None,
) -> Conversion:
    """:func:`convert_network`'s arguments checked (TypeError / ValueError naming the
    argument, before anything changes) and gathered as the rules see them."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dtype not in (*HALF_DTYPES, torch.float32):
        raise TypeError(
            f"dtype must be torch.float16 or torch.bfloat16 (or torch.float32 to convert back), got {dtype}"
        )
    if type(model) is nn.Linear:
        raise TypeError("model is a bare nn.Linear, which cannot be replaced in place; wrap it in a module")
    recipe = None if float8 is None else Float8Recipe.of(float8)
    flags = {
        "fuse_activations": fuse_activations,
        "fused_loss": fused_loss,
        "keep_fp32_params": keep_fp32_params,
        "norms": norms,
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if keep_fp32_params and (recipe is not None or dtype == torch.float32):
        raise ValueError(
            "keep_fp32_params=True keeps fp32 params for a 16-bit compute dtype: it takes dtype "
            "torch.float16 or torch.bfloat16 and no float8 recipe"
        )
    if norm_dtype is not None:
        if not isinstance(norm_dtype, torch.dtype):
            raise TypeError(f"norm_dtype must be None or a torch.dtype, got {norm_dtype!r}")
        if dtype == torch.float32 or keep_fp32_params:
            if norm_dtype != torch.float32:
                raise ValueError(
                    f"norm_dtype={norm_dtype} with "
                    + ("keep_fp32_params=True" if keep_fp32_params else "dtype torch.float32")
                    + ": every param is fp32 there; give norm_dtype=None"
                )
        elif norm_dtype not in (torch.float32, dtype):
            raise ValueError(
                f"norm_dtype must be None, torch.float32 or the conversion's dtype {dtype}, got {norm_dtype}"
            )
    if float8_filter is not None and not callable(float8_filter):
        raise TypeError(f"float8_filter must be callable (name, module) -> bool, got {float8_filter!r}")
    if dtype == torch.float32 and recipe is not None:
        raise ValueError("float8 needs dtype torch.bfloat16 or torch.float16, not torch.float32")
    if recipe is not None:  # before any module changes: a GPU without fp8 tensor cores
        for device in {p.device for p in model.parameters()}:
            check_fp8_device(device, f"convert_network(float8={recipe.scaling!r})")
    return Conversion(dtype, recipe, float8_filter, **flags, norm_dtype=norm_dtype or torch.float32)


def convert_network(
    model: nn.Module,
    dtype: torch.dtype = torch.float16,
    *,
    float8: str | Float8Recipe | None = None,
    float8_filter: Callable[[str, nn.Module], bool] | None = None,
    fuse_activations: bool = True,
    fused_loss: bool = False,
    keep_fp32_params: bool = False,
    norms: bool = True,
    norm_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Convert ``model`` in place for mixed-precision training, and return it.

    * every ``nn.Linear`` becomes a :class:`tkern.nn.Linear` (transformers' GPT-2
      ``Conv1D`` a ``tkern.nn.Conv1D``) with the same Parameter objects cast in place to
      ``dtype``: names, shapes, hooks and tied weights stay as they were;
    * with ``norms`` (the default), ``nn.LayerNorm`` and ``nn.RMSNorm`` become
      :class:`tkern.nn.LayerNorm` / :class:`tkern.nn.RMSNorm`, and transformers' RMSNorms
      (``LlamaRMSNorm`` and kin: ``weight`` and ``variance_epsilon``) a ``tkern.nn.RMSNorm``,
      keeping their Parameter objects (in fp32, or ``norm_dtype``), names and eps: they read the 16-bit input
      as it is (fp32 statistics in the kernel) and save it for backward instead of an
      fp32 copy;
    * other normalization layers (:data:`NORM_TYPES`, and the above with ``norms=False``)
      keep fp32 parameters and statistics and run on their input cast to fp32, returning
      ``dtype``;
    * modules known to run in half precision (:data:`CASTABLE_TYPES`: embeddings,
      convolutions) are cast to ``dtype`` and get their floating-point inputs cast too,
      as autocast would; modules that own no tensors need nothing;
    * any other module that owns tensors keeps them in fp32 (a leaf runs on inputs cast
      to fp32, its output cast to ``dtype``; a module with children has them converted),
      with one warning per type.

    Converting twice is converting once; ``dtype=torch.float32`` converts back (plain torch
    modules in fp32, tkern's hooks removed). Converted models pickle and deep-copy. The
    options below are detailed in docs/api.md.

    ``float8`` (a recipe name or :class:`Float8Recipe`; bf16 is its natural ``dtype``): every
    ``nn.Linear`` (and GPT-2 ``Conv1D``) with both features multiples of 16 becomes a
    :class:`Float8Linear` (``Float8Conv1D``) unless ``float8_filter(name, module)`` returns
    False (torchao's ``module_filter_fn``).

    ``fuse_activations``: in an ``nn.Sequential``, a :class:`tkern.nn.Linear` directly followed
    by ``nn.ReLU``, ``nn.SiLU`` or ``nn.GELU`` runs the activation in its GEMM epilogue (a pair
    where either module has a hook runs unfused; GELU and SiLU round once fewer).
    ``fused_loss``: a transformers ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
    ``Gemma2ForCausalLM`` (its ``final_logit_softcapping`` as ``softcap``) called with
    ``labels`` computes its loss with :func:`tkern.linear_cross_entropy` (no logits tensor) and
    returns ``logits=None``; without labels, and in ``generate()``, logits as before.
    ``keep_fp32_params``: FSDP2's ``MixedPrecisionPolicy(param_dtype=dtype)`` owns the casts:
    tkern's GEMM layers keep fp32 params and compute in ``dtype`` (docs/fsdp.md).
    ``norm_dtype=dtype``: the LayerNorm / RMSNorm params (tkern's, or with ``norms=False``
    torch's and transformers', then fed ``dtype`` inputs) are stored in ``dtype``, so a
    transformer block holds one dtype, which FSDP2's ``fully_shard`` requires of each unit.
    The norms still compute in fp32 (tkern's kernels upcast the weight and sum its gradient
    in fp32, rounding it once) and the fused optimizers keep an fp32 master of every 16-bit
    param, so the norm weights lose only what the Linear weights do.

    Args:
        model: the model (fp32, or converted before).
        dtype: torch.float16 (default) or torch.bfloat16; torch.float32 to convert back.
        float8: None, ``"tensorwise"``, ``"delayed"``, ``"blockwise"`` or a Float8Recipe.
        float8_filter: ``(fully qualified name, module) -> bool``; None converts all.
        fuse_activations: fold ReLU/GELU/SiLU modules into the preceding Linear's GEMM.
        fused_loss: compute a transformers causal LM's loss without its logits (above).
        keep_fp32_params: keep the params fp32 (FSDP2's mixed precision owns the casts).
        norms: replace LayerNorm / RMSNorm layers by tkern's (False: run torch's in fp32).
        norm_dtype: None or torch.float32 (the default: fp32 norm params), or ``dtype``.

    Raises:
        TypeError: ``model`` is not a module, or is a bare ``nn.Linear`` (it cannot be
            replaced in place; wrap it), or ``dtype`` is another dtype, or
            ``fuse_activations`` or ``norms`` is not a bool, or ``norm_dtype`` not a dtype.
        ValueError: converting back a :class:`tkern.nn.Linear` with a fused activation
            (nothing is changed), or ``keep_fp32_params`` with ``float8`` or ``torch.float32``,
            or a ``norm_dtype`` other than fp32 and ``dtype`` (fp32 only with
            ``keep_fp32_params`` or ``dtype=torch.float32``).
    """
    conv = _checked_conversion(
        model, dtype, float8, float8_filter, fuse_activations, fused_loss, keep_fp32_params, norms, norm_dtype
    )
    if dtype == torch.float32:
        _check_convertible_back(model)
        _convert_back(model)
        return model
    if conv.recipe is not None and conv.recipe.enable_fsdp_float8_all_gather:
        conv.tied = _tied_params(model)
    _convert(model, "", conv)
    _warn_kept(conv.kept, dtype)
    if conv.kept_tied:
        warnings.warn(
            f"convert_network: {', '.join(conv.kept_tied)} stay {dtype} layers, not fp8: their weight "
            "is tied to another module's, and enable_fsdp_float8_all_gather replaces the weight "
            "Parameter, which would untie it",
            stacklevel=2,
        )
    return model


def _tied_params(model: nn.Module) -> frozenset[int]:
    """The ids of the params that more than one module of ``model`` holds."""
    seen: set[int] = set()
    tied: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            (tied if id(p) in seen else seen).add(id(p))
    return frozenset(tied)
