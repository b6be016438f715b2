"""Pass 2 for SGD: skip on overflow, unscale, clip, weight decay, momentum,
update the fp32 master, write the half-precision copy. One read and one write
of each array, fp32 arithmetic throughout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern.kernels._common import INTERPRET, block_offsets, cast_rne, load_or_value, tl_dtype
from tkern.kernels._update import UpdateBuffers, aligned_parts, check_lr, check_update_buffers
from tkern.kernels.overflow import found_inf, grad_factor

#: Elements per program and warps: 1024 elements over 8 warps gives each thread
#: 4 contiguous values, one 16-byte fp32 access per array. (8 values per thread
#: made the fp32 -> half store of the param a layout conversion through 8 KB
#: of shared memory; at 4 the half store is an 8-byte vector from registers.)
BLOCK = 65536 if INTERPRET else 1024
NUM_WARPS = 8


@triton.jit
def _sgd_kernel(
    param_ptr,  # (n,) fp16/bf16 model param (== master_ptr when HAS_MASTER is False)
    grad_ptr,  # (n,) gradient, param's dtype, scaled by the loss scale
    master_ptr,  # (n,) fp32 master weights
    momentum_ptr,  # (n,) fp32 momentum buffer; unused unless MOMENTUM
    stats_ptr,  # (3,) fp32 pass-1 statistics (found_inf, sum of squares, max)
    inv_scale_ptr,  # (1,) fp32
    step_ptr,  # (1,) fp32 applied steps so far (0 on the first)
    n,
    lr,  # float, or (1,) fp32 pointer when LR_ON_DEVICE
    momentum,
    one_minus_dampening,  # formed on the host in float64, as torch does
    weight_decay,
    max_grad_norm,
    HAS_MASTER: tl.constexpr,  # param is half precision with a separate fp32 master
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    CLIP: tl.constexpr,
    MAXIMIZE: tl.constexpr,  # ascend: the gradient is negated, as torch's maximize=True
    LR_ON_DEVICE: tl.constexpr,
    PARAM_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pass 2 of an SGD step over n elements of a flat buffer: skip on overflow, unscale
    and clip, momentum/Nesterov/weight decay on the fp32 master, write the param
    (pointer shapes above; the shared lines are _update.py's)."""
    if found_inf(stats_ptr):
        return  # skipped step: nothing is written anywhere
    lr = load_or_value(lr, LR_ON_DEVICE)
    offs = block_offsets(BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = g * grad_factor(stats_ptr, inv_scale_ptr, max_grad_norm, CLIP)
    if MAXIMIZE:
        g = -g
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    g = g + weight_decay * p
    if MOMENTUM:
        buf = tl.load(momentum_ptr + offs, mask=mask, other=0.0)
        first = tl.load(step_ptr) == 0.0
        # torch.optim.SGD: the buffer starts as the first gradient, undamped.
        buf = tl.where(first, g, momentum * buf + one_minus_dampening * g)
        tl.store(momentum_ptr + offs, buf, mask=mask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    p = p - lr * g
    tl.store(master_ptr + offs, p, mask=mask)
    if HAS_MASTER:
        tl.store(param_ptr + offs, cast_rne(p, PARAM_DTYPE), mask=mask)


def sgd_update(
    buffers: UpdateBuffers,
    *,
    lr: float | torch.Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    max_grad_norm: float | None,
    maximize: bool = False,
) -> None:
    """Launch the SGD update over ``buffers`` (see :class:`UpdateBuffers`);
    it does nothing on the device when ``stats`` reports an overflow.

    ``lr`` is a number or a (1,) fp32 tensor on the params' device, read by
    the kernel (changing it then needs no recompile and no host sync).
    ``maximize`` negates the gradient, as torch.optim.SGD's."""
    b = buffers
    check_update_buffers(b, ("momentum_buffer",) if momentum > 0 else ())
    lr, lr_on_device = check_lr(lr, b.param.device)
    for part, n in aligned_parts(b):
        _sgd_kernel[(triton.cdiv(n, BLOCK),)](
            part.param, part.grad, part.master, part.state.get("momentum_buffer", part.master),
            part.stats, part.inv_scale, part.step,
            n, lr, momentum, 1.0 - dampening, weight_decay, max_grad_norm or 0.0,
            HAS_MASTER=part.has_master,
            MOMENTUM=momentum > 0,
            NESTEROV=nesterov,
            CLIP=max_grad_norm is not None,
            MAXIMIZE=bool(maximize),
            LR_ON_DEVICE=lr_on_device,
            PARAM_DTYPE=tl_dtype(part.param.dtype),
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )  # fmt: skip
