"""tkern.linear_cross_entropy against F.linear + F.cross_entropy in float64 on the same
(rounded) input, weight and bias, and the memory it never uses.

Tolerances (relative Frobenius error, conftest.rel_err):
* the loss: the chunk's logits are fp32 from tkern's GEMM (16-bit products exact in
  fp32, an fp32 sum over H = 31 features: ~H * 2^-24 relative), then the fp32
  cross-entropy (test_cross_entropy.py's LOSS_TOL argument): LOSS_TOL = 1e-5.
* the gradients: the logits' gradient is rounded once to the input's dtype (unit
  roundoff u), then dgrad and wgrad accumulate it in fp32 and round once more (u):
  errors of two independent roundings, ~sqrt(2) u in the Frobenius norm, below the
  GEMM table's 2u (conftest.TOL); fp32 inputs run torch's fp32 GEMMs: TOL[fp32].
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, count_syncs, rel_err
from torch.utils._python_dispatch import TorchDispatchMode

import tkern
import tkern.kernels.cross_entropy as ce_kernels
from tkern.ops.cross_entropy import MIN_CHUNK_ROWS, default_chunk_rows
from tkern.ops.loss_chunks import LOGITS_SPLIT, MIN_PART_ROWS, logits_rows

LOSS_TOL = 1e-5
N, H, V = 188, 31, 123


def _inputs(dtype, n=N, h=H, v=V, seed=0, bias_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) * 0.4).to(DEVICE, dtype)
    b = torch.randn(v, generator=g).to(DEVICE, bias_dtype or dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[::9] = -100
    weight = (torch.rand(v, generator=g) + 0.5).to(DEVICE)
    return x, w, b, target.to(DEVICE), weight


def _reference(x, w, b, target, grad_out=None, weight=None, z_loss=0.0, reduction="mean", softcap=None, **kw):
    """(loss, dx, dw, db) in float64: F.linear, the softcap, F.cross_entropy, the z-loss."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in (x, w, b)]
    logits = F.linear(*leaves)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    w64 = None if weight is None else weight.double()
    loss = F.cross_entropy(logits, target, weight=w64, reduction=reduction, **kw)
    if z_loss:
        valid = target != kw.get("ignore_index", -100)
        z = z_loss * torch.logsumexp(logits, -1) ** 2 * valid
        loss = loss + {"none": z, "sum": z.sum(), "mean": z.sum() / valid.sum()}[reduction]
    loss.backward(torch.ones_like(loss) if grad_out is None else grad_out.double())
    return loss.detach(), *(None if t is None else t.grad for t in leaves)


def _run(x, w, b, target, grad_out=None, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    loss = tkern.linear_cross_entropy(leaves[0], leaves[1], target, linear_bias=leaves[2], **kw)
    loss.backward(torch.ones_like(loss) if grad_out is None else grad_out)
    return loss, *(t.grad for t in leaves)


def _check(x, w, b, target, grad_out=None, chunk_size=None, **kw):
    out = _run(x, w, b, target, grad_out, chunk_size=chunk_size, **kw)
    ref = _reference(x, w, b, target, grad_out, **kw)
    assert out[0].dtype == torch.float32 and out[0].shape == ref[0].shape
    assert rel_err(out[0], ref[0]) <= LOSS_TOL, (rel_err(out[0], ref[0]), kw)
    for name, got, want, like in zip(("input", "weight", "bias"), out[1:], ref[1:], (x, w, b), strict=True):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        assert rel_err(got, want) <= TOL[x.dtype], (name, rel_err(got, want), kw)


# softcap 3: the logits (std ~2.5) are capped hard at the tails, barely near 0
ALL = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 3.0}


@pytest.mark.parametrize(
    "dtype, options",
    [
        (torch.bfloat16, "plain"),
        (torch.bfloat16, "all"),
        (torch.float16, "all"),
        (torch.float32, "all"),
    ],
)
def test_matches_float64_reference(dtype, options):
    x, w, b, target, weight = _inputs(dtype)
    kw = {} if options == "plain" else {**ALL, "weight": weight}
    _check(x, w, b, target, **kw)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions_with_upstream_gradient(reduction):
    x, w, b, target, weight = _inputs(torch.bfloat16, n=60)
    grad_out = torch.tensor(0.375) if reduction == "sum" else torch.rand(60) + 0.5
    # a chunk size that does not divide the rows: a ragged last chunk
    _check(x, w, b, target, grad_out.to(DEVICE), chunk_size=25, weight=weight, reduction=reduction, **ALL)


def test_fp32_bias_with_half_input_and_leading_shape():
    x, w, b, target, _ = _inputs(torch.float16, n=24, bias_dtype=torch.float32)
    x3, t3 = x.reshape(2, 12, H), target.reshape(2, 12)
    loss = tkern.linear_cross_entropy(x3, w, t3, linear_bias=b, reduction="none")
    ref, *_ = _reference(x, w, b, target, reduction="none")
    assert loss.shape == (2, 12) and rel_err(loss.reshape(-1), ref) <= LOSS_TOL


def test_loss_scale_scales_every_gradient_exactly():
    # loss * S under a loss scaler: S a power of two multiplies every gradient exactly
    # wherever the unscaled one is a normal fp16 number: the weight's and the bias's
    # gradients are rounded once from their fp32 sums times S, so where the unscaled one
    # is subnormal or 0 (|g| < 2^-14) the scaled one keeps the digits it loses
    x, w, b, target, _ = _inputs(torch.float16, n=24)
    _, *plain = _run(x, w, b, target)
    _, *scaled = _run(x, w, b, target, grad_out=torch.tensor(1024.0, device=DEVICE))
    for p, s in zip(plain, scaled, strict=True):
        normal = p.abs() >= torch.finfo(torch.float16).tiny
        assert normal.float().mean() > 0.5 and torch.equal((p.float() * 1024)[normal], s.float()[normal])


def test_no_grad_computes_the_loss_only():
    x, w, b, target, _ = _inputs(torch.bfloat16, n=24)
    with torch.no_grad():
        loss = tkern.linear_cross_entropy(x, w.requires_grad_(), target, linear_bias=b)
    ref, *_ = _reference(x, w, b, target)
    assert not loss.requires_grad and rel_err(loss, ref) <= LOSS_TOL


class _LargestAllocation(TorchDispatchMode):
    """Bytes of the largest tensor any op returns. ``aten.set_`` is skipped: Triton's
    interpreter views existing storage as bytes through it (no allocation)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.aten.set_.source_Storage:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_never_materializes_the_logits(reduction):
    # 8 chunks of 4 rows over 512 classes: the largest tensor allowed is a chunk's fp32
    # logits (C * V * 4 bytes; also the fp32 (V, H) weight-gradient sum), 1/8 of the
    # (N, V) fp32 logits; nothing the size of the logits is saved for backward (the largest
    # saved: the weight gradient's fp32 (V, H) sum, kept from forward for backward's one launch).
    n, h, v, chunk = 32, 4, 512, 4
    x, w, b, target, _ = _inputs(torch.float16, n=n, h=h, v=v)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _LargestAllocation() as mode:
        loss = tkern.linear_cross_entropy(
            leaves[0], leaves[1], target, linear_bias=leaves[2], reduction=reduction, chunk_size=chunk
        )
        loss.sum().backward()
    assert mode.largest <= max(chunk * v * 4, v * h * 4, n * h * 2) == n * v * 4 // 8, mode.largest
    assert max(saved) <= v * h * 4, saved


def test_default_chunk_rows():
    # 4x the power of two nearest the features H (a chunk's logits in LOGITS_SPLIT = 4 parts:
    # the weight side's bytes, 2 V H per part and 10 V H per chunk, about 0.32 of the rows'
    # 14 V per row; the chunk's buffers, 3 rows V, ~3x the fp32 weight-gradient sum), capped
    # at the power of two at most a quarter of the rows (the chunk's 16-bit gradient at most
    # 1/8 of all the rows' fp32 logits), at least MIN_CHUNK_ROWS, at most the rows rounded up
    assert MIN_CHUNK_ROWS == 64 and LOGITS_SPLIT == 4 and MIN_PART_ROWS == 16
    assert default_chunk_rows(16384, 768, 50257) == 4096  # GPT-2 small: 4 chunks
    assert default_chunk_rows(16384, 1024, 32000) == 4096  # the ledger's Llama-like: 4 chunks
    assert default_chunk_rows(8192, 4096, 128256) == 2048  # Llama 3 8B: a quarter of 8192
    assert default_chunk_rows(65536, 2304, 256000) == 8192  # Gemma 2: 4 x 2^11.17
    assert default_chunk_rows(65536, 5120, 152064) == 16384  # 4 x 2^12.32
    assert default_chunk_rows(3, 4096, 16) == 4  # at most the rows, rounded up
    assert default_chunk_rows(1000, 4096, 128256) == 128  # a short batch: 2^7 <= 250 < 2^8
    assert default_chunk_rows(256, 128, 50257) == 64  # bench_activation_memory: a quarter
    # the floor: never tiny GEMMs (issue 37: 32 rows of 32 into 1501 classes took 32 chunks)
    assert default_chunk_rows(32, 32, 1501) == 32  # one chunk, not 32 of one row
    assert default_chunk_rows(10, 2, 10**6) == 16
    assert default_chunk_rows(300, 31, 123) == 64  # a quarter, 75, below 4 x 32
    assert default_chunk_rows(300, 8, 123) == 64  # 4 x 8, floored
    assert default_chunk_rows(3000, 16, 123) == 64  # 4 x 16
    for n in (1, 7, 100, 129, 256, 1000, 5000, 70000):
        for h, v in ((32, 1501), (768, 50257), (4096, 16), (2304, 256000)):
            rows = default_chunk_rows(n, h, v)
            assert rows & (rows - 1) == 0 and rows >= min(n, MIN_CHUNK_ROWS)
            assert rows < 2 * n or n == 1  # no chunk more than twice the rows
            assert default_chunk_rows(n, h, 2 * v) == rows  # V cancels out
            if n >= 256:  # the 16-bit gradient at most 1/8 of the rows' fp32 logits
                assert rows * 2 <= n * 4 / 8, (n, h, rows)
            # above the floor and below a quarter of the rows: 4 H within a factor sqrt(2)
            if MIN_CHUNK_ROWS < rows < n // 8:
                assert 0.7 <= rows / (4 * h) <= 1.42, (n, h, v, rows)
            # the logits parts: a quarter of the chunk, never below 16 rows (or the chunk)
            assert logits_rows(rows) == max(rows // 4, min(rows, MIN_PART_ROWS))
    assert logits_rows(40) == 16 and logits_rows(600) == 150  # ceil(600 / 4); 16 at least
    assert logits_rows(10) == 10  # a chunk of at most 16 rows in one part


def test_errors_name_the_argument():
    x, w, b, target, _ = _inputs(torch.float16, n=8)
    bad = target.clone().cpu()  # on the CPU: a GPU's check is a device-side assert
    bad[3] = V + 5
    with pytest.raises(ValueError, match=rf"target\[3\] = {V + 5} is out of range: .* ignore_index"):
        tkern.linear_cross_entropy(x.cpu(), w.cpu(), bad)
    with pytest.raises(TypeError, match="input must have dtype"):
        tkern.linear_cross_entropy(x.bfloat16(), w, target)
    with pytest.raises(ValueError, match="input must have shape"):
        tkern.linear_cross_entropy(x[:, :5], w, target)
    with pytest.raises(ValueError, match="target must have shape"):
        tkern.linear_cross_entropy(x, w, target[:5])
    with pytest.raises(ValueError, match="linear_bias must have shape"):
        tkern.linear_cross_entropy(x, w, target, linear_bias=b[:5])
    with pytest.raises(ValueError, match="softcap must be None or > 0"):
        tkern.linear_cross_entropy(x, w, target, softcap=0.0)
    with pytest.raises(ValueError, match="chunk_size must be"):
        tkern.linear_cross_entropy(x, w, target, chunk_size=0)
    with pytest.raises(ValueError, match="reduction must be one of"):
        tkern.linear_cross_entropy(x, w, target, reduction="batchmean")


def test_linear_cross_entropy_module():
    torch.manual_seed(3)
    head = torch.nn.Linear(H, V, device=DEVICE)
    module = tkern.nn.LinearCrossEntropy(H, V, label_smoothing=0.1, softcap=2.0, device=DEVICE)
    assert list(module.state_dict()) == list(head.state_dict())  # a head's state_dict loads into it
    module.load_state_dict(head.state_dict())
    assert module.weight.dtype == torch.float32 and module.class_weight is None
    # convert_network casts the head like a Linear (tkern's GEMM)
    wrapper = tkern.convert_network(torch.nn.Sequential(module), torch.bfloat16)
    assert wrapper[0].weight.dtype == torch.bfloat16 and wrapper[0].bias.dtype == torch.bfloat16
    x, _, _, target, _ = _inputs(torch.float32, n=20)
    loss = module(x, target)  # an fp32 input is cast to the head's dtype
    loss.backward()
    ref = _reference(x.bfloat16(), module.weight, module.bias, target, label_smoothing=0.1, softcap=2.0)
    assert rel_err(loss, ref[0]) <= LOSS_TOL
    assert rel_err(module.weight.grad, ref[2]) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph_matches_eager(reduction):
    # the custom op tkern::linear_cross_entropy (and its backward op for "none"): no graph
    # break; the same chunks and kernels on the same inputs as the eager door, so equal
    x, w, b, target, weight = _inputs(torch.float16, n=40)
    kw = {**ALL, "weight": weight, "reduction": reduction, "chunk_size": 16}

    def step(x, w, b, t):
        loss = tkern.linear_cross_entropy(x, w, t, linear_bias=b, **kw)
        return loss.sum() * 2 if reduction == "none" else loss * 2

    results = []  # fullgraph=True: a graph break raises
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        loss = fn(*leaves, target)
        loss.backward()
        results.append((loss, *(t.grad for t in leaves)))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)
    kw.pop("chunk_size")
    grad_out = torch.full((40,) if reduction == "none" else (), 2.0, device=DEVICE)
    ref = _reference(x, w, b, target, grad_out=grad_out, **kw)
    assert rel_err(results[1][2], ref[2]) <= TOL[torch.float16]


def test_custom_ops_pass_opcheck():
    # schema, fake (meta) implementation, autograd registration and AOT dispatch of both ops
    x, w, b, target, weight = _inputs(torch.float16, n=8, v=10)
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    for reduction in ("mean", "none"):
        args = (x, w, b, target, weight, -100, 0.1, 3.0, 1e-3, reduction, 8, True, True, True)
        torch.library.opcheck(torch.ops.tkern.linear_cross_entropy.default, args)
    _, lse, *_ = torch.ops.tkern.linear_cross_entropy(
        x, w, None, target, None, -100, 0.0, 0.0, 0.0, "none", 8, *[False] * 3
    )
    grad = torch.rand(8, device=DEVICE)
    args = (
        x.detach(),
        w.detach(),
        None,
        target,
        None,
        lse.detach(),
        grad,
        -100,
        0.0,
        0.0,
        0.0,
        8,
        True,
        True,
        False,
    )
    torch.library.opcheck(torch.ops.tkern.linear_cross_entropy_backward.default, args)


def test_meta_tensors_get_the_loss_shape():
    x = torch.empty(6, 4, 8, dtype=torch.float16, device="meta")
    w = torch.empty(10, 8, dtype=torch.float16, device="meta")
    t = torch.empty(6, 4, dtype=torch.int64, device="meta")
    assert tkern.linear_cross_entropy(x, w, t).shape == ()
    assert tkern.linear_cross_entropy(x, w, t, reduction="none").shape == (6, 4)


def test_weight_gradient_goes_into_the_fused_optimizers_flat_buffer(monkeypatch):
    # as tkern.nn.Linear's (test_wgrad_into.py): .grad stays the flat buffer's view, the
    # gradient added into it by backward (common.flat_wgrad took it), over two backwards
    from tkern.flat import grad_is_flat_view
    from tkern.ops import common
    from tkern.optim import FusedAdamW

    taken = []
    flat_wgrad = common.flat_wgrad
    monkeypatch.setattr(common, "flat_wgrad", lambda *a: taken.append(flat_wgrad(*a)) or taken[-1])

    x, w, b, target, _ = _inputs(torch.float16, n=16)
    head = tkern.nn.LinearCrossEntropy(H, V, dtype=torch.float16, device=DEVICE)
    opt = FusedAdamW(head.parameters(), lr=1e-3)  # kept alive: it owns the flat buffer
    ref = [_reference(x, head.weight, head.bias, target)[2] for _ in range(2)]
    for i in range(2):
        head(x, target).backward()
        assert grad_is_flat_view(head.weight) and opt.param_groups
        assert taken[-1] is not None  # (weight, view, accumulate): backward took the view
        assert rel_err(head.weight.grad, sum(ref[: i + 1])) <= TOL[torch.float16]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_batch(reduction):
    # as torch: mean over no rows is nan, sum is 0; every gradient is zero either way
    x, w, b, _, _ = _inputs(torch.bfloat16, n=12)
    target = torch.full((12,), -100, device=DEVICE)
    loss, *grads = _run(x, w, b, target, reduction=reduction, z_loss=1e-3)
    ref = _reference(x, w, b, target, reduction=reduction)[0]
    assert torch.equal(loss.isnan().cpu(), ref.isnan().cpu()) and (reduction == "mean") == bool(loss.isnan())
    assert all(torch.all(g == 0) for g in grads)


def test_no_host_sync_per_call(monkeypatch):
    # the target check on the device path (as on a GPU), the chunks, the reduction: no value
    # read on the host in forward or backward
    monkeypatch.setattr(ce_kernels, "HOST_CHECK_DEVICES", ())
    x, w, b, target, weight = _inputs(torch.bfloat16, n=40)
    kw = {**ALL, "weight": weight}
    with count_syncs() as calls:
        out = _run(x, w, b, target, chunk_size=16, **kw)
    assert calls == []
    ref = _reference(x, w, b, target, **kw)
    assert rel_err(out[0], ref[0]) <= LOSS_TOL and rel_err(out[2], ref[2]) <= TOL[torch.bfloat16]


class _AtenLaunches(TorchDispatchMode):
    """The aten ops that launch a kernel (not views, allocations or host reads), by name;
    beside conftest's ``launches`` fixture, which runs Triton's launches with the modes off."""

    FREE = {"empty", "empty_strided", "empty_like", "new_empty", "detach", "alias", "_local_scalar_dense"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not func.is_view and name not in self.FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_the_loss_launches_nothing_around_its_kernels(launches, z_loss):
    # issue 54: one launch checks the targets and makes the reduction's scalars, each chunk's
    # launch writes its slice of the rows and lse (no cat), the weight's gradient leaves
    # backward in one launch from its fp32 sum (no round trip through fp16): the aten ops
    # left are the loss's sum times a (and the z-loss's terms) and backward's two products
    x, w, _, target, _ = _inputs(torch.float16, n=40)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    grad = torch.tensor(1024.0, device=DEVICE)
    with _AtenLaunches() as mode:
        loss = tkern.linear_cross_entropy(xl, wl, target, chunk_size=16, z_loss=z_loss)
        loss.backward(grad)
    names = [n for n, _ in launches]
    assert names.count("_target_stats_kernel") == 1 and names.count("_cross_entropy_kernel") == 3
    z_ops = ["mul", "sum", "mul", "add"] if z_loss else []
    assert mode.ops == ["sum", "mul", *z_ops, "mul", "mul"], mode.ops
    ref = _reference(x, w, None, target, grad_out=grad, z_loss=z_loss)
    assert rel_err(loss, ref[0]) <= LOSS_TOL
    assert rel_err(xl.grad, ref[1]) <= TOL[torch.float16] and rel_err(wl.grad, ref[2]) <= TOL[torch.float16]


def test_flat_weight_gradient_is_one_rounding_of_the_fp32_sum(monkeypatch):
    # the weight's gradient added into the fused optimizer's flat view by one launch:
    # view + gw32 * S in fp32, rounded once to fp16 -- against the float64 reference times
    # S, within the fp32 sum's error and one fp16 rounding of each element (half an ulp)
    from tkern.flat import grad_is_flat_view
    from tkern.optim import FusedAdamW

    x, _, _, target, _ = _inputs(torch.float16, n=48)
    head = tkern.nn.LinearCrossEntropy(H, V, dtype=torch.float16, device=DEVICE)
    opt = FusedAdamW(head.parameters(), lr=1e-3)  # kept alive: it owns the flat buffer
    scale = 3.0  # not a power of two: the product itself rounds (in fp32)
    for _ in range(2):
        (head(x, target) * scale).backward()
    assert grad_is_flat_view(head.weight) and opt.param_groups
    ref = 2 * scale * _reference(x, head.weight, head.bias, target)[2]
    got = head.weight.grad.double()
    half_ulp = torch.finfo(torch.float16).eps / 2 * ref.abs() + torch.finfo(torch.float16).tiny
    # per element: the second add's rounding (half an ulp of the sum) plus the first's
    # (half an ulp of one share) plus the fp32 sums' error (H-term products, 2^-20 relative)
    assert torch.all((got - ref).abs() <= 2 * half_ulp + 2.0**-20 * ref.abs().max())


def _lse_of_stats(stats: torch.Tensor) -> torch.Tensor:
    """float64 logsumexp of each row from its (m_j, s_j) slots."""
    m, s = stats[..., 0].double(), stats[..., 1].double()
    top = m.max(1).values
    return top + torch.log((s * torch.exp(m - top[:, None])).sum(1))


@pytest.mark.parametrize("route", ["pointer", "tma"])
@pytest.mark.parametrize("m, n, k", [(70, 300, 64), (5, 33, 16), (130, 123, 32)])
def test_logits_gemm_writes_each_rows_softmax_statistics(route, m, n, k, request):
    # issue 54: the head's GEMM writes, per row and per 32 columns, (max, sum exp(c - max)) of
    # the C it stores; every slot is written (the NaN fill never survives), and the slots give
    # the logsumexp of the stored fp32 C to fp32 rounding (exp and sum over at most 128
    # columns a slice, then log: a few ulp of lse ~ 5-10, checked at 1e-6 relative); the
    # TMA kernel (Hopper's route, run by the interpreter) writes them in its pointer epilogue.
    from tkern.kernels.gemm import matmul_row_stats_prechecked
    from tkern.kernels.gemm_epilogue import row_stats_slots

    routes = request.getfixturevalue("hopper_routes") if route == "tma" else None
    g = torch.Generator().manual_seed(m + n)
    a = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(DEVICE, torch.bfloat16)
    b = torch.randn(n, generator=g).to(DEVICE, torch.bfloat16)
    out = torch.empty(m, n, device=DEVICE)
    stats = torch.full((m, row_stats_slots(n), 2), float("nan"), device=DEVICE)
    assert matmul_row_stats_prechecked(a, w.t(), b, out, stats) is out
    assert routes is None or routes == ["tma"]
    ref = a.double() @ w.double().t() + b.double()
    assert rel_err(out, ref) <= 1e-6  # fp32 accumulation of exact 16-bit products
    assert not stats.isnan().any()
    lse = torch.logsumexp(out.double(), 1)
    assert ((_lse_of_stats(stats) - lse).abs() / lse.abs()).max() <= 1e-6


def test_the_loss_reads_each_chunks_logits_once_from_the_gemms_statistics(launches):
    # issue 54: without label smoothing and softcap, the chunk's logits GEMM writes the row
    # statistics (ROW_STATS) and the cross-entropy kernel takes the lse from them
    # (LSE_FROM_STATS: its one pass over the logits writes the gradient); with either option
    # the kernel makes both passes, as their terms need every logit. Both within the float64
    # reference's tolerances, and the statistics path agrees with the two-pass kernel on the
    # same logits to fp32 rounding.
    x, w, b, target, weight = _inputs(torch.bfloat16, n=40)
    _check(x, w, b, target, chunk_size=16, weight=weight, z_loss=1e-3)
    ce = [k for n, k in launches if n == "_cross_entropy_kernel"]
    gemms = [k for n, k in launches if n.startswith("_matmul") and k.get("ROW_STATS")]
    assert len(ce) == 3 and all(k["LSE_FROM_STATS"] and k["COMPUTE_LSE"] for k in ce)
    assert len(gemms) == 3  # one per chunk: the logits' GEMM
    launches.clear()
    _check(x, w, b, target, chunk_size=16, weight=weight, label_smoothing=0.1)
    ce = [k for n, k in launches if n == "_cross_entropy_kernel"]
    assert len(ce) == 3 and not any(k["LSE_FROM_STATS"] for k in ce)
    assert not any(k.get("ROW_STATS") for n, k in launches if n.startswith("_matmul"))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_chunks_logits_in_parts_then_one_dgrad_and_wgrad(launches, reduction):
    # issue 54: a chunk of more than MIN_PART_ROWS rows computes its fp32 logits in
    # LOGITS_SPLIT parts (chunks of 600 rows: parts of 150; 700 rows: 600 + 100, the ragged
    # one in one part), each part's kernel writing its rows of the chunk's gradient, then
    # one dgrad and one wgrad GEMM per chunk (not per part): 5 logits GEMMs and kernels, 2
    # dgrads, 2 wgrads; "none"'s backward recomputes the same parts. Against float64, and the
    # largest tensor is the chunk's 16-bit gradient (600 x V x 2, < its fp32 logits).
    n, chunk = 700, 600
    x, w, b, target, weight = _inputs(torch.bfloat16, n=n, h=16, v=40)
    grad_out = torch.rand(n).to(DEVICE) + 0.5 if reduction == "none" else None
    kw = {"weight": weight, "z_loss": 1e-3, "reduction": reduction}
    with _LargestAllocation() as mode:
        out = _run(x, w, b, target, grad_out, chunk_size=chunk, **kw)
    assert mode.largest <= max(chunk * 40 * 2, n * 16 * 4), mode.largest
    ref = _reference(x, w, b, target, grad_out, **kw)
    assert rel_err(out[0], ref[0]) <= LOSS_TOL
    for got, want in zip(out[1:], ref[1:], strict=True):
        assert rel_err(got, want) <= TOL[torch.bfloat16]
    ce = [k for name, k in launches if name == "_cross_entropy_kernel"]
    gemms = [k for name, k in launches if name.startswith("_matmul")]
    passes = 2 if reduction == "none" else 1  # forward, then backward's recompute
    assert len(ce) == 5 * passes
    assert sum(1 for k in gemms if k.get("ROW_STATS")) == 5  # forward's (the recompute's: two passes)
    # per pass with gradients: 5 logits GEMMs, then each chunk's dgrad and wgrad
    assert len(gemms) == 5 * passes + 4


def test_a_chunk_size_above_the_rows_is_one_chunk_in_parts(launches):
    # 600 rows with chunk_size 4096: one chunk of the 600 rows, its logits in 4 parts of
    # 150 (a short batch holds a quarter of its rows' fp32 logits, as a default chunk
    # capped at the rows does), then one dgrad and one wgrad; against float64
    x, w, b, target, weight = _inputs(torch.bfloat16, n=600, h=16, v=40)
    _check(x, w, b, target, chunk_size=4096, weight=weight)
    assert sum(1 for name, _ in launches if name == "_cross_entropy_kernel") == 4
    assert sum(1 for name, _ in launches if name.startswith("_matmul")) == 4 + 2


def test_cross_entropy_from_row_stats_matches_its_two_passes():
    # the kernel's LSE_FROM_STATS against its own two passes over the same fp32 logits: the
    # lse to a few ulp (a different order of the same fp32 sums), so the loss terms too, and
    # the gradient, exp(x - lse) rounded once to bf16, equal but for a last-bit flip where
    # the lse's ulp moves the product across a rounding boundary (checked at one bf16 ulp)
    from tkern.kernels.cross_entropy import cross_entropy_forward
    from tkern.kernels.gemm import matmul_row_stats_prechecked
    from tkern.kernels.gemm_epilogue import row_stats_slots

    x, w, b, target, weight = _inputs(torch.bfloat16, n=50)
    logits = torch.empty(50, V, device=DEVICE)
    stats = torch.empty(50, row_stats_slots(V), 2, device=DEVICE)
    matmul_row_stats_prechecked(x, w.t(), b, logits, stats)
    a = torch.full((1,), 0.02, device=DEVICE)
    out = []
    for st in (None, stats):
        grad = torch.empty(logits.shape, dtype=torch.bfloat16, device=DEVICE)
        loss, lse = cross_entropy_forward(logits, target, weight, grad=grad, a=a, row_stats=st)
        out.append((loss, lse, grad))
    (l2, e2, g2), (l1, e1, g1) = out
    assert ((e1 - e2).abs() <= 4 * 2**-24 * e2.abs().clamp(min=1)).all()
    assert rel_err(l1, l2) <= 1e-6
    assert ((g1.float() - g2.float()).abs() <= 2**-8 * g2.float().abs() + 1e-30).all()
    with pytest.raises(ValueError, match="row_stats must be a contiguous"):
        cross_entropy_forward(logits, target, row_stats=stats[:, :-1])
    with pytest.raises(ValueError, match="label smoothing"):
        cross_entropy_forward(logits, target, label_smoothing=0.1, row_stats=stats)
