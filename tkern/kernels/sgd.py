"""Pass 2 for SGD: skip on overflow, unscale, clip, weight decay, momentum,
update the fp32 master, write the half-precision copy. One read and one write
of each array, fp32 arithmetic throughout."""

from __future__ import annotations

import triton
import triton.language as tl

from tkern.kernels._common import INTERPRET, block_offsets, cast_rne, tl_dtype
from tkern.kernels._update import UpdateBuffers, check_update_buffers
from tkern.kernels.overflow import found_inf, grad_factor

#: Elements per program and warps: 2048 fp32 elements over 8 warps gives each
#: thread 8 contiguous values (16-byte fp16 loads and 32-byte fp32 loads).
BLOCK = 65536 if INTERPRET else 2048
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
    lr,
    momentum,
    one_minus_dampening,  # formed on the host in float64, as torch does
    weight_decay,
    max_grad_norm,
    HAS_MASTER: tl.constexpr,  # param is half precision with a separate fp32 master
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    CLIP: tl.constexpr,
    PARAM_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if found_inf(stats_ptr):
        return  # skipped step: nothing is written anywhere
    offs = block_offsets(BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = g * grad_factor(stats_ptr, inv_scale_ptr, max_grad_norm, CLIP)
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
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    max_grad_norm: float | None,
) -> None:
    """Launch the SGD update over ``buffers`` (see :class:`UpdateBuffers`);
    it does nothing on the device when ``stats`` reports an overflow."""
    b = buffers
    check_update_buffers(b, ("momentum_buffer",) if momentum > 0 else ())
    n = b.grad.numel()
    if n == 0:
        return
    _sgd_kernel[(triton.cdiv(n, BLOCK),)](
        b.param, b.grad, b.master, b.state.get("momentum_buffer", b.master),
        b.stats, b.inv_scale, b.step,
        n, lr, momentum, 1.0 - dampening, weight_decay, max_grad_norm or 0.0,
        HAS_MASTER=b.has_master,
        MOMENTUM=momentum > 0,
        NESTEROV=nesterov,
        CLIP=max_grad_norm is not None,
        PARAM_DTYPE=tl_dtype(b.param.dtype),
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )  # fmt: skip
