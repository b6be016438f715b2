"""The fp8 weight cast in a fused optimizer's step (Float8WeightCache): the forward reads
the step's cast, which stays in the same tensors for a captured forward; a write from
outside the optimizer makes the forward cast again; under delayed scaling the step's cast
is bit-identical to casting in the forward (skipped steps, checkpoints, GPT-2's Conv1D),
and a compiled forward casts its weight itself. References: the same model casting in
its forward.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conftest import DEVICE
from torch import nn

import tkern
from tkern.nn import Float8Linear, Float8Recipe

# ----------------------------------------------------------------------- the weight cast in the step


def _twin_models(seed=0):
    torch.manual_seed(seed)
    a = torch.nn.Sequential(tkern.nn.Float8Linear(32, 48), torch.nn.ReLU(), tkern.nn.Float8Linear(48, 16))
    b = copy.deepcopy(a)
    return a.to(DEVICE), b.to(DEVICE)


def test_the_optimizer_writes_the_fp8_weight_and_the_forward_reads_it():
    """issue 17: a fused optimizer's step casts a tensorwise Float8Linear's weight once after
    updating it; the forward then reads that cast instead of casting, with identical results."""
    from tkern.functional import float8_weight_cache

    cached, plain = _twin_models()
    for m in plain:  # the reference casts in every forward
        if isinstance(m, tkern.nn.Float8Linear):
            float8_weight_cache(m.weight, register=False)
    opts = [tkern.optim.FusedAdamW(m.parameters(), lr=1e-2) for m in (cached, plain)]
    x = torch.randn(8, 32, device=DEVICE).to(torch.bfloat16)
    casts = []
    for step in range(3):
        outs = []
        for model, opt in zip((cached, plain), opts, strict=True):
            opt.zero_grad()
            y = model(x)
            y.float().square().mean().backward()
            opt.step()
            outs.append(y)
        assert torch.equal(outs[0], outs[1]), step
        cache = float8_weight_cache(cached[0].weight)
        casts.append(cache.lookup(cached[0].weight))
    for a, b in zip(cached.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    data, scale = casts[-1]
    ref_data, ref_scale = tkern.to_float8(cached[0].weight.detach(), torch.float8_e4m3fn)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)) and torch.equal(scale, ref_scale)
    assert float8_weight_cache(plain[0].weight) is None


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_the_step_cast_stays_in_the_same_tensors_for_a_captured_forward(recipe):
    """A whole-step CUDA graph (Trainer(cuda_graph=True)) captures the forward reading the
    cache's tensors: each step's cast must land in those same tensors (not new ones, freed
    under the graph), holding exactly the cast a forward would make now."""
    from tkern.functional import float8_weight_cache

    torch.manual_seed(0)
    layer = tkern.nn.Float8Linear(32, 16, recipe=recipe).to(DEVICE)
    opt = tkern.optim.FusedAdamW(layer.parameters(), lr=1e-2)
    x = torch.randn(8, 32, device=DEVICE).to(torch.bfloat16)
    cache = float8_weight_cache(layer.weight)
    held = None
    for _ in range(3):
        opt.zero_grad()
        layer(x).float().square().mean().backward()
        opt.step()
        now = (cache.data, cache.scale, cache.amax)
        ptrs = [None if t is None else t.data_ptr() for t in now]
        assert held is None or ptrs == held
        held = ptrs
    if recipe == "tensorwise":
        ref = tkern.to_float8(layer.weight.detach(), torch.float8_e4m3fn)
        assert torch.equal(cache.data.view(torch.uint8), ref[0].view(torch.uint8))
        assert torch.equal(cache.scale, ref[1])


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_the_step_casts_into_the_held_tensors_with_no_copy(recipe, monkeypatch):
    """The cache's refresh casts straight into the tensors it holds (cast_2d(out=...)), as the
    MX cache does: no aten op reads or writes a weight-shaped fp8 tensor (the copy of a fresh
    cast that _keep made before), the same tensors, and the cast a forward would make now."""
    from conftest import ops_over

    from tkern.functional import float8_weight_cache
    from tkern.kernels.float8 import cast_2d

    torch.manual_seed(0)
    layer = tkern.nn.Float8Linear(64, 32, recipe=recipe).to(DEVICE)
    opt = tkern.optim.FusedAdamW(layer.parameters(), lr=1e-2)
    x = torch.randn(8, 64, device=DEVICE).to(torch.bfloat16)
    opt.zero_grad()
    layer(x).float().square().mean().backward()
    opt.step()
    cache = float8_weight_cache(layer.weight)

    def ptrs():
        held = (cache.data, cache.scale, cache.data_t, cache.amax)
        return [None if t is None else t.data_ptr() for t in held]

    held = ptrs()
    with ops_over(monkeypatch, {(32 * 64, 64), (64 * 32, 32)}) as seen:
        cache.refresh()
    assert seen == [] and ptrs() == held
    if recipe == "tensorwise":
        ref = cast_2d(layer.weight.detach(), cache.data.dtype, store_t=True)
        for mine, want in ((cache.data, ref.data), (cache.data_t, ref.data_t)):
            assert torch.equal(mine.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(cache.scale, ref.scale)


def test_cast_2d_into_given_tensors_is_the_fresh_cast_and_refuses_wrong_ones():
    from tkern.kernels.float8 import cast_2d

    e4m3 = torch.float8_e4m3fn
    x = torch.randn(96, 64, device=DEVICE).to(torch.bfloat16)
    fresh = cast_2d(x, e4m3, store_t=True)
    out = cast_2d(torch.zeros_like(x), e4m3, store_t=True)
    got = cast_2d(x, e4m3, store_t=True, out=out)
    assert got.data is out.data and got.data_t is out.data_t and got.scale is out.scale
    for mine, want in ((got.data, fresh.data), (got.data_t, fresh.data_t)):
        assert torch.equal(mine.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got.scale, fresh.scale)
    history = torch.zeros(16, device=DEVICE)
    history[0] = 3.0
    fresh = cast_2d(x, e4m3, store_t=True, history=history, defer=True)
    held = cast_2d(torch.zeros_like(x), e4m3, store_t=True, history=history, defer=True)
    got = cast_2d(x, e4m3, store_t=True, history=history, defer=True, out=held)
    assert got.amax is held.amax and torch.equal(got.amax, fresh.amax)
    assert torch.equal(got.data.view(torch.uint8), fresh.data.view(torch.uint8))
    with pytest.raises(ValueError, match=r"out.data_t must be a contiguous \(64, 96\)"):
        cast_2d(x, e4m3, store_t=True, out=out._replace(data_t=out.data))
    with pytest.raises(ValueError, match="out.amax must be"):
        cast_2d(x, e4m3, store_t=True, history=history, defer=True, out=out)
    with pytest.raises(TypeError, match="out must be a Float8Cast"):
        cast_2d(x, e4m3, out=(out.data,))


def test_a_write_from_outside_the_optimizer_makes_the_forward_cast_again():
    from tkern.functional import float8_weight_cache

    model, _ = _twin_models(1)
    opt = tkern.optim.FusedSGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 32, device=DEVICE).to(torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    weight = model[0].weight
    assert float8_weight_cache(weight).lookup(weight) is not None
    with torch.no_grad():
        weight.mul_(0.5)  # e.g. a checkpoint loaded into the model
    assert float8_weight_cache(weight).lookup(weight) is None
    fresh = copy.deepcopy(model)  # its own cache, never refreshed: casts in its forward
    assert torch.equal(model(x), fresh(x))


# ----------------------------------------------------------------------- delayed: the weight cast in the step


def _delayed_twins(seed=0):
    """Two copies of a small delayed-scaling model: the first gets its weights' casts from
    the optimizer's step, the second casts them in every forward (its caches removed)."""
    from tkern.functional import float8_weight_cache

    torch.manual_seed(seed)
    recipe = Float8Recipe("delayed", history_len=3)  # short: old amaxes drop out within the run
    cached = nn.Sequential(
        Float8Linear(32, 48, recipe=recipe), nn.ReLU(), Float8Linear(48, 16, recipe=recipe)
    )
    cached = cached.to(DEVICE)
    plain = copy.deepcopy(cached)
    for m in plain.modules():
        if isinstance(m, Float8Linear):
            float8_weight_cache(m.weight, register=False)
    return cached, plain


def _layers(model):
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def _cache_valid(model):
    """Per layer, 1 if its forward would read the optimizer's cast now, else 0."""
    from tkern.functional import float8_weight_cache

    found = []
    for m in _layers(model):
        cache = float8_weight_cache(m.weight)
        found.append(int(cache is not None and cache.lookup(m.weight, m.fp8_amax_history_weight) is not None))
    return tuple(found)


def _per_layer(expected, layers=2):
    """Expected validity per forward: 0/1 for every layer alike, or a tuple per layer."""
    return [e if isinstance(e, tuple) else (e,) * layers for e in expected]


def _bits(t):
    """A tensor's bytes, so that NaN == NaN and -0 != +0 (bit for bit)."""
    return t.detach().contiguous().view(torch.uint8)


class _Run:
    """One model, its fused optimizer and a scaler, driven by a script of actions;
    ``record`` collects every output, gradient and state, in order."""

    def __init__(self, model, scaler=None):
        self.model, self.scaler = model, scaler
        self.opt = tkern.optim.FusedAdamW(model.parameters(), lr=2e-2)
        self.record, self.valid = [], []
        self.saved = None
        g = torch.Generator().manual_seed(3)
        self.xs = [torch.randn(8, 32, generator=g).to(DEVICE, torch.bfloat16) for _ in range(4)]
        self.calls = 0

    def forward(self):
        x = self.xs[self.calls % len(self.xs)].clone().requires_grad_()
        self.calls += 1
        self.valid.append(_cache_valid(self.model))
        y = self.model(x)
        self.record.append(("y", y))
        return x, y

    def train(self):  # one micro-batch: forward and backward
        x, y = self.forward()
        loss = y.float().square().mean()
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        self.record.append(("dx", x.grad))

    def step(self):
        self.record += [(f"grad {n}", p.grad.clone()) for n, p in self.model.named_parameters()]
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()
        self.opt.zero_grad()
        self.record += [(f"state {n}", t.clone()) for n, t in self.model.state_dict().items()]

    def eval(self):
        self.model.eval()
        self.forward()
        self.model.train()

    def no_grad(self):
        with torch.no_grad():
            self.forward()

    def overflow(self):  # an inf in a gradient: the step is skipped on the device
        with torch.no_grad():
            self.model[0].weight.grad[0, 0] = float("inf")

    def spike(self):  # a weight edited in place from outside the optimizer
        with torch.no_grad():
            self.model[0].weight[0, 0] = 40.0

    def save(self):
        buf = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict()}, buf)
        self.saved = buf.getvalue()

    def load(self):  # back to the saved state, in place
        saved = torch.load(io.BytesIO(self.saved), weights_only=True)
        self.model.load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["opt"])

    def play(self, script):
        for action in script.split():
            getattr(self, action)()


def _assert_same_runs(a, b):
    assert [name for name, _ in a.record] == [name for name, _ in b.record]
    for i, ((name, got), (_, want)) in enumerate(zip(a.record, b.record, strict=True)):
        assert torch.equal(_bits(got), _bits(want)), f"{name} (record {i}) differs"


# (script, which forwards find the step's cast valid). A forward before any step has no
# cast yet; the second micro-batch of a step finds the history moved by the first's push;
# eval and no_grad forwards use the cast and leave the history, so the training forward
# after them still finds it valid; a skipped step still casts the (unchanged) weight; a
# load or an edit of the weight moves its version counter, so the next forward casts.
DELAYED_SCRIPTS = {
    "plain steps": ("train step train step train step", [0, 1, 1]),
    "accumulation": ("train train step train train step train train step", [0, 0, 1, 0, 1, 0]),
    "eval and no_grad": ("train step eval no_grad train step no_grad train step", [0, 1, 1, 1, 1, 1]),
    "skipped step": ("train step train overflow step train step", [0, 1, 1]),
    "load mid-run": ("train step save train step load train step train step", [0, 1, 0, 1]),
    "weight spike": ("train step spike train step train step", [0, (0, 1), 1]),  # only layer 0's
}


@pytest.mark.parametrize("scenario", list(DELAYED_SCRIPTS))
def test_delayed_weight_cast_in_the_step_is_bit_identical_to_casting_in_the_forward(scenario):
    """issue 17 item 5 under "delayed": the optimizer's step casts each weight with its history
    as it is then, and the training forward that finds weight and history unchanged reads that
    cast and pushes its amax; params, histories, outputs and grads match a run that casts in
    every forward, bit for bit, and the cast is read where it is valid."""
    script, valid = DELAYED_SCRIPTS[scenario]
    cached, plain = (_Run(m) for m in _delayed_twins())
    cached.play(script)
    plain.play(script)
    _assert_same_runs(cached, plain)
    assert cached.valid == _per_layer(valid)
    assert not any(map(any, plain.valid))


@pytest.mark.parametrize("scaler", ["tkern", "torch"])
def test_delayed_weight_cast_survives_a_skipped_step_under_a_loss_scaler(scaler):
    """An overflowing step under a loss scaler (tkern's, or torch.amp.GradScaler handing
    found_inf to the fused optimizer) updates nothing; the step still casts the weight,
    and the run stays bit-identical to casting in the forward."""

    def make():
        if scaler == "tkern":
            return tkern.DynamicLossScaler(init_scale=2.0**8)
        return torch.amp.GradScaler("cpu" if DEVICE == "cpu" else "cuda", init_scale=2.0**8)

    cached, plain = (_Run(m, make()) for m in _delayed_twins(1))
    script = "train step train overflow step train step"
    cached.play(script)
    plain.play(script)
    _assert_same_runs(cached, plain)
    assert cached.valid == _per_layer([0, 1, 1])
    assert cached.scaler.get_scale() == plain.scaler.get_scale() == 2.0**7  # the overflow backed off


def test_delayed_run_resumes_bit_exactly_from_a_checkpoint_with_the_step_cast():
    """A fresh model and optimizer loaded from a mid-run checkpoint continue exactly as
    the run that saved it (whose forwards read the step's casts) and as a run that casts
    in every forward; the fresh model's first forward has no cast yet and casts."""
    cached, plain = (_Run(m) for m in _delayed_twins(2))
    for run in (cached, plain):
        run.play("train step train step save train step train step")
    fresh_model, _ = _delayed_twins(5)  # other initial weights: everything comes from the load
    fresh = _Run(fresh_model)
    fresh.saved, fresh.calls = cached.saved, cached.calls - 2
    fresh.play("load train step train step")
    assert fresh.valid == _per_layer([0, 1])
    n = len(fresh.record)
    for run in (cached, plain):
        for (name, got), (_, want) in zip(fresh.record, run.record[-n:], strict=True):
            assert torch.equal(_bits(got), _bits(want)), name


def _stepped_delayed_layer(seed):
    """A delayed Float8Linear after one training step of a fused optimizer (so its weight
    cache holds the step's cast), and the input it trained on."""
    torch.manual_seed(seed)
    layer = Float8Linear(32, 16, recipe=Float8Recipe("delayed", history_len=2), device=DEVICE)
    opt = tkern.optim.FusedSGD(layer.parameters(), lr=0.1)
    x = torch.randn(4, 32, device=DEVICE).to(torch.bfloat16)
    layer(x).float().sum().backward()
    opt.step()
    return layer, x


def test_the_delayed_forward_reads_the_step_cast_and_pushes_its_amax():
    """The cache is really read: a valid cast is what the training forward multiplies
    (made all zeros here, the output is the bias alone), the forward pushes the amax
    the step recorded into the weight history, and an eval forward pushes nothing."""
    from tkern.functional import float8_weight_cache

    layer, x = _stepped_delayed_layer(4)
    cache = float8_weight_cache(layer.weight)
    history = layer.fp8_amax_history_weight
    assert cache.scaling == "delayed" and cache.lookup(layer.weight, history) is not None
    before = history.clone()
    amax = layer.weight.detach().float().abs().max()
    assert torch.equal(cache.amax.max(), amax)
    cache.data.zero_()
    layer.eval()
    assert torch.equal(layer(x), layer.bias.expand(4, 16))
    assert torch.equal(history, before)  # an eval forward casts with the history, pushes nothing
    layer.train()
    assert torch.equal(layer(x), layer.bias.expand(4, 16))
    assert torch.equal(history, torch.stack([amax, before[0]]))  # this step's amax, newest first
    assert cache.lookup(layer.weight, history) is None  # the history moved: the next forward casts


def test_the_weight_cache_follows_the_recipe():
    from tkern.functional import Float8WeightCache, float8_weight_cache

    layer = Float8Linear(16, 16, recipe="delayed", device=DEVICE)
    cache = float8_weight_cache(layer.weight)
    assert cache.scaling == "delayed" and cache.recipe()[1]() is layer.fp8_amax_history_weight
    tkern.convert_network(nn.Sequential(layer), torch.bfloat16, float8="tensorwise")
    assert float8_weight_cache(layer.weight) is cache and cache.scaling == "tensorwise"  # the same object
    tkern.convert_network(nn.Sequential(layer), torch.bfloat16, float8="blockwise")
    assert float8_weight_cache(layer.weight) is None  # blockwise casts in the forward
    with pytest.raises(ValueError, match="history"):
        Float8WeightCache(layer.weight, "delayed")
    with pytest.raises(ValueError, match="scaling"):
        Float8WeightCache(layer.weight, "blockwise")
    with pytest.raises(ValueError, match="amax"):
        layer = Float8Linear(16, 16, recipe="delayed", device=DEVICE)
        w = layer.weight
        data, scale = tkern.to_float8(w.detach(), torch.float8_e4m3fn)
        histories = (
            layer.fp8_amax_history_input,
            layer.fp8_amax_history_weight,
            layer.fp8_amax_history_grad_output,
        )
        tkern.functional.float8_linear(
            torch.zeros(2, 16, dtype=w.dtype, device=DEVICE), w, scaling="delayed",
            histories=histories, weight_fp8=(data, scale),
        )  # fmt: skip


def test_a_deferred_delayed_cast_then_its_roll_is_the_delayed_cast():
    """The two launches the cache splits to_float8_delayed into: the same data and scale,
    and the history rolled to the same values, with history entries and an amax the
    history does not hold yet (x's amax 5 saturates against a history max of 2)."""
    from tkern.kernels.float8 import roll_amax_history, to_float8_delayed, to_float8_delayed_deferred

    x = torch.randn(37, 24, device=DEVICE).to(torch.bfloat16)
    x[3, 5] = 5.0
    h1 = torch.tensor([2.0, 0.5, 1.0], device=DEVICE)
    h2 = h1.clone()
    data, scale = to_float8_delayed(x, h1, torch.float8_e4m3fn, margin=1)
    d2, s2, amax = to_float8_delayed_deferred(x, h2, torch.float8_e4m3fn, margin=1)
    assert torch.equal(h2, torch.tensor([2.0, 0.5, 1.0], device=DEVICE))  # left as it was
    assert torch.equal(_bits(d2), _bits(data)) and torch.equal(s2, scale)
    roll_amax_history(h2, amax)
    assert (
        torch.equal(h2, h1) and h1[0] == 5.0 and torch.equal(h1[1:], torch.tensor([2.0, 0.5], device=DEVICE))
    )
    with pytest.raises(TypeError, match="amax"):
        roll_amax_history(h2, amax.double())
    with pytest.raises(ValueError, match="amax"):
        roll_amax_history(h2, amax[:0])


def test_gpt2_conv1d_delayed_reads_the_step_cast_bit_identically():
    """A delayed Float8Conv1D (stored weight (in, out)): the step's cast of the stored
    weight serves the transposed GEMM operand, as casting in the forward would."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D as HFConv1D

    from tkern.functional import float8_weight_cache

    torch.manual_seed(6)
    cached = nn.Sequential(HFConv1D(48, 32)).to(DEVICE)
    tkern.convert_network(cached, torch.bfloat16, float8=Float8Recipe("delayed", history_len=2))
    plain = copy.deepcopy(cached)
    float8_weight_cache(plain[0].weight, register=False)
    x = torch.randn(6, 32, device=DEVICE).to(torch.bfloat16)
    outs = []
    for model in (cached, plain):
        opt = tkern.optim.FusedAdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            y = model(x)
            y.float().square().mean().backward()
            outs.append((y, model[0].weight.grad.clone()))
            opt.step()
        outs.append((model[0].weight, model[0].fp8_amax_history_weight))
    cache = float8_weight_cache(cached[0].weight)
    assert cache.scaling == "delayed" and cache.lookup(cached[0].weight, cached[0].fp8_amax_history_weight)
    half = len(outs) // 2
    for a, b in zip(outs[:half], outs[half:], strict=True):
        assert all(torch.equal(_bits(u), _bits(v)) for u, v in zip(a, b, strict=True))


@pytest.mark.slow
def test_a_compiled_delayed_forward_casts_its_weight_itself():
    """Under torch.compile the forward casts the weight (the cache is eager only): with the
    step's cast made all zeros, the compiled forward still matches casting in the forward,
    histories included."""
    from tkern.functional import float8_weight_cache

    layer, x = _stepped_delayed_layer(7)
    float8_weight_cache(layer.weight).data.zero_()
    plain = copy.deepcopy(layer)
    float8_weight_cache(plain.weight, register=False)
    y = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(y, plain(x))
    for a, b in zip(layer.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)
