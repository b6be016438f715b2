"""How a 16-bit GEMM is scheduled: a pure function of its shape and the GPU's SM count.

:func:`plan_gemm` picks, for ``C (M, N) = A (M, K) @ B (K, N)``, one of

* ``"pointer"``: the pointer kernel (gemm.py), one program per output tile;
* ``"tma"``: the persistent tensor-descriptor kernel (gemm_tma.py, Hopper);
* ``"split_k"``: K cut into ``split_k`` ranges, each range's fp32 partial product
  written by its own programs and the partials summed in order by a second pass
  (gemm_split.py): deterministic, bit-identical run to run.

The rule counts output tiles of :data:`PLAN_BLOCK_M` x :data:`PLAN_BLOCK_N` (the
tile every GEMM config on Hopper starts from) against the SMs, in *waves* (tiles
per SM, rounded up: the last wave runs with idle SMs), instead of a size threshold:

1. operands the pointer kernel cannot vectorise (``ragged``) go to the TMA kernel
   where it can run (``tma``): descriptors zero-fill the edges;
2. split-K when the cost model :func:`split_k_time` finds a split at least
   :data:`SPLIT_K_MIN_GAIN` faster than none (outputs with few tiles and a long K:
   the wgrad ``dY^T @ X`` over 16384 tokens, whose output has 36-144 tiles);
3. the TMA kernel when there are at least :data:`TMA_MIN_WAVES` waves of tiles
   (its persistent loop overlaps one tile's epilogue with the next tile's loads,
   which needs several tiles per SM);
4. otherwise the pointer kernel.

Nothing here reads a device: ``tkern.kernels.gemm`` asks the device for its SM
count and TMA, and the tests call :func:`plan_gemm` with GPT-2's and Llama's shapes
on 132 SMs. The constants are from the H100 measurements where there are some
(named at each), predictions where not; ``benchmarks/bench_gemm.py --sections
layouts`` records each case's plan beside its time to confirm or move them.
"""

from __future__ import annotations

from typing import NamedTuple

#: The output tile the plan counts (the first GEMM config on a GPU, and the smallest
#: TMA tile). The autotuner may pick another tile; the split count is fixed before it.
PLAN_BLOCK_M = 128
PLAN_BLOCK_N = 128

#: Waves of tiles (tiles / SMs) from which aligned operands take the TMA kernel.
#: From the H100 run (torch 2.11, triton 3.6; benchmarks/results/nvidia-h100-80gb-hbm3/gemm.csv):
#: the TMA kernel was slower on the squares up to 2048 (0.25-0.58x; 2048^2 is 1.9 waves on
#: 132 SMs) and faster from 4096 (1.05-1.49x; 4096^2 is 7.8 waves, the 8192-token
#: transformer shapes 15.5 and more). Between 1.9 and 7.8 nothing was measured: 4 is the
#: prediction, and this rule keeps every measured case's faster kernel.
TMA_MIN_WAVES = 4

#: Split-K's cost model (:func:`split_k_time`): the GPU's dense 16-bit FLOPs per byte of
#: memory bandwidth (H100 SXM ~990 TFLOP/s / 3.35 TB/s ~ 295; H200 / 4.8 TB/s ~ 205; at
#: the ~70% of peak a GEMM reaches, 140-210): what an fp32 partial's round trip costs
#: in multiply-adds.
MACHINE_BALANCE = 200
#: Bytes each output element costs per split: its fp32 partial written by the split's
#: program and read back by the reduction pass.
SPLIT_K_PARTIAL_BYTES = 8
#: Each split sums at least this much of K: shorter K loops cannot fill the load
#: pipeline (3-4 stages of 64-deep tiles) before they end.
SPLIT_K_MIN_CHUNK = 512
#: Each split's K range is a multiple of this (every config's BLOCK_K divides it, and
#: fp8 block scales change along K at most this often).
SPLIT_K_ALIGN = 128
#: At most this many splits (the partials' memory: splits x M x N fp32).
SPLIT_K_MAX = 16
#: A split must be modelled at least this much faster than none (time ratio) to be
#: taken: it pays a second launch and the model ignores L2.
SPLIT_K_MIN_GAIN = 0.85

POINTER, TMA, SPLIT_K = "pointer", "tma", "split_k"


class GemmPlan(NamedTuple):
    """What :func:`plan_gemm` chose for one GEMM.

    ``kernel``: :data:`POINTER`, :data:`TMA` or :data:`SPLIT_K`; ``split_k``: K
    ranges (1 unless split-K); ``k_chunk``: K per range (a multiple of
    :data:`SPLIT_K_ALIGN`; the last range takes what is left; K itself unless
    split-K); ``tiles``: output tiles of the plan's tile; ``waves``: programs of
    the plan's tile / SMs (tiles x splits / SMs)."""

    kernel: str
    split_k: int
    k_chunk: int
    tiles: int
    waves: float


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def output_tiles(m: int, n: int) -> int:
    """Output tiles of :data:`PLAN_BLOCK_M` x :data:`PLAN_BLOCK_N` over an (m, n) output."""
    return _cdiv(m, PLAN_BLOCK_M) * _cdiv(n, PLAN_BLOCK_N)


def split_k_chunk(k: int, splits: int) -> int:
    """K per range when ``k`` is cut into about ``splits`` ranges of a multiple of :data:`SPLIT_K_ALIGN`."""
    return _cdiv(_cdiv(k, splits), SPLIT_K_ALIGN) * SPLIT_K_ALIGN


def split_k_time(tiles: int, k: int, splits: int, num_sms: int) -> float:
    """Modelled time of a GEMM of ``tiles`` output tiles cut into ``splits`` K ranges, in
    units of one tile's whole K loop on one SM: the waves of programs (rounded up: a
    wave's SMs all wait for its slowest) times the fraction of K each sums, plus the
    partials' round trip through memory, shared by all SMs (:data:`MACHINE_BALANCE`):
    ``SPLIT_K_PARTIAL_BYTES * MACHINE_BALANCE / (2 k)`` tile-loops per partial tile
    (a tile's loop is ``2 k`` FLOPs per output element). No partials when ``splits`` is 1."""
    programs = tiles * splits
    compute = _cdiv(programs, num_sms) / splits
    if splits == 1:
        return compute
    partial = SPLIT_K_PARTIAL_BYTES * MACHINE_BALANCE / (2 * k)
    return compute + partial * programs / num_sms


def _best_split(tiles: int, k: int, num_sms: int) -> tuple[int, int]:
    """``(splits, k_chunk)`` minimising :func:`split_k_time` (the fewest splits on a tie);
    ``(1, k)`` unless one is at least :data:`SPLIT_K_MIN_GAIN` faster than none."""
    best, best_time = (1, k), split_k_time(tiles, k, 1, num_sms)
    limit = min(SPLIT_K_MAX, k // SPLIT_K_MIN_CHUNK)
    for want in range(2, limit + 1):
        chunk = split_k_chunk(k, want)
        splits = _cdiv(k, chunk)  # aligned ranges may need fewer than asked
        if splits < 2 or splits != want:
            continue
        t = split_k_time(tiles, k, splits, num_sms)
        if t < best_time - 1e-12:
            best, best_time = (splits, chunk), t
    if best[0] > 1 and best_time > SPLIT_K_MIN_GAIN * split_k_time(tiles, k, 1, num_sms):
        return 1, k
    return best


def plan_gemm(
    m: int, n: int, k: int, num_sms: int, *, tma: bool = False, ragged: bool = False, split: bool = True
) -> GemmPlan:
    """The schedule of ``(m, k) @ (k, n)`` on a GPU with ``num_sms`` SMs (the module's rule).

    Args:
        m, n, k: the GEMM's dimensions.
        num_sms: streaming multiprocessors; 0 or less: unknown (the interpreter),
            which plans the pointer kernel alone.
        tma: whether the TMA kernel can run these operands on this device (Hopper,
            and both operands describable by a tensor descriptor).
        ragged: whether the pointer kernel loses its 16-byte vector loads on them
            (``gemm_configs.operands_ragged``).
        split: whether split-K may be planned (False where the launch has an
            epilogue or prologue the split kernels do not run: bias, activation,
            the pre-activation, act' on A).
    """
    tiles = output_tiles(m, n)
    if num_sms <= 0 or min(m, n, k) <= 0:
        return GemmPlan(POINTER, 1, max(k, 0), tiles, 0.0)
    waves = tiles / num_sms
    if tma and ragged:
        return GemmPlan(TMA, 1, k, tiles, waves)
    if split:
        splits, chunk = _best_split(tiles, k, num_sms)
        if splits > 1:
            return GemmPlan(SPLIT_K, splits, chunk, tiles, tiles * splits / num_sms)
    if tma and waves >= TMA_MIN_WAVES:
        return GemmPlan(TMA, 1, k, tiles, waves)
    return GemmPlan(POINTER, 1, k, tiles, waves)
