"""What every kernel family shares: the execution mode, input checks, launch
configuration helpers and the few ``@triton.jit`` helpers whose behaviour must
not depend on whether Triton runs compiled or interpreted.

Triton's interpreter (``TRITON_INTERPRET=1``) runs every kernel on CPU tensors,
so the whole library works and is tested on machines without a GPU. ``triton.jit``
picks interpreter or compiler when it decorates, so the mode is chosen here,
before any tkern kernel is decorated (every kernel module imports this one
first). When triton was imported before tkern on a machine without CUDA (by
``import lightning``, ``torch.compile``, a transformers model, or the user),
``triton.language``'s own ``@triton.jit`` helpers (``tl.sum``, ``tl.max``,
``tl.cdiv``, ...) were decorated for the compiler; :func:`_interpret_triton_language`
re-wraps them as the interpreter would have, so the import order does not matter.

What the interpreter gets wrong, and where tkern handles it (all here):

* bf16 arithmetic and bf16 ``tl.dot`` compute on raw bit patterns:
  ``UPCAST_BF16`` tells the GEMM to upcast bf16 tiles to fp32 before ``tl.dot``
  (exact, since a bf16 x bf16 product fits in fp32); elementwise kernels always
  upcast their loads to fp32 anyway.
* fp32 -> bf16 casts truncate instead of rounding to nearest even:
  :func:`cast_rne` rounds by hand under the interpreter.
* bf16 -> fp32 casts get subnormals wrong (triton 3.9's ``_convert_float``):
  :func:`to_f32` widens bf16 on the bits under the interpreter.
* ``@triton.autotune`` with several configs cannot run: :func:`autotune` keeps
  only the first config under the interpreter.

And what it does slowly: every call of a ``@triton.jit`` helper inside a kernel
(``tl.sum``, ``tl.cdiv``, tkern's own helpers), in every program, patches
``triton.language`` again, though the launch already patched it and restores it
when the program grid is done; for small kernels that is half of the interpreter's
time. :func:`_patch_language_once` makes the nested patch a no-op where the launch's
patch already covers the helper's modules, and :func:`_memoize_numpy_dtypes` keeps the
numpy dtype of each Triton type instead of rebuilding a table per element-wise op
(``TKERN_INTERPRETER_PATCH_ONCE=0`` turns both off). And it checks every int32 add,
subtract and multiply for overflow, which compiled kernels do only when built for
debugging: :func:`_interpret_without_overflow_checks` runs them as compiled
(``TKERN_INTERPRETER_SANITIZE_OVERFLOW=1`` keeps the checks).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import NamedTuple

import torch

_TRITON_FIRST = "triton" in sys.modules
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (the mode above must be chosen before triton.jit runs)
import triton.language as tl  # noqa: E402


def _interpret_triton_language() -> int:
    """Re-wrap every ``@triton.jit`` helper that triton's own modules decorated for
    the compiler as an interpreted function, wherever triton keeps a reference to
    it (module attributes and ``tl.tensor``'s member functions); the same object
    replaces every reference, so identity checks inside the interpreter
    (``combine_fn is tl.standard._sum_combine``) still hold. Returns how many
    helpers were re-wrapped. A no-op when nothing was decorated for the compiler."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, object] = {}

    def interpreted(value):
        if id(value) not in wrapped:
            wrapped[id(value)] = InterpretedFunction(value.fn)
        return wrapped[id(value)]

    owners = [m for n, m in list(sys.modules.items()) if m is not None and n.split(".")[0] == "triton"]
    for owner in [*owners, tl.tensor]:
        for name, value in list(vars(owner).items()):
            if isinstance(value, JITFunction):
                setattr(owner, name, interpreted(value))
    return len(wrapped)


#: True when kernels run through Triton's interpreter on the CPU.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if INTERPRET and _TRITON_FIRST:
    _interpret_triton_language()


def _patch_language_once() -> bool:
    """Patch ``triton.language`` once per launch under the interpreter, not once per
    jit-helper call: ``triton.runtime.interpreter``'s launch (``GridExecutor``) patches
    the language, runs every program and restores it; a device function called from a
    kernel (``InterpretedFunction.__call__``) patches it again on every call, in every
    program, and never restores that. Wrapped here, a helper's patch returns at once
    when the running launch already patched every language module the helper sees,
    and runs in full otherwise (then once per launch and module) or outside a launch.
    What runs is unchanged: the language a helper sees is the launch's patched one
    either way. Returns whether the
    wrappers were installed (False where this Triton's interpreter lacks the two names,
    or they are wrapped already)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None or getattr(original, "tkern_once", False):
        return False
    languages = (tl, getattr(tl, "core", tl))
    launches: list[frozenset[int] | None] = []  # per running launch: the modules its patch covers
    # per globals dict (a module's, kept alive here so that its id is never reused): its language modules
    modules_seen: dict[int, tuple[dict, frozenset[int]]] = {}

    def patch_lang(fn):
        known = modules_seen.get(id(fn.__globals__))
        if known is None:
            seen = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in languages))
            known = modules_seen[id(fn.__globals__)] = (fn.__globals__, seen)
        seen = known[1]
        if not launches:  # outside any launch: the interpreter's own behaviour
            return original(fn)
        if launches[-1] is None:  # the launch's own patch, restored by the launch
            scope = original(fn)
            launches[-1] = seen
            return scope
        if seen <= launches[-1]:
            return None
        # a helper seeing a language module the launch did not (tl.sum's module sees tl.core):
        # the interpreter's own patch, never restored, so it holds for the rest of the launch
        scope = original(fn)
        launches[-1] |= seen
        return scope

    run_grid = executor.__call__

    def run_patched_once(self, *args, **kwargs):
        launches.append(None)
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang.tkern_once = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = run_patched_once
    return True


def _memoize_numpy_dtypes() -> bool:
    """The interpreter's ``_get_np_dtype`` (a Triton type's numpy storage dtype) builds
    its 18-entry table on every call, thousands of times a launch; the answer depends
    on the element type alone (a block's, or a scalar's), so it is kept per element type.
    Returns whether the memo was installed (False where the name is missing or wrapped)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "tkern_memo", False):
        return False
    memo: dict = {}

    def get_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):  # unhashable; stored as uint64 addresses
            return original(element)
        found = memo.get(element)
        if found is None:
            found = memo[element] = original(element)
        return found

    get_np_dtype.tkern_memo = True
    interpreter._get_np_dtype = get_np_dtype
    return True


def _interpret_without_overflow_checks() -> bool:
    """Run the interpreter's integer arithmetic as a compiled kernel runs it: Triton's
    ``sanitize_overflow`` widens every int32 ``+``, ``-`` and ``*`` of a kernel (address
    arithmetic, mostly) to int64, compares it with int32's range and asserts; compiled,
    those asserts are removed unless the kernel is built with ``debug=True``, but the
    interpreter runs them, a third of a GEMM launch's time here. Turned off on the
    interpreter's builder; ``TKERN_INTERPRETER_SANITIZE_OVERFLOW=1`` keeps Triton's
    checks (to hunt an int32 overflow on the CPU). Returns whether the option was
    turned off (False where this Triton's interpreter lacks it)."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not getattr(options, "sanitize_overflow", False):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


if INTERPRET and os.environ.get("TKERN_INTERPRETER_PATCH_ONCE", "1") != "0":
    _patch_language_once()
    _memoize_numpy_dtypes()
if INTERPRET and os.environ.get("TKERN_INTERPRETER_SANITIZE_OVERFLOW", "0") in ("", "0"):
    _interpret_without_overflow_checks()

if INTERPRET:
    # numpy, which runs the interpreter's arithmetic, reports fp16 overflow (and
    # NaN/inf) in its casts; loss scaling provokes exactly that overflow on purpose,
    # and the fused kernels detect it and skip the step. Such a warning says nothing
    # to a user, so it is silenced where the interpreter raises it, and only there.
    warnings.filterwarnings(
        "ignore",
        message=r"(overflow|invalid value) encountered",
        category=RuntimeWarning,
        module=r"triton\.runtime\.interpreter",
    )

# The same flag, visible inside @triton.jit functions.
IS_INTERPRETER = tl.constexpr(INTERPRET)

#: dtypes a half-precision kernel input may have.
HALF_DTYPES = (torch.float16, torch.bfloat16)

_TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
}


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype matching a torch dtype (fp16, bf16 or fp32)."""
    return _TL_DTYPES[dtype]


def mode() -> str:
    """``"interpreted"`` (CPU, Triton's interpreter) or ``"compiled"`` (GPU)."""
    return "interpreted" if INTERPRET else "compiled"


#: ``TKERN_AUTOTUNE=0`` keeps each kernel to its first config when compiled too:
#: correctness runs (the test suite on a GPU) then compile one variant per
#: specialization instead of one per config.
AUTOTUNE: bool = os.environ.get("TKERN_AUTOTUNE", "1") != "0"


def autotune(configs: list[triton.Config], key: list[str]):
    """``triton.autotune`` over ``configs`` when compiled; the first config
    alone under the interpreter, which cannot benchmark (so list the one that
    suits small CPU problems first), or when :data:`AUTOTUNE` is off."""
    return triton.autotune(configs=configs if AUTOTUNE and not INTERPRET else configs[:1], key=key)


class DirectLaunch(NamedTuple):
    """How to launch an autotuned kernel's chosen config again without the
    autotuner: ``jit[grid](*args, **kwargs)``, where ``jit`` is the function under
    ``triton.autotune`` and ``triton.heuristics`` and ``kwargs`` holds the
    constexprs, the chosen config's meta-parameters and the heuristics' values.
    Valid while ``kernel`` (the autotuned object it came from) is the one a
    launcher would call and for arguments with the same autotune key."""

    kernel: object
    jit: object
    grid: tuple
    kwargs: dict


def resolve_launch(kernel, grid, args: tuple, meta: dict) -> DirectLaunch | None:
    """Launch ``kernel[grid](*args, **meta)`` (an autotuner over heuristics over a jit
    function) and return how to launch the config it chose directly, or None
    where that cannot be read off (a patched or stubbed kernel, a config with a
    pre-hook): Triton's autotuner and heuristics build dicts of every argument
    on each launch, which costs more host time than the launch itself, and
    their answer for one key never changes."""
    if not isinstance(kernel, triton.runtime.Autotuner) or not isinstance(
        kernel.fn, triton.runtime.Heuristics
    ):
        kernel[grid](*args, **meta)
        return None
    kernel.best_config = None  # set again by a launch that runs the autotuner (not a stub)
    kernel[grid](*args, **meta)
    config = kernel.best_config
    if config is None or config.pre_hook is not None:
        return None
    heuristics = kernel.fn
    kwargs = {**meta, **config.all_kwargs()}  # what the autotuner passes on (num_warps, ...)
    named = {**dict(zip(heuristics.arg_names, args, strict=False)), **kwargs}  # args, then meta
    kwargs.update({name: value(named) for name, value in heuristics.values.items()})
    return DirectLaunch(kernel, heuristics.fn, tuple(grid(kwargs)), kwargs)


# --------------------------------------------------------------------------- checks


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``t`` is a dense
    tensor with ``ndim`` dimensions, a dtype in ``dtypes`` and (when given) the
    ``shape``, on a device the current mode can run on."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {_describe(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        expected = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({expected}), got {_describe(t)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {_describe(t)}")
    if not INTERPRET and t.device.type != "cuda":
        raise ValueError(
            f"{name} is on device {t.device}, but tkern runs compiled kernels on CUDA tensors; "
            "set TRITON_INTERPRET=1 before importing tkern to run on the CPU"
        )
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless all given (non-None) tensors share one device."""
    named = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on one device"
            )


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """Cast fp32 ``x`` to ``DTYPE`` rounding to nearest even, as torch does.

    Compiled Triton already rounds this way. The interpreter truncates on
    fp32 -> bf16, so there the rounding is done on the bits: add 0x7FFF plus the
    lowest kept bit, then drop the low 16 bits. Infinities and the canonical
    NaN (0x7FC00000, what arithmetic produces) come through unchanged.
    """
    if IS_INTERPRETER and tl.bfloat16 == DTYPE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def to_f32(x):
    """``x`` (fp32, fp16 or bf16) as fp32, exactly. Compiled Triton widens exactly; the
    interpreter (triton 3.9) turns bf16 subnormals into other values, so there a bf16
    value is widened on its bits (its 16 bits are fp32's high half)."""
    if IS_INTERPRETER and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def one_minus_pow(t, ln_beta):
    """1 - beta ** t, as -expm1(t * ln(beta)) with Kahan's accurate expm1:
    1 - exp(x) in fp32 would cancel to a few correct bits when beta ** t ~ 1
    (1 - 0.999 ** 1), and a bias correction would be off by ~1e-4. Used by
    Adam's bias corrections and the log-normal loss scaler's."""
    x = t * ln_beta
    u = tl.exp(x)
    um1 = u - 1.0
    # um1 == 0: |x| below fp32's spacing at 1, expm1(x) = x; um1 == -1: beta ** t
    # underflowed (or beta = 0), expm1 = -1; else (u - 1) * x / ln(u) cancels
    # the rounding error of exp.
    safe_log = tl.where((um1 == 0.0) | (um1 == -1.0), 1.0, tl.log(u))
    expm1 = tl.where(um1 == 0.0, x, tl.where(um1 == -1.0, -1.0, um1 * x / safe_log))
    return -expm1


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of two ints, for the launchers' grids on the host: ``triton.cdiv``
    is a ConstexprFunction there, whose call costs ~2 us of host time per launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (an int >= 0; 0 for 0, as Triton's), for the
    launchers' block sizes on the host: ``triton.next_power_of_2`` is a ConstexprFunction
    there, whose call costs ~2 us per launch, as :func:`cdiv`'s."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def ln_beta(beta: float) -> float:
    """ln(beta) in float64 for :func:`one_minus_pow` (-inf for beta = 0)."""
    return math.log(beta) if beta > 0 else float("-inf")


@triton.jit
def block_offsets(BLOCK: tl.constexpr):
    """This program's BLOCK element offsets in a 1-D launch, as int64: a flat
    buffer of 2^31 elements or more would overflow int32 offsets."""
    return tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)


INT32_MAX = 2**31 - 1


def _check_int32_reach(name: str, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
    reach = sum((size - 1) * abs(stride) for size, stride in zip(shape, strides, strict=True) if size)
    if reach > INT32_MAX:
        raise ValueError(
            f"{name} (shape {tuple(shape)}, strides {tuple(strides)}) spans {reach + 1} elements; "
            f"this kernel indexes with int32 offsets and supports at most {INT32_MAX + 1}"
        )


def check_int32_addressable(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` if an element of ``t`` lies 2^31 or more elements
    from its first: kernels that index it with int32 offsets would wrap around."""
    _check_int32_reach(name, tuple(t.shape), t.stride())


def check_int32_elements(name: str, shape: tuple[int, ...]) -> None:
    """:func:`check_int32_addressable` for a new contiguous tensor of ``shape``,
    without building one (not even on the meta device)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    _check_int32_reach(name, tuple(shape), tuple(reversed(strides)))


@triton.jit
def load_or_value(x, ON_DEVICE: tl.constexpr):
    """``x`` itself (a scalar argument) or, when ``ON_DEVICE``, the fp32 value
    it points to: a hyperparameter such as the learning rate may live in a (1,)
    device tensor, read by the kernel so that changing it needs no host sync."""
    if ON_DEVICE:
        return tl.load(x).to(tl.float32)
    else:
        return x


#: Elements per vector access: Triton specialises an integer argument divisible
#: by 16 (and a 16-byte aligned pointer), and only then can it prove that a
#: masked access covers whole 16-byte vectors.
ALIGN_ELEMENTS = 16


def aligned_split(n: int) -> tuple[int, int]:
    """``(head, tail)`` with ``head + tail == n``, ``head`` a multiple of
    :data:`ALIGN_ELEMENTS` and ``tail`` smaller than it. Launchers run the head
    (vectorised) and the tail (a second tiny launch on the offset views) apart,
    so a length that is not a multiple of 16 does not make every access scalar."""
    tail = n % ALIGN_ELEMENTS
    return n - tail, tail


def aligned_slices(n: int) -> list[slice]:
    """The launches :func:`aligned_split` asks for, as slices of an n-element
    buffer: the head and the tail, each only if it is not empty (none for n == 0).
    Every launcher that splits its buffers this way takes its runs from here."""
    head, tail = aligned_split(n)
    return [s for s, size in ((slice(0, head), head), (slice(head, n), tail)) if size]
