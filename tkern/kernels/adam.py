"""Pass 2 for Adam and AdamW: skip on overflow, unscale, clip, weight decay
(L2 or decoupled), moment updates, bias correction, update of the fp32
master, write of the half-precision copy. fp32 arithmetic throughout, in the
order torch.optim.Adam uses."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern.kernels._common import (
    INTERPRET,
    block_offsets,
    cast_rne,
    ln_beta,
    load_or_value,
    one_minus_pow,
    tl_dtype,
)
from tkern.kernels._update import UpdateBuffers, aligned_parts, check_lr, check_update_buffers
from tkern.kernels.overflow import found_inf, grad_factor

#: See tkern.kernels.sgd: 4 contiguous values per thread.
BLOCK = 65536 if INTERPRET else 1024
NUM_WARPS = 8


@triton.jit
def _adam_kernel(
    param_ptr,  # (n,) fp16/bf16 model param (== master_ptr when HAS_MASTER is False)
    grad_ptr,  # (n,) gradient, param's dtype, scaled by the loss scale
    master_ptr,  # (n,) fp32 master weights
    exp_avg_ptr,  # (n,) fp32 first moment
    exp_avg_sq_ptr,  # (n,) fp32 second moment
    max_exp_avg_sq_ptr,  # (n,) fp32 running max of the second moment; unused unless AMSGRAD
    stats_ptr,  # (3,) fp32 pass-1 statistics
    inv_scale_ptr,  # (1,) fp32
    step_ptr,  # (1,) fp32 applied steps so far; this step is step + 1
    n,
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
    HAS_MASTER: tl.constexpr,
    DECOUPLED: tl.constexpr,  # AdamW: p *= 1 - lr * wd; else Adam's L2: g += wd * p
    AMSGRAD: tl.constexpr,
    CLIP: tl.constexpr,
    MAXIMIZE: tl.constexpr,  # ascend: the gradient is negated, as torch's maximize=True
    LR_ON_DEVICE: tl.constexpr,
    PARAM_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pass 2 of an Adam/AdamW step over n elements of a flat buffer: skip on overflow,
    unscale and clip the gradient, update the fp32 master and moments, write the
    half-precision param (pointer shapes above; the shared lines are _update.py's)."""
    if found_inf(stats_ptr):
        return  # skipped step: nothing is written, the step count stays
    if LR_ON_DEVICE:
        lr = load_or_value(lr, LR_ON_DEVICE)
        decay = 1.0 - lr * weight_decay
    offs = block_offsets(BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = g * grad_factor(stats_ptr, inv_scale_ptr, max_grad_norm, CLIP)
    if MAXIMIZE:
        g = -g
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    if DECOUPLED:
        p = p * decay
    else:
        g = g + weight_decay * p
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    m = m + one_minus_beta1 * (g - m)  # lerp, as torch
    v = v * beta2 + one_minus_beta2 * g * g
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if AMSGRAD:
        v = tl.maximum(tl.load(max_exp_avg_sq_ptr + offs, mask=mask, other=0.0), v)
        tl.store(max_exp_avg_sq_ptr + offs, v, mask=mask)
    t = tl.load(step_ptr) + 1.0
    bias_correction1 = one_minus_pow(t, ln_beta1)
    bias_correction2_sqrt = tl.sqrt(one_minus_pow(t, ln_beta2))
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * (m / denom)
    tl.store(master_ptr + offs, p, mask=mask)
    if HAS_MASTER:
        tl.store(param_ptr + offs, cast_rne(p, PARAM_DTYPE), mask=mask)


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
) -> None:
    """Launch the Adam (``decoupled=False``) or AdamW update over ``buffers``
    (see :class:`UpdateBuffers`); state: ``exp_avg``, ``exp_avg_sq`` and, with
    ``amsgrad``, ``max_exp_avg_sq``. Does nothing on the device when ``stats``
    reports an overflow.

    ``lr`` is a number or a (1,) fp32 tensor on the params' device, read by the
    kernel (AdamW's ``1 - lr * weight_decay`` is then formed there in fp32; from
    a number it is formed on the host in float64, as torch does). ``maximize``
    negates the gradient, as torch.optim.Adam's."""
    b = buffers
    names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    check_update_buffers(b, names)
    lr, lr_on_device = check_lr(lr, b.param.device)
    decay = 1.0 if lr_on_device else 1.0 - lr * weight_decay
    for part, n in aligned_parts(b):
        _adam_kernel[(triton.cdiv(n, BLOCK),)](
            part.param, part.grad, part.master, part.state["exp_avg"], part.state["exp_avg_sq"],
            part.state.get("max_exp_avg_sq", part.master),
            part.stats, part.inv_scale, part.step,
            n, lr, beta2, 1.0 - beta1, 1.0 - beta2, ln_beta(beta1), ln_beta(beta2), eps, weight_decay,
            decay, max_grad_norm or 0.0,
            HAS_MASTER=part.has_master,
            DECOUPLED=decoupled,
            AMSGRAD=amsgrad,
            CLIP=max_grad_norm is not None,
            MAXIMIZE=bool(maximize),
            LR_ON_DEVICE=lr_on_device,
            PARAM_DTYPE=tl_dtype(part.param.dtype),
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )  # fmt: skip
