"""fp8 all-gather of Float8Linear weights under FSDP2 (issue 36 item 6), and the mxfp8
recipe under FSDP2 with bf16 all-gathers (issue 53), on 2 gloo ranks.

Every scenario builds two copies of one tiny bf16 model of Float8Linear layers, both
``fully_shard``-ed per layer: the fp8 all-gather one (``Float8Recipe(
enable_fsdp_float8_all_gather=True)``) and its twin with the plain bf16 all-gather, whose
forward casts the gathered weight (tkern's tensorwise ``to_float8``). The twin is the
reference: the fp8 path casts each shard with the whole weight's scale, so outputs,
gradients and a few FusedAdamW steps must be bit-identical (no tolerance: the scale is
the same fp32 number, each element is cast alone, the GEMMs see the same operands).
The third layer has 9 output rows: uneven shards (5 and 4 rows), padded
by FSDP2 and by the fp8 all-gather. Bytes are counted at ``dist.all_gather_single``,
the collective FSDP2's all-gather calls: the input tensor's bytes on each rank.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist
from scenarios import result, run_scenarios
from test_fsdp import _mesh

import tkern.nn.float8_fsdp as f8fsdp
from tkern.nn import Float8Linear, Float8Recipe
from tkern.optim import FusedAdamW

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

SIZES = (32, 48, 24, 9)  # rows 48, 24, 9: shards 24/24, 12/12, 5/4
BIAS = (True, False, True)
STEPS = 3
FP8AG = Float8Recipe(enable_fsdp_float8_all_gather=True)


def make_model(fp8_all_gather: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    recipe = FP8AG if fp8_all_gather else Float8Recipe()
    layers = [
        Float8Linear(a, b, bias=bias, recipe=recipe)
        for (a, b), bias in zip(zip(SIZES, SIZES[1:], strict=False), BIAS, strict=True)
    ]
    return torch.nn.Sequential(*layers)


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, SIZES[0], generator=g).to(torch.bfloat16)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a DTensor param or grad, as a plain tensor."""
    with torch.no_grad():
        t = t.to_local()
        t = t.high_precision() if isinstance(t, f8fsdp.Float8AllGatherWeight) else t
    return t.detach().clone()


class Counts:
    """Counts, while active, the bytes FSDP2's all-gathers send (``dist.all_gather_single``'s
    input on this rank), the all-reduces the fp8 all-gather module makes, and its casts."""

    def __init__(self) -> None:
        self.gather_bytes, self.gathers, self.reductions, self.casts = 0, 0, 0, 0

    def __enter__(self):
        self._saved = dist.all_gather_single, dist.all_reduce, f8fsdp.to_float8_with_amax
        gather, reduce, cast = self._saved

        def all_gather_single(output_tensor, input_tensor, *args, **kwargs):
            self.gather_bytes += input_tensor.nbytes
            self.gathers += 1
            return gather(output_tensor, input_tensor, *args, **kwargs)

        def all_reduce(tensor, *args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__") == f8fsdp.__name__:
                self.reductions += 1
            return reduce(tensor, *args, **kwargs)

        def to_float8_with_amax(*args, **kwargs):
            self.casts += 1
            return cast(*args, **kwargs)

        dist.all_gather_single, dist.all_reduce = all_gather_single, all_reduce
        f8fsdp.to_float8_with_amax = to_float8_with_amax
        return self

    def __exit__(self, *exc):
        dist.all_gather_single, dist.all_reduce, f8fsdp.to_float8_with_amax = self._saved


def _forward_backward(model, rank, step=0):
    counts = Counts()
    with counts:
        y = model(batch(step, rank))
        forward_bytes = counts.gather_bytes
        (y.float().square().sum()).backward()
    return y.detach().clone(), forward_bytes, counts


# ----------------------------------------------------------------------- the ranks' side


def _scenario_equal(rank, world):
    mesh, out = _mesh(world), {}
    for name in ("fp8", "bf16"):
        model = shard(make_model(name == "fp8"), mesh)
        y, forward_bytes, counts = _forward_backward(model, rank)
        out[name] = {
            "y": y,
            "grads": [local(p.grad) for p in model.parameters()],
            "forward_bytes": forward_bytes,
            "counts": vars(counts).copy(),
            "local_rows": [local(p).shape[0] for p in model.parameters()],
        }
        if name == "fp8":
            weights = [m.weight for m in model]
            out[name]["sharded_types"] = [type(w.to_local()).__name__ for w in weights]
            model[0].set_recipe(FP8AG)  # the same option again: nothing to change
            try:
                model[0].set_recipe(Float8Recipe())
            except ValueError as e:
                out["after_shard"] = (str(e), model[0].weight is weights[0], model[0].recipe == FP8AG)
    return out


def _scenario_train(rank, world):
    mesh, out = _mesh(world), {}
    for name in ("fp8-dynamic", "fp8-precomputed", "bf16"):
        model = shard(make_model(name != "bf16"), mesh)
        opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        steps = []
        for t in range(STEPS):
            opt.zero_grad()
            y, _, counts = _forward_backward(model, rank, t)
            with Counts() as step_counts:
                opt.step()
                if name == "fp8-precomputed":
                    f8fsdp.precompute_float8_dynamic_scale_for_fsdp(model)
            steps.append({
                "y": y,
                "params": [local(p) for p in model.parameters()],
                "counts": vars(counts).copy(),
                "step_reductions": step_counts.reductions,
            })  # fmt: skip
        out[name] = {"steps": steps, "memory": opt.memory_report()}
        if name == "fp8-precomputed":
            # a step without a new precompute: the next all-gather refuses the stale scale
            opt.zero_grad()
            model(batch(0, rank)).float().sum().backward()
            opt.step()
            try:
                model(batch(0, rank))
            except RuntimeError as e:
                out["stale"] = str(e)
    return out


def _scenario_conv1d(rank, world):
    """GPT-2's Conv1D (weight stored (in, out), sharded on in) as Float8Conv1D."""
    from transformers.pytorch_utils import Conv1D

    import tkern

    mesh, out = _mesh(world), {}
    for name, recipe in (("fp8", FP8AG), ("bf16", "tensorwise")):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Conv1D(48, SIZES[0]), Conv1D(16, 48))
        model = shard(tkern.convert_network(model, torch.bfloat16, float8=recipe), mesh)
        y, _, counts = _forward_backward(model, rank)
        out[name] = {
            "y": y,
            "grads": [local(p.grad) for p in model.parameters()],
            "types": [type(m).__name__ for m in model],
            "casts": counts.casts,
        }
    return out


# ------------------------------------------------- the mxfp8 recipe under FSDP2 (issue 53)
# "FSDP2 as the other recipes", the weights all-gathered in bf16: each rank holds a model of
# Float8Linear(recipe="mxfp8") layers fully_shard-ed per layer and its whole twin. FSDP2
# gathers the exact bf16 weight and the MX casts read the gathered weight, so the sharded
# forward is the twin's bit for bit on the same batch. FSDP2 averages the gradients over
# the ranks (reduce-scatter in bf16): the sharded gradient is held to the float mean of the
# twin's gradients on both ranks' batches within two bf16 roundings (2^-7 relative: the
# twin's gradients rounded once each, their bf16 sum and the division, each within half an
# ulp of 2^-8). FusedAdamW's step on the shards is torch's AdamW (fp32, from the twin's
# rows, on the gradient the shard was given) rounded once to bf16, exactly.

MX_SIZES = (64, 96, 32)  # every GEMM's K a multiple of the MX block (32); 96 rows: shards 48/48
MX_TOKENS = 32
MX_LR = 1e-2


def make_mx_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        Float8Linear(MX_SIZES[0], MX_SIZES[1], bias=True, recipe="mxfp8", dtype=torch.bfloat16),
        Float8Linear(MX_SIZES[1], MX_SIZES[2], bias=False, recipe="mxfp8", dtype=torch.bfloat16),
    )


def mx_batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(MX_TOKENS, MX_SIZES[0], generator=g).to(torch.bfloat16)


def _loss(model, x):
    y = model(x)
    return y, y.float().square().mean()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local().detach().clone() if hasattr(t, "to_local") else t.detach().clone()


def _scenario_mx(rank, world):
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(world)
    twin = make_mx_model()
    model = copy.deepcopy(twin)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = FusedAdamW(model.parameters(), lr=MX_LR, weight_decay=0.0)

    y, loss = _loss(model, mx_batch(rank))
    loss.backward()
    out = {
        "y": y.detach().clone(),
        "grads": [_local(p.grad) for p in model.parameters()],
        "types": [type(m).__name__ for m in model],
    }
    opt.step()
    out["params"] = [_local(p) for p in model.parameters()]

    # the twin: its output on this rank's batch, its gradients on every rank's batch
    twin_grads = []
    for r in range(world):
        twin.zero_grad()
        ty, tloss = _loss(twin, mx_batch(r))
        tloss.backward()
        if r == rank:
            out["twin_y"] = ty.detach().clone()
        twin_grads.append([p.grad.detach().float().clone() for p in twin.parameters()])
    out["twin_mean_grads"] = [torch.stack(gs).mean(0) for gs in zip(*twin_grads, strict=True)]
    out["twin_params"] = [p.detach().clone() for p in twin.parameters()]
    return out


SCENARIOS = {
    "equal": _scenario_equal,
    "train": _scenario_train,
    "conv1d": _scenario_conv1d,
    "mx": _scenario_mx,
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(
        "test_float8_fsdp", 2, list(SCENARIOS), tmp_path_factory.mktemp("fp8ag"), timeout_s=600
    )


# ------------------------------------------------------------------------------ tests


def test_forward_and_gradients_equal_the_bf16_all_gathers_cast(world2):
    for res in result(world2, "equal"):
        fp8, bf16 = res["fp8"], res["bf16"]
        assert fp8["sharded_types"] == ["Float8AllGatherWeight"] * 3
        assert fp8["local_rows"] == bf16["local_rows"]
        assert torch.equal(fp8["y"], bf16["y"])
        assert len(fp8["grads"]) == len(bf16["grads"]) == 5
        for a, b in zip(fp8["grads"], bf16["grads"], strict=True):
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
        assert any(g.abs().sum() > 0 for g in fp8["grads"])


def test_gpt2_conv1d_weights_gather_in_fp8_too(world2):
    pytest.importorskip("transformers")
    for res in result(world2, "conv1d"):
        fp8, bf16 = res["fp8"], res["bf16"]
        assert fp8["types"] == bf16["types"] == ["FSDPFloat8Conv1D"] * 2  # fully_shard's class
        assert fp8["casts"] >= 2 and bf16["casts"] == 0
        assert torch.equal(fp8["y"], bf16["y"])
        for a, b in zip(fp8["grads"], bf16["grads"], strict=True):
            assert torch.equal(a, b)


def test_the_option_cannot_change_after_fully_shard(world2):
    for res in result(world2, "equal"):
        why, same_weight, same_recipe = res["after_shard"]
        assert "before fully_shard" in why and same_weight and same_recipe


def test_all_gather_bytes_are_halved(world2):
    # per rank and forward: each layer's padded shard of the weight (2 B/elem in bf16, 1 in
    # fp8) and of its bias (bf16 either way); FSDP2 sends one uint8 buffer per layer when
    # the dtypes of its inputs differ (the fp8 weight and the bf16 bias)
    shapes = list(zip(SIZES[1:], SIZES, strict=False))
    rows = [-(-n // 2) for n, _ in shapes]
    weight_elems = sum(r * k for r, (_, k) in zip(rows, shapes, strict=True))
    bias_bytes = sum(2 * r for r, bias in zip(rows, BIAS, strict=True) if bias)
    for res in result(world2, "equal"):
        fp8, bf16 = res["fp8"]["forward_bytes"], res["bf16"]["forward_bytes"]
        assert bf16 == 2 * weight_elems + bias_bytes
        assert fp8 == weight_elems + bias_bytes
        assert fp8 / bf16 < 0.51  # 1522 / 2986: 0.5 on the weights, the biases' 58 B on both
        assert res["fp8"]["counts"]["gathers"] == res["bf16"]["counts"]["gathers"]


def test_training_with_fused_adamw_equals_the_bf16_all_gather_twin(world2):
    ranks = result(world2, "train")
    for res in ranks:
        bf16 = res["bf16"]["steps"]
        for name in ("fp8-dynamic", "fp8-precomputed"):
            for t, (a, b) in enumerate(zip(res[name]["steps"], bf16, strict=True)):
                assert torch.equal(a["y"], b["y"]), (name, t)
                for x, y in zip(a["params"], b["params"], strict=True):
                    assert torch.equal(x, y), (name, t)
        first = make_model(False)[0].weight.detach()
        assert not torch.equal(res["bf16"]["steps"][-1]["params"][0], first[: first.shape[0] // 2])
        why = res["fp8-precomputed"]["memory"]["alias_fallback"]
        assert "tensor subclass" in why and "Float8AllGatherWeight" in why
        assert res["bf16"]["memory"]["alias_fallback"] is None


def test_the_scale_is_found_once_per_step_when_precomputed(world2):
    for res in result(world2, "train"):
        dyn, pre = res["fp8-dynamic"]["steps"], res["fp8-precomputed"]["steps"]
        for t in range(STEPS):
            weight_gathers = pre[t]["counts"]["gathers"]
            # one cast per weight per all-gather (the forward's, the backward's re-gather)
            assert pre[t]["counts"]["casts"] == dyn[t]["counts"]["casts"] == weight_gathers >= 3
            # dynamic: each all-gather reduces its weight's amax; precomputed: none
            assert dyn[t]["counts"]["reductions"] == weight_gathers
            # ... after the first step's (no precompute yet), whose gathers reduce themselves
            assert pre[t]["counts"]["reductions"] == (weight_gathers if t == 0 else 0)
            # the precompute: one all-reduce for all three weights, once per step
            assert pre[t]["step_reductions"] == 1 and dyn[t]["step_reductions"] == 0


def test_a_stale_precomputed_scale_is_refused(world2):
    for res in result(world2, "train"):
        assert "stale" in res["stale"] and "precompute_float8_dynamic_scale_for_fsdp" in res["stale"]


@pytest.mark.parametrize("scaling", ["delayed", "blockwise"])
def test_non_tensorwise_recipes_refuse_fp8_all_gather(scaling):
    with pytest.raises(ValueError, match="tensorwise"):
        Float8Recipe(scaling, enable_fsdp_float8_all_gather=True)
    layer = Float8Linear(16, 16, recipe=scaling)
    before = layer.weight
    with pytest.raises(ValueError, match="tensorwise"):
        layer.set_recipe(Float8Recipe(scaling, enable_fsdp_float8_all_gather=True))
    assert layer.weight is before and layer.recipe.scaling == scaling


def test_outside_fsdp2_the_layer_equals_the_plain_one():
    """Without fully_shard the wrapped weight is cast whole, as without the option;
    switching the option off gives the plain Parameter back."""
    fp8, plain = make_model(True)[0], make_model(False)[0]
    assert isinstance(fp8.weight, f8fsdp.Float8AllGatherWeight)
    assert torch.equal(fp8.weight.high_precision(), plain.weight)
    x = batch(0, 0)
    y, y_ref = fp8(x), plain(x)
    assert torch.equal(y, y_ref)
    y.float().square().sum().backward()
    y_ref.float().square().sum().backward()
    assert type(fp8.weight.grad) is torch.Tensor and torch.equal(fp8.weight.grad, plain.weight.grad)
    fp8.set_recipe(Float8Recipe())
    assert type(fp8.weight) is torch.nn.Parameter and torch.equal(fp8.weight, plain.weight)


def test_outside_fsdp2_a_fused_optimizer_steps_the_weight_the_layer_reads():
    """One process, no fully_shard: the fused optimizer re-points each param's ``.data``
    into its flat buffer; the wrapper must follow (else its layer keeps reading the old
    weight and training silently does nothing). Three FusedAdamW steps equal the
    plain-Parameter twin's, outputs and weights, bit for bit, and the outputs move."""
    fp8, plain = make_model(True), make_model(False)
    opts = [FusedAdamW(m.parameters(), lr=1e-2) for m in (fp8, plain)]
    x = batch(0, 0)
    first = fp8(x).detach().clone()
    for step in range(3):
        for m, opt in zip((fp8, plain), opts, strict=True):
            opt.zero_grad()
            m(batch(step, 0)).float().square().sum().backward()
            opt.step()
    assert not torch.equal(fp8(x), first)
    assert torch.equal(fp8(x), plain(x))
    for a, b in zip(fp8.parameters(), plain.parameters(), strict=True):
        hp = a.high_precision() if isinstance(a, f8fsdp.Float8AllGatherWeight) else a
        assert torch.equal(hp, b)


def test_the_option_cannot_change_under_a_fused_optimizer():
    """Switching enable_fsdp_float8_all_gather replaces the weight Parameter: refused
    once a fused optimizer holds it (it would step the orphan), nothing changed."""
    model = make_model(False)
    FusedAdamW(model.parameters(), lr=1e-2)
    weight = model[0].weight
    with pytest.raises(ValueError, match="before building the optimizer"):
        model[0].set_recipe(FP8AG)
    assert model[0].weight is weight and model[0].recipe == Float8Recipe()


def test_convert_network_keeps_a_tied_weight_tied_under_fp8_all_gather():
    """An embedding tied to the head: the option would replace the head's weight
    Parameter and untie the two, so convert_network leaves that layer a bf16 Linear
    (with a warning naming it) and the tie holds; other layers still become fp8, and
    without the option the tied head is fp8 as before (the same Parameter, cast)."""
    import warnings

    import tkern

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.body = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 32, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    with pytest.warns(UserWarning, match="head stay torch.bfloat16 layers, not fp8: their weight is tied"):
        tkern.convert_network(m, torch.bfloat16, float8=FP8AG)
    assert m.head.weight is m.emb.weight and type(m.head) is tkern.nn.Linear
    assert isinstance(m.body, Float8Linear) and isinstance(m.body.weight, f8fsdp.Float8AllGatherWeight)
    plain = Tied()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tkern.convert_network(plain, torch.bfloat16, float8="tensorwise")
    assert isinstance(plain.head, Float8Linear) and plain.head.weight is plain.emb.weight


def test_a_shard_cast_with_the_whole_amax_is_that_rows_whole_cast():
    """to_float8_with_amax (the shard cast) against to_float8 of the whole tensor: the
    rows of every piece, cast with the max of the pieces' amaxes, are the whole cast's
    rows, bit for bit, and the scale is the whole cast's (an empty piece included)."""
    from tkern import to_float8
    from tkern.kernels.float8 import to_float8_with_amax

    g = torch.Generator().manual_seed(3)
    whole = (torch.randn(9, 40, generator=g) * 7).to(torch.bfloat16)
    data, scale = to_float8(whole)
    pieces = [whole[:5], whole[5:], whole[9:]]
    amax = torch.stack([p.abs().amax().float() if p.numel() else torch.zeros(()) for p in pieces])
    got = [to_float8_with_amax(p, amax) for p in pieces]
    assert all(torch.equal(s, scale) for _, s in got)
    assert torch.equal(torch.cat([d for d, _ in got]).view(torch.uint8), data.view(torch.uint8))
    # a piece's own amax is another scale: the comparison above can fail
    own, own_scale = to_float8_with_amax(pieces[1], amax[1:2])
    assert not torch.equal(own_scale, scale)
    with pytest.raises(ValueError, match="amax"):
        to_float8_with_amax(whole, torch.zeros(0))
    with pytest.raises(TypeError, match="amax"):
        to_float8_with_amax(whole, amax.double())


def test_convert_network_state_dicts_and_converting_back():
    """convert_network(float8=<the recipe>) wraps the weights; state dicts load both ways
    (the values, as plain tensors or wrappers); converting to fp32 gives plain Parameters."""
    from torch import nn

    import tkern

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))

    fp8 = tkern.convert_network(build(), torch.bfloat16, float8=FP8AG)
    plain = tkern.convert_network(build(), torch.bfloat16, float8="tensorwise")
    assert [type(m.weight) for m in (fp8[0], fp8[2])] == [f8fsdp.Float8AllGatherWeight] * 2
    x = batch(0, 0)
    assert torch.equal(fp8(x), plain(x))
    with torch.no_grad():
        plain[0].weight.mul_(2)
    fp8.load_state_dict(plain.state_dict())
    assert type(fp8[0].weight) is f8fsdp.Float8AllGatherWeight and torch.equal(fp8(x), plain(x))
    fp8.load_state_dict(build().to(torch.bfloat16).state_dict())
    plain.load_state_dict(fp8.state_dict())
    assert type(plain[0].weight) is torch.nn.Parameter and torch.equal(fp8(x), plain(x))
    tkern.convert_network(fp8, torch.float32)
    assert type(fp8[0]) is nn.Linear and type(fp8[0].weight) is torch.nn.Parameter
    assert fp8[0].weight.dtype == torch.float32


# ------------------------------------------------------------------ mxfp8 under FSDP2


def _rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of a param FSDP2 shards on dim 0 (even here: 96, 32 and 96 rows)."""
    n = full.shape[0] // world
    return full[rank * n : (rank + 1) * n]


def test_mxfp8_sharded_forward_is_the_whole_models_bit_for_bit(world2):
    for res in result(world2, "mx"):
        assert res["types"] == ["FSDPFloat8Linear"] * 2  # fully_shard's class over Float8Linear
        assert res["y"].dtype == torch.bfloat16 and torch.equal(res["y"], res["twin_y"])


def test_mxfp8_sharded_gradients_are_the_mean_of_the_ranks_within_two_bf16_roundings(world2):
    ranks = result(world2, "mx")
    for rank, res in enumerate(ranks):
        assert len(res["grads"]) == 3
        for g, ref in zip(res["grads"], res["twin_mean_grads"], strict=True):
            ref = _rows(ref, rank, len(ranks))
            assert g.dtype == torch.bfloat16 and g.shape == ref.shape
            assert ref.abs().max() > 0
            torch.testing.assert_close(g.float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def test_mxfp8_fused_adamw_steps_the_shards_as_torchs_adamw_on_their_gradients(world2):
    # the reference: torch's AdamW in fp32 from the twin's rows (the shard's starting
    # values) with the gradient the shard was given, rounded once to bf16
    ranks = result(world2, "mx")
    for rank, res in enumerate(ranks):
        start = [_rows(p, rank, len(ranks)).float().requires_grad_() for p in res["twin_params"]]
        ref_opt = torch.optim.AdamW(start, lr=MX_LR, weight_decay=0.0)
        for p, g in zip(start, res["grads"], strict=True):
            p.grad = g.float()
        ref_opt.step()
        for p, ref in zip(res["params"], start, strict=True):
            assert p.dtype == torch.bfloat16
            torch.testing.assert_close(p, ref.detach().to(torch.bfloat16), rtol=0, atol=0)
