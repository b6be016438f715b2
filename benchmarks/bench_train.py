"""Time per training step and peak memory, end to end, on three models:

(1) a GPT-2-small-shaped transformer built from a transformers ``GPT2Config``
    (12 layers, 768 wide, 12 heads, vocabulary 50257; no download), SDPA
    attention, sequence 1024, batch ``--gpt2-batch`` (16 fills most of an H100's
    80 GB under fp32); then issue 42's Llama-like model (:data:`LLAMA_LIKE`: 12
    layers, width 1024, SwiGLU, RMSNorm, vocabulary 32000), sequence 2048, batch 8;
(2) a deep, wide MLP: 8 layers of 4096, batch 8192 tokens;
(3) the seeds' 2-layer MLP on MNIST-sized input: 784 -> 4096 -> 10, batch 8192.

(in this order: a time-boxed run that is cut short keeps the headline model).
Recipes (:data:`RECIPES`), each from the same initial weights and the same batch,
every step one ``tkern.Trainer.train_step`` (zero the gradients, forward, loss,
scaled backward, step), so every recipe pays the same loop. The language models' loss
is the mean next-token cross entropy: every tkern recipe trains them as a tkern user
does, ``convert_network(..., fused_loss=True)`` and the model called with labels
(:class:`HFLM`'s ``fused_loss`` mode: the loss by ``tkern.linear_cross_entropy``, no
tokens x vocabulary logits), the torch and torchao recipes from the logits in eager
fp32 (:func:`lm_loss`):

* ``tkern``: convert_network (fp16) + FusedAdamW + DynamicLossScaler with no option
  set: the Trainer's ``cuda_graph="auto"`` (the whole step captured where the host
  bounds it; ``graph_status`` says what it chose), else the optimizer's step a CUDA
  graph where it can be (its default ``cuda_graph=None``);
* ``tkern opt eager``: the same with ``Trainer(cuda_graph=False)`` and
  ``FusedAdamW(cuda_graph=False)``;
* ``tkern whole-step graph``: the same under ``Trainer(cuda_graph=True)``: the whole
  step (forward, backward, scaler, optimizer) captured once and replayed;
* ``tkern bf16``: ``convert_network(model, torch.bfloat16)`` + FusedAdamW, no loss scale;
* ``tkern compiled``: the converted fp16 model under ``torch.compile`` (default mode);
* ``tkern state bf16`` / ``tkern state 8-bit`` / ``tkern bf16 master=split`` /
  ``tkern bf16 split + 8-bit state``: the memory modes (:data:`MEMORY_MODES`:
  FusedAdamW's ``state_dtype`` and ``master="split"``, which needs bf16 params);
  each row's ``loss_vs_tkern`` is the loss it costs, relative, against ``tkern``
  (``tkern bf16`` for the bf16 and fp8 rows);
* ``tkern fp8 tensorwise`` / ``delayed`` / ``blockwise``: ``convert_network(model,
  torch.bfloat16, float8=recipe)`` (Float8Linear wherever in and out features are
  multiples of 16, the LM head aside: its GEMMs run in bf16 inside the fused loss,
  :func:`fp8_body_filter`), FusedAdamW, no loss scale (bf16);
* ``torch autocast``: fp32 params, autocast fp16 + GradScaler + AdamW(fused=True);
* ``torch autocast compiled``: the same model under ``torch.compile`` (the best
  a torch user has without writing kernels);
* ``torch autocast bf16``: autocast bf16, no scaler, AdamW(fused=True): the fp8
  recipes' baseline; ``torch autocast bf16 compiled``: the same under ``torch.compile``;
* ``torchao float8 tensorwise compiled``: torchao's ``convert_to_float8_training``
  (tensorwise, the same module filter) on bf16 params, AdamW(fused=True), under
  ``torch.compile`` as torchao documents it (skipped, with the reason recorded,
  where torchao is not importable; in smoke mode eager with ``emulate=True``): bf16
  params and no master copy (its ``master`` says so); ``..., fp32 master``: the same
  on fp32 params under bf16 autocast, an fp32 master as tkern's;
* ``torch fp32 tf32``: fp32 with TF32 tensor cores allowed, AdamW(fused=True);
* ``torch fp32 (no tf32)``: strict fp32, labelled as such.

Each recipe's time is the mean over ``STEPS`` back-to-back steps between two CUDA
events (``ms``: what training sees, the host free to run ahead), beside the median
of the same steps each synchronised on its own (``ms_synced``) and their 90th
percentile (``ms_p90``, nearest rank). ``mfu``: the step's model FLOPs
(``flops_per_step``, :func:`harness.model_flops`, which the step ledger's count
agrees with) over ``ms`` at the device's dense 16-bit peak (:data:`harness.DEVICES`;
fp8 rows on the same scale; None off an H100/H200); ``master``: the master weights
the recipe keeps. Every row records
its peak memory (``peak_mib``), the loss after the timed steps (``loss``), and
the CUDA graph: ``cuda_graph`` (the Trainer's whole-step graph asked for),
``opt_cuda_graph`` (the fused optimizer's setting), ``graph_fallback`` (why the
trainer or the optimizer ran eager; None when it replayed) and the captures and
replays. The run checks that every recipe's loss agrees with the fp32 recipe's
within ``LOSS_MARGIN`` (relative): a faster recipe that trains differently is not
a faster recipe.

Targets on H100/H200 (issues 16, 30): tkern >= 1.2x torch autocast and >= 1.0x the
compiled autocast recipe on every model; tkern's peak memory <= 0.9x autocast's;
the fp8 recipes on GPT-2 small >= 1.6x bf16 autocast and >= 1.1x torchao's compiled
Float8Linear (issue 43), with a final loss within 1% of bf16 autocast's
(``loss_within_1pct_of_bf16``, every row's check column).
``--profile`` profiles the language models' steps instead (:func:`run_profiles`;
default recipes :data:`PROFILE_RECIPES`): each GPU kernel put in the step ledger's
categories (``step_ledger.kernel_category``), device time per category beside the
committed ledger's floor, busy against wall, the top kernels with their achieved
TFLOP/s or GB/s, into ``results/<device>/profile_<recipe>.csv`` and ``profile.png``.
``--models`` and ``--recipes`` (comma-separated prefixes; ``=NAME`` one exact
name) pick a subset; an item that selects nothing is refused, naming it and the valid
names, before anything runs (:func:`check_selection`). Within a case the baselines run
first, so a run cut by its time limit has what tkern's rows are compared with.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    GraphCount,
    Results,
    device_name,
    device_spec,
    error_line,
    graph_fields,
    graph_possible,
    model_flops,
    setup,
    slug,
)
from harness import device_key as harness_device_key  # noqa: E402

import tkern  # noqa: E402
from tkern.train import demo  # noqa: E402

STEPS, WARMUP = 30, 5
#: The recipes train the same weights on the same batch for WARMUP + STEPS steps
#: at lr 1e-4; their losses differ by rounding (fp16 vs fp32 products, loss
#: scaling), which stays well under 2% of the loss over 35 steps.
LOSS_MARGIN = 0.02
MLPS = {
    "mlp 8x4096, batch 8192": (4096, [4096] * 7, 4096, 8192),
    "mlp 784-4096-10, batch 8192": (784, [4096], 10, 8192),
}
SMOKE_MLPS = {"mlp 16-32-4, batch 8": (16, [32], 4, 8)}
GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
GPT2_SMOKE = {
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 64,
    "n_positions": 16,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
SEQ, SMOKE_SEQ, SMOKE_GPT2_BATCH = 1024, 16, 2
#: issue 42's Llama-like model: 12 layers, width 1024, SwiGLU (2816 = 8/3 x 1024 rounded up to a
#: multiple of 256, as Llama's intermediate size), RMSNorm, 16 heads, Llama's 32000-token vocabulary
LLAMA_LIKE = {
    "num_hidden_layers": 12,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
LLAMA_SMOKE = {**LLAMA_LIKE, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 176,
               "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64,
               "max_position_embeddings": 64}  # fmt: skip
LLAMA_SEQ, LLAMA_BATCH = 2048, 8  # 16384 tokens a step, as GPT-2 small's
LR = 1e-4
BASELINE = "torch fp32 (no tf32)"
FP8_RECIPES = ("tensorwise", "delayed", "blockwise")


@contextlib.contextmanager
def tf32(allowed: bool):
    """TF32 tensor cores for fp32 matmuls and convolutions on or off, restored after."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def fp8_filter(name: str, module: nn.Module) -> bool:
    """The layers an fp8 recipe converts (tkern's and torchao's alike): both
    features multiples of 16, as the fp8 GEMMs need (``weight.shape`` holds them
    for ``nn.Linear`` and GPT-2's ``Conv1D`` alike)."""
    return all(d % 16 == 0 for d in module.weight.shape)


@dataclass(frozen=True)
class Built:
    """One recipe's parts, ready for a Trainer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: object = None
    autocast: torch.dtype | None = None
    cuda_graph: bool | str = False  # Trainer(cuda_graph=...)
    tf32: bool = False


def _tkern(
    base: nn.Module,
    device: torch.device,
    *,
    whole_step: bool | str = "auto",
    dtype: torch.dtype = torch.float16,
    compiled: bool = False,
    **opt_options,
) -> Built:
    """tkern's fp16 recipe; ``whole_step``: Trainer(cuda_graph=...), the Trainer's default
    ``"auto"`` unless asked; ``dtype`` bf16: no loss scale; ``compiled``: the converted
    model under ``torch.compile`` (default mode: tkern's own CUDA graphs stay the
    optimizer's); ``opt_options`` go to FusedAdamW (``cuda_graph=False``: its step eager;
    ``master``, ``state_dtype``: the memory modes). A language model (:class:`HFLM`)
    computes its loss with tkern's fused loss (:func:`_converted`)."""
    model = _converted(base, dtype)
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=LR, **opt_options)
    scaler = tkern.DynamicLossScaler() if dtype == torch.float16 else None
    return Built(torch.compile(model) if compiled else model, opt, scaler, cuda_graph=whole_step)


def _converted(base: nn.Module, dtype: torch.dtype, **options) -> nn.Module:
    """``convert_network`` of a copy of ``base``; a language model (:class:`HFLM`) with
    ``fused_loss=True`` and called in its ``fused_loss`` mode, as a tkern user trains one:
    the loss by :func:`tkern.linear_cross_entropy`, no (tokens x vocabulary) logits."""
    lm = isinstance(base, HFLM)
    model = tkern.convert_network(copy.deepcopy(base), dtype, fused_loss=lm, **options)
    if lm:
        model.fused_loss = True
    return model


def fp8_body_filter(name: str, module: nn.Module) -> bool:
    """:func:`fp8_filter` without the LM head, the layers tkern's fp8 recipes convert: under
    the fused loss the head's weight feeds :func:`tkern.linear_cross_entropy` (bf16) and its
    own forward never runs, so an fp8 head would sit unused."""
    return fp8_filter(name, module) and not name.endswith("lm_head")


def _tkern_fp8(base: nn.Module, device: torch.device, recipe: str) -> Built:
    model = _converted(base, torch.bfloat16, float8=recipe, float8_filter=fp8_body_filter)
    return Built(model, tkern.optim.FusedAdamW(model.parameters(), lr=LR))


def _torch_adamw(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, **({"fused": True} if device.type == "cuda" else {}))


def _torch(
    base: nn.Module, device: torch.device, *, autocast=None, compiled=False, allow_tf32=False
) -> Built:
    model = copy.deepcopy(base)
    opt = _torch_adamw(model, device)
    scaler = torch.amp.GradScaler(device.type) if autocast == torch.float16 else None
    return Built(torch.compile(model) if compiled else model, opt, scaler, autocast, tf32=allow_tf32)


def conv1d_as_linear(model: nn.Module) -> nn.Module:
    """transformers' GPT-2 ``Conv1D`` layers (weight (in, out)) replaced in place by
    ``nn.Linear`` layers computing the same function, so that converters that
    only know ``nn.Linear`` (torchao's) reach GPT-2's GEMMs as tkern's does."""
    for name, child in list(model.named_children()):
        if type(child).__name__ == "Conv1D":
            n_in, n_out = child.weight.shape
            linear = nn.Linear(n_in, n_out, device=child.weight.device, dtype=child.weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(child.weight.t())
                linear.bias.copy_(child.bias)
            setattr(model, name, linear)
        else:
            conv1d_as_linear(child)
    return model


def _torchao_fp8(base: nn.Module, device: torch.device, *, smoke: bool, fp32_master: bool = False) -> Built:
    """torchao's Float8Linear training, compiled as torchao documents it; its params
    bf16 (no master: torchao's documented recipe) or, with ``fp32_master``, fp32
    params under bf16 autocast (an fp32 master as tkern's recipes have)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = conv1d_as_linear(copy.deepcopy(base))
    if not fp32_master:
        model = model.to(torch.bfloat16)
    convert_to_float8_training(
        model, config=Float8LinearConfig(emulate=smoke), module_filter_fn=lambda m, name: fp8_filter(name, m)
    )
    # autocast bf16 casts the fp32 batch (and torch ops outside the fp8 layers) as a bf16 user's would
    return Built(
        model if smoke else torch.compile(model), _torch_adamw(model, device), autocast=torch.bfloat16
    )


TORCHAO_FP32_MASTER = "torchao float8 tensorwise compiled, fp32 master"
#: bf16 autocast under torch.compile: the fp8 recipes' compiled 16-bit peer
BF16_COMPILED = "torch autocast bf16 compiled"
#: the recipe whose final loss the ``loss_vs_bf16`` check column reads against, and its bound
BF16_REFERENCE, BF16_LOSS_MARGIN = "torch autocast bf16", 0.01
#: tkern's memory modes (FusedAdamW's ``master`` and ``state_dtype``; issue 45 item 4)
#: (``master="split"`` keeps the master as the bf16 param plus 16 low bits: bf16 params only)
MEMORY_MODES = {
    "tkern state bf16": {"state_dtype": torch.bfloat16},
    "tkern state 8-bit": {"state_dtype": torch.uint8},
    "tkern bf16 master=split": {"dtype": torch.bfloat16, "master": "split"},
    "tkern bf16 split + 8-bit state": {
        "dtype": torch.bfloat16,
        "master": "split",
        "state_dtype": torch.uint8,
    },
}

#: recipe -> builder(base, device, smoke); each makes its own copy of ``base``.
#: Baselines first: a run cut by its time limit keeps what tkern is compared with.
RECIPES: dict[str, Callable[[nn.Module, torch.device, bool], Built]] = {
    BASELINE: lambda b, d, s: _torch(b, d),
    "torch autocast": lambda b, d, s: _torch(b, d, autocast=torch.float16),
    "torch autocast compiled": lambda b, d, s: _torch(b, d, autocast=torch.float16, compiled=True),
    "torch autocast bf16": lambda b, d, s: _torch(b, d, autocast=torch.bfloat16),
    BF16_COMPILED: lambda b, d, s: _torch(b, d, autocast=torch.bfloat16, compiled=True),
    "torchao float8 tensorwise compiled": lambda b, d, s: _torchao_fp8(b, d, smoke=s),
    TORCHAO_FP32_MASTER: lambda b, d, s: _torchao_fp8(b, d, smoke=s, fp32_master=True),
    "torch fp32 tf32": lambda b, d, s: _torch(b, d, allow_tf32=True),
    "tkern": lambda b, d, s: _tkern(b, d),
    "tkern bf16": lambda b, d, s: _tkern(b, d, dtype=torch.bfloat16),
    "tkern compiled": lambda b, d, s: _tkern(b, d, compiled=True),
    "tkern opt eager": lambda b, d, s: _tkern(b, d, whole_step=False, cuda_graph=False),
    "tkern whole-step graph": lambda b, d, s: _tkern(b, d, whole_step=True),
    **{name: (lambda b, d, s, o=options: _tkern(b, d, **o)) for name, options in MEMORY_MODES.items()},
    **{f"tkern fp8 {r}": (lambda b, d, s, r=r: _tkern_fp8(b, d, r)) for r in FP8_RECIPES},
}
#: what a smoke run leaves out: torch.compile of a whole model takes minutes on a CPU
SMOKE_SKIPS = ("torch autocast compiled", BF16_COMPILED, "tkern compiled")
#: the master weights each recipe keeps (a row's ``master``): torchao's documented recipe
#: trains bf16 params with no fp32 copy, which its fp32-master row adds
MASTERS = {
    "torchao float8 tensorwise compiled": "none (bf16 params)",
    TORCHAO_FP32_MASTER: "fp32 params",
    "tkern bf16 master=split": "split",
    "tkern bf16 split + 8-bit state": "split",
}
#: the recipes a smoke run takes through GPT-2 (its Conv1D and embedding paths); the
#: MLP runs every recipe. Each tkern step of the tiny GPT-2 is seconds of interpreter.
SMOKE_GPT2_RECIPES = ("tkern", "tkern fp8 tensorwise", "torchao float8 tensorwise compiled", BASELINE)
#: the language models' cases (GPT-2 and the Llama-like model: a smoke run takes them through
#: SMOKE_GPT2_RECIPES only)
LM_CASES = ("gpt2", "llama")


class HFLM(nn.Module):
    """A transformers causal LM (``self.lm``) behind one ``forward(ids)``: the logits
    (what :func:`lm_loss` needs), or with ``fused_loss`` set the model's own loss,
    ``self.lm(input_ids=ids, labels=ids).loss`` (transformers shifts the labels inside:
    the mean next-token cross entropy over the seq - 1 predicted positions of each row,
    :func:`lm_loss`'s quantity), as a user of ``convert_network(..., fused_loss=True)``
    calls it: tkern computes it without materializing the logits."""

    fused_loss = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.fused_loss:
            return self.lm(input_ids=ids, labels=ids, use_cache=False).loss
        return self.lm(input_ids=ids, use_cache=False).logits


class GPT2LM(HFLM):
    """A transformers GPT-2 LM (:class:`HFLM`)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            **config, attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        )
        self.lm = GPT2LMHeadModel(cfg)


class LlamaLM(HFLM):
    """A transformers Llama LM (:class:`HFLM`: SwiGLU MLP, RMSNorm, rotary positions,
    untied head)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(**config, attn_implementation="sdpa", tie_word_embeddings=False)
        self.lm = LlamaForCausalLM(cfg)


def classify_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), y)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, in fp32 (the loss is one of the FP32 islands); an
    :class:`HFLM` in ``fused_loss`` mode returns its loss, which passes through."""
    if logits.dim() == 0:  # the model's own loss (HFLM.fused_loss): the same quantity
        return logits
    return nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


def trainer_for(built: Built, loss_fn: Callable) -> tkern.Trainer:
    """The Trainer every recipe's step goes through (also the step ledger's)."""
    return tkern.Trainer(
        built.model,
        built.optimizer,
        loss_fn,
        built.scaler,
        autocast_dtype=built.autocast,
        progress=False,
        cuda_graph=built.cuda_graph,
    )


def time_steps(
    recipe: str,
    base: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable,
    device: torch.device,
    steps: int,
    warmup: int,
    smoke: bool,
) -> dict:
    """Train a copy of ``base`` under ``recipe`` through ``Trainer.train_step``: ms
    per step (pipelined and synchronised), peak memory, the loss after the timed
    steps and how the CUDA graphs ran."""
    if device.type == "cuda":  # peak from the start: a CUDA graph's pool is allocated at capture
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    built = RECIPES[recipe](base, device, smoke)
    with tf32(built.tf32):
        count = GraphCount(built.optimizer)
        trainer = trainer_for(built, loss_fn)
        batch = [(x, y)]

        def step() -> torch.Tensor:
            return trainer.train_step(batch)

        for _ in range(warmup):
            step()
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / steps
            synced = []
            for _ in range(steps):
                start.record()
                step()
                end.record()
                end.synchronize()
                synced.append(start.elapsed_time(end))
            peak = torch.cuda.max_memory_allocated()
        else:
            import time

            synced = []
            for _ in range(steps):
                t = time.perf_counter()
                step()
                synced.append(1e3 * (time.perf_counter() - t))
            ms, peak = sum(synced) / len(synced), 0
        loss = float(step())  # one more step: the loss every recipe must agree on
    synced.sort()
    opt_graph = graph_fields(built.optimizer, count)
    fused = isinstance(built.optimizer, tkern.optim.FusedAdamW)
    graphs = trainer.graphs
    # the whole step's graph: asked for, or chosen by "auto" (else the optimizer's own graph's counts)
    whole = graphs is not None and (built.cuda_graph is True or graphs.counts["capture"] > 0)
    opt_fallback = opt_graph["graph_fallback"] if fused else None
    return {
        "ms": ms,
        "ms_synced": synced[len(synced) // 2],
        "ms_p90": synced[math.ceil(0.9 * len(synced)) - 1],  # nearest rank
        # layers running fp8 GEMMs (tkern's Float8Linear / Float8Conv1D, torchao's Float8Linear)
        "fp8_layers": sum("Float8" in type(m).__name__ for m in built.model.modules()),
        "peak_mib": round(peak / 2**20, 1),
        "loss": loss,
        "cuda_graph": built.cuda_graph,
        "opt_cuda_graph": opt_graph["cuda_graph"] if fused else None,
        # meant to replay: the whole step, or the fused optimizer's own graph
        "graphed": graph_possible() and (built.cuda_graph is True or (fused and opt_graph["graphed"])),
        "graph_status": trainer.graph_status,  # what cuda_graph="auto" chose, and why
        # under Trainer(cuda_graph=True) the trainer's reason alone: its graph holds the
        # optimizer's step, whose own graph then stands aside by design
        "graph_fallback": trainer.graph_fallback if whole or built.cuda_graph is True else opt_fallback,
        "graph_captures": graphs.counts["capture"] if whole else opt_graph["graph_captures"],
        "graph_replays": (
            graphs.counts["capture"] + graphs.counts["replay"] if whole else opt_graph["graph_replays"]
        ),
    }


def release(device: torch.device) -> None:
    """What a recipe left behind, freed before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def master_of(recipe: str) -> str:
    """The master weights a recipe keeps (a row's ``master``)."""
    return MASTERS.get(recipe, "fp32 params" if recipe.startswith("torch") else "fp32")


def step_flops(base: nn.Module, x: torch.Tensor, loss_fn: Callable) -> int:
    """Model FLOPs of one step of a case (:func:`harness.model_flops`): an LM's batch is
    (sequences, seq) token ids, an MLP's (rows, features)."""
    if loss_fn is lm_loss:
        return model_flops(base, x.numel(), x.shape[1])["total"]
    return model_flops(base, x.shape[0])["total"]


def mfu(flops: int, ms: float | None, name: str) -> float | None:
    """Model FLOPs utilisation of a step of ``ms`` on the device ``name``: at its dense
    16-bit peak (:data:`harness.DEVICES`; every recipe, fp8 too, on the same scale);
    None for a device without a spec (a CPU)."""
    spec = device_spec(name)
    if spec is None or not ms:
        return None
    return round(flops / (ms * 1e-3) / (spec.bf16 * 1e12), 4)


def cases(smoke: bool, device: torch.device, gpt2_batch: int, models: str | None = None):
    """(case, base model, x, y, loss_fn) for every model of the run picked by ``models``
    (case prefixes, as ``--models``): GPT-2 first, then the Llama-like model, then the
    MLPs. A model not picked is not built."""
    g = torch.Generator().manual_seed(0)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed: the GPT-2 model is skipped (pip install 'tkern[integrations]')")
    else:
        for name, cls, config, s, b in _language_models(smoke, gpt2_batch):
            case = _lm_case(name, s, b)
            # GPT-2's batch is drawn from the shared generator whether or not it is picked, and
            # Llama's from its own: the MLPs' batches stay those of every earlier run
            gen = g if cls is GPT2LM else torch.Generator().manual_seed(1)
            ids = torch.randint(0, config["vocab_size"], (b, s), generator=gen)
            if not _picked(case, models):
                continue
            torch.manual_seed(0)
            ids = ids.to(device)
            yield case, cls(config).to(device), ids, ids, lm_loss
    for case, (d_in, hidden, d_out, batch) in (SMOKE_MLPS if smoke else MLPS).items():
        if not _picked(case, models):
            continue
        torch.manual_seed(0)
        base = demo.make_mlp(d_in, tuple(hidden), d_out).to(device)
        x = torch.randn(batch, d_in, generator=g).to(device)
        y = torch.randint(0, d_out, (batch,), generator=g).to(device)
        yield case, base, x, y, classify_loss


def _language_models(smoke: bool, gpt2_batch: int) -> tuple:
    """(name, model class, config, seq, batch) of each language model of a run."""
    if smoke:
        return (("gpt2-tiny", GPT2LM, GPT2_SMOKE, SMOKE_SEQ, SMOKE_GPT2_BATCH),
                ("llama-tiny", LlamaLM, LLAMA_SMOKE, SMOKE_SEQ, SMOKE_GPT2_BATCH))  # fmt: skip
    return (("gpt2-small", GPT2LM, GPT2_SMALL, SEQ, gpt2_batch),
            ("llama-like", LlamaLM, LLAMA_LIKE, LLAMA_SEQ, LLAMA_BATCH))  # fmt: skip


def _lm_case(name: str, seq: int, batch: int) -> str:
    return f"{name}, seq {seq}, batch {batch}"


def case_names(smoke: bool, gpt2_batch: int = 16) -> list[str]:
    """Every case a run times (what ``--models`` picks from), in :func:`cases`' order."""
    lms = [_lm_case(name, s, b) for name, _, _, s, b in _language_models(smoke, gpt2_batch)]
    return lms + list(SMOKE_MLPS if smoke else MLPS)


def check_selection(items: str | None, names, flag: str) -> None:
    """Refuse (SystemExit, before anything runs) a ``--models`` / ``--recipes`` value any of
    whose comma-separated items (a prefix, or ``=NAME``) selects none of ``names``: a
    misspelt name would otherwise run nothing and say nothing."""
    if items is None:
        return
    given = [p.strip() for p in items.split(",") if p.strip()]
    bad = [item for item in given if not any(_picked(n, item) for n in names)] or ([] if given else [items])
    if bad:
        raise SystemExit(
            f"bench_train.py: {flag} {', '.join(map(repr, bad))} selects nothing; "
            f"the names (a prefix picks every name it starts, =NAME that one): {list(names)}"
        )


def _picked(name: str, prefixes: str | None) -> bool:
    """Whether ``name`` is among ``prefixes`` (comma-separated; ``=NAME`` is one exact name)."""
    if prefixes is None:
        return True
    items = [p.strip() for p in prefixes.split(",") if p.strip()]
    return any(name == p[1:] if p.startswith("=") else name.startswith(p) for p in items)


def final_loss(res: Results, case: str, losses: dict[str, float], recipe: str) -> float | None:
    """``recipe``'s final loss on ``case`` in this run, else the one merged from an earlier
    run of the same file (a GPU session splits the recipes across calls); None if neither."""
    if recipe in losses:
        return losses[recipe]
    return next((r.get("loss") for r in res.rows if (r["case"], r["impl"]) == (case, recipe)), None)


def bf16_check(res: Results, case: str, losses: dict[str, float]) -> None:
    """Each row of ``case`` trained in this run gets ``loss_vs_bf16`` (its final loss over
    bf16 autocast's, less 1; that of an earlier run merged into the file when this run has
    none) and the check column ``loss_within_1pct_of_bf16``; the fp8 recipes' into ``res.meta``."""
    ref = final_loss(res, case, losses, BF16_REFERENCE)
    if not ref:
        return
    for row in res.rows:
        if row["case"] == case and row["impl"] in losses:
            off = losses[row["impl"]] / ref - 1
            row["loss_vs_bf16"] = round(off, 6)
            row["loss_within_1pct_of_bf16"] = abs(off) <= BF16_LOSS_MARGIN
            if row["impl"].startswith("tkern fp8"):
                res.meta[f"{case}: {row['impl'][6:]} loss within 1% of bf16"] = abs(off) <= BF16_LOSS_MARGIN


def summarize(res: Results, case: str, smoke: bool) -> str:
    """The case's target ratios into ``res.meta`` (what report.py reads), and its line."""

    def ratio(impl: str, baseline: str) -> float | None:
        value = res.ratio(case, impl, baseline)
        return round(value, 3) if value == value else None

    mem = {r["impl"]: r.get("peak_mib") for r in res.rows if r["case"] == case}  # a skipped row has none
    for b in ("torch autocast", "torch autocast compiled", "torch fp32 tf32"):
        res.meta[f"{case}: vs {b}"] = ratio("tkern", b)
    res.meta[f"{case}: whole-step graph vs tkern"] = ratio("tkern whole-step graph", "tkern")
    res.meta[f"{case}: opt graph vs opt eager"] = ratio("tkern", "tkern opt eager")
    for r in FP8_RECIPES:
        res.meta[f"{case}: fp8 {r} vs autocast bf16"] = ratio(f"tkern fp8 {r}", "torch autocast bf16")
        res.meta[f"{case}: fp8 {r} vs compiled autocast bf16"] = ratio(f"tkern fp8 {r}", BF16_COMPILED)
        res.meta[f"{case}: fp8 {r} vs torchao float8"] = ratio(
            f"tkern fp8 {r}", "torchao float8 tensorwise compiled"
        )
    peak = (
        mem.get("tkern") / mem["torch autocast"] if mem.get("tkern") and mem.get("torch autocast") else None
    )
    res.meta[f"{case}: peak vs autocast"] = None if peak is None else round(peak, 3)
    res.meta[f"{case}: tkern compiled vs torch autocast compiled"] = ratio(
        "tkern compiled", "torch autocast compiled"
    )
    res.meta[f"{case}: tkern bf16 vs torch autocast bf16"] = ratio("tkern bf16", "torch autocast bf16")
    for r in FP8_RECIPES:
        res.meta[f"{case}: fp8 {r} vs torchao float8, fp32 master"] = ratio(
            f"tkern fp8 {r}", TORCHAO_FP32_MASTER
        )
    for mode in MEMORY_MODES:
        if mem.get(mode) and mem.get("torch autocast"):
            res.meta[f"{case}: peak {mode} vs autocast"] = round(mem[mode] / mem["torch autocast"], 3)
    res.meta[f"{case}: tkern mfu"] = next(
        (r.get("mfu") for r in res.rows if (r["case"], r["impl"]) == (case, "tkern")), None
    )
    if smoke:
        return ""
    m = res.meta
    return (
        f"{case}: tkern {m[f'{case}: vs torch autocast']}x autocast (target >= 1.2), "
        f"{m[f'{case}: vs torch autocast compiled']}x compiled autocast (target >= 1.0); "
        f"whole-step graph {m[f'{case}: whole-step graph vs tkern']}x tkern; "
        f"fp8 tensorwise {m[f'{case}: fp8 tensorwise vs autocast bf16']}x bf16 autocast (target >= 1.6), "
        f"{m[f'{case}: fp8 tensorwise vs torchao float8']}x torchao Float8Linear (target >= 1.1); "
        f"peak {mem.get('tkern')} MiB vs autocast {mem.get('torch autocast')} MiB (target <= 0.9x)"
    )


# --------------------------------------------------------------------------- --profile

#: steps under torch.profiler per recipe (after WARMUP), and the recipes --profile takes by default
PROFILE_STEPS = 3
PROFILE_RECIPES = ("tkern", "torch autocast compiled", "tkern fp8 tensorwise")
#: top kernels by device time a profile CSV lists per recipe
TOP_KERNELS = 15
PROFILE_FIELDS = (
    "kind", "recipe", "category", "kernel", "shapes", "launches_per_step", "ms_per_step", "share",
    "floor_ms", "tflops", "gbps", "busy_ms", "wall_ms", "commit",
)  # fmt: skip


def kernel_rows(events, spec) -> list[dict]:
    """One row per GPU kernel (and memcpy / memset) of a profile's ``events``
    (``prof.events()``): its name, device time, the ledger's category with its FLOPs and
    bytes (``step_ledger.kernel_category``), the innermost aten op's input shapes. A
    kernel finds its CPU ranges through the runtime call that launched it (its
    ``linked_correlation_id``) and that call's parents."""
    import step_ledger
    from torch.autograd import DeviceType

    cpu = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    rows = []
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        node = cpu.get(getattr(e, "linked_correlation_id", 0))
        node = node.cpu_parent if node is not None else None
        ancestors, shapes = [], None
        while node is not None:
            ancestors.append(node.name)
            if shapes is None and node.name.startswith("aten::"):
                shapes = node.input_shapes
            node = node.cpu_parent
        category, flops, nbytes = step_ledger.kernel_category(e.name, ancestors, shapes, spec)
        op = next((a for a in ancestors if a.startswith("aten::")), "")
        rows.append(
            {
                "kernel": e.name,
                "category": category,
                "us": e.time_range.elapsed_us(),
                "flops": flops,
                "bytes": nbytes,
                "shapes": f"{op} {shapes}" if shapes else op,
            }
        )
    return rows


def profile_summary(
    recipe: str, rows: list[dict], steps: int, wall_ms: float, floors: dict | None
) -> list[dict]:
    """A recipe's profile as CSV rows: one per category (device ms per step, share of the
    busy time, the ledger's floor), a total (busy against wall), the top kernels (with
    achieved TFLOP/s, or GB/s where the bytes are known)."""
    import step_ledger

    busy = sum(r["us"] for r in rows) / 1e3 / steps
    out = []
    for cat in step_ledger.CATEGORIES:
        mine = [r for r in rows if r["category"] == cat]
        ms = sum(r["us"] for r in mine) / 1e3 / steps
        floor = (floors or {}).get(cat)
        if mine or floor:
            out.append(
                {
                    "kind": "category",
                    "recipe": recipe,
                    "category": cat,
                    "launches_per_step": len(mine) / steps,
                    "ms_per_step": round(ms, 4),
                    "share": round(ms / busy, 4) if busy else None,
                    "floor_ms": floor,
                }
            )
    out.append({
        "kind": "total", "recipe": recipe, "ms_per_step": round(busy, 4), "busy_ms": round(busy, 4),
        "wall_ms": round(wall_ms, 4), "share": round(busy / wall_ms, 4) if wall_ms else None,
        "floor_ms": sum((floors or {}).values()) or None, "launches_per_step": len(rows) / steps,
    })  # fmt: skip
    kernels: dict[tuple, dict] = {}
    for r in rows:
        k = kernels.setdefault(
            (r["kernel"], r["category"], r["shapes"]), {"us": 0.0, "n": 0, "flops": 0, "bytes": 0}
        )
        k["us"] += r["us"]
        k["n"] += 1
        k["flops"] += r["flops"]
        k["bytes"] = None if r["bytes"] is None or k["bytes"] is None else k["bytes"] + r["bytes"]
    top = sorted(kernels.items(), key=lambda kv: (-kv[1]["us"], kv[0]))[:TOP_KERNELS]
    for (kernel, cat, shapes), k in top:
        s = k["us"] * 1e-6
        out.append(
            {
                "kind": "kernel",
                "recipe": recipe,
                "category": cat,
                "kernel": kernel[:200],
                "shapes": shapes[:200],
                "launches_per_step": k["n"] / steps,
                "ms_per_step": round(k["us"] / 1e3 / steps, 4),
                "share": round(k["us"] / 1e3 / steps / busy, 4) if busy else None,
                "tflops": round(k["flops"] / s / 1e12, 1) if k["flops"] and s else None,
                "gbps": round(k["bytes"] / s / 1e9, 1) if k["bytes"] and s else None,
            }
        )
    return out


def write_profile_csv(path: Path, rows: list[dict]) -> None:
    """The rows of :func:`profile_summary` (every run's commit on each) as a CSV."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=PROFILE_FIELDS)
        writer.writeheader()
        writer.writerows([{k: r.get(k) for k in PROFILE_FIELDS} for r in rows])


def draw_profile(folder: Path) -> Path | None:
    """``profile.png`` from every ``profile_*.csv`` in ``folder``: one stacked bar per
    recipe (device ms per step by category), its wall time and the ledger's floor as
    markers; at most :data:`plots.MAX_PX` wide. None when there is nothing to draw."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import plots
    import step_ledger

    bars, totals = {}, {}
    for path in sorted(folder.glob("profile_*.csv")):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r["kind"] == "category":
                    bars.setdefault(r["recipe"], {})[r["category"]] = float(r["ms_per_step"] or 0)
                elif r["kind"] == "total":
                    totals[r["recipe"]] = r
                    bars.setdefault(r["recipe"], {})
    if not bars:
        return None
    recipes = list(bars)  # a recipe with no kernel (a CPU's profile) keeps its wall marker
    width_in = min(plots.MAX_PX / plots.DPI, 5.0 + 1.6 * len(recipes))
    fig, ax = plt.subplots(figsize=(width_in, 5.5), dpi=plots.DPI)
    xs = list(range(len(recipes)))
    bottom = [0.0] * len(recipes)
    colours = plt.get_cmap("tab20").colors
    for i, cat in enumerate(step_ledger.CATEGORIES):
        values = [bars[r].get(cat, 0.0) for r in recipes]
        if any(values):
            ax.bar(xs, values, 0.6, bottom=bottom, label=cat, color=colours[i % len(colours)])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(xs, recipes)
    ax.set_xlim(-0.6, len(recipes) - 0.4)
    for x, r in enumerate(recipes):
        t = totals.get(r, {})
        if t.get("wall_ms"):
            ax.plot(x, float(t["wall_ms"]), "k_", markersize=30, label="wall" if x == 0 else None)
        if t.get("floor_ms"):
            ax.plot(x, float(t["floor_ms"]), "r_", markersize=30, label="ledger floor" if x == 0 else None)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("device ms per step")
    ax.set_title("GPU time of a training step\nby the step ledger's categories", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    path = folder / "profile.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def ledger_floors(model: str | None, recipe: str, device: str) -> dict | None:
    """The committed step ledger's floor per category for this model, recipe and device
    (``results/host/ledger_*.json``), or None where none is committed."""
    import step_ledger

    key = harness_device_key(device)
    if model is None or key is None:
        return None
    path = step_ledger.ledger_path(model, recipe, key)
    if not path.is_file():
        return None
    return {c["name"]: c["floor_ms"] for c in json.loads(path.read_text())["categories"] if c["floor_ms"]}


def profile_recipe(
    recipe, base, x, y, loss_fn, device, spec, smoke, steps, warmup
) -> tuple[list[dict], float]:
    """(kernel rows, wall ms per step) of ``steps`` profiled steps of ``recipe`` after
    ``warmup``: torch.profiler over CPU and CUDA with the input shapes recorded, tkern's
    launches in their ledger ranges, the loss and the optimizer in theirs."""
    import step_ledger
    from torch.profiler import ProfilerActivity, profile, record_function

    built = RECIPES[recipe](base, device, smoke)
    step_ledger.optimizer_phase(built.optimizer, built.scaler, lambda: record_function("ledger:optimizer"))

    def ranged_loss(out, target):
        with record_function("ledger:loss"):
            return loss_fn(out, target)

    trainer = trainer_for(built, ranged_loss)
    batch = [(x, y)]
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tf32(built.tf32), step_ledger.profiled_launches(spec):
        for _ in range(warmup):
            trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=True) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                trainer.train_step(batch)
            if cuda:
                torch.cuda.synchronize()
            wall_ms = 1e3 * (time.perf_counter() - start) / steps
    return kernel_rows(prof.events(), spec), wall_ms


def run_profiles(mode, args, res_dir: Path | None) -> list[dict]:
    """``--profile``: each language-model case's recipes (default :data:`PROFILE_RECIPES`)
    profiled; ``profile_<recipe>.csv`` per recipe and ``profile.png`` into ``res_dir``."""
    import step_ledger
    from harness import commit

    recipes = [r for r in (RECIPES if args.recipes else PROFILE_RECIPES) if _picked(r, args.recipes)]
    if mode.smoke:  # the code path once: each profiled tiny step is seconds of interpreter
        recipes = [r for r in recipes if r not in SMOKE_SKIPS][:1]
    steps, warmup = (1, 1) if mode.smoke else (PROFILE_STEPS, WARMUP)
    everything = []
    for case, base, x, y, loss_fn in cases(mode.smoke, mode.device, args.gpt2_batch, args.models):
        if loss_fn is not lm_loss or not _picked(case, args.models):
            continue
        model = case.split(",")[0]
        config = base.lm.config.to_dict()
        family = "llama" if case.startswith("llama") else "gpt2"
        spec = step_ledger.ModelSpec(family, config, x.shape[1], x.shape[0])
        for recipe in recipes:
            try:
                rows, wall = profile_recipe(
                    recipe, base, x, y, loss_fn, mode.device, spec, mode.smoke, steps, warmup
                )
            except Exception as exc:  # record it, profile the others
                print(f"profile {case} {recipe}: FAILED ({error_line(exc)})")
                continue
            finally:
                release(mode.device)
            summary = profile_summary(recipe, rows, steps, wall, ledger_floors(model, recipe, device_name()))
            stamp = commit()
            for r in summary:
                r["commit"] = stamp
            everything += summary
            for r in summary:
                if r["kind"] != "kernel":
                    print(
                        f"profile {recipe:<28} {r.get('category') or 'busy / wall':<18} "
                        f"{r['ms_per_step']:>9} ms  floor {r.get('floor_ms')}  share {r.get('share')}"
                    )
            if res_dir is not None:
                write_profile_csv(res_dir / f"profile_{slug(recipe)}.csv", summary)
    if res_dir is not None:
        try:
            drawn = draw_profile(res_dir)
        except ImportError:
            drawn = None
            print("(matplotlib is missing: no profile picture)")
        print(f"wrote {res_dir}/profile_*.csv" + (f" and {drawn}" if drawn else ""))
    return everything


def main(argv: list[str] | None = None) -> Results:
    def add_arguments(parser):
        parser.add_argument("--gpt2-batch", type=int, default=16, help="GPT-2 batch (sequences of 1024)")
        parser.add_argument("--models", default=None, help="comma-separated case prefixes (default: all)")
        parser.add_argument("--recipes", default=None, help="comma-separated recipe prefixes (default: all)")
        parser.add_argument(
            "--profile",
            action="store_true",
            help="profile the language models' steps instead (default recipes "
            f"{', '.join(PROFILE_RECIPES)}): device time by the step ledger's categories "
            "into results/<device>/profile_<recipe>.csv and profile.png",
        )

    mode, args = setup("train", __doc__, argv, add_arguments)
    check_selection(args.models, case_names(mode.smoke, args.gpt2_batch), "--models")
    check_selection(args.recipes, list(RECIPES), "--recipes")
    if args.profile:
        run_profiles(mode, args, mode.out_dir)
        return Results("train", mode, metric=None)
    # a subset adds its rows to the file (a GPU session splits the recipes across calls)
    res = Results("train", mode, metric=None, merge=bool(args.models or args.recipes))
    res.meta["failed"] = []
    steps, warmup = (1, 1) if mode.smoke else (STEPS, WARMUP)
    summary, disagree = [], []
    recipes = [r for r in RECIPES if _picked(r, args.recipes)]
    for case, base, x, y, loss_fn in cases(mode.smoke, mode.device, args.gpt2_batch, args.models):
        if not _picked(case, args.models):
            continue
        losses = {}
        flops = step_flops(base, x, loss_fn)
        for recipe in recipes:
            if mode.smoke and (
                recipe in SMOKE_SKIPS or (case.startswith(LM_CASES) and recipe not in SMOKE_GPT2_RECIPES)
            ):
                continue
            try:
                r = time_steps(recipe, base, x, y, loss_fn, mode.device, steps, warmup, mode.smoke)
            except torch.OutOfMemoryError:
                print(f"{case} {recipe}: out of memory, skipped")
                res.add(case, recipe, None, skipped="out of memory")
                continue
            except ImportError as exc:  # an optional peer (torchao) that is not installed
                res.add(case, recipe, None, skipped=error_line(exc))
                continue
            except Exception as exc:  # record it, keep the other recipes' numbers
                error = error_line(exc)
                res.meta["failed"].append({"case": case, "impl": recipe, "error": error})
                print(f"{case} {recipe}: FAILED ({error}); the other recipes go on")
                continue
            finally:
                release(mode.device)
            losses[recipe] = r["loss"]
            ms = r.pop("ms")
            res.add(
                case,
                recipe,
                ms,
                ms_synced=round(r.pop("ms_synced"), 4),
                ms_p90=round(r.pop("ms_p90"), 4),
                flops_per_step=flops,
                mfu=mfu(flops, ms, device_name()),
                master=master_of(recipe),
                **r,
            )
            res.save()  # after every recipe: a timeout loses only the one in progress
        ref = final_loss(res, case, losses, BASELINE)
        for recipe, loss in losses.items():
            if ref is not None and not abs(loss - ref) <= LOSS_MARGIN * abs(ref):
                disagree.append(f"{case}: {recipe} loss {loss:.5g} vs {BASELINE} {ref:.5g}")
        # what a memory mode (or any tkern variant) costs in loss against tkern's recipe of
        # the same param dtype (bf16 rows against ``tkern bf16``)
        bf16_check(res, case, losses)
        for row in res.rows:
            bf16 = row["impl"].startswith(("tkern bf16", "tkern fp8"))
            ref_name = "tkern bf16" if bf16 else "tkern"
            mine = row["case"] == case and row["impl"].startswith("tkern") and row["impl"] in losses
            if mine and ref_name in losses:
                row["loss_vs_tkern"] = round(losses[row["impl"]] / losses[ref_name] - 1, 6)
        res.save()
        line = summarize(res, case, mode.smoke)
        if line:
            summary.append(line)
    res.meta["loss_margin"] = LOSS_MARGIN
    res.meta["losses_agree"] = not disagree
    summary += [f"LOSS DISAGREES: {d}" for d in disagree]
    summary += [f"FAILED {f['case']} {f['impl']}: {f['error']}" for f in res.meta["failed"]]
    res.save(plot=True)
    res.print_table(
        [
            "ms",
            "ms_synced",
            "ms_p90",
            "mfu",
            "peak_mib",
            "loss",
            "loss_within_1pct_of_bf16",
            "master",
            "graph_replays",
        ],
        summary,
    )
    if disagree and not mode.smoke:
        raise SystemExit(f"bench_train: recipes disagree on the loss beyond {LOSS_MARGIN:.0%}: {disagree}")
    return res


if __name__ == "__main__":
    main()
