"""convert_network: which modules become what, and that the result runs."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import DEVICE, rel_err
from torch import nn

import tkern
from tkern.nn import convert_network


def test_apex_fastai_rule_linear_bn_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 30), nn.BatchNorm1d(30), nn.Linear(30, 2)).to(DEVICE)
    reference = [p.detach().clone() for p in model.parameters()]
    keys = list(model.state_dict())
    assert convert_network(model) is model
    assert isinstance(model[0], tkern.nn.Linear) and isinstance(model[2], tkern.nn.Linear)
    assert [p.dtype for p in model[0].parameters()] == [torch.float16] * 2
    assert [p.dtype for p in model[1].parameters()] == [torch.float32] * 2
    assert model[1].running_mean.dtype == model[1].running_var.dtype == torch.float32
    assert [p.dtype for p in model[2].parameters()] == [torch.float16] * 2
    assert list(model.state_dict()) == keys  # same names: checkpoints still load
    for p, r in zip(model.parameters(), reference, strict=True):
        assert torch.equal(p, r.to(p.dtype))
    x = torch.randn(8, 10, device=DEVICE)
    y = model(x.half())
    assert y.dtype == torch.float16
    # the same network in float64 from the converted weights (train-mode BN)
    ref = model[0].weight.double()
    h = x.half().double() @ ref.t() + model[0].bias.double()
    h = torch.nn.functional.batch_norm(
        h, None, None, model[1].weight.double(), model[1].bias.double(), training=True
    )
    out = h.half().double() @ model[2].weight.double().t() + model[2].bias.double()
    assert rel_err(y, out) < 5e-3  # three fp16 roundings in a row (u = 4.9e-4 each) plus BN's fp32


def test_layer_norm_and_group_norm_stay_fp32_and_return_half():
    model = nn.Sequential(
        nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.GroupNorm(4, 16)
    )
    convert_network(model.to(DEVICE), dtype=torch.bfloat16)
    # LayerNorm runs on tkern's norm kernel (fp32 statistics on the bf16 input), GroupNorm
    # on an fp32 copy of its input; both keep fp32 parameters (tests/test_norm.py: the rest)
    assert type(model[1]) is tkern.nn.LayerNorm and type(model[4]) is nn.GroupNorm
    assert model[1].weight.dtype == model[4].weight.dtype == torch.float32
    assert model[0].weight.dtype == model[3].weight.dtype == torch.bfloat16
    assert model(torch.randn(3, 8, device=DEVICE)).dtype == torch.bfloat16


def test_unknown_module_with_parameters_is_kept_fp32_with_a_warning():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.full((4,), 2.0))

        def forward(self, x):
            assert x.dtype == torch.float32  # it really runs in fp32
            return x * self.w

    model = nn.Sequential(nn.Linear(4, 4), Scale()).to(DEVICE)
    with pytest.warns(UserWarning, match=r"1 \(Scale\) is not a type tkern knows"):
        convert_network(model)
    assert model[1].w.dtype == torch.float32
    assert model(torch.randn(2, 4, device=DEVICE)).dtype == torch.float16


def test_embedding_is_cast_and_plain_modules_need_nothing():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Dropout(0.0), nn.Linear(8, 3), nn.ReLU()).to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_network(model)
    assert model[0].weight.dtype == torch.float16
    assert model(torch.tensor([[1, 2, 3]], device=DEVICE)).dtype == torch.float16


def test_frozen_linear_stays_frozen():
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    convert_network(model)
    assert not model[0].weight.requires_grad and model[0].bias.requires_grad


def test_bad_arguments():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        convert_network("model")
    with pytest.raises(TypeError, match="dtype must be torch.float16 or torch.bfloat16"):
        convert_network(nn.Sequential(nn.Linear(2, 2)), dtype=torch.float64)
    with pytest.raises(TypeError, match="bare nn.Linear"):
        convert_network(nn.Linear(2, 2))


# --------------------------------------------------------------------------- whole models


def _mlp_with_norms():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)
    ).to(DEVICE)


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_converted_model_with_norm_layers_pickles_and_deepcopies(how, tmp_path):
    import copy

    model = convert_network(_mlp_with_norms())
    if how == "torch.save":
        torch.save(model, tmp_path / "model.pt")
        other = torch.load(tmp_path / "model.pt", weights_only=False)
    else:
        other = copy.deepcopy(model)
    x = torch.randn(5, 6, device=DEVICE)
    model.eval(), other.eval()
    y = model(x)
    assert y.dtype == torch.float16 and torch.equal(other(x), y)  # the same hooks came along
    assert other[1].weight.dtype == torch.float32 and isinstance(other[0], tkern.nn.Linear)


class TiedLM(nn.Module):
    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tie_word_embeddings

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def test_tied_weights_stay_one_parameter():
    torch.manual_seed(0)
    model = TiedLM().to(DEVICE)
    count = sum(p.numel() for p in model.parameters())
    convert_network(model)
    assert model.head.weight is model.embed.weight
    assert model.head.weight.dtype == torch.float16
    assert sum(p.numel() for p in model.parameters()) == count
    # one training step moves both uses of the one weight
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([[1, 2, 3]], device=DEVICE)
    model(ids).float().logsumexp(-1).sum().backward()
    opt.step()
    assert model.head.weight is model.embed.weight


def test_other_shared_parameters_stay_shared():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared).to(DEVICE)
    other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(DEVICE)
    other[1].bias = other[0].bias
    convert_network(model), convert_network(other)
    assert model[0] is model[2] and len(list(model.parameters())) == 2
    assert other[1].bias is other[0].bias and len(list(other.parameters())) == 3


def test_cnn_accepts_the_same_fp32_input_as_before():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)
    ).to(DEVICE)
    x = torch.randn(2, 3, 6, 6, device=DEVICE)  # fp32, as the data loader gives it
    convert_network(model)
    y = model(x)
    assert y.dtype == torch.float16 and model[0].weight.dtype == torch.float16
    # the reference: the converted weights in float64, activations rounded to fp16 as autocast would
    h = torch.nn.functional.conv2d(
        x.half().double(), model[0].weight.double(), model[0].bias.double(), padding=1
    )
    h = torch.nn.functional.batch_norm(h.half().double(), None, None, model[1].weight.double(),
                                       model[1].bias.double(), training=True).relu()  # fmt: skip
    out = h.half().double().flatten(1) @ model[4].weight.double().t() + model[4].bias.double()
    assert rel_err(y, out) < 5e-3  # three fp16 roundings in a row plus BN's fp32
    y.float().sum().backward()
    assert model[0].weight.grad.dtype == torch.float16


class Scaled(nn.Module):
    """A root that owns a learned scale and has Linear children."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.register_buffer("shift", torch.zeros(3))
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))

    def forward(self, x):
        return self.body(x) * self.scale + self.shift


def test_module_owning_parameters_keeps_only_its_own_in_fp32_and_warns_once_per_type():
    model = nn.Sequential(Scaled(), Scaled()).to(DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_network(model)
    ours = [w for w in caught if "convert_network" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "0, 1 (Scaled)" in str(ours[0].message)
    assert ours[0].filename == __file__  # attributed to the user's call
    for sub in model:
        assert sub.scale.dtype == sub.shift.dtype == torch.float32
        assert isinstance(sub.body[0], tkern.nn.Linear) and sub.body[0].weight.dtype == torch.float16
    y = model[0].body(torch.randn(2, 4, device=DEVICE))
    assert y.dtype == torch.float16  # the children run in half precision


def _hooks(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def test_converting_twice_is_converting_once():
    once = convert_network(_mlp_with_norms())
    twice = convert_network(convert_network(_mlp_with_norms()))
    assert _hooks(once) == _hooks(twice) and max(max(h) for h in _hooks(twice)) == 1
    x = torch.randn(4, 6, device=DEVICE)
    assert torch.equal(once(x), twice(x))
    assert [p.dtype for p in once.parameters()] == [p.dtype for p in twice.parameters()]


def test_convert_back_to_float32_restores_plain_modules():
    model = _mlp_with_norms()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    convert_network(model)
    assert convert_network(model, torch.float32) is model
    assert [type(m) for m in model] == [
        nn.Linear,
        nn.LayerNorm,
        nn.ReLU,
        nn.Linear,
        nn.BatchNorm1d,
        nn.Linear,
    ]
    assert all(h == (0, 0) for h in _hooks(model))
    assert list(model.parameters()) == params  # the same Parameter objects, now fp32
    for k, v in model.state_dict().items():
        assert v.dtype == reference[k].dtype
        linear = k.split(".")[0] in ("0", "3", "5")  # a round trip through fp16: one rounding
        assert torch.equal(v, reference[k].half().float() if linear else reference[k]), k
    x = torch.randn(4, 6, device=DEVICE)
    assert model(x).dtype == torch.float32


def test_convert_back_refuses_a_fused_activation_before_changing_anything():
    model = nn.Sequential(nn.Linear(4, 4), tkern.nn.Linear(4, 4, activation="relu"))
    convert_network(model)
    with pytest.raises(ValueError, match=r"1 is a tkern.nn.Linear with activation='relu'"):
        convert_network(model, torch.float32)
    assert model[0].weight.dtype == torch.float16 and isinstance(model[0], tkern.nn.Linear)


def test_keep_fp32_params_computes_in_the_16_bit_dtype_on_fp32_weights():
    """FSDP2 owns the precision: params stay fp32, tkern's GEMMs run on the weight cast per
    forward (as autocast would) and the gradients arrive in fp32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.LayerNorm(4), nn.Embedding(3, 2))
    convert_network(model, torch.bfloat16, keep_fp32_params=True)
    assert isinstance(model[0], tkern.nn.Linear) and model[0].compute_dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    x = torch.randn(5, 8, device=DEVICE)
    model.to(DEVICE)
    y = model[:3](x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert {p.grad.dtype for p in model[:3].parameters()} == {torch.float32}
    # float64 reference on the bf16-rounded operands (bias fp32, added before the one rounding)
    w0, w2 = (m.weight.detach().to(torch.bfloat16).double() for m in (model[0], model[2]))
    h = torch.relu(x.to(torch.bfloat16).double() @ w0.t() + model[0].bias.double()).to(torch.bfloat16)
    ref = h.double() @ w2.t() + model[2].bias.double()
    assert rel_err(y, ref) < 2 * 8e-3  # two bf16 roundings in a row (tests/conftest.py: 8e-3 each)
    assert model[4].weight.dtype == torch.float32 and not model[4]._forward_pre_hooks  # left as it was
    convert_network(model, torch.float32)
    assert type(model[0]) is nn.Linear and not hasattr(model[0], "compute_dtype")


def test_keep_fp32_params_bad_arguments():
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="keep_fp32_params"):
        convert_network(model, torch.bfloat16, float8="tensorwise", keep_fp32_params=True)
    with pytest.raises(ValueError, match="keep_fp32_params"):
        convert_network(model, torch.float32, keep_fp32_params=True)
    with pytest.raises(TypeError, match="keep_fp32_params"):
        convert_network(model, torch.bfloat16, keep_fp32_params=1)
    assert type(model[0]) is nn.Linear  # nothing changed
    with pytest.raises(TypeError, match="compute_dtype"):
        tkern.nn.Linear(4, 4, dtype=torch.float32)
    layer = tkern.nn.Linear(4, 4, dtype=torch.float32, compute_dtype=torch.float16)
    assert (
        layer.weight.dtype == torch.float32
        and layer(torch.ones(2, 4, device=layer.weight.device)).dtype == torch.float16
    )


# --------------------------------------------------------------------------- transformers' own rules


def _t5():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config).to(DEVICE)


def test_keep_in_fp32_modules_keep_fp32_params_and_compute_under_fp16():
    model = _t5()
    assert set(model._keep_in_fp32_modules) == {"wo"}  # fp16 overflows there (transformers' own rule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_network(model)
    wo = [(n, m) for n, m in model.named_modules() if n.endswith(".wo")]
    assert len(wo) == 2 and all(type(m) is nn.Linear and m.weight.dtype == torch.float32 for _, m in wo)
    assert model.encoder.block[0].layer[1].DenseReluDense.wi.weight.dtype == torch.float16  # its sibling
    said = [str(w.message) for w in caught if "_keep_in_fp32_modules" in str(w.message)]
    assert len(said) == 1 and ", ".join(n for n, _ in wo) + " (Linear): kept in fp32" in said[0]
    seen = []
    wo[0][1].register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    ids = torch.tensor([[1, 2, 3, 4]], device=DEVICE)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and seen == [(torch.float32, torch.float32)]  # fp32 in, fp32 out
    assert wo[0][1].weight.grad.dtype == torch.float32
    convert_network(model, torch.float32)
    assert all(type(m) is nn.Linear and not m._forward_pre_hooks for _, m in wo)


def test_keep_in_fp32_modules_is_fp16_only_and_the_strict_list_holds_for_bf16():
    model = convert_network(_t5(), torch.bfloat16)  # bf16 has fp32's range: transformers keeps none
    assert all(isinstance(m, tkern.nn.Linear) for n, m in model.named_modules() if n.endswith(".wo"))

    class Strict(nn.Module):
        _keep_in_fp32_modules_strict = ["head.proj"]

        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = nn.ModuleDict({"proj": nn.Linear(4, 4)})

    model = Strict()
    with pytest.warns(UserWarning, match=r"head.proj \(Linear\): kept in fp32"):
        convert_network(model, torch.bfloat16)
    assert model.head.proj.weight.dtype == torch.float32 and model.body.weight.dtype == torch.bfloat16


def test_bert_warns_only_for_what_it_keeps_in_fp32():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16,
    )  # fmt: skip
    model = transformers.BertForMaskedLM(config).to(DEVICE)
    head = model.cls.predictions
    assert head.bias is head.decoder.bias
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_network(model)
    said = [str(w.message) for w in caught if "convert_network" in str(w.message)]
    # the embeddings own only integer buffers (position_ids, token_type_ids): nothing to keep
    assert not any("embeddings" in s for s in said), said
    assert model.bert.embeddings.position_ids.dtype == torch.int64
    # cls.predictions' own bias is its decoder's: a Linear's bias, 16-bit like every other
    assert not any("cls.predictions" in s for s in said), said
    assert head.bias is head.decoder.bias and head.bias.dtype == torch.float16
    ids = torch.tensor([[1, 2, 3, 4]], device=DEVICE)
    model(input_ids=ids, labels=ids).loss.backward()
    assert head.bias.grad.dtype == torch.float16


def test_a_module_owning_an_unshared_parameter_beside_a_child_keeps_only_that_in_fp32():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = nn.Linear(4, 6)
            self.bias = self.decoder.bias  # shared with the child: the child's
            self.scale = nn.Parameter(torch.ones(6))  # its own

        def forward(self, x):
            return self.decoder(x) * self.scale

    model = nn.Sequential(Head()).to(DEVICE)
    with pytest.warns(UserWarning, match=r"0 \(Head\) is not a type tkern knows"):
        convert_network(model)
    assert model[0].scale.dtype == torch.float32 and model[0].bias.dtype == torch.float16
    assert model[0].bias is model[0].decoder.bias
