"""The models bench_train.py times and the step ledger counts: the MLPs, GPT-2 and the
Llama-like model (transformers' causal LMs behind one ``forward(ids)``, :class:`HFLM`),
their sizes and batches, their losses, the cases of a run (:func:`cases`) and how
``--models`` / ``--recipes`` pick among names (:func:`check_selection`, :func:`_picked`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tkern.train import demo

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


# --------------------------------------------------------------------------- the step ledger's models


@dataclass(frozen=True)
class ModelSpec:
    """A language model of the ledger: its family (``gpt2``/``llama``), its config,
    sequence length and batch."""

    family: str
    config: dict
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.seq * self.batch

    @property
    def vocab(self) -> int:
        return self.config["vocab_size"]

    @property
    def layers(self) -> int:
        return self.config.get("n_layer", self.config.get("num_hidden_layers"))

    @property
    def width(self) -> int:
        return self.config.get("n_embd", self.config.get("hidden_size"))

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        return (GPT2LM if self.family == "gpt2" else LlamaLM)(self.config)


_GPT2_TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 64}
_GPT2_TINY.update(bos_token_id=0, eos_token_id=0)
#: gpt2-small is bench_train's case; llama-like is issue 42's (12 layers, width 1024, SwiGLU
#: 2816 = 8/3 x 1024 rounded up to 256, RMSNorm, 16 heads, Llama's 32000-token vocabulary), its
#: batch of 8 x 2048 the same 16384 tokens as GPT-2's. The tiny ones are the tests': every
#: dimension distinct from the token count (96), which tells a wgrad by its reduction.
MODELS = {
    "gpt2-small": ModelSpec("gpt2", GPT2_SMALL, SEQ, 16),
    "llama-like": ModelSpec("llama", LLAMA_LIKE, LLAMA_SEQ, LLAMA_BATCH),
    "gpt2-tiny": ModelSpec("gpt2", _GPT2_TINY, 48, 2),
    "llama-tiny": ModelSpec("llama", {**LLAMA_SMOKE, "vocab_size": 1000}, 48, 2),
}
