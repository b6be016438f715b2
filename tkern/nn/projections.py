"""An attention forward's projections of one input run as one autograd node (see
:func:`tkern.convert_network`): Llama's ``self.q_proj(hidden_states)``, ``self.k_proj(...)``,
``self.v_proj(...)`` become one :func:`tkern.ops.projections.shared_input_linears` call, whose
backward sums the three input gradients in the dgrad GEMMs (autograd would sum them with two
torch adds over (tokens, hidden)).

:func:`grouped_code` rewrites the forward's source (the three calls, as the family's rule in
``tkern.nn.rotary.ROTARY_RULES`` names them, each ``self.<name>(<the same name>)``) so that
each call goes through a :class:`SharedInputCall` with a dict local to that call of the
forward: the first of the three computes all three outputs and leaves the other two there for
their calls. Decided on every call: a layer that is not a tkern ``Linear`` without an
activation, has anything (a hook, a patched forward) on it, or computes in another dtype, or a
call under ``torch.compile``, gets each layer called as a module, as HF wrote it. The modules,
their Parameters and the module tree stay as they are.

A packed projection split in the forward, GPT-2's ``self.c_attn(hidden_states).split(
self.split_size, dim=2)`` (:data:`SPLIT_RULES`, by family), likewise becomes one
:func:`tkern.ops.projections.split_linear` call through a :class:`SplitCall` (:func:`split_code`
rewrites it; :class:`SplitAttentionForward` is the attention's instance forward): one GEMM whose
output the three parts are views of, and a backward that takes their gradients apart, where
autograd's split would concatenate dq, dk and dv into one (tokens, 3H) tensor first. Decided on
every call as above (a tkern ``Linear`` or GPT-2 ``Conv1D`` with nothing on it, one dtype, a plain
tensor outside ``torch.compile``, the split on the last dimension into parts of its width); a
split of another call (GPT-2's cross-attention's ``self.c_attn(encoder_hidden_states)``) is left
as HF wrote it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from dataclasses import dataclass

import torch
from torch import nn

from tkern.nn.fusion import family_rule, runs_more_than_forward
from tkern.nn.linear import Linear, compute_operands, conv1d_class
from tkern.ops.common import is_compiling, launches_directly
from tkern.ops.projections import shared_input_linears, split_linear

__all__ = [
    "CALL",
    "CALLS",
    "SPLIT_CALL",
    "SPLIT_RULES",
    "SharedInputCall",
    "SplitAttentionForward",
    "SplitCall",
    "SplitRule",
    "grouped_code",
    "rebuilt",
    "route_split",
    "shared_outputs",
    "split_code",
    "split_outputs",
]

#: The global the rewritten forward calls as ``CALL(CALLS, self, name, x)`` for each grouped
#: projection, and the local dict (one per call of the forward) it keeps outputs in.
CALL, CALLS = "_tkern_shared_input_call", "_tkern_shared_input_outputs"


def shared_outputs(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> tuple | None:
    """``tuple(getattr(module, n)(x) for n in names)`` as one :func:`shared_input_linears`
    call where each child is a tkern ``Linear`` without an activation, nothing (a hook, a
    patched forward) on it, all computing in one dtype; else None (nothing run)."""
    layers = [getattr(module, n, None) for n in names]
    if any(type(layer) is not Linear or layer.activation is not None for layer in layers):
        return None
    if any(map(runs_more_than_forward, layers)):
        return None
    xs, weight = compute_operands(layers[0], x, layers[0].weight)
    weights = [weight] + [compute_operands(layer, xs, layer.weight)[1] for layer in layers[1:]]
    if any(w.dtype != xs.dtype for w in weights):
        return None
    return shared_input_linears(xs, weights, [layer.bias for layer in layers])


class SharedInputCall:
    """What a rewritten forward calls for each grouped projection (:data:`CALL`):
    ``call(outputs, module, name, x)`` returns ``getattr(module, name)(x)``, computed with the
    group's other projections of the same ``x`` by :func:`shared_outputs` on the first call and
    left in ``outputs`` (the forward's local dict) for theirs; each layer called as a module
    where the group cannot run as one (or under ``torch.compile``)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def __call__(self, outputs: dict, module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
        held = outputs.pop(name, None)
        if held is not None and held[0] is x:
            return held[1]
        ys = None if is_compiling() else shared_outputs(module, self.names, x)
        if ys is None:
            return getattr(module, name)(x)
        outputs.update((n, (x, y)) for n, y in zip(self.names, ys, strict=True) if n != name)
        return ys[self.names.index(name)]

    def __repr__(self) -> str:
        return f"tkern.nn.projections.SharedInputCall({self.names})"


class _Group(ast.NodeTransformer):
    """Rewrites each ``self.<name>(arg)`` for ``name`` in ``names`` into ``CALL(CALLS, self,
    "<name>", arg)``, recording the names and arguments it saw."""

    def __init__(self, self_name: str, names: tuple[str, ...]) -> None:
        self.self_name, self.names, self.seen = self_name, names, []

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if not (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and f.value.id == self.self_name
            and f.attr in self.names
        ):
            return node
        plain = len(node.args) == 1 and isinstance(node.args[0], ast.Name) and not node.keywords
        self.seen.append((f.attr, node.args[0].id if plain else None))
        args = [ast.Name(CALLS, ast.Load()), ast.Name(self.self_name, ast.Load()), ast.Constant(f.attr)]
        return ast.copy_location(ast.Call(ast.Name(CALL, ast.Load()), [*args, *node.args], []), node)


def _parsed(fn) -> ast.FunctionDef | None:
    """``fn``'s definition (its own source, dedented), or None where it has none to read."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef) or func.name != fn.__name__ or not func.args.args:
        return None
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)  # getsource starts at the decorators
    return func


def grouped_code(fn, names: tuple[str, ...]) -> types.CodeType | None:
    """``fn``'s code with its calls ``self.<name>(x)``, for each of ``names`` once and all on
    one plain name ``x``, going through :data:`CALL` with a local dict :data:`CALLS` made first
    (the code a :class:`SharedInputCall` bound to :data:`CALL` groups); None where ``fn`` is
    not written so (or has no source, or closes over anything)."""
    func = _parsed(fn) if len(names) > 1 and not fn.__code__.co_freevars else None
    if func is None or CALL in fn.__code__.co_names or CALLS in fn.__code__.co_varnames:
        return None
    group = _Group(func.args.args[0].arg, names)
    group.visit(func)
    args = {arg for _, arg in group.seen}
    if sorted(attr for attr, _ in group.seen) != sorted(names) or len(args) != 1 or None in args:
        return None
    first = func.body[0]
    made = ast.Assign([ast.Name(CALLS, ast.Store())], ast.Dict([], []))
    func.body.insert(0, ast.copy_location(made, first))
    func.decorator_list = []
    module = compile(
        ast.fix_missing_locations(ast.Module([func], [])), fn.__code__.co_filename, "exec", dont_inherit=True
    )
    code = next(c for c in module.co_consts if isinstance(c, types.CodeType) and c.co_name == fn.__name__)
    return code if not code.co_freevars else None


# --------------------------------------------------------------------------- a packed projection, split


#: The global a rewritten forward calls as ``SPLIT_CALL(self, name, x, size, dim)`` in place of
#: ``self.<name>(x).split(size, dim=dim)``.
SPLIT_CALL = "_tkern_split_call"


@dataclass(frozen=True)
class SplitRule:
    """One family's packed projection split in its attention forward: the forward calls
    ``self.<layer>(<input>).split(<size>, dim=<dim>)`` once (``input`` a plain name; a split
    of any other call is left as it is)."""

    layer: str = "c_attn"
    input: str = "hidden_states"


#: transformers' attention classes (by name) whose forward splits its packed projection as the
#: rule says (read from their source, transformers 5.x; tests/test_gpt2_qkv_split.py checks
#: GPT-2's): GPT-2's self-attention ``self.c_attn(hidden_states).split(self.split_size, dim=2)``.
SPLIT_RULES: dict[str, SplitRule] = {"GPT2Attention": SplitRule()}


def split_outputs(layer: nn.Module, x: torch.Tensor, size, dim: int) -> tuple | None:
    """``layer(x).split(size, dim)`` as one :func:`split_linear` call where ``layer`` is a tkern
    ``Linear`` without an activation or a ``tkern.nn.Conv1D``, nothing (a hook, a patched
    forward) on it, computing in one dtype on plain tensors (not meta, not a subclass, not under
    ``torch.compile``), ``dim`` its output's last and ``size`` an int dividing its width or a
    list of widths summing to it; else None (nothing run)."""
    kind = type(layer)
    if kind is Linear:
        if layer.activation is not None:
            return None
    elif kind is not conv1d_class(create=False):
        return None
    if runs_more_than_forward(layer) or not (launches_directly(x) and launches_directly(layer.weight)):
        return None
    if dim != -1 and dim != x.dim() - 1:
        return None
    xs, weight = compute_operands(layer, x, layer.weight)
    if kind is not Linear:
        weight = weight.t()  # Conv1D's (K, N), read in place
    if weight.dtype is not xs.dtype:
        return None
    n = weight.shape[0]
    if type(size) is int:
        if size <= 0 or n % size:
            return None
        sizes = (size,) * (n // size)
    elif isinstance(size, (list, tuple)) and all(type(s) is int and s > 0 for s in size) and sum(size) == n:
        sizes = tuple(size)
    else:
        return None
    return split_linear(xs, weight, layer.bias, sizes)


class SplitCall:
    """What a rewritten forward calls for its packed projection (:data:`SPLIT_CALL`):
    ``call(module, name, x, size, dim)`` returns ``getattr(module, name)(x).split(size,
    dim=dim)``, as one :func:`split_outputs` node where it can, else as HF wrote it."""

    def __call__(self, module: nn.Module, name: str, x: torch.Tensor, size, dim: int) -> tuple:
        layer = getattr(module, name)
        ys = None if is_compiling() else split_outputs(layer, x, size, dim)
        return layer(x).split(size, dim=dim) if ys is None else ys

    def __repr__(self) -> str:
        return "tkern.nn.projections.SplitCall()"


class _Split(ast.NodeTransformer):
    """Rewrites each ``self.<layer>(<input>).split(size, dim)`` (``dim`` positional or by
    keyword) into ``SPLIT_CALL(self, "<layer>", <input>, size, dim)``, counting them."""

    def __init__(self, self_name: str, rule: SplitRule) -> None:
        self.self_name, self.rule, self.seen = self_name, rule, 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if not (isinstance(f, ast.Attribute) and f.attr == "split" and isinstance(f.value, ast.Call)):
            return node
        inner = f.value
        g = inner.func
        if not (
            isinstance(g, ast.Attribute)
            and isinstance(g.value, ast.Name)
            and g.value.id == self.self_name
            and g.attr == self.rule.layer
            and len(inner.args) == 1
            and not inner.keywords
            and isinstance(inner.args[0], ast.Name)
            and inner.args[0].id == self.rule.input
        ):
            return node
        dims = [k.value for k in node.keywords if k.arg == "dim"]
        if len(node.args) == 2 and not node.keywords:
            size, dim = node.args
        elif len(node.args) == 1 and len(node.keywords) == 1 and dims:
            size, dim = node.args[0], dims[0]
        else:
            return node
        self.seen += 1
        args = [ast.Name(self.self_name, ast.Load()), ast.Constant(g.attr), inner.args[0], size, dim]
        return ast.copy_location(ast.Call(ast.Name(SPLIT_CALL, ast.Load()), args, []), node)


def split_code(fn, rule: SplitRule) -> types.CodeType | None:
    """``fn``'s code with its one ``self.<rule.layer>(<rule.input>).split(size, dim)`` going
    through :data:`SPLIT_CALL` (the code a :class:`SplitCall` bound to it runs); None where
    ``fn`` is not written so (none or more than one such call, no source, a closure)."""
    func = None if fn.__code__.co_freevars or SPLIT_CALL in fn.__code__.co_names else _parsed(fn)
    if func is None:
        return None
    split = _Split(func.args.args[0].arg, rule)
    split.visit(func)
    if split.seen != 1:
        return None
    func.decorator_list = []
    module = compile(
        ast.fix_missing_locations(ast.Module([func], [])), fn.__code__.co_filename, "exec", dont_inherit=True
    )
    code = next(c for c in module.co_consts if isinstance(c, types.CodeType) and c.co_name == fn.__name__)
    return code if not code.co_freevars else None


def rebuilt(fn, innermost):
    """``fn`` with the function at the bottom of its ``functools.wraps`` chain replaced by
    ``innermost(that function)`` (a new function, or None: none can be made), each wrapper above
    rebuilt with its closure's reference to the function below replaced; names, docs and
    attributes kept. None where ``innermost`` gives None or a wrapper holds the function below
    otherwise than in one closure cell."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        new = innermost(fn)
        if new is None:
            return None
    else:
        below = rebuilt(inner, innermost)
        cells = fn.__closure__ or ()
        holds = [i for i, c in enumerate(cells) if _contents(c) is inner]
        if below is None or len(holds) != 1:
            return None
        closure = tuple(types.CellType(below) if i == holds[0] else c for i, c in enumerate(cells))
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__dict__.update(fn.__dict__)
    if inner is not None:
        new.__wrapped__ = below
    new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    new.__module__ = fn.__module__
    return new


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _split_innermost(fn, rule: SplitRule):
    """``fn`` (no wrapper) over a copy of its globals with :data:`SPLIT_CALL` bound, its code
    :func:`split_code`'s; None where that gives none."""
    code = split_code(fn, rule)
    if code is None:
        return None
    globals_ = {**fn.__globals__, SPLIT_CALL: SplitCall()}
    globals_.pop("__name__", None)  # torch.compile: guard on this dict, not HF's module
    return types.FunctionType(code, globals_, fn.__name__, fn.__defaults__, fn.__closure__)


#: attention class -> its forward with the split as one node (None: its forward cannot be rewritten).
_SPLIT_FORWARDS: dict[type, object] = {}


def _split_forward(cls: type, rule: SplitRule):
    if cls not in _SPLIT_FORWARDS:
        _SPLIT_FORWARDS[cls] = rebuilt(cls.forward, lambda fn: _split_innermost(fn, rule))
    return _SPLIT_FORWARDS[cls]


class SplitAttentionForward:
    """The forward of a transformers attention module of a family in :data:`SPLIT_RULES`,
    converted with ``fuse_activations``: its class's own forward with the packed projection's
    split through a :class:`SplitCall` (one autograd node where it can run as one). Stored as the
    instance's ``forward`` (hooks on the module fire as before); a module-level class, so the
    model pickles and deep-copies."""

    def __init__(self, attention: nn.Module, rule: SplitRule) -> None:
        self.attention = attention
        self.rule = rule

    def __call__(self, *args, **kwargs):
        return _split_forward(type(self.attention), self.rule)(self.attention, *args, **kwargs)

    def __repr__(self) -> str:
        return f"tkern.nn.projections.SplitAttentionForward({self.rule.layer})"


def route_split(module: nn.Module) -> None:
    """Give ``module`` the :class:`SplitAttentionForward` if it is a transformers attention
    module of a family in :data:`SPLIT_RULES` whose forward splits as the rule says (the rule's
    class's own forward: ``fusion.family_rule``); nothing otherwise (it runs as HF wrote it)."""
    if "forward" in module.__dict__ or not type(module).__module__.startswith("transformers."):
        return
    cls, rule = family_rule(module, SPLIT_RULES)
    if cls is not None and _split_forward(type(module), rule) is not None:
        module.forward = SplitAttentionForward(module, rule)
