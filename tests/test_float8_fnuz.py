"""fp8 in gfx942's FNUZ formats (``float8_e4m3fnuz``, max 240; ``float8_e5m2fnuz``): the
casts bit for bit torchao's (and torch's own cast for zeros, subnormals and NaN), the
per-tensor, per-row and blockwise GEMMs against float64, the two families never mixed,
MX kept OCP, and a recipe on an MI300X spec picking the FNUZ formats.

References: torchao's ``tensor_to_scale`` / ``to_fp8_saturated`` (which read the
format's max from ``torch.finfo``, so 240 for e4m3fnuz), torch's ``Tensor.to`` for the
rounding of single values, float64 products of the dequantized operands.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, dequantized
from test_float8 import assert_gemm_close, bits, emulate_blocks, quantize_b, reference, sample

import tkern
from tkern.kernels import float8 as f8
from tkern.kernels.float8 import FP8_MAX

torchao_utils = pytest.importorskip("torchao.float8.float8_utils")

E4, E5 = torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
HIGH = [torch.float32, torch.bfloat16]


def test_fnuz_ranges_are_torchs():
    assert FP8_MAX[E4] == 240.0 == torch.finfo(E4).max
    assert FP8_MAX[E5] == 57344.0 == torch.finfo(E5).max


@pytest.mark.parametrize("fp8", [E4, E5])
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("shape", [(37, 53), (3, 4, 17)])
def test_tensorwise_fnuz_is_torchaos_cast_bit_for_bit(fp8, dtype, shape):
    x = sample(shape, dtype)
    data, scale = tkern.to_float8(x, fp8)
    ref_mult = torchao_utils.tensor_to_scale(x, fp8)
    ref = torchao_utils.to_fp8_saturated(x.float() * ref_mult, fp8)
    assert data.dtype == fp8 and data.shape == x.shape
    assert torch.equal(bits(data), bits(ref))
    assert torch.equal(scale, ref_mult.reciprocal())


@pytest.mark.parametrize("fp8", [E4, E5])
@pytest.mark.parametrize("granularity", ["row", (1, 128), (128, 128)])
def test_rows_and_blocks_in_fnuz_match_the_float64_emulation(fp8, granularity):
    x = sample((130, 300), torch.float32, seed=3)
    data, scale = tkern.to_float8(x, fp8, granularity)
    block = (1, 300) if granularity == "row" else granularity
    ref, ref_scale = emulate_blocks(x, fp8, *block)
    assert torch.equal(bits(data.cpu()), bits(ref))
    assert torch.equal(scale.cpu().reshape(ref_scale.shape), ref_scale)


@pytest.mark.parametrize("fp8", [E4, E5])
def test_fnuz_specials_are_torchs_cast(fp8):
    """-0.0 is +0 (FNUZ has no negative zero: 0x80 is its NaN), subnormals round to
    nearest even on FNUZ's grid (bias one more than OCP's), past the range saturates; with
    the multiplier 1 (a row whose amax is the format's max)."""
    mx = FP8_MAX[fp8]
    tiny = 2.0 ** (-10 if fp8 == E4 else -17)  # FNUZ's smallest subnormal
    row = [mx, -0.0, 0.0, -tiny, tiny * 0.5, tiny * 1.5, tiny * 0.49, 3.9460067749023438, -0.9416, 1e-30]
    x = torch.tensor([row], device=DEVICE)
    data, scale = tkern.to_float8(x, fp8, "row")
    assert scale.item() == 1.0
    expect = x.cpu().to(fp8)  # torch's own cast: the multiplier is 1, nothing to clamp
    assert torch.equal(bits(data.cpu()), bits(expect)) and bits(data)[0, 1].item() == 0
    over = tkern.to_float8(torch.tensor([[1.0, 3.0]], device=DEVICE), fp8, (1, 1))[0]  # x * mult == max
    assert over.float().abs().max().item() == mx


@pytest.mark.parametrize(("fa", "fb"), [(E4, E4), (E5, E4), (E4, E5)])
@pytest.mark.parametrize(
    ("ga", "gb", "block_a", "block_b"),
    [
        ("tensor", "tensor", None, None),
        ("row", "col", None, None),
        ((1, 128), (128, 128), (1, 128), (128, 128)),
    ],
)
def test_scaled_mm_on_fnuz_operands_matches_float64(fa, fb, ga, gb, block_a, block_b):
    M, N, K = 37, 45, 300
    x, w = sample((M, K), torch.float32, seed=4), sample((K, N), torch.float32, seed=5)
    a, sa = tkern.to_float8(x, fa, ga)
    b, sb = quantize_b(w, fb, gb)
    out = tkern.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert_gemm_close(out, reference(a, b, sa, sb, block_a, block_b), K, torch.float32)


@pytest.mark.parametrize(
    ("da", "db", "words"),
    [
        (E5, E5, "cannot both be torch.float8_e5m2fnuz"),
        (torch.float8_e4m3fn, E4, "both be OCP fp8 or both FNUZ"),
        (E4, torch.float8_e5m2, "both be OCP fp8 or both FNUZ"),
    ],
)
def test_pairs_no_tensor_core_takes_are_refused_by_name(da, db, words):
    one = torch.ones(16, 16, device=DEVICE)
    a, sa = tkern.to_float8(one, da)
    b, sb = tkern.to_float8(one, db)
    with pytest.raises(TypeError, match=words):
        tkern.scaled_mm(a, b, sa, sb)


def test_mx_stays_ocp():
    with pytest.raises(TypeError, match="float8_e4m3fn or torch.float8_e5m2, got torch.float8_e4m3fnuz"):
        tkern.to_mx(torch.ones(4, 32, device=DEVICE), E4)


def test_recipes_take_the_devices_native_formats():
    from tkern.device import device_spec

    ocp = (torch.float8_e4m3fn, torch.float8_e5m2)
    assert f8.native_formats("cpu", ocp) == ocp
    mi300x, h100, mi355x = device_spec("mi300x"), device_spec("h100"), device_spec("mi355x")
    assert f8.fp8_refusal(mi300x, "x", (E4, E5)) is None
    reason = f8.fp8_refusal(h100, "Float8Linear('tensorwise')", (E4, E5))
    assert "h100" in reason and "float8_e4m3fnuz" in reason and "float8_e4m3fn," in reason
    assert f8.fp8_refusal(mi355x, "x", (E4,)) is not None


@pytest.fixture
def on_mi300x(monkeypatch, scaled_mm_calls):
    """tkern's fp8 code asked about the GPU (``float8.compiled_spec``, its one seam) answers
    for an MI300X: the kernels run here, under the interpreter, in gfx942's formats."""
    from tkern.device import device_spec

    monkeypatch.setattr(f8, "compiled_spec", lambda device: device_spec("mi300x"))
    return scaled_mm_calls


@pytest.mark.parametrize(("recipe", "grad"), [("tensorwise", E5), ("delayed", E5), ("blockwise", E4)])
def test_float8_linear_on_an_mi300x_multiplies_fnuz(recipe, grad, on_mi300x):
    """Float8Linear picks the device's native formats: on an MI300X x and W in e4m3fnuz and
    dY in e5m2fnuz (e4m3fnuz under blockwise), every GEMM's operands FNUZ, and the output
    and dX the float64 products of those operands (dequantized) within one bf16 rounding."""
    torch.manual_seed(0)
    layer = tkern.nn.Float8Linear(64, 32, recipe=recipe, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(48, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    fwd, dgrad, wgrad = on_mi300x
    assert (fwd[0].dtype, fwd[1].dtype) == (E4, E4)
    assert (dgrad[0].dtype, dgrad[1].dtype) == (grad, E4) and (wgrad[0].dtype, wgrad[1].dtype) == (grad, E4)
    for (a, b, sa, sb, ba, bb), got in ((fwd, y), (dgrad, x.grad)):
        ref = dequantized(a, sa, ba) @ dequantized(b, sb, bb)
        if got is y:
            ref = ref + layer.bias.double()
        err = (got.double() - ref).abs()  # fp32 sums of exact products, one bf16 rounding
        assert (err <= 2.0**-8 * ref.abs() + 64 * 2.0**-24 * ref.abs().max()).all(), err.max().item()
    if recipe == "tensorwise":  # the cast: torchao's, in the device's format
        data, scale = tkern.to_float8(x.detach(), E4)
        assert torch.equal(bits(fwd[0]), bits(data)) and torch.equal(fwd[2].reshape(()), scale)


def test_the_optimizer_casts_the_weight_to_fnuz_on_an_mi300x(on_mi300x):
    """The fused optimizer's fp8 weight cache casts in the device's format too (e4m3fnuz), and
    the forward reads that cast: the same output as casting in the forward."""
    from tkern.functional import float8_weight_cache

    torch.manual_seed(0)
    cached = tkern.nn.Float8Linear(32, 16, device=DEVICE)
    plain = tkern.nn.Float8Linear(32, 16, device=DEVICE)
    plain.load_state_dict(cached.state_dict())
    float8_weight_cache(plain.weight, register=False)
    opts = [tkern.optim.FusedAdamW(m.parameters(), lr=1e-2) for m in (cached, plain)]
    x = torch.randn(8, 32, device=DEVICE).to(torch.bfloat16)
    for _ in range(2):
        outs = []
        for model, opt in zip((cached, plain), opts, strict=True):
            opt.zero_grad()
            y = model(x.to(model.weight.dtype))
            y.float().square().mean().backward()
            opt.step()
            outs.append(y)
        assert torch.equal(outs[0], outs[1])
    data, scale = float8_weight_cache(cached.weight).lookup(cached.weight)
    ref, ref_scale = tkern.to_float8(cached.weight.detach(), E4)
    assert data.dtype == E4 and torch.equal(bits(data), bits(ref)) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2, E4, E5])
@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 2)])
def test_a_non_finite_input_reaches_the_fp8_output_as_nan(fp8, granularity):
    """torchao's clamp keeps a NaN, and an inf's block scales by fp8_max / inf = 0, so
    inf * 0 is NaN: a gradient that overflowed under fp16 loss scaling stays non-finite
    through the casts and the fp8 GEMM, where the scaler's overflow check finds it (a
    plain min / max would have returned ±fp8_max, a finite value). The finite values of
    a block whose amax is inf are zeros, as torchao's cast gives them."""
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0], [1.0, -0.0, 2.0, 3.0]], device=DEVICE)
    data, scale = tkern.to_float8(x, fp8, granularity)
    got = data.float().cpu()
    assert got[0, :3].isnan().all() and got[0, 3] == 0
    assert torch.isfinite(got[1]).all()
    ones = torch.ones(4, 8, device=DEVICE)
    b, sb = tkern.to_float8(
        ones, torch.float8_e4m3fn if fp8 in (torch.float8_e4m3fn, torch.float8_e5m2) else E4
    )
    a, sa = tkern.to_float8(x, fp8)
    if fp8 in (torch.float8_e5m2, E5):
        a, sa = tkern.to_float8(x, E4 if fp8 == E5 else torch.float8_e4m3fn)
    out = tkern.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert not torch.isfinite(out[0]).any()  # NaN on a GPU; non-finite here too
