"""Pass 2 for SGD: skip on overflow, unscale, clip, weight decay, momentum,
update the fp32 master, write the half-precision copy. One read and one write
of each array, fp32 arithmetic throughout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern.kernels._common import INTERPRET, load_or_value, tl_dtype
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

#: Elements per program and warps: 1024 elements over 8 warps gives each thread
#: 4 contiguous values, one 16-byte fp32 access per array. (8 values per thread
#: made the fp32 -> half store of the param a layout conversion through 8 KB
#: of shared memory; at 4 the half store is an 8-byte vector from registers.)
BLOCK = 65536 if INTERPRET else 1024
NUM_WARPS = 8


@triton.jit
def _sgd_kernel(
    param_ptr,  # (n,) model param: fp16/bf16 (int16 bits under a split master), or fp32 (its own master)
    grad_ptr,  # (n,) gradient, param's dtype, scaled by the loss scale
    master_ptr,  # (n,) fp32 master, int16 remainder (split) or unused (see _update.py)
    momentum_ptr,  # (n,) momentum buffer (fp32, bf16 or uint8 codes); unused unless MOMENTUM
    momentum_absmax_ptr,  # (n / QBLOCK,) fp32 block absmax of a uint8 momentum
    momentum_qmap_ptr,  # (256,) fp32 signed code map
    stats_ptr,  # (3,) fp32 pass-1 statistics (found_inf, sum of squares, max; ONE_PASS: written here)
    inv_scale_ptr,  # (1,) fp32
    step_ptr,  # (1,) fp32 applied steps so far (0 on the first; ONE_PASS: counted here)
    partials_ptr,  # (n_rows, 3) fp32 scratch for the statistics' rows; unused unless ONE_PASS
    found_ptr,  # (1,) fp32 a GradScaler's found_inf; unused unless HAS_FOUND
    n_rows,  # rows of the statistics (overflow.stats_rows(n)); unused unless ONE_PASS
    barrier_ptr,  # (2,) int32 grid-barrier workspace (grid_sync.py); unused unless GRID
    n,
    seed,  # stochastic rounding (MASTER == NONE): Philox key with the step count
    offset,  # element offset of param_ptr in its flat buffer (the random stream's counter)
    lr,  # float, or (1,) fp32 pointer when LR_ON_DEVICE
    momentum,
    one_minus_dampening,  # formed on the host in float64, as torch does
    weight_decay,
    max_grad_norm,
    MASTER: tl.constexpr,  # SELF, FP32, SPLIT or NONE (_update.py)
    MOMENTUM_KIND: tl.constexpr,  # STATE_F32, STATE_BF16 or STATE_U8
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
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
    """Pass 2 of an SGD step over n elements of a flat buffer: skip on overflow, unscale
    and clip, momentum/Nesterov/weight decay on the fp32 master, write the param
    (pointer shapes above; the shared lines, master modes and state dtypes are
    _update.py's). With ONE_PASS, the whole step in one program: pass 1 first
    (_update.step_prologue), then every tile, then the step count."""
    stats = (n_rows, inv_scale_ptr, found_ptr, partials_ptr, stats_ptr, barrier_ptr)
    step_prologue(grad_ptr, n, *stats, ONE_PASS, HAS_FOUND, GRID, STATS_BLOCK)  # ONE_PASS: pass 1, here
    if found_inf(stats_ptr):
        return  # skipped step: nothing is written anywhere
    lr = load_or_value(lr, LR_ON_DEVICE)
    lo, hi, step = tile_starts(n, BLOCK, ONE_PASS, GRID)
    for start in range(lo, hi, step):  # one tile (ONE_PASS: every tile; GRID: this program's)
        offs, mask = tile_at(start, n, BLOCK)
        g = load_grad(grad_ptr, offs, mask, stats_ptr, inv_scale_ptr, max_grad_norm, CLIP, MAXIMIZE)
        p = load_master(param_ptr, master_ptr, offs, mask, MASTER)
        g = g + weight_decay * p
        t = tl.load(step_ptr)
        if MOMENTUM:
            buf = load_state(momentum_ptr, momentum_absmax_ptr, momentum_qmap_ptr, offs, mask, MOMENTUM_KIND)
            # torch.optim.SGD: the buffer starts as the first gradient, undamped.
            buf = tl.where(t == 0.0, g, momentum * buf + one_minus_dampening * g)
            store_state(
                momentum_ptr,
                momentum_absmax_ptr,
                momentum_qmap_ptr,
                offs,
                mask,
                buf,
                MOMENTUM_KIND,
            )
            if NESTEROV:
                g = g + momentum * buf
            else:
                g = buf
        p = p - lr * g
        store_master(param_ptr, master_ptr, offs, mask, p, seed, t, offset, MASTER, PARAM_DTYPE)
    step_epilogue(step_ptr, barrier_ptr, ONE_PASS, GRID)


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
    prechecked: bool = False,
    one_pass: bool = False,
    found_inf: torch.Tensor | None = None,
    barrier: GridBarrier | None = None,
) -> None:
    """Launch the SGD update over ``buffers`` (see :class:`UpdateBuffers`);
    it does nothing on the device when ``stats`` reports an overflow.

    ``lr`` is a number or a (1,) fp32 tensor on the params' device, read by
    the kernel (changing it then needs no recompile and no host sync).
    ``maximize`` negates the gradient, as torch.optim.SGD's. ``prechecked``: as
    :func:`tkern.kernels.adam.adam_update`'s (the buffers' checks skipped);
    ``one_pass``, ``found_inf`` and ``barrier``: as its (the whole step in one program, or
    in one grid-wide launch)."""
    parts, lr, lr_on_device = update_parts(
        buffers, ("momentum_buffer",) if momentum > 0 else (), lr, prechecked=prechecked, one_pass=one_pass,
        found_inf=found_inf, barrier=barrier, block=BLOCK,
    )  # fmt: skip
    for part, n in parts:
        buf = part.kernel_state("momentum_buffer" if momentum > 0 else None)
        grid, stats_args, consts = pass_launch(part, n, BLOCK, NUM_WARPS, one_pass, found_inf, barrier)
        _sgd_kernel[grid](
            part.kernel_param(), part.grad, part.kernel_master(), *buf[:3],
            part.stats, part.inv_scale, part.step, *stats_args, n, part.seed, part.offset,
            lr, momentum, 1.0 - dampening, weight_decay, max_grad_norm or 0.0,
            MASTER=part.master_mode,
            MOMENTUM_KIND=buf[3],
            MOMENTUM=momentum > 0,
            NESTEROV=nesterov,
            CLIP=max_grad_norm is not None,
            MAXIMIZE=bool(maximize),
            LR_ON_DEVICE=lr_on_device,
            PARAM_DTYPE=tl_dtype(part.param.dtype),
            BLOCK=BLOCK,
            **consts,
        )  # fmt: skip
