"""transformers' causal LMs computing their loss with :func:`tkern.linear_cross_entropy`
(``convert_network(model, dtype, fused_loss=True)``): no (tokens x vocabulary) logits
in forward or backward.

Which models: by structure, not by class name. A transformers model qualifies when its
``forward`` (read from its source, :func:`fused_loss_plan`) is "base model, output
embeddings, HF's causal loss": it calls its base model (``self.<base_model_prefix>``,
or a module below it, as OPT's ``self.model.decoder``) with arguments taken as they are
from its own, feeds that output's last hidden state (optionally through
``slice_logits_to_keep``) to its output embeddings (``get_output_embeddings()``, an
``nn.Linear``: ``lm_head``, GPT-NeoX's ``embed_out``), hands the logits unchanged
(``.contiguous()`` / ``.float()`` aside) to ``self.loss_function`` (transformers'
``ForCausalLMLoss``), and returns the loss as it comes. A config's
``final_logit_softcapping`` (Gemma 2 and 3: ``c * tanh(logits / c)`` before the loss,
inside an ``if`` on that option) becomes the loss's ``softcap``. GPT-2, Llama, Mistral,
Qwen2, Gemma, Gemma 2, Phi, Phi-3, GPT-NeoX, OPT and user subclasses of them qualify;
a forward that changes the logits (Cohere's ``logit_scale``, Granite's
``logits_scaling``), the hidden states before the head, or the loss after it
(Mixtral's router loss) does not, and ``convert_network`` warns, naming the class and why.

The model's ``forward`` is replaced on the instance by a :class:`FusedCausalLMLoss`:
with ``labels`` it calls the base model with the same arguments, and the loss on its last
hidden state and the head's weight (and bias), with HF's shift (position i predicts
label i + 1: the labels are shifted, padded with -100 at the end; the hidden states are
not copied), ``ignore_index`` (-100) and HF's ``num_items_in_batch`` / ``shift_labels``
keywords; ``logits`` is None in the output. Without labels (``generate()`` included),
or with ``logits_to_keep``, the model's own forward runs, untouched. Tied embeddings
stay tied: the head's weight is read where it lives.

The head's GEMM runs in the head weight's 16-bit dtype: :func:`tkern.linear_cross_entropy`
has no fp8 GEMM. So ``convert_network(float8=..., fused_loss=True)`` keeps the fused heads
out of fp8 (:func:`fused_loss_heads`; Transformer Engine and torchao keep the LM head out of
fp8 too), and where a fused loss's head is an fp8 layer anyway (converted to fp8 before the
fused loss was installed) :func:`warn_if_float8_head` says that it trains in 16 bits.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from tkern.ops.cross_entropy import linear_cross_entropy

__all__ = [
    "FusedCausalLMLoss",
    "FusedLossPlan",
    "fused_loss_heads",
    "fused_loss_plan",
    "install_fused_loss",
    "remove_fused_loss",
    "warn_if_float8_head",
    "warn_if_no_fused_loss",
]

IGNORE_INDEX = -100
_SOFTCAP_OPTION = "final_logit_softcapping"
#: Calls that leave the logits' values as they are (between the head and the loss).
_SAME_VALUES = ("contiguous", "float")


@dataclass(frozen=True)
class FusedLossPlan:
    """What :class:`FusedCausalLMLoss` needs of a qualifying model (see :func:`fused_loss_plan`)."""

    head: str  #: the head's attribute name (``lm_head``, ``embed_out``)
    base: tuple  #: the base model's attribute path (``("model",)``, OPT's ``("model", "decoder")``)
    base_args: tuple  #: per base-model argument: (keyword or None for positional, forward parameter)
    base_kwargs: bool  #: whether the forward passes its ``**kwargs`` on to the base model
    output_class: type  #: the forward's output class (a transformers ModelOutput)
    softcap: float | None  #: the config's ``final_logit_softcapping``
    params: tuple  #: the forward's parameter names, ``self`` excluded
    defaults: dict  #: their defaults
    var_kwargs: str | None  #: the name of the forward's ``**kwargs``, if any


class _RefusedError(Exception):
    """Why the fused loss cannot apply (the message names it)."""


# --------------------------------------------------------------------------- reading the forward


def _self_attr(node: ast.AST) -> list[str] | None:
    """``self.a.b`` as ``["a", "b"]``; None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return names[::-1] if isinstance(node, ast.Name) and node.id == "self" and names else None


def _assignments(fn: ast.FunctionDef, name: str) -> list[ast.stmt]:
    """Every statement of ``fn`` that (re)binds ``name``."""
    found = []
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
            isinstance(t, ast.Name) and t.id == name for t in targets
        ):
            found.append(node)
    return found


def _strip_same_values(node: ast.AST) -> ast.AST:
    """``x.contiguous().float()`` as ``x``."""
    while (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _SAME_VALUES
        and not node.args
    ):
        node = node.func.value
    return node


def _loss_call(fn: ast.FunctionDef) -> tuple[ast.Assign, str]:
    """The ``loss = self.loss_function(logits, ...)`` statement and the logits' name."""
    calls = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and _self_attr(n.value.func) == ["loss_function"]
    ]
    if len(calls) != 1 or not isinstance(calls[0].targets[0], ast.Name):
        raise _RefusedError("its forward does not compute its loss with one call of self.loss_function")
    call = calls[0].value
    arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "logits"), None)
    if not isinstance(arg, ast.Name):
        raise _RefusedError("its forward hands self.loss_function something other than the head's logits")
    return calls[0], arg.id


def _mentions(node: ast.AST, word: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == word for n in ast.walk(node))


def _softcap_ifs(fn: ast.FunctionDef) -> set[int]:
    """The ids of the statements inside an ``if`` on ``final_logit_softcapping``."""
    inside = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and _mentions(node.test, _SOFTCAP_OPTION):
            inside.update(id(s) for s in node.body)
    return inside


def _logits_source(fn: ast.FunctionDef, logits: str, head: str, src: str) -> tuple[ast.AST, bool]:
    """The head call's argument, and whether the forward softcaps the logits; refuses any
    other change of the logits between the head and the loss."""
    head_calls, softcapped = [], False
    softcap_stmts = _softcap_ifs(fn)
    for stmt in _assignments(fn, logits):
        value = _strip_same_values(stmt.value) if isinstance(stmt, ast.Assign) else None
        if isinstance(value, ast.Call) and _self_attr(value.func) == [head] and len(value.args) == 1:
            head_calls.append(value.args[0])
        elif isinstance(value, ast.Name) and value.id == logits:
            continue  # logits = logits.contiguous() and the like
        elif id(stmt) in softcap_stmts:
            softcapped = True
        else:
            line = ast.get_source_segment(src, stmt)
            raise _RefusedError(f"its forward changes the logits between self.{head} and the loss (`{line}`)")
    if len(head_calls) != 1:
        raise _RefusedError(f"its forward does not compute the logits with one call of self.{head}")
    return head_calls[0], softcapped


def _refers_to(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _origin(fn: ast.FunctionDef, name: str) -> ast.AST | None:
    """The one value ``name`` is bound to that does not read ``name`` itself, where every
    other binding is ``slice_logits_to_keep(name, ...)`` (positions kept, values as they are)."""
    origins = []
    for stmt in _assignments(fn, name):
        value = getattr(stmt, "value", None)
        if isinstance(stmt, ast.AugAssign) or value is None:
            return None
        if not _refers_to(value, name):
            origins.append(value)
        elif not (isinstance(value, ast.Call) and getattr(value.func, "id", None) == "slice_logits_to_keep"):
            return None
    return origins[0] if len(origins) == 1 else None


def _hidden_source(fn: ast.FunctionDef, arg: ast.AST, src: str) -> str:
    """The name of the base model's output whose last hidden state feeds the head."""
    seen = 0
    while seen < 8:  # a short chain of names: hidden = out.last_hidden_state; hidden = slice(...)
        seen += 1
        if (
            isinstance(arg, ast.Attribute)
            and arg.attr == "last_hidden_state"
            and isinstance(arg.value, ast.Name)
        ):
            return arg.value.id
        if isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name):
            index = arg.slice
            if isinstance(index, ast.Constant) and index.value == 0:
                return arg.value.id  # outputs[0]
            if isinstance(index, ast.Tuple) and any(
                getattr(e, "id", None) == "slice_indices" for e in index.elts
            ):
                arg = arg.value  # hidden[:, slice_indices, :] (older transformers' logits_to_keep)
                continue
        if isinstance(arg, ast.Call) and getattr(arg.func, "id", None) == "slice_logits_to_keep":
            arg = arg.args[0]  # the positions kept when logits_to_keep is set (not with labels here)
            continue
        if isinstance(arg, ast.Name):
            origin = _origin(fn, arg.id)
            if origin is None:
                break
            arg = origin
            continue
        break
    segment = ast.get_source_segment(src, arg) or ast.dump(arg)
    raise _RefusedError(
        f"its forward feeds the head something other than the base model's last hidden state (`{segment}`)"
    )


def _base_call(fn: ast.FunctionDef, outputs: str, prefix: str, params: tuple) -> tuple[tuple, tuple, bool]:
    """``(path, base_args, base_kwargs)``: which module the forward calls for the hidden
    states (its base model or a module below it) and how."""
    binds = _assignments(fn, outputs)
    call = binds[0].value if len(binds) == 1 else None
    path = _self_attr(call.func) if isinstance(call, ast.Call) else None
    if not path or path[0] != prefix:
        raise _RefusedError(
            f"its forward does not take the hidden states from its base model (self.{prefix})"
        )
    args, var = [], False
    for a in call.args:
        if not (isinstance(a, ast.Name) and a.id in params):
            raise _RefusedError(f"its forward passes its base model a computed argument ({ast.dump(a)})")
        args.append((None, a.id))
    for k in call.keywords:
        if k.arg is None:
            var = True
        elif isinstance(k.value, ast.Name) and k.value.id in params:
            args.append((k.arg, k.value.id))
        else:
            raise _RefusedError(f"its forward passes its base model a computed argument ({k.arg}=...)")
    return tuple(path), tuple(args), var


def _loss_kept(fn: ast.FunctionDef, call: ast.Assign, src: str) -> None:
    """Refuses a forward that changes the loss after ``self.loss_function``."""
    loss = call.targets[0].id
    for stmt in _assignments(fn, loss):
        if stmt is call or (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)):
            continue
        raise _RefusedError(
            f"its forward changes the loss after self.loss_function (`{ast.get_source_segment(src, stmt)}`)"
        )


def _output_class(fn: ast.FunctionDef, func) -> type:
    from transformers.utils import ModelOutput

    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Return)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
        ):
            cls = func.__globals__.get(node.value.func.id)
            if (
                isinstance(cls, type)
                and issubclass(cls, ModelOutput)
                and "logits" in cls.__dataclass_fields__
            ):
                return cls
    raise _RefusedError("its forward does not return a ModelOutput with loss and logits")


# --------------------------------------------------------------------------- the plan


def _head_name(model: nn.Module) -> str:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        raise _RefusedError(f"its output embeddings are {type(head).__name__}, not a Linear head")
    name = next((n for n, m in model.named_children() if m is head), None)
    if name is None:
        raise _RefusedError("its output embeddings are not one of its own modules")
    return name


def _causal_loss(model: nn.Module) -> None:
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING

    causal = LOSS_MAPPING["ForCausalLM"]
    prop = inspect.getattr_static(type(model), "loss_function", None)
    own = model.__dict__.get("_loss_function")
    loss_type = getattr(model, "loss_type", None)
    named = LOSS_MAPPING.get(loss_type, causal)  # transformers falls back to the causal loss
    if prop is not inspect.getattr_static(PreTrainedModel, "loss_function") or (own or named) is not causal:
        raise _RefusedError(
            f"its loss_function is not transformers' ForCausalLMLoss (loss_type {loss_type!r})"
        )


def fused_loss_plan(model: nn.Module) -> FusedLossPlan:
    """How :class:`FusedCausalLMLoss` runs ``model`` (a transformers ``PreTrainedModel``
    with output embeddings), read from its class's ``forward``; raises ``ValueError``
    saying why where the fused loss would not compute what the model's own forward does."""
    try:
        head = _head_name(model)
        base = getattr(model, "base_model", model)
        if base is model:
            raise _RefusedError("it has no base model below its head")
        _causal_loss(model)
        func = inspect.unwrap(type(model).forward)
        src = textwrap.dedent(inspect.getsource(func))
        fn = ast.parse(src).body[0]
        sig = inspect.signature(func)
        params = tuple(p for p in sig.parameters if p != "self")
        var_kwargs = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        call, logits = _loss_call(fn)
        _loss_kept(fn, call, src)
        arg, softcapped = _logits_source(fn, logits, head, src)
        outputs = _hidden_source(fn, arg, src)
        path, base_args, base_kwargs = _base_call(fn, outputs, model.base_model_prefix, params)
    except _RefusedError as why:
        raise ValueError(str(why)) from None
    except (OSError, TypeError, SyntaxError) as e:  # no source to read (a compiled or generated class)
        raise ValueError(f"its forward's source cannot be read ({e})") from None
    cap = getattr(model.config, _SOFTCAP_OPTION, None) if softcapped else None
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    return FusedLossPlan(
        head,
        path,
        base_args,
        base_kwargs,
        _output_class(fn, func),
        None if cap is None else float(cap),
        params,
        defaults,
        var_kwargs,
    )


# --------------------------------------------------------------------------- the forward


class FusedCausalLMLoss:
    """``model.forward`` with the loss by :func:`tkern.linear_cross_entropy` when labels are
    given (see the module docstring). A module-level class, so models pickle and deep-copy.
    Plain dict work per call (no ``inspect``), so ``torch.compile`` traces it."""

    def __init__(self, model: nn.Module, plan: FusedLossPlan) -> None:
        self.model, self.plan = model, plan

    def _original(self, *args, **kwargs):
        return type(self.model).forward(self.model, *args, **kwargs)

    def _bind(self, args: tuple, kwargs: dict) -> tuple[dict, dict] | None:
        """``(named, extra)``: the forward's parameters by name, and its ``**kwargs``;
        None where they do not bind plainly (HF's own forward then runs)."""
        plan = self.plan
        if len(args) > len(plan.params):
            return None
        named = dict(zip(plan.params, args, strict=False))  # args may be fewer
        extra = {}
        for key, value in kwargs.items():
            if key in named:
                return None
            if key in plan.params:
                named[key] = value
            elif plan.var_kwargs is None:
                return None
            else:
                extra[key] = value
        for key in plan.params:
            if key not in named and key in plan.defaults:
                named[key] = plan.defaults[key]
        return named, extra

    def __call__(self, *args, **kwargs):
        bound = self._bind(args, kwargs) if kwargs.get("labels") is not None else None
        if bound is None or bound[0].get("logits_to_keep", 0) not in (0, None):
            return self._original(*args, **kwargs)
        named, extra = bound
        return_dict = extra.pop("return_dict", named.get("return_dict"))  # ours to apply, at the end
        positional, keywords = [], dict(extra) if self.plan.base_kwargs else {}
        for key, param in self.plan.base_args:
            value = True if param == "return_dict" else named.get(param)
            if key is None:
                positional.append(value)
            else:
                keywords[key] = value
        base = self.model
        for name in self.plan.base:
            base = getattr(base, name)
        out = base(*positional, **keywords)
        loss = self.loss(out.last_hidden_state, named["labels"], extra)
        fields = {k: v for k, v in out.items() if k in self.plan.output_class.__dataclass_fields__}
        fields.pop("last_hidden_state", None)
        result = self.plan.output_class(loss=loss, logits=None, **fields)
        return result.to_tuple() if return_dict is False else result

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, extra: dict) -> torch.Tensor:
        """HF's ``ForCausalLMLoss`` on ``hidden`` (B, T, H) through the head, chunked: the
        labels are shifted (padded with ``ignore_index`` at the end), the hidden states are not."""
        head = getattr(self.model, self.plan.head)
        ignore_index = extra.get("ignore_index", IGNORE_INDEX)
        shift_labels = extra.get("shift_labels")
        if shift_labels is None:
            # position i predicts label i + 1; the last position predicts nothing (the shifted
            # labels padded: one launch, contiguous, where padding first and slicing made a
            # strided view that reshape(-1) copied)
            shift_labels = nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)
        shift_labels = shift_labels.to(hidden.device)
        num_items = extra.get("num_items_in_batch")
        weight = head.weight
        x = hidden if hidden.dtype == weight.dtype else hidden.to(weight.dtype)
        loss = linear_cross_entropy(
            x.reshape(-1, x.shape[-1]),
            weight,
            shift_labels.reshape(-1),
            linear_bias=head.bias,
            reduction="mean" if num_items is None else "sum",
            ignore_index=ignore_index,
            softcap=self.plan.softcap,
        )
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        return loss


def _is_hf_lm(module: nn.Module) -> bool:
    """A transformers model with output embeddings (an LM head of some kind)."""
    get = getattr(module, "get_output_embeddings", None)
    if not (hasattr(module, "base_model_prefix") and callable(get)):
        return False
    try:
        return get() is not None
    except (AttributeError, NotImplementedError):  # a model class that declares no head
        return False


def install_fused_loss(module: nn.Module) -> bool:
    """Give ``module`` a :class:`FusedCausalLMLoss` forward if it is a transformers causal LM
    that qualifies (:func:`fused_loss_plan`); warns, naming its class and why, where it is a
    transformers model with an LM head that does not. Returns whether it installed it."""
    if not _is_hf_lm(module):
        return False
    try:
        plan = fused_loss_plan(module)
    except ValueError as why:
        warnings.warn(
            f"convert_network(fused_loss=True): {type(module).__name__} keeps its own loss (the logits "
            f"are materialized): {why}",
            stacklevel=4,
        )
        return False
    module.forward = FusedCausalLMLoss(module, plan)
    return True


def warn_if_no_fused_loss(model: nn.Module) -> None:
    """After ``convert_network(fused_loss=True)``: a warning where ``model`` holds no
    transformers model with an LM head at all (nothing was fused, and nothing said why)."""
    if not any(
        _is_hf_lm(m) or isinstance(m.__dict__.get("forward"), FusedCausalLMLoss) for m in model.modules()
    ):
        warnings.warn(
            f"convert_network(fused_loss=True): {type(model).__name__} holds no transformers causal LM "
            "(a model with get_output_embeddings()); its loss is computed as before",
            stacklevel=3,
        )


def fused_loss_heads(model: nn.Module, *, qualifying: bool = False) -> dict[str, nn.Module]:
    """The LM heads in ``model`` whose GEMM :func:`tkern.linear_cross_entropy` computes,
    by path: the output embeddings of every model with the fused loss installed and, with
    ``qualifying``, of every transformers causal LM that qualifies (to which
    :func:`install_fused_loss` would give it)."""
    heads = {}
    for path, module in model.named_modules():
        fused = module.__dict__.get("forward")
        if isinstance(fused, FusedCausalLMLoss):
            name = fused.plan.head
        elif qualifying and _is_hf_lm(module):
            try:
                name = fused_loss_plan(module).head
            except ValueError:
                continue
        else:
            continue
        heads[f"{path}.{name}" if path else name] = getattr(module, name)
    return heads


def warn_if_float8_head(model: nn.Module) -> None:
    """A warning naming each fused loss's LM head in ``model`` that is an fp8 layer
    (tkern's ``Float8Linear``, or another library's ``Float8...`` class): the fused loss
    computes that head's GEMM in its weight's 16-bit dtype, not in fp8; the layer's own fp8
    forward runs only where the fused loss does not (no labels: ``generate()``)."""
    fp8 = {
        path: head
        for path, head in fused_loss_heads(model).items()
        if type(head).__name__.startswith("Float8")
    }
    if fp8:
        names = ", ".join(f"{path} ({type(head).__name__})" for path, head in fp8.items())
        dtype = next(iter(fp8.values())).weight.dtype
        warnings.warn(
            f"fused loss: the LM head {names} trains in 16 bits ({dtype}), not fp8: "
            "tkern.linear_cross_entropy computes the head's GEMM and has no fp8 one (its fp8 forward "
            "runs only without labels). Convert the fp32 model once with both float8 and fused_loss=True "
            "(the head then stays a 16-bit layer), or with fused_loss=False to train the head in fp8",
            stacklevel=3,
        )


def remove_fused_loss(module: nn.Module) -> None:
    """Undo :func:`install_fused_loss` (nothing if it was not installed)."""
    if isinstance(module.__dict__.get("forward"), FusedCausalLMLoss):
        del module.forward
