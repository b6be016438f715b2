"""What every pass-2 (update) kernel shares: its arguments (:class:`UpdateBuffers`)
and their checks, and the jit lines every update kernel runs the same way.

The shared lines, in the order a kernel calls them:

* :func:`tile` -- this program's elements (whole blocks of the 8-bit state);
* :func:`load_grad` -- the gradient unscaled, clipped and (``maximize``) negated;
* :func:`load_master` / :func:`store_master` -- the fp32 master in one of the
  four *master modes* below, and the write of the param;
* :func:`load_state` / :func:`store_state` -- an optimizer state buffer in one of
  the three *state dtypes* below.

Master modes (``MASTER``, from the buffers' dtypes):

``SELF``
    fp32 params: the param is its own master.
``FP32``
    an fp32 master beside the 16-bit param; the param is the master rounded to
    nearest even. 4 B/param.
``SPLIT``
    bf16 params: the master's 32 bits are the param's 16 and a 16-bit remainder.
    The param holds the master rounded to nearest (ties away from zero, so that
    the remainder ``master - param`` always fits in 16 signed bits) and
    ``master`` the int16 remainder: the fp32 master is rebuilt exactly, bit for
    bit what ``FP32`` would hold. The param differs from ``FP32``'s only on an
    exact tie (1 value in 65536, by one ulp, and with the same half-ulp error).
    2 B/param.
``NONE``
    no master: the update is computed in fp32 from the param and written back
    with stochastic rounding (unbiased: the expected param is the fp32 result),
    drawn from Philox keyed by (seed, step count) at each element's place in
    the flat buffer, so a step is reproducible and a resumed run bit-identical.
    0 B/param.

State dtypes (``KIND``, from each state buffer's dtype):

``STATE_F32`` fp32 (4 B/param); ``STATE_BF16`` bf16, rounded to nearest even
(2 B/param); ``STATE_U8`` 8 bits, block-quantized as bitsandbytes' 8-bit Adam:
blocks of :data:`QBLOCK` elements, one fp32 absmax per block, each value
divided by its block's absmax and coded as the nearest entry of a 256-entry
*dynamic* code map (:func:`dynamic_code_map`; signed for a first moment or a
momentum, unsigned for a second moment), ties rounding up, exactly as
torchao's ``quantize_8bit_with_qmap`` (1 + 4 / 256 B/param).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tkern.kernels import overflow
from tkern.kernels._common import INTERPRET, aligned_slices, cast_rne, cdiv, check_tensor
from tkern.kernels.grid_sync import GridBarrier, check_programs, last_to_finish, launch_options, spin_kind
from tkern.kernels.overflow import N_STATS, grad_factor, one_pass_stats

PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Elements per block of the 8-bit state (bitsandbytes' and torchao's block size).
QBLOCK = 256
_QBLOCK: tl.constexpr = tl.constexpr(QBLOCK)
#: State buffers of params smaller than this keep fp32 state (bitsandbytes' min_8bit_size).
MIN_8BIT_SIZE = 4096
#: The absmax of an all-zero block, as torchao clamps it.
ABSMAX_EPS = 1e-12
_ABSMAX_EPS: tl.constexpr = tl.constexpr(ABSMAX_EPS)

# Master modes.
SELF: tl.constexpr = tl.constexpr(0)
FP32: tl.constexpr = tl.constexpr(1)
SPLIT: tl.constexpr = tl.constexpr(2)
NONE: tl.constexpr = tl.constexpr(3)
MASTER_MODES = {"fp32": 1, "split": 2, "none": 3}

# State kinds.
STATE_F32: tl.constexpr = tl.constexpr(0)
STATE_BF16: tl.constexpr = tl.constexpr(1)
STATE_U8: tl.constexpr = tl.constexpr(2)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
_STATE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}

#: Names of the state buffers whose values can be negative (signed code map).
SIGNED_STATE = frozenset({"exp_avg", "momentum_buffer"})

#: Up to this many elements a fused optimizer's step runs in ONE launch of ONE program
#: (``one_pass=True``: statistics, then the update of every tile, then the step count),
#: instead of pass 1 (two launches) + pass 2 + the step counts' two torch ops. The
#: reasoning: in a CUDA graph each launch costs ~2-3 us of launch and tail however
#: little it does, so the two-pass step of a small buffer is ~5 launches of latency
#: (10-15 us); one program streams its Adam bytes (30 B/param, mostly L2 hits right
#: after backward) at roughly 50-100 GB/s, i.e. 16384 params in ~5-10 us: 16 update
#: tiles and 8 statistics chunks of the GPU blocks -- about where one program stops
#: beating the launches it saves. Not yet measured on a GPU (it waits for one).
ONE_PASS_MAX_ELEMENTS = 16384

#: Up to this many elements the *grid-wide* one-pass step may run (``one_pass="grid"``):
#: one launch of P <= SM-count programs, each computing its share of the statistics, all
#: meeting at a grid barrier (:mod:`tkern.kernels.grid_sync`), then each updating its tiles.
#: Why a bound at all: (1) what the grid path saves is launches (pass 1, its finalize, the
#: step count: ~3 launches, some 6-10 us in a CUDA graph), while a step of 4M fp16 params
#: moves ~120 MB (30 B/param), ~30 us at H100/H200 bandwidth, so above it the saving is
#: under a fifth of the step and shrinking; (2) one program per SM (8 warps, 1/8 of an SM's
#: warps) may stream below the two-pass launches' full occupancy, a cost that grows with
#: the size; (3) the gradients (8 MB in fp16 at 4M) stay far inside L2 (50 MB on H100/H200)
#: between the statistics and the update that reads them again; (4) the fewer elements,
#: the shorter any program waits at the barrier. A guess from those figures, not yet
#: measured on a GPU (bench_optimizer --sections grid measures the 1M step).
GRID_MAX_ELEMENTS = 1 << 22
#: What the fused optimizers' ``one_pass`` attribute takes (see :func:`step_path`).
ONE_PASS_MODES = ("auto", "single", "grid", "off")


class StepPath(NamedTuple):
    """Which launches a step takes (:func:`step_path`): ``path`` is ``"single"`` (one
    program: statistics, update and step count), ``"grid"`` (one launch of up to
    ``programs`` programs meeting at a grid barrier) or ``"two-pass"`` (pass 1, its
    finalize, pass 2, the step counts); ``reason`` says why, in words."""

    path: str
    programs: int
    reason: str


@functools.lru_cache(maxsize=256)  # the optimizer asks every step, with a few distinct arguments
def step_path(
    n: int,
    mode: str,
    *,
    device_programs: int,
    interpret: bool = INTERPRET,
    single_max: int = ONE_PASS_MAX_ELEMENTS,
    grid_max: int = GRID_MAX_ELEMENTS,
) -> StepPath:
    """The path a one-range step of ``n`` elements takes (a pure function of its arguments).

    Args:
        n: the range's elements (a step that is not one range is two-pass before this).
        mode: ``"off"`` (two passes), ``"single"`` (one program up to ``single_max``
            elements), ``"grid"`` (one launch of up to ``device_programs`` programs up to
            ``grid_max`` elements), ``"auto"``: today ``"single"``'s rule; the grid path is
            not the default until a GPU has measured it.
        device_programs: the most co-resident programs a grid launch may have: the device's
            SM count on CUDA, 1 under the interpreter, 0 on a device without a grid path.
        interpret: Triton's interpreter runs the kernels (programs one after another).
    """
    if mode not in ONE_PASS_MODES:
        raise ValueError(f"one_pass must be one of {ONE_PASS_MODES}, got {mode!r}")
    if mode == "off":
        return StepPath("two-pass", 0, "one_pass='off'")
    if n <= 0 or n % 16:
        return StepPath("two-pass", 0, f"{n} elements: not a positive multiple of 16 (pass 1 splits it)")
    if mode in ("auto", "single"):
        if n <= single_max:
            return StepPath("single", 1, f"{n} <= one_pass_max_elements ({single_max}): one program")
        return StepPath("two-pass", 0, f"{n} > one_pass_max_elements ({single_max})")
    if n > grid_max:
        return StepPath("two-pass", 0, f"{n} > GRID_MAX_ELEMENTS ({grid_max})")
    if device_programs < 1:
        return StepPath("two-pass", 0, "no grid path on this device (CUDA or Triton's interpreter only)")
    if interpret:
        return StepPath("grid", 1, "Triton's interpreter: one program (its programs run in turn)")
    return StepPath("grid", device_programs, f"up to {device_programs} programs, one per SM")


def dynamic_code_map(signed: bool) -> list[float]:
    """The 256 sorted values of bitsandbytes' dynamic 8-bit code map (Dettmers et
    al., "8-bit Optimizers via Block-wise Quantization", 2022; as torchao's
    ``create_dynamic_map(signed)`` with 7 exponent bits): each of 7 decades
    10^-6 .. 10^0 holds evenly spaced fractions (more of them in the larger
    decades), plus 0 and 1, and their negatives when ``signed``."""
    data: list[float] = []
    max_exponent_bits, non_sign_bits = 7, 7
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)) + 1
        bounds = torch.linspace(0.1, 1, items)  # float32 arithmetic, as torchao builds it
        means = (bounds[:-1] + bounds[1:]) / 2.0
        decade = 10 ** (-(max_exponent_bits - 1) + i)
        data += (decade * means).tolist()
        if signed:
            data += (-decade * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return sorted(data)


@functools.cache
def code_map(signed: bool, device: torch.device) -> torch.Tensor:
    """(256,) fp32 :func:`dynamic_code_map` on ``device`` (one per device and sign)."""
    return torch.tensor(dynamic_code_map(signed), dtype=torch.float32, device=device)


def zero_code(signed: bool) -> int:
    """The code of 0.0 in the signed or unsigned map."""
    return dynamic_code_map(signed).index(0.0)


def state_kind(dtype: torch.dtype) -> int:
    """The ``KIND`` constexpr of a state buffer of ``dtype``."""
    return _STATE_KINDS[dtype]


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def tile(n, BLOCK: tl.constexpr):
    """This program's BLOCK of n elements: ``(offs, mask)``, int64 element offsets
    and which lie below n. BLOCK is a multiple of QBLOCK, so a program holds whole
    blocks of the 8-bit state."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < n


@triton.jit
def tile_at(start, n, BLOCK: tl.constexpr):
    """The tile of BLOCK elements from element ``start``: ``(offs, mask)``, as :func:`tile`."""
    offs = start + tl.arange(0, BLOCK)
    return offs, offs < n


@triton.jit
def tile_starts(n, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, GRID: tl.constexpr):
    """``(lo, hi, step)``: this program's tiles start at ``range(lo, hi, step)`` -- its own
    BLOCK (one tile, as :func:`tile`); every tile of n for a one-pass step's one program
    (:func:`step_prologue`); with GRID, tiles q, q + P, ... of n for program q of P."""
    if GRID:
        lo = tl.program_id(0).to(tl.int64) * BLOCK
        hi = n
        step = tl.num_programs(0).to(tl.int64) * BLOCK
    elif ONE_PASS:
        lo = tl.full((), 0, tl.int64)
        hi = lo + n
        step = BLOCK
    else:
        lo = tl.program_id(0).to(tl.int64) * BLOCK
        hi = lo + 1
        step = BLOCK
    return lo, hi, step


@triton.jit
def step_prologue(
    grad_ptr, n, n_rows, inv_scale_ptr, found_ptr, partials_ptr, stats_ptr, barrier_ptr,
    ONE_PASS: tl.constexpr, HAS_FOUND: tl.constexpr, GRID: tl.constexpr, STATS_BLOCK: tl.constexpr,
):  # fmt: skip
    """What an update kernel does before its tiles: with ONE_PASS (the whole step in this
    launch) the statistics of the step (:func:`tkern.kernels.overflow.one_pass_stats`:
    ``partials_ptr`` (n_rows, N_STATS) fp32 scratch, ``found_ptr`` (1,) fp32 read when
    HAS_FOUND, into ``stats_ptr`` (N_STATS,); with GRID every program of the launch meets
    the others at the grid barrier of ``barrier_ptr``, (2,) int32, first); nothing
    otherwise (pass 1 wrote them)."""
    if ONE_PASS:
        one_pass_stats(
            grad_ptr, n, n_rows, inv_scale_ptr, found_ptr, partials_ptr, stats_ptr, barrier_ptr,
            HAS_FOUND, GRID, STATS_BLOCK,
        )  # fmt: skip


@triton.jit
def step_epilogue(step_ptr, barrier_ptr, ONE_PASS: tl.constexpr, GRID: tl.constexpr):
    """After an applied step's tiles: a one-pass step counts its step (``step_ptr`` (1,)
    fp32 += 1, as the optimizer's ``step.add_(1 - found_inf)`` does after pass 2); with
    GRID the last program to finish its tiles does (every other has read the count by
    then: :func:`tkern.kernels.grid_sync.last_to_finish`)."""
    if GRID:
        if last_to_finish(barrier_ptr):
            t = tl.load(step_ptr)
            tl.store(step_ptr, t + 1.0)
    elif ONE_PASS:
        tl.debug_barrier()  # every tile has read the count
        t = tl.load(step_ptr)
        tl.store(step_ptr, t + 1.0)


@triton.jit
def load_grad(
    grad_ptr, offs, mask, stats_ptr, inv_scale_ptr, max_grad_norm, CLIP: tl.constexpr, MAXIMIZE: tl.constexpr
):
    """The gradient at ``offs`` in fp32: unscaled, clipped by the global norm, and
    negated when ``MAXIMIZE`` (torch's ``maximize=True``)."""
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = g * grad_factor(stats_ptr, inv_scale_ptr, max_grad_norm, CLIP)
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def load_master(param_ptr, master_ptr, offs, mask, MASTER: tl.constexpr):
    """The fp32 master at ``offs`` (see the module docstring's master modes). In
    ``SPLIT`` mode ``param_ptr`` is the bf16 param viewed as int16."""
    if MASTER == FP32:
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    elif MASTER == SPLIT:
        high = tl.load(param_ptr + offs, mask=mask, other=0).to(tl.int32)
        low = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32)
        p = ((high << 16) + low).to(tl.float32, bitcast=True)
    else:  # SELF, NONE: the param itself
        p = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return p


@triton.jit
def _stochastic_round(p, random, PARAM_DTYPE: tl.constexpr):
    """fp32 ``p`` to PARAM_DTYPE (bf16 or fp16), rounded up in magnitude with the
    probability of its distance from the value below (unbiased), ``random`` (p's
    shape) uniform uint32 draws."""
    if tl.bfloat16 == PARAM_DTYPE:
        # bf16 is fp32's upper half: adding 16 random bits to the magnitude carries
        # into the kept bits with probability low16 / 2^16
        bits = p.to(tl.int32, bitcast=True) + (random >> 16).to(tl.int32)
        out = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        # fp16: the spacing at |p| (2^(e - 10), at least the subnormals' 2^-24) is a
        # power of two, so |p| / ulp, its floor and the two neighbours are exact in fp32
        mag = tl.abs(p)
        e = tl.maximum(((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -14)
        ulp = ((e - 10 + 127) << 23).to(tl.float32, bitcast=True)
        q = mag / ulp
        down = tl.floor(q)
        u = (random >> 8).to(tl.float32) * (1.0 / 16777216.0)  # uniform in [0, 1), 24 bits
        mag = tl.where(u < q - down, down + 1.0, down) * ulp
        out = tl.where(p < 0.0, -mag, mag).to(tl.float16)
    return out


@triton.jit
def store_master(
    param_ptr, master_ptr, offs, mask, p, seed, t, offset, MASTER: tl.constexpr, PARAM_DTYPE: tl.constexpr
):
    """Write the updated fp32 master ``p`` and the param it gives (see the module
    docstring). ``NONE`` draws its random bits from Philox keyed by
    ``(seed, t)`` (t: the step count) at element ``offset + offs`` of the flat buffer."""
    if MASTER == SELF:
        tl.store(param_ptr + offs, p, mask=mask)
    elif MASTER == FP32:
        tl.store(master_ptr + offs, p, mask=mask)
        tl.store(param_ptr + offs, cast_rne(p, PARAM_DTYPE), mask=mask)
    elif MASTER == SPLIT:
        bits = p.to(tl.int32, bitcast=True)
        rounded = (bits + 0x8000) & -65536  # to nearest, ties away from zero
        tl.store(param_ptr + offs, (rounded >> 16).to(tl.int16), mask=mask)
        tl.store(master_ptr + offs, (bits - rounded).to(tl.int16), mask=mask)
    else:  # NONE
        key = (t.to(tl.uint64) << 32) | seed.to(tl.uint64)
        random = tl.randint(key, (offset + offs).to(tl.uint32))
        tl.store(param_ptr + offs, _stochastic_round(p, random, PARAM_DTYPE), mask=mask)


@triton.jit
def load_state(ptr, absmax_ptr, qmap_ptr, offs, mask, KIND: tl.constexpr):
    """A state buffer at ``offs`` (a tile from :func:`tile`) in fp32."""
    if KIND == STATE_U8:
        code = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        absmax = tl.load(absmax_ptr + offs // _QBLOCK, mask=mask, other=0.0)  # its block's, per element
        x = tl.load(qmap_ptr + code) * absmax
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def store_state(ptr, absmax_ptr, qmap_ptr, offs, mask, x, KIND: tl.constexpr):
    """Write fp32 ``x`` (a tile from :func:`tile`, whole blocks) to a state buffer:
    as it is, rounded to bf16, or block-quantized (absmax per row, then the
    nearest code by a branchless binary search over the sorted code map)."""
    if KIND == STATE_U8:
        ROWS: tl.constexpr = x.shape[0] // _QBLOCK
        absmax = tl.maximum(tl.max(tl.reshape(tl.abs(x), (ROWS, _QBLOCK)), axis=1), _ABSMAX_EPS)
        absmax = tl.reshape(tl.broadcast_to(absmax[:, None], (ROWS, _QBLOCK)), x.shape)  # per element
        first = mask & (offs % _QBLOCK == 0)  # one store per block, from its first element
        tl.store(absmax_ptr + offs // _QBLOCK, absmax, mask=first)
        xn = x / absmax
        code = tl.where(xn >= tl.load(qmap_ptr + 128), 128, 0)
        for shift in tl.static_range(6, -1, -1):
            step = 1 << shift
            code += tl.where(xn >= tl.load(qmap_ptr + code + step), step, 0)
        up = tl.minimum(code + 1, 255)
        below = tl.load(qmap_ptr + code)
        code = tl.where(xn - below >= (tl.load(qmap_ptr + up) - below) * 0.5, up, code)
        tl.store(ptr + offs, code.to(tl.uint8), mask=mask)
    elif KIND == STATE_BF16:
        tl.store(ptr + offs, cast_rne(x, tl.bfloat16), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


# --------------------------------------------------------------------------- buffers


@dataclass
class UpdateBuffers:
    """One contiguous run of a flat parameter buffer and its companions.

    The master mode and each state buffer's kind follow from the dtypes (see the
    module docstring).

    Attributes:
        param: (n,) fp16/bf16/fp32 model parameters, written in place.
        grad: (n,) gradients of ``param``'s dtype, scaled by the loss scale.
        master: (n,) fp32 master weights; for fp32 params, ``param`` itself (the
            same memory); (n,) int16 remainders for a ``"split"`` master (bf16
            params); None for no master (``"none"``: stochastic rounding).
        state: name -> (n,) optimizer state (momentum, exp_avg, ...): fp32, bf16,
            or uint8 codes (then ``n`` is a multiple of :data:`QBLOCK`).
        absmax: name -> (n / QBLOCK,) fp32 block absmax of each uint8 state buffer.
        stats: (3,) fp32 pass-1 statistics from :func:`tkern.kernels.overflow.grad_stats`.
        inv_scale: (1,) fp32, 1 / loss scale.
        step: (1,) fp32 count of applied steps before this one.
        seed: the stochastic rounding's seed (32 bits; no master only).
        offset: where ``param[0]`` lies in its flat buffer (the random stream's counter).
    """

    param: torch.Tensor
    grad: torch.Tensor
    master: torch.Tensor | None
    stats: torch.Tensor | None
    inv_scale: torch.Tensor | None
    step: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    absmax: dict[str, torch.Tensor] = field(default_factory=dict)
    seed: int = 0
    offset: int = 0

    @property
    def master_mode(self) -> int:
        """The ``MASTER`` constexpr: SELF, FP32, SPLIT or NONE."""
        if self.param.dtype == torch.float32:
            return 0
        if self.master is None:
            return 3
        return 2 if self.master.dtype == torch.int16 else 1

    def kernel_param(self) -> torch.Tensor:
        """The param as the kernel addresses it (its int16 bits under a split master)."""
        return self.param.view(torch.int16) if self.master_mode == 2 else self.param

    def kernel_master(self) -> torch.Tensor:
        """The master pointer (the param itself where there is none)."""
        return self.param if self.master is None else self.master

    def kernel_state(self, name: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(buffer, absmax, code map, KIND)`` of state ``name`` as the kernel takes
        them; placeholders (never read) for None, a state the update does not use."""
        buf = self.state.get(name) if name is not None else None
        if buf is None:
            return self.param, self.param, self.param, 0
        kind = state_kind(buf.dtype)
        if kind != 2:
            return buf, buf, buf, kind
        return buf, self.absmax[name], code_map(name in SIGNED_STATE, buf.device), kind


def check_update_buffers(b: UpdateBuffers, state_names: tuple[str, ...]) -> None:
    """Raise ``TypeError``/``ValueError`` naming the buffer that is wrong."""
    check_tensor("param", b.param, ndim=1, dtypes=PARAM_DTYPES)
    n = b.param.numel()
    named: dict[str, tuple[torch.Tensor | None, tuple[torch.dtype, ...]]] = {
        "grad": (b.grad, (b.param.dtype,))
    }
    if b.master is not None or b.param.dtype == torch.float32:
        masters = (torch.float32, torch.int16) if b.param.dtype == torch.bfloat16 else (torch.float32,)
        named["master"] = (b.master, masters)
    named.update({name: (b.state.get(name), STATE_DTYPES) for name in state_names})
    for name, (t, dtypes) in named.items():
        if t is None:
            raise ValueError(f"state buffer {name!r} is missing")
        check_tensor(name, t, ndim=1, dtypes=dtypes)
        if t.numel() != n or not t.is_contiguous() or t.device != b.param.device:
            raise ValueError(
                f"{name} must be a contiguous ({n},) tensor on {b.param.device} like param, "
                f"got shape {tuple(t.shape)} on {t.device}"
            )
    if b.param.dtype == torch.float32 and b.master.data_ptr() != b.param.data_ptr():
        raise ValueError("an fp32 param is its own master: pass the same memory as param and master")
    for name in state_names:
        if b.state[name].dtype != torch.uint8:
            continue
        absmax = b.absmax.get(name)
        if n % QBLOCK:
            raise ValueError(f"uint8 state {name!r} needs whole blocks of {QBLOCK} elements, got {n}")
        check_tensor(f"absmax[{name!r}]", absmax, ndim=1, dtypes=(torch.float32,))
        if absmax.numel() != n // QBLOCK or not absmax.is_contiguous() or absmax.device != b.param.device:
            raise ValueError(
                f"absmax[{name!r}] must be a contiguous ({n // QBLOCK},) fp32 tensor on {b.param.device}, "
                f"got shape {tuple(absmax.shape)} on {absmax.device}"
            )
    for name, t, size in (
        ("stats", b.stats, N_STATS),
        ("inv_scale", b.inv_scale, 1),
        ("step", b.step, 1),
    ):
        check_tensor(name, t, dtypes=(torch.float32,))
        if t.numel() != size or t.device != b.param.device:
            raise ValueError(
                f"{name} must hold {size} value(s) on {b.param.device}, got shape {tuple(t.shape)}"
            )


def grid_programs(n: int, block: int, barrier: GridBarrier) -> int:
    """The programs of a grid-wide launch over n elements in tiles of ``block``: one per
    tile, at most ``barrier.max_programs`` (each then loops over its tiles)."""
    return max(1, min(barrier.max_programs, cdiv(n, block)))


def pass_launch(
    b: UpdateBuffers,
    n: int,
    block: int,
    num_warps: int,
    one_pass: bool,
    found_inf: torch.Tensor | None,
    barrier: GridBarrier | None = None,
) -> tuple[tuple[int], tuple, dict]:
    """``(grid, args, options)`` of an update launch over the first n elements of ``b``:
    ``args`` (partials, found_inf, n_rows, barrier word), which every update kernel takes
    after ``step_ptr``, and the ONE_PASS/HAS_FOUND/GRID/STATS_BLOCK constexprs, ``num_warps``
    and the launch options. Two-pass: a program per ``block``, placeholders, ``num_warps``;
    ``one_pass``: one program (or, with a ``barrier``, :func:`grid_programs` programs, a
    cooperative launch on CUDA), a new (n_rows, N_STATS) fp32 scratch (no launch: its rows
    are all written), ``found_inf`` (a GradScaler's, or None) and pass 1's warps (the same
    reductions)."""
    grid = barrier is not None
    spin = spin_kind(b.param.device) if grid else 0  # GRID: the barrier's spin, grid_sync.SPIN_*
    consts = dict(ONE_PASS=one_pass, HAS_FOUND=found_inf is not None, GRID=spin, STATS_BLOCK=overflow.BLOCK)
    consts["num_warps"] = overflow.NUM_WARPS if one_pass else num_warps
    if not one_pass:
        return (cdiv(n, block),), (b.stats, b.stats, 0, b.stats), consts
    rows = overflow.stats_rows(n)
    partials = torch.empty((rows, N_STATS), dtype=torch.float32, device=b.param.device)
    found = b.stats if found_inf is None else found_inf
    if not grid:
        return (1,), (partials, found, rows, b.stats), consts
    consts.update(launch_options())
    return (grid_programs(n, block, barrier),), (partials, found, rows, barrier.word), consts


def check_one_pass(
    b: UpdateBuffers, found_inf: torch.Tensor | None, barrier: GridBarrier | None = None, block: int = 1
) -> None:
    """Raise ``ValueError`` unless ``b`` can be stepped in one pass: a (N_STATS,) fp32
    ``stats`` to write and ``found_inf`` None or one fp32 value, both on the params' device;
    with a ``barrier`` (the grid-wide step, tiles of ``block``), one that a launch of
    :func:`grid_programs` programs can meet at (:func:`tkern.kernels.grid_sync.check_programs`).
    (Any length works; without a barrier one program does it all, so it is meant for small
    buffers.)"""
    if barrier is not None:
        check_programs(barrier, grid_programs(b.param.numel(), block, barrier), b.param.device)
    for name, t, size in (("stats", b.stats, N_STATS), ("found_inf", found_inf, 1)):
        if t is None and name == "found_inf":
            continue
        check_tensor(name, t, dtypes=(torch.float32,))
        if t.numel() != size or t.device != b.param.device or not t.is_contiguous():
            raise ValueError(
                f"a one-pass step needs {name} as {size} contiguous fp32 value(s) on {b.param.device}, "
                f"got shape {tuple(t.shape)} on {t.device}"
            )


def check_lr(lr: float | torch.Tensor, device: torch.device) -> tuple[float | torch.Tensor, bool]:
    """``(lr, on_device)`` for a kernel's ``lr`` argument: a Python number, or a
    (1,) fp32 tensor on ``device`` that the kernel reads itself (no host sync)."""
    if isinstance(lr, torch.Tensor):
        check_tensor("lr", lr, dtypes=(torch.float32,))
        if lr.numel() != 1 or lr.device != device:
            raise ValueError(
                f"a tensor lr must hold one fp32 value on {device}, "
                f"got shape {tuple(lr.shape)} on {lr.device}"
            )
        return lr, True
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise TypeError(f"lr must be a float or a (1,) fp32 tensor, got {type(lr).__name__}")
    return float(lr), False


def update_parts(
    b: UpdateBuffers,
    state_names: tuple[str, ...],
    lr: float | torch.Tensor,
    *,
    prechecked: bool,
    one_pass: bool,
    found_inf: torch.Tensor | None,
    barrier: GridBarrier | None,
    block: int,
) -> tuple[list[tuple[UpdateBuffers, int]], float | torch.Tensor, bool]:
    """What every update launcher (:func:`tkern.kernels.adam.adam_update`,
    :func:`tkern.kernels.sgd.sgd_update`) checks before its launches, raising before any:
    ``b`` with its ``state_names`` (:func:`check_update_buffers`, skipped when
    ``prechecked``), the one-pass arguments (:func:`check_one_pass`; a ``barrier`` only
    with ``one_pass``) and ``lr`` (:func:`check_lr`). Returns ``(parts, lr, lr_on_device)``:
    the (part, length) runs to launch on (all of ``b`` at once in one pass, else
    :func:`aligned_parts`) and the kernel's ``lr``."""
    if not prechecked:
        check_update_buffers(b, state_names)
    if one_pass:
        check_one_pass(b, found_inf, barrier, block)
    elif barrier is not None:
        raise ValueError("a grid barrier is for a one-pass launch: pass one_pass=True with it")
    lr, lr_on_device = check_lr(lr, b.param.device)
    return ([(b, b.param.numel())] if one_pass else aligned_parts(b)), lr, lr_on_device


def aligned_parts(b: UpdateBuffers) -> list[tuple[UpdateBuffers, int]]:
    """``b`` as (part, length) runs: a head whose length is a multiple of 16
    elements (the kernel vectorises it) and, when the length is not, a tail of
    fewer than 16 elements on offset views of every buffer. (Block-quantized
    state comes in whole blocks of 256, so it never has a tail.)"""
    n = b.param.numel()
    runs = aligned_slices(n)
    if len(runs) < 2:
        return [(b, n)] if n else []
    return [
        (replace(b, param=b.param[s], grad=b.grad[s], master=None if b.master is None else b.master[s],
                 state={k: v[s] for k, v in b.state.items()}, offset=b.offset + s.start), s.stop - s.start)
        for s in runs
    ]  # fmt: skip


# --------------------------------------------------------------------------- state conversion

#: Elements per program of the conversion kernels.
CONVERT_BLOCK = 65536 if INTERPRET else 1024


@triton.jit
def _convert_state_kernel(
    x_ptr,  # (n,) fp32 values
    buf_ptr,  # (n,) the state buffer (fp32, bf16 or uint8 codes)
    absmax_ptr,  # (n / QBLOCK,) fp32 block absmax (uint8 only)
    qmap_ptr,  # (256,) fp32 code map (uint8 only)
    n,
    TO_STATE: tl.constexpr,  # True: x -> buf (quantize); False: buf -> x (dequantize)
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A whole state buffer to or from fp32 with the update kernels' own
    :func:`load_state`/:func:`store_state` (checkpoints, loading, inspection)."""
    offs, mask = tile(n, BLOCK)
    if TO_STATE:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        store_state(buf_ptr, absmax_ptr, qmap_ptr, offs, mask, x, KIND)
    else:
        x = load_state(buf_ptr, absmax_ptr, qmap_ptr, offs, mask, KIND)
        tl.store(x_ptr + offs, x, mask=mask)


def _convert(
    x: torch.Tensor, buf: torch.Tensor, absmax: torch.Tensor | None, signed: bool, to_state: bool
) -> None:
    """One ``_convert_state_kernel`` launch between ``x`` ((n,) fp32) and the (n,) state buffer
    ``buf`` (fp32, bf16 or uint8 codes with their (n / QBLOCK,) ``absmax``; ``signed``: the
    code map of a first moment): ``to_state`` writes ``buf`` from ``x``, else ``x`` from ``buf``."""
    n = buf.numel()
    kind = state_kind(buf.dtype)
    if kind == 2 and (absmax is None or n % QBLOCK or absmax.numel() != n // QBLOCK):
        raise ValueError(
            f"a uint8 state of {n} elements needs whole blocks of {QBLOCK} and {n // QBLOCK} absmax"
        )
    if n == 0:
        return
    qmap = code_map(signed, buf.device) if kind == 2 else x
    _convert_state_kernel[(cdiv(n, CONVERT_BLOCK),)](
        x, buf, absmax if absmax is not None else x, qmap, n,
        TO_STATE=to_state, KIND=kind, BLOCK=CONVERT_BLOCK,
    )  # fmt: skip


def state_to_fp32(buf: torch.Tensor, absmax: torch.Tensor | None, signed: bool) -> torch.Tensor:
    """A (n,) state buffer as a new (n,) fp32 tensor (a uint8 one dequantized
    with its (n / 256,) ``absmax`` and the signed or unsigned code map)."""
    if buf.dtype == torch.float32:
        return buf.clone()
    if buf.dtype == torch.bfloat16:
        return buf.float()
    out = torch.empty(buf.shape, dtype=torch.float32, device=buf.device)
    _convert(out, buf, absmax, signed, to_state=False)
    return out


def state_from_fp32(x: torch.Tensor, buf: torch.Tensor, absmax: torch.Tensor | None, signed: bool) -> None:
    """Write (n,) fp32 ``x`` into the state buffer ``buf`` (and ``absmax``), as an
    update kernel stores it: as it is, rounded to nearest even, or quantized."""
    check_tensor("x", x, ndim=1, dtypes=(torch.float32,))
    if x.numel() != buf.numel() or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous ({buf.numel()},) fp32 tensor, got shape {tuple(x.shape)}")
    if buf.dtype == torch.uint8:
        _convert(x, buf, absmax, signed, to_state=True)
    else:
        with torch.no_grad():
            buf.copy_(x)
