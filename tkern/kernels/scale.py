"""The loss-scale update, one tiny launch on the device per step.

A loss scaler keeps its whole state in one fp32 vector on the device (layout
below), so that ``update()`` is a single one-program kernel that reads the
optimizer's statistics (``[found_inf, sum of squares, max |g|]``, see
:mod:`tkern.kernels.overflow`) and never waits for the host. Counters are
held in fp32, exact up to 2^24.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern.kernels._common import check_tensor, ln_beta, one_minus_pow
from tkern.kernels.overflow import N_STATS, found_inf, grad_amax

# State vector layout, shared by every scheme.
SCALE = 0  # the loss scale S
INV_SCALE = 1  # 1 / S, what the optimizer multiplies the gradients by
SKIPPED = 2  # steps skipped so far
STREAK = 3  # consecutive overflowing steps taken at the minimum scale
LAST_LOSS = 4  # last finite loss seen by scale(); written by the scaler, not here
# dynamic
GROWTH_TRACKER = 5  # clean steps since the last growth or overflow
HYSTERESIS_LEFT = 6  # overflows still tolerated before the next backoff
# log-normal (OpenSeq2Seq's LogMaxScaler): EMAs of x = log2(max |g|)
X_HAT = 7
SLOW_X_HAT = 8
XSQ_HAT = 9
N_OBSERVED = 10  # informative updates so far (the EMAs' bias-correction exponent)
STATE_SIZE = 11

STATIC, DYNAMIC, LOGNORMAL = 0, 1, 2

_SCALE: tl.constexpr = tl.constexpr(SCALE)
_INV_SCALE: tl.constexpr = tl.constexpr(INV_SCALE)
_SKIPPED: tl.constexpr = tl.constexpr(SKIPPED)
_STREAK: tl.constexpr = tl.constexpr(STREAK)
_GROWTH_TRACKER: tl.constexpr = tl.constexpr(GROWTH_TRACKER)
_HYSTERESIS_LEFT: tl.constexpr = tl.constexpr(HYSTERESIS_LEFT)
_X_HAT: tl.constexpr = tl.constexpr(X_HAT)
_SLOW_X_HAT: tl.constexpr = tl.constexpr(SLOW_X_HAT)
_XSQ_HAT: tl.constexpr = tl.constexpr(XSQ_HAT)
_N_OBSERVED: tl.constexpr = tl.constexpr(N_OBSERVED)
_DYNAMIC: tl.constexpr = tl.constexpr(DYNAMIC)
_LOGNORMAL: tl.constexpr = tl.constexpr(LOGNORMAL)
_FP32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _update_scale_kernel(
    state_ptr,  # (STATE_SIZE,) fp32 scaler state, updated in place
    stats_ptr,  # (3,) fp32 [found_inf, sum of squares, max |g|] of the unscaled gradients
    min_scale,  # the floor: never back off below it
    max_scale,  # the ceiling: never grow past it
    # dynamic (torch.amp.GradScaler + DeepSpeed hysteresis)
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
    # log-normal (OpenSeq2Seq LogMaxScaler); 1 - beta and ln(beta) formed in float64
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    ln_beta1,
    ln_beta2,
    log_max,
    overflow_std_dev,
    SCHEME: tl.constexpr,  # 0 static, 1 dynamic, 2 log-normal
):
    """One program: the loss scale's update from the step's statistics, in place in the
    scaler's device state (grow, back off, hysteresis), with no host sync."""
    found = found_inf(stats_ptr)
    scale = tl.load(state_ptr + _SCALE)
    at_floor = scale <= min_scale
    skipped = tl.load(state_ptr + _SKIPPED)
    streak = tl.load(state_ptr + _STREAK)
    tl.store(state_ptr + _SKIPPED, tl.where(found, skipped + 1.0, skipped))
    tl.store(state_ptr + _STREAK, tl.where(found & at_floor, streak + 1.0, 0.0))

    if SCHEME == _DYNAMIC:
        tracker = tl.load(state_ptr + _GROWTH_TRACKER)
        left = tl.load(state_ptr + _HYSTERESIS_LEFT)
        # Overflow: lower S at the hysteresis-th overflow since the last growth
        # (DeepSpeed: the counter refills only when S grows); with hysteresis 1,
        # at every overflow, as GradScaler does.
        backoff = found & (left <= 1.0)
        backed_off = tl.maximum(scale * backoff_factor, min_scale)
        # Clean step: grow every growth_interval clean steps, as GradScaler
        # (which keeps S when the grown value is not finite), capped at max_scale.
        tracker = tl.where(found, 0.0, tracker + 1.0)
        grow = tracker == growth_interval
        grown = scale * growth_factor
        grown = tl.where(grown <= _FP32_MAX, tl.minimum(grown, max_scale), scale)
        new_scale = tl.where(backoff, backed_off, tl.where(grow, grown, scale))
        tl.store(state_ptr + _GROWTH_TRACKER, tl.where(grow, 0.0, tracker))
        left = tl.where(found & (left > 1.0), left - 1.0, tl.where(grow, hysteresis, left))
        tl.store(state_ptr + _HYSTERESIS_LEFT, left)
    elif SCHEME == _LOGNORMAL:
        amax = grad_amax(stats_ptr)
        # x = log2(max |g|). An overflowing step only tells that max |g| * S
        # reached 2 ** log_max: it is recorded as one bit above that bound,
        # x = log_max - log2(S) + 1. (OpenSeq2Seq records x = 2 ** log_max, i.e.
        # 65536 as a log2 value, which pins S at scale_min for the ~10^4 steps
        # the x^2 EMA takes to forget it.) An all-zero gradient carries no
        # information (log2 0 = -inf would poison the EMAs): nothing is updated.
        informative = found | (amax > 0.0)
        censored = log_max - tl.log2(scale) + 1.0
        x = tl.where(found, censored, tl.log2(tl.where(amax > 0.0, amax, 1.0)))
        x_hat = tl.load(state_ptr + _X_HAT)
        slow_x_hat = tl.load(state_ptr + _SLOW_X_HAT)
        xsq_hat = tl.load(state_ptr + _XSQ_HAT)
        n_observed = tl.load(state_ptr + _N_OBSERVED)
        x_hat = tl.where(informative, beta1 * x_hat + one_minus_beta1 * x, x_hat)
        slow_x_hat = tl.where(informative, beta2 * slow_x_hat + one_minus_beta2 * x, slow_x_hat)
        xsq_hat = tl.where(informative, beta2 * xsq_hat + one_minus_beta2 * (x * x), xsq_hat)
        n_observed = tl.where(informative, n_observed + 1.0, n_observed)
        tl.store(state_ptr + _X_HAT, x_hat)
        tl.store(state_ptr + _SLOW_X_HAT, slow_x_hat)
        tl.store(state_ptr + _XSQ_HAT, xsq_hat)
        tl.store(state_ptr + _N_OBSERVED, n_observed)
        # Bias corrections 1 - beta ** n, accurate in fp32 (a running product of
        # betas drifts by n ulps, and 1 - beta2 ** n ~ 1e-3 n magnifies that).
        b1_correction = one_minus_pow(tl.maximum(n_observed, 1.0), ln_beta1)
        b2_correction = one_minus_pow(tl.maximum(n_observed, 1.0), ln_beta2)
        mu = x_hat / b1_correction
        slow_mu = slow_x_hat / b2_correction
        sigma = tl.sqrt(tl.maximum(xsq_hat / b2_correction - slow_mu * slow_mu, 0.0))
        proposed = tl.exp2(log_max - (mu + overflow_std_dev * sigma))
        proposed = tl.minimum(tl.maximum(proposed, min_scale), max_scale)
        new_scale = tl.where(informative, proposed, scale)
    else:
        new_scale = scale
    tl.store(state_ptr + _SCALE, new_scale)
    tl.store(state_ptr + _INV_SCALE, 1.0 / new_scale)


#: Placeholders for the arguments a scheme does not read (0.0 for the others).
_UNUSED = {"beta1": 0.5, "beta2": 0.5}

#: The arguments each scheme reads; their defaults live once, in :mod:`tkern.amp`.
SCHEME_ARGS = {
    STATIC: (),
    DYNAMIC: ("growth_factor", "backoff_factor", "growth_interval", "hysteresis"),
    LOGNORMAL: ("beta1", "beta2", "log_max", "overflow_std_dev"),
}


def update_scale(
    state: torch.Tensor,
    stats: torch.Tensor,
    *,
    scheme: int,
    min_scale: float,
    max_scale: float,
    growth_factor: float | None = None,
    backoff_factor: float | None = None,
    growth_interval: int | None = None,
    hysteresis: int | None = None,
    beta1: float | None = None,
    beta2: float | None = None,
    log_max: float | None = None,
    overflow_std_dev: float | None = None,
) -> None:
    """Update a scaler's ``state`` vector in place from one step's ``stats``.

    Args:
        state: (STATE_SIZE,) fp32 scaler state (layout in this module).
        stats: (3,) fp32 ``[found_inf, sum of squares, max |g|]``, same device.
        scheme: STATIC, DYNAMIC or LOGNORMAL. The scheme's own arguments
            (:data:`SCHEME_ARGS`) are required, the others unused; they mean what
            the scalers of :mod:`tkern.amp` (which hold the defaults) say.
    """
    check_tensor("state", state, ndim=1, dtypes=(torch.float32,))
    check_tensor("stats", stats, ndim=1, dtypes=(torch.float32,))
    if state.numel() != STATE_SIZE or stats.numel() != N_STATS or stats.device != state.device:
        raise ValueError(
            f"state must be ({STATE_SIZE},) and stats ({N_STATS},) on one device, got "
            f"{tuple(state.shape)} on {state.device} and {tuple(stats.shape)} on {stats.device}"
        )
    if scheme not in (STATIC, DYNAMIC, LOGNORMAL):
        raise ValueError(f"scheme must be STATIC, DYNAMIC or LOGNORMAL (0, 1, 2), got {scheme!r}")
    given = {
        "growth_factor": growth_factor, "backoff_factor": backoff_factor, "growth_interval": growth_interval,
        "hysteresis": hysteresis, "beta1": beta1, "beta2": beta2, "log_max": log_max,
        "overflow_std_dev": overflow_std_dev,
    }  # fmt: skip
    missing = [name for name in SCHEME_ARGS[scheme] if given[name] is None]
    if missing:
        raise TypeError(f"update_scale: scheme {scheme} needs {', '.join(missing)}")
    # the kernel compiles out what a scheme does not read: placeholders there
    # (the betas' placeholder has a finite logarithm)
    v = {k: float(val) if val is not None else _UNUSED.get(k, 0.0) for k, val in given.items()}
    beta1, beta2 = v["beta1"], v["beta2"]
    _update_scale_kernel[(1,)](
        state, stats, min_scale, max_scale,
        v["growth_factor"], v["backoff_factor"], v["growth_interval"], v["hysteresis"],
        beta1, beta2, 1.0 - beta1, 1.0 - beta2, ln_beta(beta1), ln_beta(beta2),
        v["log_max"], v["overflow_std_dev"],
        SCHEME=scheme,
    )  # fmt: skip
