"""Every target of the project, in one place (:data:`TARGETS`), for ``benchmarks/report.py``:
the file and key each figure is read from and its bound (``report.py``'s docstring says
how they are judged and shown)."""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report_summary as summary  # noqa: E402  (the cases and rows the targets read)

OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt}
MET, MISSED, NOT_MEASURED, FIGURE = "met", "missed", "not measured", "figure"
#: a GPU target with no figure yet: no GPU run has measured its rows (never a figure made up)
WAITING = "waiting for a GPU measurement"
#: the same for a target only Blackwell (sm_100) can measure: its rows are refused elsewhere
WAITING_BLACKWELL = "waiting for a Blackwell measurement"


@dataclass(frozen=True)
class Target:
    """One figure of a results file and what it should be.

    Args:
        stem: the results file (``<stem>.json`` in a results folder).
        key: the key in that file's top level; a tuple gives older names after
            the current one (the first present is read).
        label: what it is, as the tables print it.
        op, bound: the target (``value op bound``); ``op`` "" for a figure shown
            without one (a ceiling, a comparison no issue sets a bound on).
        headline: one of the few listed first in a device's table of TARGETS.md.
        where: ``"gpu"`` (read in each GPU folder), ``"cpu"`` (in ``results/host``) or both.
        rows: the ``(case, impl)`` rows of the file its figure is computed from:
            a graphed one that replayed nothing makes it ``fell back``.
        waiting: what a GPU folder says while no run has measured it (:data:`WAITING`,
            or :data:`WAITING_BLACKWELL` for the MXFP8 targets).
    """

    stem: str
    key: str | tuple[str, ...]
    label: str
    op: str = ""
    bound: float | None = None
    headline: bool = False
    where: tuple[str, ...] = ("gpu",)
    rows: tuple[tuple[str, str], ...] = ()
    waiting: str = WAITING

    def names(self) -> tuple[str, ...]:
        return self.key if isinstance(self.key, tuple) else (self.key,)

    def goal(self) -> str:
        return "" if not self.op else f"{self.op} {self.bound:g}"

    def judge(self, value: float | None) -> str:
        if not self.op:
            return FIGURE if value is not None else NOT_MEASURED
        if value is None:
            return NOT_MEASURED
        return MET if OPS[self.op](value, self.bound) else MISSED


#: bench_optimizer's tkern row and torch's graphed peer (capturable fused AdamW +
#: GradScaler in a CUDA graph)
OPT_TKERN, OPT_GRAPHED_TORCH = "tkern", "(e) (a) capturable, CUDA graph"

#: a linear layer's three GEMM layouts as tkern.linear launches them (bench_gemm_layouts.LAYOUTS)
GEMM_LAYOUTS = summary.GEMM_LAYOUTS
OPT_MODES = [(m, s) for m in ("fp32", "split", "none") for s in ("fp32", "bf16", "uint8")]

#: the fp8 training step's peers on GPT-2 small (issue 43): (bench_train's meta key after
#: "vs", the peer as the tables name it, the bound; None: a figure)
FP8_STEP_PEERS = (
    ("autocast bf16", "bf16 autocast", 1.6),
    ("torchao float8", "torchao Float8Linear compiled", 1.1),
    ("compiled autocast bf16", "bf16 autocast under torch.compile", None),
    ("torchao float8, fp32 master", "torchao Float8Linear compiled, fp32 master", None),
)

#: Every target (issue 30 item 4, and the earlier issues' that still stand), in one place.
TARGETS: list[Target] = [
    Target("ceilings", "copy_gbps", "device copy bandwidth, GB/s (read + write)", headline=True),
    Target("ceilings", "cublas_fp16_8192_tflops", "cuBLAS fp16 8192^3, TFLOP/s", headline=True),
    # GEMM
    Target(
        "gemm",
        "fp16_square_ge2048_vs_cublas",
        "GEMM fp16 / cuBLAS, squares >= 2048 (geomean)",
        ">=",
        0.95,
        True,
    ),
    Target(
        "gemm",
        "fp16_transformer_vs_cublas",
        "GEMM fp16 / cuBLAS, transformer shapes (geomean)",
        ">=",
        0.95,
        True,
    ),
    Target("gemm", "bf16_square_ge2048_vs_cublas", "GEMM bf16 / cuBLAS, squares >= 2048", ">=", 0.95),
    Target("gemm", "bf16_transformer_vs_cublas", "GEMM bf16 / cuBLAS, transformer shapes", ">=", 0.95),
    Target(
        "gemm", "fp16_tma_square_ge2048_vs_cublas", "the persistent TMA kernel alone, fp16 squares >= 2048"
    ),
    Target(
        "gemm", "fp16_tma_transformer_vs_cublas", "the persistent TMA kernel alone, fp16 transformer shapes"
    ),
    *[
        Target(
            "gemm",
            # like with like: torch with tkern's accumulation (gemm_checks.ACCUM); the key
            # before it ("_vs_torch") compared tkern's fast accumulation with torch's precise
            f"fp8_{fmt}_{scaling}_vs_torch_same_accum",
            f"fp8 scaled_mm {fmt} {scaling} / torch's fp8 GEMM, same accumulation "
            f"({summary.FP8_ACCUM[scaling]}), transformer shapes",
            ">=",
            0.95,
            headline=(fmt, scaling) == ("e4m3xe4m3", "tensorwise"),
        )
        for fmt in summary.FP8_FORMATS
        for scaling in summary.FP8_SCALINGS
    ],
    *[
        Target("gemm", f"fp8_{fmt}_{scaling}_vs_bf16", f"fp8 scaled_mm {fmt} {scaling} / bf16 cuBLAS")
        for fmt in summary.FP8_FORMATS
        for scaling in summary.FP8_SCALINGS
    ],
    # the training layouts (bench_gemm's layouts and fp8_layouts sections, issues 42.5 and 43.7)
    *[
        Target(
            "gemm",
            f"fp16_{layout}_{model}_vs_cublas",
            f"GEMM fp16 / cuBLAS, {layout} layout, {label} shapes",
            ">=",
            0.95,
        )
        for model, label in (("gpt2", "GPT-2 small"), ("llama", "Llama-2-7B"))
        for layout in GEMM_LAYOUTS
    ],
    *[
        Target(
            "gemm",
            f"fp8_{scaling}_{layout}_vs_bf16",
            f"fp8 scaled_mm {scaling} / bf16 cuBLAS, {layout} layout",
            ">=",
            1.3 if scaling == "blockwise" else 1.5,
        )
        for scaling in summary.FP8_SCALINGS
        for layout in GEMM_LAYOUTS
    ],
    # issue 53: the MXFP8 GEMMs in the training layouts (bench_gemm's mx_layouts), Blackwell only
    *[
        Target(
            "gemm",
            f"mx_{layout}_vs_bf16",
            f"MXFP8 scaled_mm / bf16 cuBLAS, {layout} layout",
            ">=",
            1.8,
            waiting=WAITING_BLACKWELL,
        )
        for layout in GEMM_LAYOUTS
    ],
    Target(
        "gemm",
        "fused_bias_gelu_fwd_speedup",
        "linear + bias + GELU fused / torch unfused, forward",
        ">=",
        1.1,
        True,
    ),
    Target("gemm", "fused_bias_gelu_fwd_bwd_speedup", "the same, forward + backward"),
    Target(
        "gemm",
        "fused_bias_gelu_fwd_vs_addmm_activation",
        "linear + bias + GELU fused / torch._addmm_activation(use_gelu=True), forward",
    ),
    Target(
        "gemm",
        "fused_bias_gelu_fwd_vs_compiled",
        "linear + bias + GELU fused / the unfused recipe compiled, forward",
    ),
    Target(
        "gemm",
        "fused_bias_gelu_fwd_bwd_vs_compiled",
        "linear + bias + GELU fused / the unfused recipe compiled, forward + backward",
    ),
    # optimizer
    *[
        Target(
            "optimizer",
            f"{size}_vs_a",
            f"optimizer + scaler step at {size} / GradScaler + AdamW(fused=True)",
            ">=",
            1.5 if size in ("100M", "1B") else 1.0,
            headline=size in ("1M", "1B"),
            rows=((size, OPT_TKERN),),
        )
        for size in ("1M", "10M", "100M", "1B")
    ],
    Target(
        "optimizer",
        "many_small_vs_a",
        "1000 tensors of 10k / GradScaler + AdamW(fused=True)",
        ">=",
        1.0,
        rows=(("1000x10k", OPT_TKERN),),
    ),
    Target(
        "optimizer",
        "many_small_vs_b",
        "1000 tensors of 10k / GradScaler + AdamW(foreach=True)",
        ">=",
        3.0,
        rows=(("1000x10k", OPT_TKERN),),
    ),
    Target(
        "optimizer",
        "100M_pct_copy",
        "AdamW step at 100M, % of copy bandwidth (30 B/param)",
        ">=",
        85,
        rows=(("100M", OPT_TKERN),),
    ),
    Target(
        "optimizer",
        "1B_pct_copy",
        "AdamW step at 1B, % of copy bandwidth",
        ">=",
        85,
        rows=(("1B", OPT_TKERN),),
    ),
    Target(
        "optimizer",
        "100M_vs_d",
        "step at 100M / torch.compile'd master-weights recipe",
        ">",
        1.0,
        rows=(("100M", OPT_TKERN),),
    ),
    *[
        row
        for size in ("1M", "10M")
        for row in (
            Target(
                "optimizer",
                f"{size}_graph_vs_eager",
                f"graphed step / cuda_graph=False at {size}",
                rows=((size, OPT_TKERN),),
            ),
            Target(
                "optimizer",
                f"{size}_vs_e",
                f"tkern graphed / torch graphed capturable fused AdamW at {size} (both + their scaler)",
                rows=((size, OPT_TKERN),),
            ),
        )
    ],
    *[
        Target(
            "optimizer",
            f"{size}_{master}_{state}_vs_floor",
            f"master={master} state={state} at {size}: time / its byte floor",
            "<=",
            1.1,
        )
        for size in ("100M", "1B")
        for master, state in OPT_MODES
    ],
    *[
        Target(
            "optimizer",
            f"{size}_none_vs_torchao_{tag}",
            f"master=none state={state} at {size} / torchao {peer}",
        )
        for size in ("100M", "1B")
        for tag, state, peer in (
            ("adamw8bit", "uint8", "AdamW8bit"),
            ("adamw_sr", "bf16", "_AdamW(bf16_stochastic_round=True)"),
        )
    ],
    # mixed-precision health (issue 37 item 7): what it adds to the scaled step at 10M params
    Target(
        "optimizer",
        "health_10M_k100_vs_off",
        "health cost at 10M: step with overflow tracking + underflow sampling every 100 / tracking off",
        "<=",
        1.02,
        rows=(("health 10M", "tkern health off"), ("health 10M", "tkern underflow every 100")),
    ),
    Target("optimizer", "health_10M_tracking_vs_off", "health cost at 10M: overflow tracking alone / off"),
    Target("optimizer", "health_10M_k1_vs_off", "health cost at 10M: underflow sampling every step / off"),
    # host time (bench_host: on a GPU machine with CUDA tensors, on a CPU machine with CPU tensors),
    # as ratios of torch's in the same run (issue 55 item 5: absolute us move 1.5x between machines)
    Target(
        "host",
        "linear_fwd_vs_torch",
        "tkern.linear forward host time / F.linear's (autograd both sides, launches stubbed)",
        "<=",
        0.5,
        where=("gpu", "cpu"),
    ),
    Target(
        "host",
        "linear_bwd_vs_torch",
        "tkern.linear backward host time / F.linear's (autograd both sides, launches stubbed)",
        "<=",
        0.5,
        where=("gpu", "cpu"),
    ),
    Target(
        "host",
        "step_loop_1000_vs_torch",
        "optimizer in a training loop (zero_grad, scaled step) at 1000 tensors, host time / torch "
        "fused AdamW + GradScaler's",
        "<=",
        0.1,
        where=("gpu", "cpu"),
    ),
    Target("host", "linear_fwd_us", "tkern.linear forward host time, us", where=("gpu", "cpu")),
    Target("host", "linear_bwd_us", "tkern.linear backward host time, us", where=("gpu", "cpu")),
    Target(
        "host",
        "step_loop_us_per_tensor_1000",
        "optimizer in a training loop, host time per tensor at 1000 tensors, us",
        where=("gpu", "cpu"),
    ),
    # training step
    *[
        row
        for model, label in summary.TRAIN_MODELS
        for row in (
            Target(
                "train",
                # the key before bench_train named its recipes "torch ...": "vs autocast"
                (f"{model}: vs torch autocast", f"{model}: vs autocast"),
                f"training step, {label} / autocast + GradScaler",
                ">=",
                1.2,
                headline=True,
                rows=((model, "tkern"),),
            ),
            Target(
                "train",
                f"{model}: vs torch autocast compiled",
                f"training step, {label} / autocast under torch.compile",
                ">=",
                1.0,
                headline=label == "GPT-2 small",
                rows=((model, "tkern"),),
            ),
            Target(
                "train",
                f"{model}: peak vs autocast",
                f"peak memory, {label} / autocast's",
                "<=",
                0.9,
                True,
                rows=((model, "tkern"),),
            ),
            Target(
                "train",
                f"{model}: whole-step graph vs tkern",
                f"{label}: Trainer(cuda_graph=True) / tkern",
                rows=((model, "tkern whole-step graph"), (model, "tkern")),
            ),
        )
    ],
    # issue 43: the fp8 step on GPT-2 small against each peer (FP8_STEP_PEERS)
    *[
        Target(
            "train",
            f"{summary.GPT2}: fp8 {r} vs {key}",
            f"fp8 {r} training step, GPT-2 small / {peer}",
            ">=" if bound else "",
            bound,
            headline=bound is not None and r == "tensorwise",
            rows=((summary.GPT2, f"tkern fp8 {r}"),),
        )
        for r in summary.FP8_RECIPES
        for key, peer, bound in FP8_STEP_PEERS
    ],
    # issue 53: the MXFP8 step on the Llama-like model against torchao's MX recipe
    Target(
        "train",
        f"{summary.LLAMA}: fp8 mxfp8 vs torchao mxfp8",
        "MXFP8 training step, Llama-like / torchao's MXFP8 recipe compiled",
        ">=",
        1.1,
        rows=((summary.LLAMA, "tkern fp8 mxfp8"),),
        waiting=WAITING_BLACKWELL,
    ),
    # norms and loss (issue 28): figures until an issue sets bounds
    Target("norm", "layer_norm_fwd_bwd_vs_torch", "layer_norm fwd + bwd / torch (autocast path)"),
    Target("norm", "rms_norm_fwd_bwd_vs_torch", "rms_norm fwd + bwd / torch (autocast path)"),
    Target("loss", "cross_entropy_fwd_bwd_vs_torch", "cross_entropy fwd + bwd / torch on logits.float()"),
    Target("loss", "linear_cross_entropy_fwd_bwd_vs_torch", "linear_cross_entropy fwd + bwd / torch unfused"),
    Target("loss", "linear_cross_entropy_peak_vs_torch", "linear_cross_entropy peak memory / torch unfused"),
    # activation memory, measured on a CPU (bench_activation_memory.py)
    Target(
        "activation_memory",
        "norms_saved_vs_autocast",
        "GPT-2 norm layers' saved bytes, tkern + norms / autocast",
        "<=",
        0.55,
        True,
        where=("cpu",),
    ),
    Target(
        "activation_memory",
        "loss_largest_vs_fp32_logits",
        "largest tensor of the fused loss / the fp32 logits",
        "<=",
        0.125,
        True,
        where=("cpu",),
    ),
]
