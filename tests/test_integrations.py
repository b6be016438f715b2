"""tkern inside the stacks people train in: import order, HF transformers (GPT-2's
Conv1D, tied embeddings, save_pretrained/from_pretrained, generate); Lightning is
exercised by examples/lightning.py (tests/test_examples.py).

The optional packages come with ``pip install -e '.[integrations]'`` (`make test` installs
them); a test that needs one is skipped, naming it, when it is absent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DEVICE, rel_err

import tkern

# --------------------------------------------------------------------------- import order

# Runs a reduction kernel (the optimizer's gradient statistics use tl.sum / tl.max,
# triton.language's own @triton.jit helpers) and a GEMM, checked against torch.
_SMOKE = textwrap.dedent(
    """
    import torch, tkern
    assert tkern.mode() == "interpreted"
    x, w = torch.randn(8, 16).half(), torch.randn(4, 16).half()
    err = (tkern.linear(x, w).float() - x.float() @ w.float().t()).abs().max().item()
    assert err < 1e-2, err
    p = torch.nn.Parameter(torch.ones(40).half())
    opt = tkern.optim.FusedSGD([p], lr=0.5)
    p.grad = torch.full((40,), 2.0).half()
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(40).half()), p
    print("ok")
    """
)


def _run_fresh(first: str) -> subprocess.CompletedProcess:
    """A fresh interpreter that runs ``first`` and then imports tkern, without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(tkern.__file__)), *sys.path])
    return subprocess.run(
        [sys.executable, "-c", first + "\n" + _SMOKE], capture_output=True, text=True, env=env, timeout=300
    )


needs_cpu = pytest.mark.skipif(DEVICE == "cuda", reason="the import order matters only under the interpreter")


@needs_cpu
@pytest.mark.parametrize(
    "first",
    [
        "import triton",
        "import torch._inductor.runtime.triton_heuristics",  # what torch.compile loads
    ],
)
def test_triton_imported_before_tkern_works(first):
    proc = _run_fresh(first)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@needs_cpu
@pytest.mark.parametrize(
    "package, first",
    [("lightning", "import lightning"), ("transformers", "from transformers import GPT2LMHeadModel")],
)
def test_framework_imported_before_tkern_works(package, first):
    pytest.importorskip(package, reason=f"{package} is not installed (pip install -e '.[integrations]')")
    proc = _run_fresh(first)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# --------------------------------------------------------------------------- HF transformers


def _tiny_gpt2():
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[integrations]')"
    )
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers, transformers.GPT2LMHeadModel(config).to(DEVICE)


def test_gpt2_conv1d_runs_on_tkern_with_names_shapes_and_ties_unchanged():
    transformers, model = _tiny_gpt2()
    ref = transformers.GPT2LMHeadModel(model.config).to(DEVICE)
    ref.load_state_dict(model.state_dict())
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    count = sum(p.numel() for p in model.parameters())
    tkern.convert_network(model)
    conv = model.transformer.h[0].attn.c_attn
    assert type(conv) is tkern.nn.Conv1D and isinstance(conv, transformers.pytorch_utils.Conv1D)
    assert conv.weight.dtype == torch.float16 and conv.weight.shape == (32, 96)  # (in, out), as HF stores it
    assert type(model.lm_head) is tkern.nn.Linear
    assert model.lm_head.weight is model.transformer.wte.weight  # tie_word_embeddings
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    assert sum(p.numel() for p in model.parameters()) == count
    # every Conv1D of the block runs as tkern's
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, o: calls.append(type(m)) if type(m) is tkern.nn.Conv1D else None
    )
    try:
        ids = torch.randint(0, 64, (2, 12), device=DEVICE)
        out = model(ids, labels=ids)
    finally:
        handle.remove()
    assert calls.count(tkern.nn.Conv1D) == 4  # c_attn, c_proj, c_fc, mlp.c_proj
    with torch.no_grad():
        expected = ref.eval()(ids, labels=ids)
    model.eval()
    with torch.no_grad():
        got = model(ids, labels=ids)
    # fp16 weights and activations against fp32: a few fp16 roundings per layer
    assert got.logits.dtype == torch.float16
    assert rel_err(got.logits, expected.logits) < 5e-3
    assert abs(got.loss.item() - expected.loss.item()) < 5e-3
    assert out.loss.requires_grad


def test_gpt2_trains_saves_loads_and_generates(tmp_path):
    transformers, model = _tiny_gpt2()
    tkern.convert_network(model)
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=1e-2)
    scaler = tkern.DynamicLossScaler()
    ids = torch.randint(0, 64, (2, 8), device=DEVICE)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[1] < losses[0]
    model.save_pretrained(tmp_path)
    # the file holds fp16 Linear/Conv1D weights and fp32 LayerNorms; load it as fp32
    # (from_pretrained would otherwise cast everything to the config's fp16) and convert
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float32).to(DEVICE)
    tkern.convert_network(back)
    mine, theirs = model.state_dict(), back.state_dict()
    assert list(mine) == list(theirs)
    for k in mine:
        assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), k
    assert back.lm_head.weight is back.transformer.wte.weight
    model.eval(), back.eval()
    prompt = ids[:1, :4]
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8) and torch.equal(out[:, :4], prompt)
    assert torch.equal(back.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0), out)
    # greedy decoding agrees with the model's own argmax on the generated prefix
    with torch.no_grad():
        logits = model(out[:, :-1]).logits
    assert torch.equal(logits[0, 3:].argmax(-1), out[0, 4:])


def test_gpt2_converted_model_pickles(tmp_path):
    _, model = _tiny_gpt2()
    tkern.convert_network(model).eval()
    torch.save(model, tmp_path / "gpt2.pt")
    other = torch.load(tmp_path / "gpt2.pt", weights_only=False)
    ids = torch.randint(0, 64, (1, 6), device=DEVICE)
    with torch.no_grad():
        assert torch.equal(other(ids).logits, model(ids).logits)
    assert type(other.transformer.h[0].mlp.c_fc) is tkern.nn.Conv1D


def test_gpt2_convert_back_restores_hf_conv1d():
    transformers, model = _tiny_gpt2()
    tkern.convert_network(model)
    tkern.convert_network(model, torch.float32)
    assert type(model.transformer.h[0].attn.c_attn) is transformers.pytorch_utils.Conv1D
    assert type(model.lm_head) is torch.nn.Linear
    assert all(p.dtype == torch.float32 for p in model.parameters())


# --------------------------------------------------------------------------- what users see


@needs_cpu
def test_interpreter_numpy_warnings_do_not_reach_users_and_tkern_imports_no_framework():
    # An fp16 GEMM whose result overflows: numpy warns inside Triton's interpreter. The
    # user's own numpy code still gets its warning.
    code = textwrap.dedent(
        """
        import numpy as np, torch, tkern
        x = torch.full((4, 16), 200.0).half()
        y = tkern.linear(x, x)
        assert torch.isinf(y).all()
        np.array([1e10]).astype(np.float16)
        import sys
        assert "transformers" not in sys.modules  # tkern never imports it itself
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(tkern.__file__))
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("overflow encountered in cast") == 1, proc.stderr  # the user's, not ours
    assert "interpreter.py" not in proc.stderr
