"""A grid-wide barrier for one launch of co-resident programs: the grid-wide one-pass
optimizer step (:mod:`tkern.kernels._update`) computes its statistics in every program,
meets here, and then updates.

The workspace is one (:data:`WORDS`,) int32 device tensor per user (an optimizer), zero
when made, that resets itself: no host read, no host-side reset, so a launch is CUDA-graph
capturable and replays any number of times.

``word[BARRIER]``
    the arrivals of this launch in its low 16 bits, a generation number above them. A
    program arrives with one ``atomic_add(+1)`` (acq_rel, gpu scope), which also tells it
    the generation it waits in; the last of P to arrive adds ``2**16 - P`` (release): the
    count back to 0 and the generation moved on, in one atomic. The others spin with
    volatile loads until the generation moves, then read the word once with acquire
    semantics, so everything the programs wrote before arriving is visible after it.
``word[FINISHED]``
    a ticket: each program adds 1 after its last read of what the launch changes at its
    end (the step count); the last of P does the change and puts the ticket back to 0.

Everything the count and the generation need lives in the one word, so a program never
reads a generation that the last arrival has already moved (it gets its own from its
arrival). The generation wraps after 65536 launches; a waiter only compares it with the
one it arrived in.

A spin barrier deadlocks if the programs are not all resident at once, so a launch
(``launch_options``) has at most as many programs as the device has SMs (each program
fits one SM), and is a *cooperative* launch on CUDA: the driver refuses a grid that
cannot be co-resident instead of starting it. Under Triton's interpreter the programs
run one after another, so a spin with P > 1 would never end: the launchers refuse
P > 1 there (:func:`check_programs`), and P = 1 runs the barrier's code (the last
arrival's branch) trivially. That all P programs meet and agree is proven only on a GPU
(tests/test_gpu_grid_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tkern import device as tkdev
from tkern.kernels._common import INTERPRET, check_tensor

#: The workspace's words (int32).
BARRIER, FINISHED, WORDS = 0, 1, 2
_BARRIER: tl.constexpr = tl.constexpr(BARRIER)
_FINISHED: tl.constexpr = tl.constexpr(FINISHED)
#: The count's bits in ``word[BARRIER]``; the generation is above them.
_COUNT_BITS: tl.constexpr = tl.constexpr(16)
_COUNT_MASK: tl.constexpr = tl.constexpr(0xFFFF)
_GENERATION: tl.constexpr = tl.constexpr(1 << 16)  # one generation in the word
#: At most this many programs meet at one barrier (the count's 16 bits).
MAX_PROGRAMS = 0xFFFF
#: How the waiters read the barrier's word while they spin: a grid-wide launch's ``GRID``
#: constexpr (0: no barrier), by vendor (:func:`spin_kind`). NVIDIA: a volatile load
#: (``ld.volatile.global``). AMD: a volatile load that bypasses the caches
#: (``cache_modifier=".cv"``: ``sc0 sc1`` on gfx942/gfx950, the memory model's volatile
#: access): Triton 3.6 compiles a plain volatile load of the one word for AMD into a
#: ``global_load_dword`` without them, which a CU's L1 may answer from a stale line for as
#: long as the waiter spins (Triton 3.9 sets the bits itself; NVIDIA's ptxas refuses
#: ``.volatile`` with ``.cv``).
SPIN_VOLATILE, SPIN_UNCACHED = 1, 2
_SPIN_UNCACHED: tl.constexpr = tl.constexpr(SPIN_UNCACHED)


def spin_kind(device: torch.device) -> int:
    """:data:`SPIN_UNCACHED` on an AMD GPU, else :data:`SPIN_VOLATILE` (the interpreter's too)."""
    if INTERPRET or device.type != "cuda":
        return SPIN_VOLATILE
    return SPIN_UNCACHED if tkdev.device_spec(device).is_amd else SPIN_VOLATILE


@triton.jit
def _spin_load(word_ptr, SPIN: tl.constexpr):
    """The barrier's word as a waiter reads it while spinning (:data:`SPIN_VOLATILE`)."""
    if SPIN == _SPIN_UNCACHED:
        word = tl.load(word_ptr + _BARRIER, volatile=True, cache_modifier=".cv")
    else:
        word = tl.load(word_ptr + _BARRIER, volatile=True)
    return word


@triton.jit
def grid_barrier(word_ptr, SPIN: tl.constexpr):
    """Wait until every program of this launch has arrived; what each wrote before
    arriving is visible to all after. ``word_ptr``: (WORDS,) int32 workspace (module
    docstring); ``SPIN``: how the waiters read it (:data:`SPIN_VOLATILE`). Every thread of
    the program calls it (the scalar atomics are one per program)."""
    nprog = tl.num_programs(0)
    tl.debug_barrier()  # every thread's stores issued before the program arrives
    arrival = tl.atomic_add(word_ptr + _BARRIER, 1, sem="acq_rel", scope="gpu")
    generation = arrival >> _COUNT_BITS
    if (arrival & _COUNT_MASK) == nprog - 1:
        # the last to arrive: the count back to 0 and the generation on, in one atomic
        tl.atomic_add(word_ptr + _BARRIER, (0 - nprog) + _GENERATION, sem="release", scope="gpu")
    else:
        seen = generation
        while seen == generation:
            while (_spin_load(word_ptr, SPIN) >> _COUNT_BITS) == generation:
                pass  # every thread spins on volatile loads: no atomics while waiting
            # then one read with acquire semantics, whose value decides the exit: an acquire
            # whose result went unused was dropped by triton 3.6 (an add of 0, folded away)
            seen = tl.atomic_add(word_ptr + _BARRIER, 0, sem="acquire", scope="gpu") >> _COUNT_BITS
    tl.debug_barrier()  # no thread goes on before the program has passed


@triton.jit
def last_to_finish(word_ptr):
    """True in the one program that arrives last at the ``FINISHED`` ticket (call it once
    per program, after its last read of what the winner then changes); the ticket is back
    at 0 for the next launch."""
    tl.debug_barrier()  # every thread's reads done before the program takes its ticket
    ticket = tl.atomic_add(word_ptr + _FINISHED, 1, sem="acq_rel", scope="gpu")
    last = ticket == tl.num_programs(0) - 1
    if last:
        tl.atomic_xchg(word_ptr + _FINISHED, 0, sem="relaxed", scope="gpu")
    return last


@dataclass(frozen=True)
class GridBarrier:
    """What a grid-wide launch meets at: ``word``, the (WORDS,) int32 workspace on the
    device (zero when made: :func:`new_grid_barrier`), and ``max_programs``, the most
    programs a launch over it may have (at most the device's SM count; 1 under the
    interpreter). One launch at a time per workspace (one stream)."""

    word: torch.Tensor
    max_programs: int


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors (compute units on AMD) of a GPU ``device``: its
    :class:`tkern.DeviceSpec`'s ``sms`` (asked of torch once per device)."""
    return tkdev.device_spec(device).sms


def device_programs(device: torch.device) -> int:
    """The most programs a grid barrier on ``device`` may hold: its SM count on CUDA
    compiled, 1 under the interpreter (programs run in turn), 0 elsewhere (none)."""
    if INTERPRET:
        return 1
    return sm_count(device) if device.type == "cuda" else 0


def new_grid_barrier(device: torch.device, max_programs: int | None = None) -> GridBarrier:
    """A zeroed workspace on ``device`` for launches of at most ``max_programs`` programs
    (default and bound: :func:`device_programs`)."""
    limit = device_programs(device)
    max_programs = limit if max_programs is None else max_programs
    barrier = GridBarrier(torch.zeros(WORDS, dtype=torch.int32, device=device), max_programs)
    check_programs(barrier, max_programs, device)
    return barrier


def check_programs(barrier: GridBarrier, programs: int, device: torch.device) -> None:
    """Raise ``ValueError`` unless a launch of ``programs`` programs on ``device`` can meet
    at ``barrier``: its workspace a (WORDS,) int32 contiguous tensor on ``device``, and
    1 <= programs <= its ``max_programs`` <= :func:`device_programs` (all co-resident;
    one under the interpreter, where a spin over several programs never ends)."""
    check_tensor("barrier.word", barrier.word, ndim=1, dtypes=(torch.int32,))
    if barrier.word.numel() != WORDS or barrier.word.device != device or not barrier.word.is_contiguous():
        raise ValueError(
            f"barrier.word must be a contiguous ({WORDS},) int32 tensor on {device}, "
            f"got shape {tuple(barrier.word.shape)} on {barrier.word.device}"
        )
    limit = min(device_programs(device), MAX_PROGRAMS)
    if not 1 <= programs <= barrier.max_programs <= limit:
        where = "under Triton's interpreter (programs run in turn)" if INTERPRET else f"on {device}"
        raise ValueError(
            f"a grid barrier {where} holds 1 to {limit} co-resident programs; got a launch of "
            f"{programs} with max_programs={barrier.max_programs}"
        )


#: Grid-wide launches are cooperative on CUDA (Triton's ``launch_cooperative_grid``: the
#: driver refuses a grid that cannot be co-resident rather than letting it spin forever).
#: CUDA graphs take cooperative kernel nodes; if a capture ever refused one, this is the
#: switch (the SM-count bound alone then keeps the programs co-resident).
COOPERATIVE = True


def launch_options() -> dict:
    """The launch options of a grid-wide launch (:data:`COOPERATIVE` on CUDA)."""
    return {} if INTERPRET else {"launch_cooperative_grid": COOPERATIVE}
