"""Rotary position embeddings (RoPE) in HF's ``rotate_half`` convention, q and k in one
launch, forward and backward, computed in fp32 and rounded once.

transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (Llama, Mistral, Qwen2/3, Gemma,
Phi-3, OLMo, Granite, GPT-NeoX, Phi) is ``x * cos + rotate_half(x) * sin`` over the first
``R = cos.shape[-1]`` columns of the head dim, the rest passed through (R = head_dim
except in the partial-rotary families, GPT-NeoX and Phi-3). With ``x1, x2`` the two halves
of those R columns (and ``c1, c2, s1, s2`` the halves of cos and sin)::

    y1 = x1 * c1 - x2 * s1          (rotate_half(x) = cat(-x2, x1))
    y2 = x2 * c2 + x1 * s2

Unfused, torch runs ~6 kernels per tensor (the slices, the negation, the concatenation,
two products and the sum; GPT-NeoX two more for the pass-through), each rounding to 16
bits. Here one launch reads q and k once and writes their rotated copies. Its backward is
the transpose of the same linear map (a rotation by -theta where c1 = c2 and s1 = s2, as
HF's tables are): ``dx1 = dy1 * c1 + dy2 * s2``, ``dx2 = dy2 * c2 - dy1 * s1``; the same
kernel with ``INVERSE``. Gradients reach neither cos nor sin.

q is (batch, heads, seq, head_dim) and k (batch, kv_heads, seq, head_dim), any strides (the
transposed views of a projection, the chunks of a packed qkv); cos and sin (batch or 1,
seq, R), any strides. Every (batch, seq, head) row of q, then of k, is one row of the
launch: a program rotates ROWS rows, all of q's or all of k's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern.kernels._common import (
    INTERPRET,
    cast_rne,
    cdiv,
    check_same_device,
    check_tensor,
    next_power_of_2,
    tl_dtype,
)

#: Elements (rows x half columns, or x pass-through columns where those are wider) per
#: program: large under the interpreter, where each program costs milliseconds; on a GPU
#: 2048 (4 warps x 32 threads x 16 elements of each tile: 128-bit loads of 16-bit
#: values; 48-80 registers, no spills, sm_80 and sm_90, head_dim 64 and 128, full rotary
#: and a quarter of it, compiled with Triton 3.9).
ELEMENTS = 65536 if INTERPRET else 2048
NUM_WARPS = 4
#: dtypes q and k may have, and cos and sin.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------- kernel


@triton.jit
def _rotate_rows(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    block,  # which block of ROWS rows of this tensor
    heads,
    seq,
    rows_total,
    head_dim,
    sx_b, sx_h, sx_s, sx_d,
    so_b, so_h, so_s, so_d,
    sc_b, sc_s, sc_d,
    ss_b, ss_s, ss_d,
    HALF: tl.constexpr,  # R // 2
    INVERSE: tl.constexpr,
    DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,  # 0: no pass-through columns (R == head_dim)
):  # fmt: skip
    """Rotate ROWS (batch, seq, head) rows of x into out; pass the columns past R through."""
    r = block.to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64: rows * strides may pass 2^31
    row_ok = r < rows_total
    h = r % heads
    s = (r // heads) % seq
    b = r // (heads * seq)
    x_row = (b * sx_b + h * sx_h + s * sx_s)[:, None]
    o_row = (b * so_b + h * so_h + s * so_s)[:, None]
    c = tl.arange(0, BLOCK_HALF)[None, :]
    mask = row_ok[:, None] & (c < HALF)
    x1 = tl.load(x_ptr + x_row + c * sx_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row + (c + HALF) * sx_d, mask=mask, other=0.0).to(tl.float32)
    cos_row = (b * sc_b + s * sc_s)[:, None]
    sin_row = (b * ss_b + s * ss_s)[:, None]
    c1 = tl.load(cos_ptr + cos_row + c * sc_d, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cos_row + (c + HALF) * sc_d, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + sin_row + c * ss_d, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + sin_row + (c + HALF) * ss_d, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:  # the transpose: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(out_ptr + o_row + c * so_d, cast_rne(y1, DTYPE), mask=mask)
    tl.store(out_ptr + o_row + (c + HALF) * so_d, cast_rne(y2, DTYPE), mask=mask)
    if BLOCK_PASS > 0:  # the partial-rotary families' columns R..head_dim, copied
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
        pmask = row_ok[:, None] & (p < head_dim)
        v = tl.load(x_ptr + x_row + p * sx_d, mask=pmask, other=0.0)
        tl.store(out_ptr + o_row + p * so_d, v, mask=pmask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # (B, H, S, D) fp16/bf16/fp32, strides (sq_b, sq_h, sq_s, sq_d)
    k_ptr,  # (B, Hk, S, D) q's dtype, strides (sk_b, sk_h, sk_s, sk_d)
    q_out_ptr,  # (B, H, S, D) output, q's dtype, strides (sqo_*)
    k_out_ptr,  # (B, Hk, S, D) output, q's dtype, strides (sko_*)
    cos_ptr,  # (B or 1, S, R) fp16/bf16/fp32, strides (sc_b, sc_s, sc_d); sc_b = 0 broadcasts
    sin_ptr,  # (B or 1, S, R) fp16/bf16/fp32, strides (ss_b, ss_s, ss_d)
    heads,  # H
    kv_heads,  # Hk
    seq,  # S
    head_dim,  # D
    q_rows,  # B * S * H
    k_rows,  # B * S * Hk
    q_blocks,  # cdiv(q_rows, ROWS): programs below it rotate q, the others k
    sq_b, sq_h, sq_s, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sqo_b, sqo_h, sqo_s, sqo_d,
    sko_b, sko_h, sko_s, sko_d,
    sc_b, sc_s, sc_d,
    ss_b, ss_s, ss_d,
    HALF: tl.constexpr,  # R // 2
    INVERSE: tl.constexpr,  # the backward: rotate by -theta (the transpose)
    DTYPE: tl.constexpr,  # the outputs' dtype (q's)
    ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(HALF)
    BLOCK_PASS: tl.constexpr,  # next_power_of_2(D - R), or 0
):  # fmt: skip
    """q_out, k_out = rotary(q), rotary(k): fp32 inside, one rounding on each store."""
    pid = tl.program_id(0)
    if pid < q_blocks:
        _rotate_rows(
            q_ptr, q_out_ptr, cos_ptr, sin_ptr, pid, heads, seq, q_rows, head_dim,
            sq_b, sq_h, sq_s, sq_d, sqo_b, sqo_h, sqo_s, sqo_d, sc_b, sc_s, sc_d, ss_b, ss_s, ss_d,
            HALF, INVERSE, DTYPE, ROWS, BLOCK_HALF, BLOCK_PASS,
        )  # fmt: skip
    else:
        _rotate_rows(
            k_ptr, k_out_ptr, cos_ptr, sin_ptr, pid - q_blocks, kv_heads, seq, k_rows, head_dim,
            sk_b, sk_h, sk_s, sk_d, sko_b, sko_h, sko_s, sko_d, sc_b, sc_s, sc_d, ss_b, ss_s, ss_d,
            HALF, INVERSE, DTYPE, ROWS, BLOCK_HALF, BLOCK_PASS,
        )  # fmt: skip


# --------------------------------------------------------------------------- launcher


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def _check_inputs(q, k, cos, sin) -> None:
    """TypeError / ValueError naming the argument, its shape and dtype, and what was expected."""
    for name, t in (("q", q), ("k", k)):
        check_tensor(name, t, ndim=4, dtypes=DTYPES)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=3, dtypes=DTYPES)
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {_describe(k)}")
    batch, _, seq, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != seq or k.shape[3] != head_dim:
        raise ValueError(
            f"k must have shape ({batch}, kv_heads, {seq}, {head_dim}) to match q (batch, heads, "
            f"seq, head_dim) of shape {tuple(q.shape)}, got {_describe(k)}"
        )
    rotary_dim = cos.shape[2]
    if (
        rotary_dim % 2
        or not 0 < rotary_dim <= head_dim
        or cos.shape[0] not in (1, batch)
        or cos.shape[1] != seq
    ):
        raise ValueError(
            f"cos must have shape (1 or {batch}, {seq}, rotary_dim) with rotary_dim even and at "
            f"most head_dim {head_dim} (q of shape {tuple(q.shape)}), got {_describe(cos)}"
        )
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {_describe(sin)}")


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    prechecked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_embed, k_embed)``: q and k rotated by the angles whose cos and sin are given, over
    their first ``cos.shape[-1]`` head-dim columns (the rest copied), in one launch.

    Args:
        q: (batch, heads, seq, head_dim), fp16 / bf16 / fp32, any strides.
        k: (batch, kv_heads, seq, head_dim), q's dtype, any strides.
        cos, sin: (batch or 1, seq, rotary_dim), fp16 / bf16 / fp32 (either), any strides;
            rotary_dim even, at most head_dim.
        inverse: rotate by -theta (the transpose of the forward map: its backward, where
            q and k are the outputs' gradients).
        q_out, k_out: optional outputs of q's / k's shape and q's dtype, any strides (not
            overlapping the inputs); new contiguous tensors where None.
        prechecked: True from a caller whose arguments are valid by construction (the
            eager backward of ``tkern.apply_rotary_pos_emb``, with both outputs given):
            nothing is checked (:func:`rotary_embedding_prechecked`).
    """
    if prechecked:
        return rotary_embedding_prechecked(q, k, cos, sin, inverse, q_out, k_out)
    _check_inputs(q, k, cos, sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=q.dtype, device=q.device) if k_out is None else k_out
    check_tensor("q_out", q_out, ndim=4, dtypes=(q.dtype,), shape=q.shape)
    check_tensor("k_out", k_out, ndim=4, dtypes=(q.dtype,), shape=k.shape)
    check_same_device(q=q, k=k, cos=cos, sin=sin, q_out=q_out, k_out=k_out)
    return rotary_embedding_prechecked(q, k, cos, sin, inverse, q_out, k_out)


def rotary_embedding_prechecked(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool,
    q_out: torch.Tensor, k_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`rotary_embedding` for a caller whose arguments are valid (``tkern.apply_rotary_pos_emb``'s
    backward: autograd's gradients of the outputs it checked, the cos and sin its forward saved,
    new outputs): the launch, nothing checked again."""
    batch, heads, seq, head_dim = q.shape
    kv_heads, rotary_dim = k.shape[1], cos.shape[2]
    q_rows, k_rows = batch * seq * heads, batch * seq * kv_heads
    if q_rows + k_rows == 0:
        return q_out, k_out
    block_half = next_power_of_2(rotary_dim // 2)
    block_pass = next_power_of_2(head_dim - rotary_dim)
    # rows per program: the wider of the two tiles (a half, the pass-through) holds ELEMENTS
    rows = max(1, min(ELEMENTS // max(block_half, block_pass), next_power_of_2(max(q_rows, k_rows))))
    q_blocks = cdiv(q_rows, rows)
    cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)  # one table for every batch row
    sin_b = 0 if sin.shape[0] == 1 else sin.stride(0)
    _rotary_kernel[(q_blocks + cdiv(k_rows, rows),)](
        q, k, q_out, k_out, cos, sin,
        heads, kv_heads, seq, head_dim, q_rows, k_rows, q_blocks,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(),
        cos_b, *cos.stride()[1:], sin_b, *sin.stride()[1:],
        HALF=rotary_dim // 2, INVERSE=bool(inverse), DTYPE=tl_dtype(q.dtype),
        ROWS=rows, BLOCK_HALF=block_half, BLOCK_PASS=block_pass, num_warps=NUM_WARPS,
    )  # fmt: skip
    return q_out, k_out


# --------------------------------------------------------------------------- cos / sin tables
#
# HF's rotary embedding modules (``LlamaRotaryEmbedding`` and its per-family twins) compute
# ``freqs = position_ids[..., None].float() * inv_freq``, ``emb = cat(freqs, freqs)``,
# ``cos = emb.cos() * attention_scaling`` (and sin), then ``.to(x.dtype)``: about ten torch
# launches per step. Here one launch: each program takes ROWS (batch, seq) rows and the
# HALF frequencies, computes the fp32 angle exactly as HF does (one fp32 product), its cos
# and sin in fp32 times the scaling, rounds once, and writes each to both halves.

#: (rows x half columns) per program of the tables kernel: large under the interpreter; on a
#: GPU 1024 (4 warps x 32 threads x 8 angles, each with its cos and sin)
TABLE_ELEMENTS = 65536 if INTERPRET else 1024
#: dtypes of the tables' position ids
POSITION_DTYPES = (torch.int32, torch.int64)
#: pi / 2 in two fp64 parts (fdlibm's pio2_1, 33 bits, and pio2_1t): ``k * _PIO2_HI`` is exact
#: for k < 2^20 (angles below 1.6e6 rad), so ``a - k pi/2`` keeps ~50 bits of the angle's
#: remainder; beyond, it loses what fp64 rounds of k * pi/2 (2^-53 of the angle)
_PIO2_HI: tl.constexpr = tl.constexpr(1.57079632673412561417e00)
_PIO2_LO: tl.constexpr = tl.constexpr(6.07710050650619224932e-11)
_TWO_OVER_PI: tl.constexpr = tl.constexpr(0.63661977236758134308)
#: cephes' sinf / cosf minimax polynomials on [-pi/4, pi/4] (about an fp32 ulp): libdevice's
#: precise sinf / cosf keep a Payne-Hanek reduction with a stack array (spilled on sm_90)
_SIN_1: tl.constexpr = tl.constexpr(-1.6666654611e-1)
_SIN_2: tl.constexpr = tl.constexpr(8.3321608736e-3)
_SIN_3: tl.constexpr = tl.constexpr(-1.9515295891e-4)
_COS_1: tl.constexpr = tl.constexpr(4.166664568298827e-2)
_COS_2: tl.constexpr = tl.constexpr(-1.388731625493765e-3)
_COS_3: tl.constexpr = tl.constexpr(2.443315711809948e-5)


@triton.jit
def _cos_sin(angle):
    """(cos(angle), sin(angle)) of fp32 ``angle``, in fp32: the remainder of angle / (pi/2)
    found in fp64 (the constants as fp64 tensors: a float literal would be fp32), then
    cephes' polynomials on it, and the quadrant's signs and swap."""
    a = angle.to(tl.float64)
    k = tl.floor(a * tl.full([], _TWO_OVER_PI, tl.float64) + 0.5)
    r = ((a - k * tl.full([], _PIO2_HI, tl.float64)) - k * tl.full([], _PIO2_LO, tl.float64)).to(tl.float32)
    z = r * r
    sin_r = r + r * z * (_SIN_1 + z * (_SIN_2 + z * _SIN_3))
    cos_r = 1.0 - 0.5 * z + z * z * (_COS_1 + z * (_COS_2 + z * _COS_3))
    q = k.to(tl.int64) & 3  # the quadrant: two's complement keeps it right for negative k
    swap = (q & 1) == 1
    cos = tl.where(swap, sin_r, cos_r)
    sin = tl.where(swap, cos_r, sin_r)
    cos = tl.where((q == 1) | (q == 2), -cos, cos)
    sin = tl.where(q >= 2, -sin, sin)
    return cos, sin


@triton.jit
def _rotary_tables_kernel(
    inv_freq_ptr,  # (HALF,) fp32, stride s_f
    pos_ptr,  # (B, S) int32/int64 position ids, strides (sp_b, sp_s)
    cos_ptr,  # (B, S, 2 * HALF) output, DTYPE, contiguous
    sin_ptr,  # (B, S, 2 * HALF) output, DTYPE, contiguous
    rows,  # B * S
    seq,  # S
    s_f,
    sp_b, sp_s,
    scaling,  # fp32: HF's attention_scaling
    HALF: tl.constexpr,  # inv_freq's length: the tables' last dim is 2 * HALF
    DTYPE: tl.constexpr,  # the tables' dtype
    ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(HALF)
):  # fmt: skip
    """cos, sin = cos(emb) * scaling, sin(emb) * scaling with emb = cat(freqs, freqs) and
    freqs = position * inv_freq, all in fp32; one rounding to DTYPE on each store."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64: rows * 2 HALF may pass 2^31
    row_ok = r < rows
    b, s = r // seq, r % seq
    pos = tl.load(pos_ptr + b * sp_b + s * sp_s, mask=row_ok, other=0).to(tl.float32)
    c = tl.arange(0, BLOCK_HALF)
    col_ok = c < HALF
    inv_freq = tl.load(inv_freq_ptr + c * s_f, mask=col_ok, other=0.0)
    angle = pos[:, None] * inv_freq[None, :]  # fp32, as HF's product rounds
    cos, sin = _cos_sin(angle)
    cos = cast_rne(cos * scaling, DTYPE)
    sin = cast_rne(sin * scaling, DTYPE)
    out = r[:, None] * (2 * HALF) + c[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(cos_ptr + out, cos, mask=mask)
    tl.store(cos_ptr + out + HALF, cos, mask=mask)
    tl.store(sin_ptr + out, sin, mask=mask)
    tl.store(sin_ptr + out + HALF, sin, mask=mask)


def _check_table_inputs(position_ids, inv_freq, attention_scaling, dtype) -> None:
    """TypeError / ValueError naming the argument, before any launch."""
    check_tensor("position_ids", position_ids, ndim=2, dtypes=POSITION_DTYPES)
    check_tensor("inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,))
    if inv_freq.numel() == 0:
        raise ValueError(f"inv_freq must have at least one frequency, got {_describe(inv_freq)}")
    if isinstance(attention_scaling, bool) or not isinstance(attention_scaling, (int, float)):
        raise TypeError(f"attention_scaling must be a float, got {attention_scaling!r}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(map(str, DTYPES))}, got {dtype!r}")
    check_same_device(position_ids=position_ids, inv_freq=inv_freq)


def rotary_tables(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` as transformers' rotary embedding modules return them, in one launch.

    ``emb = cat(freqs, freqs)`` with ``freqs = position_ids[..., None].float() * inv_freq``
    (an fp32 product, as HF's); ``cos = cos(emb) * attention_scaling`` and ``sin`` alike,
    computed in fp32 and rounded once to ``dtype``.

    Args:
        position_ids: (batch, seq) int32 / int64, any strides (a broadcast batch too).
        inv_freq: (half,) fp32, the module's ``inv_freq`` buffer.
        attention_scaling: the module's ``attention_scaling`` (1.0 but for yarn and kin).
        dtype: the tables' dtype: fp16, bf16 or fp32 (HF's ``x.dtype``).

    Returns:
        ``(cos, sin)``: new contiguous (batch, seq, 2 * half) tensors of ``dtype``.
    """
    _check_table_inputs(position_ids, inv_freq, attention_scaling, dtype)
    batch, seq = position_ids.shape
    half = inv_freq.shape[0]
    cos = torch.empty((batch, seq, 2 * half), dtype=dtype, device=position_ids.device)
    sin = torch.empty((batch, seq, 2 * half), dtype=dtype, device=position_ids.device)
    n_rows = batch * seq
    if n_rows == 0:
        return cos, sin
    block_half = next_power_of_2(half)
    rows = max(1, min(TABLE_ELEMENTS // block_half, next_power_of_2(n_rows)))
    _rotary_tables_kernel[(cdiv(n_rows, rows),)](
        inv_freq, position_ids, cos, sin, n_rows, seq, inv_freq.stride(0), *position_ids.stride(),
        float(attention_scaling),
        HALF=half, DTYPE=tl_dtype(dtype), ROWS=rows, BLOCK_HALF=block_half, num_warps=NUM_WARPS,
    )  # fmt: skip
    return cos, sin
