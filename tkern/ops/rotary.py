"""Rotary position embeddings, ``tkern.apply_rotary_pos_emb``: HF's function of that name
(``rotate_half`` convention, partial rotary included), differentiable, on
kernels/rotary.py (q and k in one launch, fp32 inside, one rounding); and
:func:`rotary_tables`, the (cos, sin) tables HF's rotary embedding modules compute, in one
launch (torch operations with the same math where traced).

Two doors to the same kernel, as ops/swiglu.py has: eager calls go through a plain
``torch.autograd.Function``; ``torch.compile`` tracing, meta tensors and tensor subclasses
go through the custom op ``tkern::rotary`` (a fake implementation gives the shapes; its
backward is the same op with ``inverse`` flipped: the rotation's transpose).
"""

from __future__ import annotations

import torch

from tkern.kernels import rotary as _kernels
from tkern.kernels.rotary import rotary_embedding
from tkern.ops.common import is_compiling

__all__ = ["apply_rotary_pos_emb", "rotary_tables"]


def _eager(*tensors: torch.Tensor) -> bool:
    """Whether the autograd Function applies: plain tensors, not meta, not being traced."""
    return not is_compiling() and all(type(t) is torch.Tensor and not t.is_meta for t in tensors)


def _rotate(q, k, cos, sin, inverse: bool, unsqueeze_dim: int, checked: bool = True, strides=None) -> tuple:
    """The kernel on q and k in HF's layout for ``unsqueeze_dim`` (1: (batch, heads, seq,
    head_dim); 2: (batch, seq, heads, head_dim)); the outputs new tensors of q's / k's shape
    in that layout, contiguous, or with ``strides`` (a pair: q's and k's). ``checked`` False:
    the eager backward, on autograd's gradients of outputs its forward checked
    (``rotary_embedding(prechecked=True)``)."""
    if strides is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=q.dtype, device=q.device)
    else:
        q_out = torch.empty_strided(q.shape, strides[0], dtype=q.dtype, device=q.device)
        k_out = torch.empty_strided(k.shape, strides[1], dtype=q.dtype, device=q.device)
    args = (q, k, q_out, k_out) if unsqueeze_dim == 1 else (t.transpose(1, 2) for t in (q, k, q_out, k_out))
    qv, kv, qo, ko = args  # the kernel's (b, h, s, d) order
    rotary_embedding(qv, kv, cos, sin, inverse=inverse, q_out=qo, k_out=ko, prechecked=not checked)
    return q_out, k_out


def _differentiable(dq, dk, cos, sin, unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)`` rotated back by torch operations in fp32, each rounded once: what the
    kernel computes, recorded by autograd (backward with ``create_graph=True``)."""
    c, s = (t.float().unsqueeze(unsqueeze_dim) for t in (cos, sin))
    half = c.shape[-1] // 2
    out = []
    for d in (dq, dk):
        g = d.float()
        g1, g2, rest = g[..., :half], g[..., half : 2 * half], g[..., 2 * half :]
        x1 = g1 * c[..., :half] + g2 * s[..., half:]
        x2 = g2 * c[..., half:] - g1 * s[..., :half]
        out.append(torch.cat((x1, x2, rest), -1).to(d.dtype))
    return out[0], out[1]


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of a new dense tensor of ``t``'s shape with ``t``'s dimension order, the
    largest stride outermost (``t``'s own where it is dense: HF's ``proj(x).view(b, s, h,
    d).transpose(1, 2)``); computed on the host, no tensor made."""
    order = sorted(range(t.dim()), key=lambda i: (t.stride(i), -i))  # innermost first
    strides, step = [0] * t.dim(), 1
    for i in order:
        strides[i] = step
        step *= max(t.shape[i], 1)
    return tuple(strides)


class _Rotary(torch.autograd.Function):
    """(q_embed, k_embed) = rotary(q), rotary(k); only cos and sin saved for backward.
    Outputs and input gradients in the inputs' dimension order (HF's q and k are transposed
    views of the projections' outputs): the gradient then reaches the projection through
    the transpose and the view with no copy (a contiguous dq made ``view``'s backward copy it)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        ctx.unsqueeze_dim = unsqueeze_dim
        ctx.strides = (_dense_strides(q), _dense_strides(k))
        ctx.save_for_backward(cos, sin)
        return _rotate(q, k, cos, sin, False, unsqueeze_dim, strides=ctx.strides)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a graph autograd can differentiate again
            return (*_differentiable(dq, dk, cos, sin, ctx.unsqueeze_dim), None, None, None)
        grads = _rotate(dq, dk, cos, sin, True, ctx.unsqueeze_dim, checked=False, strides=ctx.strides)
        return (*grads, None, None, None)


# --------------------------------------------------------------------------- custom op


@torch.library.custom_op("tkern::rotary", mutates_args=())
def _rotary_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated (kernels.rotary.rotary_embedding; ``inverse``: by -theta)."""
    return _rotate(q, k, cos, sin, inverse, unsqueeze_dim)


@_rotary_op.register_fake
def _(q, k, cos, sin, inverse, unsqueeze_dim):
    return q.new_empty(q.shape), k.new_empty(k.shape, dtype=q.dtype)


def _setup_context(ctx, inputs, output):
    _, _, cos, sin, inverse, unsqueeze_dim = inputs
    ctx.inverse, ctx.unsqueeze_dim = inverse, unsqueeze_dim
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = _rotary_op(dq, dk, cos, sin, not ctx.inverse, ctx.unsqueeze_dim)
    return dq, dk, None, None, None, None


_rotary_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- public


def _check(q, k, cos, sin, unsqueeze_dim) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if unsqueeze_dim not in (1, 2):
        raise ValueError(
            f"unsqueeze_dim must be 1 (q of shape (batch, heads, seq, head_dim)) or 2 (batch, seq, "
            f"heads, head_dim), got {unsqueeze_dim!r}"
        )
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "cos and sin must not require grad: tkern's rotary kernel computes no gradient for them "
            "(transformers' rotary embeddings compute them under torch.no_grad())"
        )


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``, and k's),
    q and k in one kernel launch, differentiable in q and k.

    Computed in fp32 from the inputs and rounded once (HF's eager fp16 rounds each of its
    ~6 ops); the backward rotates the gradients by -theta in one launch. Only the first
    ``rotary_dim = cos.shape[-1]`` head-dim columns rotate, the rest pass through (the
    partial-rotary form of GPT-NeoX and Phi-3; the full form where rotary_dim = head_dim).

    Args:
        q: (batch, heads, seq, head_dim) (``unsqueeze_dim=2``: (batch, seq, heads,
            head_dim)), fp16, bf16 or fp32, any strides (a view of a projection).
        k: (batch, kv_heads, seq, head_dim) (or as q for ``unsqueeze_dim=2``), q's dtype.
        cos, sin: (batch or 1, seq, rotary_dim) as HF's rotary embeddings return them (any
            float dtype; not requiring grad); with ``position_ids``, (positions, rotary_dim)
            tables whose rows ``position_ids`` picks.
        position_ids: None, or (batch or 1, seq) indices into 2-D cos / sin (HF's older
            form); ignored with 3-D cos / sin, as HF's deprecated argument was.
        unsqueeze_dim: 1 or 2, HF's: the heads' dimension of q and k.

    Returns:
        ``(q_embed, k_embed)``: new tensors of q's / k's shape and q's dtype, laid out in
        q's / k's dimension order (a transposed view's order: so are their gradients, with no
        copy on the way back to the projection); contiguous where traced (the custom op).
    """
    _check(q, k, cos, sin, unsqueeze_dim)
    if position_ids is not None and cos.dim() == 2:
        cos, sin = cos[position_ids], sin[position_ids]
    if _eager(q, k, cos, sin):
        return _Rotary.apply(q, k, cos, sin, unsqueeze_dim)
    return _rotary_op(q, k, cos, sin, False, unsqueeze_dim)


def _tables_by_torch(position_ids, inv_freq, attention_scaling, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's rotary embedding forward, as torch operations: the kernel's math (fp32 angles,
    cos and sin times the scaling in fp32, one rounding to ``dtype``), for tracing."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def rotary_tables(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, as transformers' rotary embedding modules (``LlamaRotaryEmbedding``
    and kin) compute them from their ``inv_freq`` and ``attention_scaling``: ``emb =
    cat(freqs, freqs)`` with ``freqs = position_ids[..., None].float() * inv_freq`` (fp32),
    ``cos(emb) * attention_scaling`` and ``sin(emb) * attention_scaling``, rounded once to
    ``dtype``. One kernel launch (kernels.rotary.rotary_tables); under ``torch.compile``, on
    meta tensors or tensor subclasses, torch operations with the same math. Not
    differentiable (HF's tables reach no parameter).

    Args:
        position_ids: (batch, seq) int32 / int64.
        inv_freq: (rotary_dim // 2,) fp32.
        attention_scaling: the module's ``attention_scaling``.
        dtype: the tables' dtype, fp16 / bf16 / fp32 (HF's: its input ``x``'s).

    Returns:
        ``(cos, sin)``: (batch, seq, rotary_dim) tensors of ``dtype``.
    """
    if _eager(position_ids, inv_freq):
        return _kernels.rotary_tables(position_ids, inv_freq, attention_scaling, dtype)
    return _tables_by_torch(position_ids, inv_freq, attention_scaling, dtype)
