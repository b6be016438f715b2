"""The step ledger (benchmarks/step_ledger.py) counts one training step on the CPU:
its FLOPs agree with the analytic count, its launch counts with the model's layers,
its bytes with a known op's, and it is the same on every run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE
from torch import nn

import tkern

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

pytest.importorskip("transformers")
# the ledger runs a step on CPU tensors with every launch recorded, not run: a CPU's job
pytestmark = pytest.mark.skipif(DEVICE == "cuda", reason="the step ledger counts on the CPU")


@pytest.fixture(scope="module")
def sl():
    import step_ledger

    return step_ledger


@pytest.fixture(scope="module")
def tkern_tiny(sl):
    return sl.run("gpt2-tiny", "tkern").payload()


def _by_name(payload) -> dict:
    return {c["name"]: c for c in payload["categories"]}


def _gpt2_flops(cfg: dict, seq: int, batch: int) -> int:
    """GPT-2's step FLOPs from its config alone: 12 d^2 GEMM weights per block, the
    tied head's V x d, 6 FLOPs per weight per token; attention 12 L T S d."""
    d, layers, vocab, tokens = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"], seq * batch
    return 6 * (12 * d * d * layers + vocab * d) * tokens + 12 * layers * tokens * seq * d


def _llama_flops(cfg: dict, seq: int, batch: int) -> int:
    d, i, layers, tokens = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], seq * batch
    return (
        6 * ((4 * d * d + 3 * d * i) * layers + cfg["vocab_size"] * d) * tokens
        + 12 * layers * tokens * seq * d
    )


@pytest.mark.parametrize(
    "model,recipe",
    [
        ("gpt2-tiny", "tkern"),
        ("gpt2-tiny", "torch autocast"),
        ("gpt2-tiny", "torch autocast fused"),
        ("llama-tiny", "tkern"),
        ("llama-tiny", "tkern fp8 delayed"),
        ("llama-tiny", "tkern fp8 mxfp8"),  # the MX GEMMs as Triton launches, with their FLOPs
    ],
)
def test_flops_agree_with_the_analytic_count_and_nothing_is_unclassified(sl, model, recipe):
    payload = sl.run(model, recipe).payload()
    spec = sl.MODELS[model]
    expected = (_gpt2_flops if spec.family == "gpt2" else _llama_flops)(spec.config, spec.seq, spec.batch)
    assert payload["analytic_flops"]["total"] == expected
    assert payload["totals"]["flops"] == pytest.approx(expected, rel=0.03)
    cats = _by_name(payload)
    assert cats["other"]["launches"] == 0, [r for r in payload["ops"] if r["category"] == "other"]
    # every category's floor is its launches' roofline: the GEMMs' FLOPs at the peak at least
    peak = payload["spec"]["bf16_tflops"] * (2 if "fp8" in recipe else 1) * 1e12
    for name in sl.GEMM_CATEGORIES:
        assert cats[name]["floor_ms"] >= 1e3 * cats[name]["flops"] / peak * 0.999
    assert payload["totals"]["floor_ms"] == pytest.approx(sum(c["floor_ms"] for c in payload["categories"]))


def _gemm_layers(model: nn.Module) -> int:
    """GEMM layers of the blocks (Linear / Conv1D, the head left out), counted on the model."""
    return sum(
        1
        for name, m in model.named_modules()
        if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D") and not name.endswith("lm_head")
    )


@pytest.mark.parametrize("recipe", ["tkern", "torch autocast"])
def test_launch_counts_match_the_model_layers(sl, recipe, tkern_tiny):
    payload = tkern_tiny if recipe == "tkern" else sl.run("gpt2-tiny", recipe).payload()
    spec = sl.MODELS["gpt2-tiny"]
    layers = _gemm_layers(spec.build())
    assert layers == 4 * spec.layers  # c_attn, c_proj, c_fc, mlp c_proj per block
    cats = _by_name(payload)
    assert cats["gemm fwd"]["launches"] == layers
    # tkern: c_attn's dgrad and wgrad one GEMM per part of its split (q, k, v: split_linear)
    parts = 2 * spec.layers if recipe == "tkern" else 0
    for role in ("gemm dgrad", "gemm wgrad"):
        assert cats[role]["launches"] == layers + parts, role
    if recipe == "tkern":  # the fused loss: per chunk its logits parts, one dgrad, one wgrad
        chunks = _loss_chunks(spec)
        assert cats["gemm lm head"]["launches"] == sum(len(parts) + 2 for _, parts in chunks)
    else:
        assert cats["gemm lm head"]["launches"] == 3  # forward, dgrad, wgrad of the tied head
    assert cats["attention"]["launches"] == 2 * spec.layers  # SDPA forward and backward per block
    logits = spec.tokens * spec.vocab
    if recipe == "tkern":  # the fused loss: its cross-entropy kernel, and scalars only of torch's
        aten = [r for r in payload["ops"] if r["category"] == "loss" and r["name"].startswith("aten.")]
        assert aten and sum(r["bytes"] for r in aten) < 1024, aten
        # its one pass over each fp32 logits chunk (the lse from the GEMM's row statistics,
        # 8 bytes a row per 32 columns, read) and the fp16 gradient written: 6 bytes an
        # element, a few more a row
        stats = 8 * spec.tokens * -(-spec.vocab // 32)
        assert logits * 6 + stats <= cats["loss"]["bytes"] < logits * 6 + stats + 64 * spec.tokens
    else:  # the loss reads the (tokens x vocab) logits: at least its fp32 copy written and read back
        assert cats["loss"]["bytes"] >= 2 * logits * 4


def _loss_chunks(spec) -> list[tuple[int, list[int]]]:
    """The fused loss's chunks at ``spec``'s size by its default rule: (rows, [rows of each
    logits part]) per chunk."""
    from tkern.ops.loss_chunks import default_chunk_rows, logits_rows

    t = spec.tokens
    chunk = default_chunk_rows(t, spec.width, spec.vocab)
    part = logits_rows(chunk)
    spans = [min(chunk, t - s) for s in range(0, t, chunk)]
    return [(c, [min(part, c - a) for a in range(0, c, part)]) for c in spans]


def test_bytes_of_known_launches(sl, tkern_tiny):
    """The head's GEMMs under the fused loss (fp16 operands; this size's 96 rows of 64 into
    1000 take two chunks, 64 + 32 rows, in logits parts of 16): each part's logits
    x (p x d) @ W^T (V x d) written in fp32 (p x V) with their softmax statistics (an fp32
    (max, sum) pair per row and 32 columns, ROW_STATS); each chunk's dgrad from its fp16
    gradient g (c x V) @ W and its wgrad g^T @ x into an fp32 (V x d) buffer, written by the
    first chunk and read and written by the next (the accumulating kernel); the Adam pass
    reads grad (2 B), writes the param (2 B) and reads and writes the master and two moments
    (fp32): 28 B per element of the flat buffer (DESIGN.md)."""
    spec = sl.MODELS["gpt2-tiny"]
    d, v = spec.width, spec.vocab
    chunks = _loss_chunks(spec)
    assert [c for c, _ in chunks] == [64, 32] and chunks[0][1] == [16] * 4
    ops = {r["name"]: r for r in tkern_tiny["ops"] if r["category"] == "gemm lm head"}
    logits = sum(2 * (p * d + v * d) + 4 * p * v + 8 * p * -(-v // 32) for _, ps in chunks for p in ps)
    dgrads = sum(2 * (c * v + v * d + c * d) for c, _ in chunks)
    wgrads = [2 * (c * v + c * d) + (4 if i == 0 else 8) * v * d for i, (c, _) in enumerate(chunks)]
    plain, accumulate = (
        ops["triton.gemm_tma._matmul_tma_kernel"],
        ops["triton.gemm_tma._matmul_tma_accumulate_kernel"],
    )
    assert plain["launches"] == sum(len(ps) for _, ps in chunks) + len(chunks) + 1
    assert plain["bytes"] == logits + dgrads + wgrads[0]
    assert accumulate["launches"] == 1 and accumulate["bytes"] == wgrads[1]
    adam = [r for r in tkern_tiny["ops"] if r["name"] == "triton.adam._adam_kernel"]
    assert adam[0]["launches"] == 2  # the fp16 params with a master, the fp32 (norm) params without
    # fp32 params without a master: grad 4 B, param written 4 B, the two moments read and written 16 B
    model = tkern.convert_network(spec.build())
    n16 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float16)
    n32 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)
    floor = 28 * n16 + 24 * n32
    assert floor <= adam[0]["bytes"] <= floor * 1.02  # the flat buffers' padding and a few scalars


def test_epilogue_tensors_beside_c_are_priced(sl):
    """A GEMM's epilogue that reads the residual stream beside C (ADD_RESIDUAL) pays its
    (M, N) read; one that writes the head's row statistics (ROW_STATS) pays their bytes."""
    from ledger_costs import triton_cost

    spec = sl.MODELS["gpt2-tiny"]
    m, n, k = 64, 96, 32
    base = {
        "M": m, "N": n, "K": k, "a_ptr": torch.empty(m, k, dtype=torch.bfloat16),
        "b_ptr": torch.empty(k, n, dtype=torch.bfloat16), "c_ptr": torch.empty(m, n, dtype=torch.bfloat16),
    }  # fmt: skip
    plain = triton_cost("gemm._matmul_kernel", base, spec, False)[1]
    residual = {**base, "ADD_RESIDUAL": True, "preact_ptr": torch.empty(m, n, dtype=torch.bfloat16)}
    assert triton_cost("gemm._matmul_kernel", residual, spec, False)[1] == plain + 2 * m * n
    stats = {**base, "ROW_STATS": True, "preact_ptr": torch.empty(m, n // 32, 2)}
    assert triton_cost("gemm._matmul_kernel", stats, spec, False)[1] == plain + 8 * m * (n // 32)


def test_ledger_is_deterministic_and_compares(sl, tkern_tiny):
    again = sl.run("gpt2-tiny", "tkern").payload()
    assert json.dumps(again, sort_keys=True) == json.dumps(tkern_tiny, sort_keys=True)
    text = sl.compare(tkern_tiny, again)
    assert "gemm fwd" in text and "total" in text
    assert "loss" in sl.table(tkern_tiny)


def test_device_specs_routing_and_cli(sl, tmp_path, capsys, tkern_tiny):
    """``--device`` takes any named ``tkern.device.SPECS`` entry (issue 52 item 6): the floors
    come from its peaks, and tkern's GEMMs take the routes that device's plan gives them
    (issue 54 item 2): the H200's TMA kernel for the aligned head GEMMs, the A100's pointer
    kernel (no TMA) for all."""
    from tkern.device import SPECS

    assert set(sl.DEVICES) == set(SPECS)
    h200 = sl.device_peaks("h200")
    assert (h200.bf16, h200.fp8, h200.hbm_tbps) == (SPECS["h200"].tflops_16bit, SPECS["h200"].tflops_fp8, 4.8)
    assert h200.peak_tflops(torch.float8_e4m3fn) == pytest.approx(
        2 * h200.peak_tflops(torch.bfloat16), rel=1e-3
    )
    assert sl.device_peaks("a100").fp8 == SPECS["a100"].tflops_16bit  # no fp8 tensor cores
    with pytest.raises(ValueError, match="compiled"):
        sl.run("gpt2-tiny", "torch autocast compiled")
    with pytest.raises(ValueError, match="device"):
        sl.run("gpt2-tiny", "tkern", "h300")
    out = tmp_path / "ledger.json"
    payload = sl.main(["--model", "gpt2-tiny", "--recipe", "tkern", "--device", "a100", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["device"] == "a100" and written["totals"] == payload["totals"]
    assert written["spec"]["bf16_tflops"] == 312.0 and written["spec"]["hbm_tbps"] == 2.039
    assert [c["name"] for c in written["categories"]] == list(sl.CATEGORIES)
    assert "floor ms" in capsys.readouterr().out
    names = {r["name"] for r in tkern_tiny["ops"]}
    assert "triton.gemm_tma._matmul_tma_kernel" in names
    assert not any("tma" in r["name"] for r in written["ops"])
    assert written["totals"]["floor_ms"] > tkern_tiny["totals"]["floor_ms"]  # the A100's lower peaks


def test_gpt2_small_at_its_real_shape_counts_the_known_14_tflop(sl):
    """GPT-2 small at seq 1024 x batch 16 (DESIGN.md: 14.0 TFLOP per step, 8.35 in the
    blocks' GEMMs, 3.79 in the head, 1.86 in attention): a few seconds, nothing computed."""
    payload = sl.run("gpt2-small", "tkern").payload()
    expected = _gpt2_flops(sl.MODELS["gpt2-small"].config, 1024, 16)
    assert payload["totals"]["flops"] == pytest.approx(expected, rel=0.03)
    cats = _by_name(payload)
    blocks = sum(cats[c]["flops"] for c in ("gemm fwd", "gemm dgrad", "gemm wgrad"))
    assert blocks / 1e12 == pytest.approx(8.35, abs=0.01)
    assert cats["gemm lm head"]["flops"] / 1e12 == pytest.approx(3.79, abs=0.01)
    assert cats["attention"]["flops"] / 1e12 == pytest.approx(1.86, abs=0.01)
    # the H200's plan: split-K (workspace, then its reduction) for the wgrads' few output tiles
    names = {r["name"] for r in payload["ops"]}
    assert {
        "triton.gemm_split._matmul_split_k_kernel",
        "triton.gemm_split._split_k_reduce_kernel",
    } <= names, names
    # issue 42's target: at most half the 123.8 GB outside the GEMMs before its fusions
    assert payload["totals"]["bytes_outside_gemms"] <= 0.5 * 123.8e9


def test_cross_entropy_kernel_is_charged_every_pass_over_its_logits(sl):
    """Issue 54 item 4: the kernel reads each logits row once for the lse (pass 1) and once
    more for the gradient (pass 2, fused into the forward or the backward's own launch)."""
    import ledger_record

    from tkern.kernels import cross_entropy as ce

    rec = ledger_record._Recorder(sl.MODELS["gpt2-tiny"], False)
    rec.on = True
    n, v = 64, 1000
    logits, target = torch.empty(n, v, dtype=torch.float16), torch.zeros(n, dtype=torch.int64)
    lse, a = torch.zeros(n), torch.ones(1)
    with ledger_record.recorded_launches(rec):
        ce.cross_entropy_forward(logits, target)  # pass 1 only
        ce.cross_entropy_forward(logits, target, grad=torch.empty_like(logits), a=a)  # both passes
        ce.cross_entropy_backward(logits, target, lse, a)  # pass 2 only
    kernel = [x.bytes for x in rec.launches if x.name == "triton.cross_entropy._cross_entropy_kernel"]
    one, both, back = kernel
    # the targets' check before each forward: the (n,) int64 targets read, 5 fp32 stats written
    stats = [x.bytes for x in rec.launches if x.name == "triton.cross_entropy._target_stats_kernel"]
    assert stats == [n * 8 + 20] * 2
    logits_bytes = n * v * 2
    assert logits_bytes < one < logits_bytes + 64 * n  # the logits once, a few bytes a row
    assert both - one >= 2 * logits_bytes  # read again and the gradient written
    assert 2 * logits_bytes <= back < both  # read once, the gradient written


def test_dgrad_epilogues_are_charged_what_they_read_and_write(sl):
    """The GEMM that produces dZ = (dY @ W) * act'(Z) reads Z beside its operands; a gated
    unit's (gemm.matmul_grad_glu) reads gate and up and writes d(gate) and d(up)."""
    import ledger_record

    from tkern.kernels import gemm

    rec = ledger_record._Recorder(sl.MODELS["gpt2-tiny"], False)
    rec.on = True
    m, k, n = 64, 32, 48
    dy, w = torch.empty(m, k, dtype=torch.float16), torch.empty(k, n, dtype=torch.float16)
    with ledger_record.recorded_launches(rec):
        tkern.matmul(dy, w)
        gemm.matmul_grad_act(dy, w, torch.empty(m, n, dtype=torch.float16), "gelu_tanh")
        gemm.matmul_grad_glu(dy, w, torch.empty(m, 2 * n, dtype=torch.float16), "silu")
    plain, act, glu = [x.bytes for x in rec.launches if x.name.startswith("triton.gemm")]
    assert plain == 2 * (m * k + k * n + m * n)
    assert act == plain + 2 * m * n  # Z read
    assert glu == plain + 2 * 3 * m * n  # gate and up read, d(up) written beside d(gate)


def test_the_up_gemm_with_the_gated_unit_is_charged_gate_read_and_h_written(sl):
    """The up GEMM whose epilogue computes h = act(gate) * up (gemm.matmul_glu_prechecked)
    writes up and h and reads the stored gate beside its operands (and its bias)."""
    import ledger_record

    from tkern.kernels import gemm

    rec = ledger_record._Recorder(sl.MODELS["gpt2-tiny"], False)
    rec.on = True
    m, k, n = 64, 32, 48
    x, w = torch.empty(m, k, dtype=torch.float16), torch.empty(k, n, dtype=torch.float16)
    bias = torch.empty(n, dtype=torch.float16)
    with ledger_record.recorded_launches(rec):
        tkern.matmul(x, w)
        gemm.matmul_glu_prechecked(x, w, bias, torch.empty(m, 2 * n, dtype=torch.float16), "silu")
    plain, glu = [x.bytes for x in rec.launches if x.name.startswith("triton.gemm")]
    assert plain == 2 * (m * k + k * n + m * n)
    assert glu == plain + 2 * n + 2 * 2 * m * n  # the bias, gate read, up written beside h


def test_norm_parameter_gradients_are_charged_their_partials_and_gradients(sl):
    """The norm's dweight / dbias reduction (one launch for both) reads the backward's (P, N)
    fp32 partials for each output and writes the (N,) gradient, or reads and writes it where
    it adds into a fused optimizer's flat buffer; RMSNorm has no dbias."""
    import ledger_record

    from tkern.kernels import norm

    rec = ledger_record._Recorder(sl.MODELS["gpt2-tiny"], False)
    rec.on = True
    p, n = 4, 96
    w16 = torch.empty(n, dtype=torch.float16)
    parts = [torch.empty(p, n) for _ in range(2)]
    with ledger_record.recorded_launches(rec):
        norm.param_grads_prechecked(*parts, (torch.empty(n), False), (torch.empty(n), False))
        norm.param_grads_prechecked(*parts, (w16, True), (torch.empty(n), False))
        norm.param_grads_prechecked(parts[0], None, (torch.empty(n), False), None)
    costs = [(x.category, x.bytes) for x in rec.launches if x.name == "triton.norm._norm_param_grads_kernel"]
    partials = 4 * p * n
    assert costs == [
        ("norm", 2 * (partials + 4 * n)),
        ("norm", partials + 2 * 2 * n + partials + 4 * n),
        ("norm", partials + 4 * n),
    ]


def test_nll_loss_and_slice_backward_are_charged_what_a_gpu_touches(sl):
    """Issue 54 item 5: nll_loss gathers one logit per row (not the row), its backward
    zero-fills the gradient and writes one element per row; slice_backward zero-fills the
    whole gradient, then copies the slice's gradient in (two launches each)."""
    import ledger_record

    rec = ledger_record._Recorder(sl.MODELS["gpt2-tiny"], False)
    rec.on = True
    n, v = 64, 1000
    with ledger_record.NoCompute(rec):
        logp, target = torch.empty(n, v), torch.zeros(n, dtype=torch.int64)
        loss, total = torch.ops.aten.nll_loss_forward(logp, target, None, 1, -100)
        torch.ops.aten.nll_loss_backward(torch.ones(()), logp, target, None, 1, -100, total)
        torch.ops.aten.slice_backward(torch.empty(n, v), [n, v + 1], 1, 0, v, 1)
    by = {}
    for x in rec.launches:
        by.setdefault(x.name, []).append(x.bytes)
    small = n * (8 + 4) + 16  # the targets, one fp32 logit or gradient a row, scalars
    assert len(by["aten.nll_loss_forward"]) == 1 and by["aten.nll_loss_forward"][0] <= small
    fill, scatter = by["aten.nll_loss_backward"]
    assert fill == n * v * 4 and scatter <= small
    assert by["aten.slice_backward"] == [n * (v + 1) * 4, 2 * n * v * 4]


def test_autocast_runs_cuda_autocasts_op_lists(sl):
    """Issue 54 item 1: inside ``cuda_autocast_lists`` CPU autocast gives ops the dtypes CUDA
    autocast gives them (``pow``, ``exp``, ``softmax``, ``layer_norm``, ``sum`` in fp32; ``mv`` in
    fp16), an explicit dtype is kept, and nothing stays registered after it; every op of the
    lists is one CUDA autocast registers. In the ledger, HF GPT-2's GELU chain (``pow``,
    ``tanh``) reads and writes fp32, as on a GPU."""
    import ledger_autocast as la

    x = torch.randn(4, 8, dtype=torch.float16)
    with torch.autocast("cpu", torch.float16):
        assert torch.pow(x, 3.0).dtype == torch.float16  # CPU autocast's lists
        with la.cuda_autocast_lists():
            for y in (
                torch.pow(x, 3.0),
                torch.exp(x),
                torch.softmax(x, -1),
                x.sum(),
                nn.functional.layer_norm(x, (8,)),
            ):
                assert y.dtype == torch.float32
            assert torch.softmax(x, -1, dtype=torch.float16).dtype == torch.float16
            assert torch.mv(x.float(), x[0].float()).dtype == torch.float16
            assert torch.mm(x.float(), x.float().t()).dtype == torch.float16
        assert torch.pow(x, 3.0).dtype == torch.float16 and torch.exp(x).dtype == torch.float16
    for name in la.policies():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCUDA"), name
    payload = sl.run("gpt2-tiny", "torch autocast").payload()
    spec = sl.MODELS["gpt2-tiny"]
    gelu_elems = spec.tokens * 4 * spec.width
    for op in ("aten.pow", "aten.tanh"):
        row = next(r for r in payload["ops"] if r["name"] == op)
        assert row["bytes"] == row["launches"] * gelu_elems * 8, op  # fp32 in, fp32 out


@pytest.mark.parametrize("recipe", ["torch autocast", "tkern"])
def test_positions_are_real_so_hf_builds_no_packed_sequence_mask(sl, recipe):
    """Issue 54 item 3: ``arange`` and ops on integer tensors up to ``SMALL_INT_BYTES`` (GPT-2
    small's (16, 1024) int64 position ids among them) are computed, so HF's packed-sequence
    check sees positions 0, 1, ... and, as on a GPU, builds no (batch, 1, seq, seq) mask."""
    import ledger_record

    rec = ledger_record._Recorder(sl.MODELS["gpt2-tiny"], False)
    with ledger_record.NoCompute(rec):
        pos = torch.arange(1024).expand(16, 1024).contiguous()
        assert bool((torch.diff(pos, dim=-1) == 1).all()) and int(pos[3, 7]) == 7
        assert int(torch.ones(4096, 4096).sum()) == 0  # a large float tensor is still not computed
    spec = sl.MODELS["gpt2-tiny"]
    mask = f"({spec.batch}, 1, {spec.seq}, {spec.seq})"
    launches = sl.run("gpt2-tiny", recipe).launches
    assert launches and not [x.name for x in launches if mask in x.shapes]


def test_the_fused_eager_baseline(sl):
    """Issue 54 item 6: ``torch autocast fused`` is HF's GPT-2 under autocast with one tanh GELU
    kernel each way per block (no ``pow`` / ``tanh`` chain) and the loss over a view of the
    logits (no fp32 copy of the shifted logits): fewer bytes than ``torch autocast``, the same
    GEMMs, FLOPs and model."""
    import train_recipes

    spec = sl.MODELS["gpt2-tiny"]
    fused = sl.run("gpt2-tiny", "torch autocast fused").payload()
    plain = sl.run("gpt2-tiny", "torch autocast").payload()
    ops = {r["name"]: r for r in fused["ops"]}
    assert ops["aten.gelu"]["launches"] == ops["aten.gelu_backward"]["launches"] == spec.layers
    assert "aten.pow" not in ops and "aten.tanh" not in ops
    logits = spec.tokens * spec.vocab
    clones = [r for r in fused["ops"] if r["category"] == "loss" and r["name"] == "aten.clone"]
    assert all(r["bytes"] < logits for r in clones), clones
    assert fused["totals"]["flops"] == plain["totals"]["flops"]
    assert fused["totals"]["bytes"] < plain["totals"]["bytes"]
    for role in sl.GEMM_CATEGORIES:
        assert _by_name(fused)[role]["bytes"] == _by_name(plain)[role]["bytes"]
    # the same function: the loss the wrapper returns is lm_loss of the model's logits
    torch.manual_seed(0)
    base = spec.build()
    model = train_recipes.fused_eager(base)
    ids = torch.randint(0, spec.vocab, (2, 16))
    with torch.no_grad():
        expected = sl.lm_loss(base(ids), ids)
        assert torch.allclose(model(ids), expected, rtol=1e-5, atol=1e-5)
