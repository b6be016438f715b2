"""``convert_network``: a model converted in place for mixed-precision training, by a
table of small per-module rules (tkern/nn/convert_rules.py: :data:`RULES`,
:data:`POST_RULES`, :data:`BACK_RULES`) over a walk of the module tree (here).

Each rule looks at one module and either converts it (returns True: its children
are not visited) or declines (False: the next rule is asked). A module no rule takes
is a container or a module of unknown kind: its children are converted and, if it
owns floating-point tensors itself that no child holds, they stay fp32 (one warning
per type). After its children, the post rules fuse what they can (activations).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from tkern.kernels._common import HALF_DTYPES
from tkern.kernels.float8 import check_fp8_device
from tkern.nn.casting import CastInputs, CastOutput, cast_own, cast_tree, float_tensors, run_in_fp32
from tkern.nn.convert_rules import (
    BACK_RULES,
    CASTABLE_TYPES,
    NORM_TYPES,
    POST_RULES,
    RULES,
    Conversion,
    keep_in_fp32_patterns,
    remove_tkern_hooks,
)
from tkern.nn.float8 import Float8Recipe
from tkern.nn.hf_loss import fused_loss_heads, warn_if_float8_head, warn_if_no_fused_loss
from tkern.nn.linear import Linear
from tkern.ops.float8_args import recipe_formats

# CastInputs / CastOutput: models pickled while they lived here find them by this name
__all__ = [
    "BACK_RULES",
    "CASTABLE_TYPES",
    "NORM_TYPES",
    "POST_RULES",
    "RULES",
    "CastInputs",
    "CastOutput",
    "Conversion",
    "convert_network",
]


# --------------------------------------------------------------------------- the walk


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


def _own_unshared(module: nn.Module, children: list[nn.Module]) -> list[torch.Tensor]:
    """``module``'s own floating-point tensors that none of its descendants holds (a bias
    shared with a child Linear, as BERT's ``cls.predictions.bias``, is the child's: its
    rule decides its dtype)."""
    held = {id(t) for c in children for t in (*c.parameters(), *c.buffers())}
    return [t for t in float_tensors(module) if id(t) not in held]


def _convert(module: nn.Module, path: str, conv: Conversion) -> None:
    remove_tkern_hooks(module)  # converting again replaces, never stacks, the hooks
    if any(rule(module, path, conv) for rule in RULES):
        return
    children = list(module.named_children())
    own = _own_unshared(module, [c for _, c in children])
    if own:
        conv.kept.setdefault(type(module), []).append(path or "the model")
        if not children:
            run_in_fp32(module, conv.dtype)
            return
        cast_own(module, torch.float32, only={id(t) for t in own})
    for name, child in children:
        _convert(child, f"{path}.{name}" if path else name, conv)
    for rule in POST_RULES if conv.fuse_activations else ():
        why = rule(module)
        if why is not None:
            conv.eager_blocks.setdefault((type(module), why), []).append(path or "the model")


# --------------------------------------------------------------------------- what it says


def _listed(paths: list[str]) -> str:
    return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _warn(conv: Conversion) -> None:
    """One warning per module type (and reason) for what was kept in fp32 or left eager;
    attributed to the caller of convert_network."""
    said = []
    for cls, paths in conv.kept.items():
        verb = "is" if len(paths) == 1 else "are"
        said.append(
            f"{_listed(paths)} ({cls.__name__}) {verb} not a type tkern knows to run in {conv.dtype}; "
            "its own floating-point parameters and buffers are kept in fp32 (a leaf module runs on "
            "its inputs cast to fp32, a module with children has its children converted)"
        )
    for cls, paths in conv.kept_asked.items():
        said.append(
            f"{_listed(paths)} ({cls.__name__}): kept in fp32 (parameters and compute, inputs cast to "
            "fp32, output fp32) as the model's _keep_in_fp32_modules asks"
        )
    for (cls, why), paths in conv.eager_blocks.items():
        said.append(f"{_listed(paths)} ({cls.__name__}): left eager, {why}; its activation runs as torch ops")
    for (cls, why), paths in conv.eager_rotary.items():
        said.append(f"{_listed(paths)} ({cls.__name__}): rotary embedding left eager, {why}")
    if conv.kept_tied:
        said.append(
            f"{', '.join(conv.kept_tied)} stay {conv.dtype} layers, not fp8: their weight is tied to "
            "another module's, and enable_fsdp_float8_all_gather replaces the weight Parameter, which "
            "would untie it"
        )
    for text in said:
        warnings.warn(f"convert_network: {text}", stacklevel=3)


def _tied_params(model: nn.Module) -> frozenset[int]:
    """The ids of the params that more than one module of ``model`` holds."""
    seen: set[int] = set()
    tied: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            (tied if id(p) in seen else seen).add(id(p))
    return frozenset(tied)


def _keep_fused_heads_16bit(model: nn.Module, conv: Conversion) -> None:
    """The LM heads whose GEMM this call's fused loss will compute stay 16-bit layers under
    a float8 recipe (tkern.linear_cross_entropy has no fp8 GEMM): the float8 filter refuses
    them and asks the user's (if any) about the rest."""
    heads = frozenset(map(id, fused_loss_heads(model, qualifying=True).values()))
    inner = conv.float8_filter

    def without_heads(path: str, module: nn.Module) -> bool:
        return id(module) not in heads and (inner is None or bool(inner(path, module)))

    if heads:
        conv.float8_filter = without_heads


# --------------------------------------------------------------------------- the entry point


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
            formats = recipe_formats(recipe.scaling, device)  # FNUZ on a gfx942
            check_fp8_device(device, f"convert_network(float8={recipe.scaling!r})", formats)
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
    """Convert ``model`` in place for mixed-precision training, and return it (docs/api.md).

    * ``nn.Linear`` (transformers' GPT-2 ``Conv1D``) becomes :class:`tkern.nn.Linear`
      (``tkern.nn.Conv1D``): the same Parameter objects cast in place to ``dtype``; names,
      shapes, hooks and tied weights stay as they were;
    * with ``norms``, ``nn.LayerNorm`` / ``nn.RMSNorm`` / transformers' RMSNorms become
      :class:`tkern.nn.LayerNorm` / :class:`tkern.nn.RMSNorm` (same Parameters, fp32 or
      ``norm_dtype``); other norms (:data:`NORM_TYPES`) run in fp32;
    * :data:`CASTABLE_TYPES` (embeddings, convolutions) are cast, their inputs too;
    * the modules a transformers model's ``_keep_in_fp32_modules`` names (fp16; ``..._strict``
      for fp16 and bf16) keep fp32 params and compute, as ``from_pretrained`` keeps them;
    * any other module's own floating-point tensors (none a child holds) stay fp32;
    * with ``fuse_activations``: in an ``nn.Sequential`` a Linear directly followed by ReLU,
      SiLU or GELU runs the activation in its GEMM epilogue; transformers' MLP blocks
      (GPT-2, Llama, Mistral, Qwen2/3, Gemma 1-3, Phi, Phi-3, GPT-NeoX, ...:
      ``fusion.MLP_RULES``) run their activation on tkern's kernels in fp32, forward and
      backward (GPT-2's in c_fc's epilogue, Llama's ``act(gate) * up`` as one kernel);
      a pair or block with a hook on a module it would skip runs unfused; HF attention by
      family (``rotary.ROTARY_RULES``) runs its rotary as :func:`tkern.apply_rotary_pos_emb`
      and its q, k, v projections as one autograd node (``projections``);
      Llama-family decoder layers and GPT-2 blocks (``residual.DECODER_RULES``) add their
      first residual inside the second norm's kernel, forward and backward.

    One warning per module type for what stays fp32 or an MLP block left eager. Converting
    twice is converting once; ``dtype=torch.float32`` converts back. Converted models
    pickle and deep-copy.

    Args:
        model: the model (fp32, or converted before).
        dtype: torch.float16 (default) or torch.bfloat16; torch.float32 to convert back.
        float8: None, ``"tensorwise"``, ``"delayed"``, ``"blockwise"``, ``"mxfp8"`` or a Float8Recipe:
            Linear / Conv1D layers with both features multiples of 16 become fp8 layers,
            except an LM head the fused loss computes (it stays 16-bit, warned if it is fp8).
        float8_filter: ``(fully qualified name, module) -> bool``; None converts all.
        fuse_activations: fuse activations into tkern's kernels (above).
        fused_loss: a transformers causal LM called with ``labels`` computes its loss with
            :func:`tkern.linear_cross_entropy` (no logits) and returns ``logits=None``; which
            qualify is read from their forward (tkern/nn/hf_loss.py), others warn why.
        keep_fp32_params: keep the params fp32 (FSDP2's mixed precision owns the casts).
        norms: replace LayerNorm / RMSNorm layers by tkern's (False: run torch's in fp32).
        norm_dtype: None or torch.float32 (the default: fp32 norm params), or ``dtype``.

    Raises:
        TypeError: ``model`` is not a module or is a bare ``nn.Linear``; ``dtype`` is
            another dtype; a flag is not a bool; ``norm_dtype`` is not a dtype.
        ValueError: converting back a :class:`tkern.nn.Linear` with a fused activation;
            ``keep_fp32_params`` with ``float8`` or torch.float32; another ``norm_dtype``.
        Nothing is changed when it raises.
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
    conv.keep_fp32 = keep_in_fp32_patterns(model, dtype)
    if conv.recipe is not None and fused_loss:
        _keep_fused_heads_16bit(model, conv)
    _convert(model, "", conv)
    if fused_loss:
        warn_if_no_fused_loss(model)
        warn_if_float8_head(model)
    _warn(conv)
    return model
