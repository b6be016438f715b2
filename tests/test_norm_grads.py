"""LayerNorm / RMSNorm parameter gradients from one launch (issue 54): the backward's
per-program fp32 partial sums reduced over the programs in a fixed order by
``_norm_param_grads_kernel``, dweight and dbias together, written into new tensors, or
into a fused optimizer's flat gradient views (``tkern.ops.common.flat_wgrad``'s rules),
where it adds them to the gradient already there (fp32, one rounding) and hands autograd
that memory, so AccumulateGrad adds nothing.

Reference: float64 torch on the same (rounded) inputs. Tolerance (:func:`bound`): dweight
= sum over M rows of dy * xhat is summed in fp32, within (M - 1) * 2^-24 * sum|dy * xhat|
of the exact sum (recursive summation, Higham), each term carrying xhat's own fp32 error
(mean and rstd in fp32: a few 2^-24 relative, 16 allowed); then one rounding to the
parameter's dtype, u * |ref| (u: 2^-24, fp16 2^-11, bf16 2^-8). Gradient accumulation
into the flat buffer keeps the sum of two backwards in fp32 and rounds it once: the same
bound over both passes' terms, one u * |ref|.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from torch.utils._python_dispatch import TorchDispatchMode

import tkern
from tkern.flat import grad_is_flat_view
from tkern.kernels import norm as knorm
from tkern.ops.norm import rms_norm_eps
from tkern.optim import FusedAdamW

HALF = [torch.float16, torch.bfloat16]
#: unit roundoff of the parameter's dtype
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
#: fp32 error of each term dy * xhat, in units of 2^-24 of |dy * xhat| (see the module docstring)
TERM_ULPS = 16
#: hidden sizes: one element, ragged sizes over one and several reduction programs
#: (512 columns a program under the interpreter), one row wider than MAX_BLOCK (chunked)
SIZES = [1, 100, 1500, knorm.MAX_BLOCK + 9]


def bound(ref: torch.Tensor, scale: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The elementwise bound on |got - ref| (module docstring): ``scale`` = sum of |terms|."""
    return (rows - 1 + TERM_ULPS) * 2.0**-24 * scale + UNIT[dtype] * ref.abs()


def reference(kind: str, x: torch.Tensor, dy: torch.Tensor, eps: float) -> tuple:
    """float64 (dweight, dbias, sum |dy * xhat|, sum |dy|) over the rows of (rounded) x, dy."""
    x, dy = x.double().reshape(-1, x.shape[-1]), dy.double().reshape(-1, x.shape[-1])
    xc = x if kind == "rms" else x - x.mean(-1, keepdim=True)
    xhat = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    return (dy * xhat).sum(0), dy.sum(0), (dy * xhat).abs().sum(0), dy.abs().sum(0)


def module(kind: str, n: int, param_dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    m = tkern.nn.LayerNorm(n) if kind == "ln" else tkern.nn.RMSNorm(n)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1 + 0.5 * torch.randn_like(p))
    return m.to(device=DEVICE, dtype=param_dtype)


def data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(device=DEVICE, dtype=dtype) for _ in range(2))


def check(kind, m, x_dy_pairs):
    """The module's .grad against the float64 sums over every (x, dy) pair's rows."""
    eps = m.eps if kind == "ln" else rms_norm_eps(m.eps)
    refs = [reference(kind, x, dy, eps) for x, dy in x_dy_pairs]
    rows = sum(x.numel() // x.shape[-1] for x, _ in x_dy_pairs)
    for i, p in enumerate([m.weight] + ([m.bias] if kind == "ln" else [])):
        ref = sum(r[i] for r in refs)
        scale = sum(r[2 + i] for r in refs)
        err = (p.grad.double().cpu() - ref.cpu()).abs()
        tol = bound(ref.cpu(), scale.cpu(), rows, p.dtype)
        assert (err <= tol).all(), (i, (err - tol).max().item())


@pytest.mark.parametrize("kind", ["ln", "rms"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("flat", [False, True], ids=["plain", "flat"])
def test_param_grads_match_float64(kind, dtype, n, flat, wgrad_counts):
    m = module(kind, n, torch.float32)
    opt = FusedAdamW(m.parameters()) if flat else None  # noqa: F841 (its flat buffer kept)
    x, dy = data((3, 5, n), dtype, 1)
    m(x).backward(dy)
    check(kind, m, [(x, dy)])
    params = list(m.parameters())
    assert wgrad_counts == {"into": len(params) if flat else 0, "copies": 0}
    assert all(grad_is_flat_view(p) == flat for p in params)


@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("kind", ["ln", "rms"])
@pytest.mark.parametrize("param_dtype", ["fp32", "x's"])
def test_several_partial_rows_and_the_inputs_dtype(programs, kind, param_dtype, monkeypatch):
    # P partial rows from _INTERPRET_PROGRAMS backward programs (more than one tile of the
    # reduction's rows at 7), over 1500 columns (three reduction programs, the last ragged)
    monkeypatch.setattr(knorm, "_INTERPRET_PROGRAMS", programs)
    dtype = torch.bfloat16
    m = module(kind, 1500, torch.float32 if param_dtype == "fp32" else dtype)
    opt = FusedAdamW(m.parameters())  # noqa: F841
    x, dy = data((9, 1500), dtype, 2)
    m(x).backward(dy)
    check(kind, m, [(x, dy)])


@pytest.mark.parametrize("kind", ["ln", "rms"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_two_backwards_accumulate_with_one_rounding(kind, dtype, wgrad_counts):
    # params of the input's dtype: AccumulateGrad would round each pass's gradient, then
    # their sum (two roundings); the kernel adds in fp32 and rounds once
    m = module(kind, 100, dtype)
    opt = FusedAdamW(m.parameters())  # noqa: F841
    pairs = [data((4, 6, 100), dtype, s) for s in (3, 4)]
    for x, dy in pairs:
        m(x).backward(dy)
    check(kind, m, pairs)
    assert wgrad_counts == {"into": 2 * len(list(m.parameters())), "copies": 0}
    assert all(grad_is_flat_view(p) for p in m.parameters())


def test_a_weight_used_twice_in_one_graph_sums_both_uses(wgrad_counts):
    m = module("ln", 100, torch.float32)
    opt = FusedAdamW(m.parameters())  # noqa: F841
    (x1, dy1), (x2, dy2) = data((4, 100), torch.float16, 5), data((4, 100), torch.float16, 6)
    for _ in range(2):  # into a zeroed buffer, then accumulated
        (m(x1).float() * dy1.float() + m(x2).float() * dy2.float()).sum().backward()
    check("ln", m, [(x1, dy1), (x2, dy2)] * 2)
    # each backward: the first node reached puts weight's and bias's share into the views,
    # the other finds them taken and returns its share, which autograd adds
    assert wgrad_counts["into"] == 2 * 2
    assert all(grad_is_flat_view(p) for p in m.parameters())


def test_a_tensor_hook_on_the_weight_refuses_the_flat_path(wgrad_counts):
    m = module("ln", 100, torch.float32)
    opt = FusedAdamW(m.parameters())  # noqa: F841
    m.weight.register_hook(lambda g: 2 * g)
    x, dy = data((4, 100), torch.float16, 7)
    m(x).backward(dy)
    assert wgrad_counts["into"] == 1  # the bias only
    w, b, *_ = reference("ln", x, dy, 1e-5)
    assert torch.allclose(m.weight.grad.double().cpu(), 2 * w.cpu(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(m.bias.grad.double().cpu(), b.cpu(), rtol=1e-5, atol=1e-5)
    assert grad_is_flat_view(m.weight) and grad_is_flat_view(m.bias)  # copied back by the buffer's hook


def test_autograd_grad_returns_the_gradients_and_leaves_dot_grad(wgrad_counts):
    m = module("ln", 100, torch.float32)
    opt = FusedAdamW(m.parameters())  # noqa: F841
    x, dy = data((4, 100), torch.float16, 8)
    m(x).backward(dy)
    before = [p.grad.clone() for p in m.parameters()]
    into = wgrad_counts["into"]
    gw, gb = torch.autograd.grad(m(x), [m.weight, m.bias], dy)
    assert wgrad_counts["into"] == into  # refused: autograd.grad captures the gradient
    assert all(torch.equal(p.grad, b) for p, b in zip(m.parameters(), before, strict=True))
    assert torch.equal(gw, before[0]) and torch.equal(gb, before[1])  # the same sum, bit for bit


def test_norm_backward_writes_or_adds_into_given_outputs():
    torch.manual_seed(9)
    x, dy = (torch.randn(6, 700).to(DEVICE, torch.bfloat16) for _ in range(2))
    w = torch.randn(700, device=DEVICE)
    y = knorm.norm_forward(x, w, None, 1e-5, False)
    plain = knorm.norm_backward(dy, x, w, y.mean, y.rstd, False, bias_dtype=torch.float32)
    again = knorm.norm_backward(dy, x, w, y.mean, y.rstd, False, bias_dtype=torch.float32)
    assert torch.equal(plain.dweight, again.dweight) and torch.equal(plain.dbias, again.dbias)  # fixed order
    dw, db = torch.ones(700, device=DEVICE), torch.full((700,), 2.0, device=DEVICE)
    out = knorm.norm_backward(
        dy,
        x,
        w,
        y.mean,
        y.rstd,
        False,
        bias_dtype=torch.float32,
        dweight_out=dw,
        dbias_out=db,
        accumulate=True,
    )
    assert out.dweight is dw and out.dbias is db
    assert torch.equal(dw, plain.dweight + 1) and torch.equal(db, plain.dbias + 2)  # one fp32 add
    with pytest.raises(TypeError, match="dweight_out"):
        knorm.norm_backward(dy, x, w, y.mean, y.rstd, False, dweight_out=dw.half())
    with pytest.raises(ValueError, match="dbias_out"):
        knorm.norm_backward(dy, x, w, y.mean, y.rstd, False, dbias_out=db)
    with pytest.raises(ValueError, match="contiguous"):
        knorm.norm_backward(dy, x, w, y.mean, y.rstd, False, dweight_out=torch.zeros(1400)[::2])


# --------------------------------------------------------------------------- whole models


class _Reductions(TorchDispatchMode):
    """Counts, in backward, aten sums whose output has ``shape`` and aten add_ into a tensor
    over one of ``grads``' memory (a norm param's .grad): what the norm's parameter
    gradients cost in torch launches. Beside the ``launches`` fixture (which runs each
    launch with the modes off), the interpreter's own ops are not seen."""

    def __init__(self, shape, grads) -> None:
        super().__init__()
        self.shape, self.ptrs, self.seen = torch.Size(shape), {g.data_ptr() for g in grads}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch._C._current_graph_task_id() != -1:
            packet = func.overloadpacket
            if packet is torch.ops.aten.sum and isinstance(out, torch.Tensor) and out.shape == self.shape:
                self.seen.append(str(func))
            if packet is torch.ops.aten.add_ and args[0].data_ptr() in self.ptrs:
                self.seen.append(str(func))
        return out


def _tiny(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        return transformers.GPT2LMHeadModel(config).to(DEVICE).eval()
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(DEVICE)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Llama's rotary buffers kept fp32
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_converted_models_sum_and_add_no_norm_gradient_in_torch(kind, launches):
    model = tkern.convert_network(_tiny(kind))
    opt = FusedAdamW(model.parameters(), lr=1e-3)
    norms = [m for m in model.modules() if isinstance(m, (tkern.nn.LayerNorm, tkern.nn.RMSNorm))]
    params = [p for m in norms for p in m.parameters()]
    ids = torch.randint(0, 64, (2, 12), device=DEVICE)
    for step in range(2):  # the gradient written, then (two backwards) added into
        opt.zero_grad(set_to_none=step == 0)
        for _ in range(step + 1):
            start = len(launches)
            with _Reductions((32,), _views(params)) as mode:
                model(ids, labels=ids).loss.backward()
            assert mode.seen == [], mode.seen
            names = [name for name, _ in launches[start:]]
            assert names.count("_norm_param_grads_kernel") == len(norms) == names.count("_norm_bwd_kernel")
        assert all(grad_is_flat_view(p) for p in params)
        opt.step()


def _views(params):
    """Each param's gradient view in its flat buffer (its .grad between backwards)."""
    from tkern.flat.views import _view_of

    return [_view_of(p) for p in params]
