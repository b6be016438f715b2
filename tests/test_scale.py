"""The loss-scale update kernel's launcher (scale.py): its input checks (the
scalers' behaviour is tests/test_amp*.py's)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from tkern.kernels import scale as K


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def test_update_scale_checks_its_inputs():
    with pytest.raises(ValueError, match=r"state must be \(11,\) and stats \(3,\)"):
        K.update_scale(t(5), t(3), scheme=K.DYNAMIC, min_scale=1.0, max_scale=2.0)
    with pytest.raises(ValueError, match="scheme must be STATIC, DYNAMIC or LOGNORMAL"):
        K.update_scale(t(K.STATE_SIZE), t(3), scheme=7, min_scale=1.0, max_scale=2.0)


def test_update_scale_needs_its_schemes_arguments_before_any_launch():
    state = t(K.STATE_SIZE)
    with pytest.raises(TypeError, match="needs growth_factor, backoff_factor, growth_interval, hysteresis"):
        K.update_scale(state, t(3), scheme=K.DYNAMIC, min_scale=1.0, max_scale=2.0)
    with pytest.raises(TypeError, match="needs beta2, log_max"):
        K.update_scale(state, t(3), scheme=K.LOGNORMAL, min_scale=1.0, max_scale=2.0, beta1=0.9,
                       overflow_std_dev=3.0)  # fmt: skip
    assert torch.equal(state, t(K.STATE_SIZE))  # nothing launched, nothing written
