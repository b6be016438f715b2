"""Pass 2 for Adam and AdamW: skip on overflow, unscale, clip, weight decay
(L2 or decoupled), moment updates, bias correction, update of the fp32
master, write of the half-precision copy. fp32 arithmetic throughout, in the
order torch.optim.Adam uses."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern.kernels._common import INTERPRET, ln_beta, load_or_value, one_minus_pow, tl_dtype
from tkern.kernels._update import (
    GridBarrier,
    UpdateBuffers,
    load_grad,
    load_master,
    load_state,
    pass_launch,
    step_epilogue,
    step_prologue,
    store_master,
    store_state,
    tile_at,
    tile_starts,
    update_parts,
)
from tkern.kernels.overflow import found_inf

#: See tkern.kernels.sgd: 4 contiguous values per thread.
BLOCK = 65536 if INTERPRET else 1024
NUM_WARPS = 8


@triton.jit
def _adam_kernel(
    param_ptr,  # (n,) model param: fp16/bf16 (int16 bits under a split master), or fp32 (its own master)
    grad_ptr,  # (n,) gradient, param's dtype, scaled by the loss scale
    master_ptr,  # (n,) fp32 master, int16 remainder (split) or unused (see _update.py)
    exp_avg_ptr,  # (n,) first moment: fp32, bf16 or uint8 codes
    exp_avg_absmax_ptr,  # (n / QBLOCK,) fp32 block absmax of a uint8 first moment
    exp_avg_qmap_ptr,  # (256,) fp32 signed code map
    exp_avg_sq_ptr,  # (n,) second moment, as exp_avg
    exp_avg_sq_absmax_ptr,  # (n / QBLOCK,) fp32, as exp_avg_absmax_ptr
    exp_avg_sq_qmap_ptr,  # (256,) fp32 unsigned code map
    max_exp_avg_sq_ptr,  # (n,) running max of the second moment; unused unless AMSGRAD
    max_exp_avg_sq_absmax_ptr,  # (n / QBLOCK,) fp32, as exp_avg_absmax_ptr
    max_exp_avg_sq_qmap_ptr,  # (256,) fp32 unsigned code map
    stats_ptr,  # (3,) fp32 pass-1 statistics (ONE_PASS: written here first)
    inv_scale_ptr,  # (1,) fp32
    step_ptr,  # (1,) fp32 applied steps so far; this step is step + 1 (ONE_PASS: counted here)
    partials_ptr,  # (n_rows, 3) fp32 scratch for the statistics' rows; unused unless ONE_PASS
    found_ptr,  # (1,) fp32 a GradScaler's found_inf; unused unless HAS_FOUND
    n_rows,  # rows of the statistics (overflow.stats_rows(n)); unused unless ONE_PASS
    barrier_ptr,  # (2,) int32 grid-barrier workspace (grid_sync.py); unused unless GRID
    n,
    seed,  # stochastic rounding (MASTER == NONE): Philox key with the step count
    offset,  # element offset of param_ptr in its flat buffer (the random stream's counter)
    # Hyperparameters. Differences such as 1 - beta are formed on the host in
    # float64, as torch does: in fp32, 1 - 0.999 is off by 1.3e-5 relative.
    lr,  # float, or (1,) fp32 pointer when LR_ON_DEVICE
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    ln_beta1,  # ln(beta1), -inf for 0
    ln_beta2,
    eps,
    weight_decay,
    decay,  # 1 - lr * weight_decay (AdamW), formed in the kernel when LR_ON_DEVICE
    max_grad_norm,
    MASTER: tl.constexpr,  # SELF, FP32, SPLIT or NONE (_update.py)
    M_KIND: tl.constexpr,  # STATE_F32, STATE_BF16 or STATE_U8, per state buffer
    V_KIND: tl.constexpr,
    VMAX_KIND: tl.constexpr,
    DECOUPLED: tl.constexpr,  # AdamW: p *= 1 - lr * wd; else Adam's L2: g += wd * p
    AMSGRAD: tl.constexpr,
    CLIP: tl.constexpr,
    MAXIMIZE: tl.constexpr,  # ascend: the gradient is negated, as torch's maximize=True
    LR_ON_DEVICE: tl.constexpr,
    PARAM_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # one program: the statistics, every tile, the step count
    HAS_FOUND: tl.constexpr,
    GRID: tl.constexpr,  # with ONE_PASS: P programs sharing rows and tiles, one grid barrier (its spin)
    STATS_BLOCK: tl.constexpr,  # pass 1's BLOCK (overflow.BLOCK)
):
    """Pass 2 of an Adam/AdamW step over n elements of a flat buffer: skip on overflow,
    unscale and clip the gradient, update the fp32 master and moments, write the
    param (pointer shapes above; the shared lines, master modes and state dtypes
    are _update.py's). With ONE_PASS, the whole step in one program: pass 1 first
    (_update.step_prologue), then every tile, then the step count."""
    stats = (n_rows, inv_scale_ptr, found_ptr, partials_ptr, stats_ptr, barrier_ptr)
    step_prologue(grad_ptr, n, *stats, ONE_PASS, HAS_FOUND, GRID, STATS_BLOCK)  # ONE_PASS: pass 1, here
    if found_inf(stats_ptr):
        return  # skipped step: nothing is written, the step count stays
    if LR_ON_DEVICE:
        lr = load_or_value(lr, LR_ON_DEVICE)
        decay = 1.0 - lr * weight_decay
    lo, hi, step = tile_starts(n, BLOCK, ONE_PASS, GRID)
    for start in range(lo, hi, step):  # one tile (ONE_PASS: every tile; GRID: this program's)
        offs, mask = tile_at(start, n, BLOCK)
        g = load_grad(grad_ptr, offs, mask, stats_ptr, inv_scale_ptr, max_grad_norm, CLIP, MAXIMIZE)
        p = load_master(param_ptr, master_ptr, offs, mask, MASTER)
        if DECOUPLED:
            p = p * decay
        else:
            g = g + weight_decay * p
        m = load_state(exp_avg_ptr, exp_avg_absmax_ptr, exp_avg_qmap_ptr, offs, mask, M_KIND)
        v = load_state(exp_avg_sq_ptr, exp_avg_sq_absmax_ptr, exp_avg_sq_qmap_ptr, offs, mask, V_KIND)
        m = m + one_minus_beta1 * (g - m)  # lerp, as torch
        v = v * beta2 + one_minus_beta2 * g * g
        store_state(exp_avg_ptr, exp_avg_absmax_ptr, exp_avg_qmap_ptr, offs, mask, m, M_KIND)
        store_state(exp_avg_sq_ptr, exp_avg_sq_absmax_ptr, exp_avg_sq_qmap_ptr, offs, mask, v, V_KIND)
        if AMSGRAD:  # the running max of the second moment, which the step then divides by
            vmax = load_state(
                max_exp_avg_sq_ptr, max_exp_avg_sq_absmax_ptr, max_exp_avg_sq_qmap_ptr, offs, mask, VMAX_KIND
            )
            v = tl.maximum(vmax, v)
            store_state(
                max_exp_avg_sq_ptr,
                max_exp_avg_sq_absmax_ptr,
                max_exp_avg_sq_qmap_ptr,
                offs,
                mask,
                v,
                VMAX_KIND,
            )
        t = tl.load(step_ptr)
        bias_correction1 = one_minus_pow(t + 1.0, ln_beta1)
        bias_correction2_sqrt = tl.sqrt(one_minus_pow(t + 1.0, ln_beta2))
        denom = tl.sqrt(v) / bias_correction2_sqrt + eps
        p = p - (lr / bias_correction1) * (m / denom)
        store_master(param_ptr, master_ptr, offs, mask, p, seed, t, offset, MASTER, PARAM_DTYPE)
    step_epilogue(step_ptr, barrier_ptr, ONE_PASS, GRID)


def adam_update(
    buffers: UpdateBuffers,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool,
    max_grad_norm: float | None,
    maximize: bool = False,
    prechecked: bool = False,
    one_pass: bool = False,
    found_inf: torch.Tensor | None = None,
    barrier: GridBarrier | None = None,
) -> None:
    """Launch the Adam (``decoupled=False``) or AdamW update over ``buffers``
    (see :class:`UpdateBuffers`); state: ``exp_avg``, ``exp_avg_sq`` and, with
    ``amsgrad``, ``max_exp_avg_sq``. Does nothing on the device when ``stats``
    reports an overflow.

    ``lr`` is a number or a (1,) fp32 tensor on the params' device, read by the
    kernel (AdamW's ``1 - lr * weight_decay`` is then formed there in fp32; from
    a number it is formed on the host in float64, as torch does). ``maximize``
    negates the gradient, as torch.optim.Adam's. ``prechecked``: the caller built
    ``buffers`` right (a fused optimizer's plan, :meth:`tkern.flat.FlatParams.plan`),
    so :func:`check_update_buffers` is skipped (its host time on every step).

    ``one_pass``: the whole step in one launch of one program (for small buffers:
    :data:`tkern.kernels._update.ONE_PASS_MAX_ELEMENTS`): it first writes ``stats`` itself
    from ``grad`` (bit for bit what :func:`tkern.kernels.overflow.grad_stats` gives for a
    length that is a multiple of 16), with ``found_inf`` (a GradScaler's (1,) fp32 flag,
    or None) maxed into found_inf, then updates every tile, then adds 1 to ``step``
    unless the step is skipped (pass 2 leaves the count to its caller).

    ``barrier`` (with ``one_pass``): the grid-wide one-pass step -- one launch of up to
    ``barrier.max_programs`` programs (:class:`tkern.kernels.grid_sync.GridBarrier`; at most
    the SM count, one under the interpreter): each writes its share of the statistics'
    rows, all meet at the grid barrier, each reduces every row in the same order (the same
    bits as pass 1's finalize) and updates its share of the tiles, and the last to finish
    counts the step. Bit for bit the two-pass step, for up to
    :data:`tkern.kernels._update.GRID_MAX_ELEMENTS` elements (larger works, but is not what
    it is for)."""
    names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    parts, lr, lr_on_device = update_parts(
        buffers, names, lr, prechecked=prechecked, one_pass=one_pass, found_inf=found_inf, barrier=barrier,
        block=BLOCK,
    )  # fmt: skip
    decay = 1.0 if lr_on_device else 1.0 - lr * weight_decay
    for part, n in parts:
        m, v = part.kernel_state("exp_avg"), part.kernel_state("exp_avg_sq")
        vmax = part.kernel_state("max_exp_avg_sq" if amsgrad else None)
        grid, stats_args, consts = pass_launch(part, n, BLOCK, NUM_WARPS, one_pass, found_inf, barrier)
        _adam_kernel[grid](
            part.kernel_param(), part.grad, part.kernel_master(), *m[:3], *v[:3], *vmax[:3],
            part.stats, part.inv_scale, part.step, *stats_args, n, part.seed, part.offset,
            lr, beta2, 1.0 - beta1, 1.0 - beta2, ln_beta(beta1), ln_beta(beta2), eps, weight_decay,
            decay, max_grad_norm or 0.0,
            MASTER=part.master_mode,
            M_KIND=m[3],
            V_KIND=v[3],
            VMAX_KIND=vmax[3],
            DECOUPLED=decoupled,
            AMSGRAD=amsgrad,
            CLIP=max_grad_norm is not None,
            MAXIMIZE=bool(maximize),
            LR_ON_DEVICE=lr_on_device,
            PARAM_DTYPE=tl_dtype(part.param.dtype),
            BLOCK=BLOCK,
            **consts,
        )  # fmt: skip
