"""The step ledger's cost rules: the category, bytes and FLOPs each launch is charged. An
aten op's category (:func:`_aten_category`: a GEMM's role from its dimensions,
:func:`gemm_role`) and an SDPA call's FLOPs; a Triton launch's category, bytes and FLOPs
from its kernel family and arguments (:func:`triton_cost`); and a profiled GPU kernel's
(:func:`kernel_category`), so that a profile and the ledger sum alike.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import ModelSpec  # noqa: E402

CATEGORIES = (
    "gemm fwd", "gemm dgrad", "gemm wgrad", "gemm lm head", "attention", "norm", "embedding",
    "loss", "fp8 cast/amax", "optimizer", "copies and fills", "elementwise", "other"
)  # fmt: skip
GEMM_CATEGORIES = CATEGORIES[:4]


def footprint(t: torch.Tensor) -> int:
    """Bytes a kernel touches reading or writing all of ``t`` once: a broadcast
    (stride 0) dimension counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if size == 0:
            return 0
        if stride != 0:
            n *= size
    return n * t.element_size()


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _shapes(tensors) -> str:
    return " ".join(
        f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}"
        for t in tensors
        if isinstance(t, torch.Tensor)
    )


# aten ops that launch nothing: allocations and views run as they are
_ALLOC = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "lift_fresh", "resize_",
          "_record_function_enter_new", "_record_function_exit", "record_stream"}  # fmt: skip
_METADATA = {"set_", "_unsafe_view", "as_strided_", "detach_", "_reshape_alias", "alias", "_nested_tensor"}
_OVERWRITE = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"}
_GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "addmv", "mv", "dot"}
_NORM_OPS = (
    "layer_norm", "rms_norm", "batch_norm", "group_norm"
)  # fmt: skip
_LOSS_OPS = ("log_softmax", "nll_loss", "cross_entropy", "_softmax_backward", "mse_loss")
_COPY_OPS = {
    "copy_", "_to_copy", "clone", "contiguous", "cat", "stack", "fill_", "zero_", "zeros", "ones",
    "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "fill",
    "slice_scatter", "select_scatter", "as_strided_scatter", "_foreach_copy_", "_foreach_zero_",
    "scalar_tensor", "arange"
}  # fmt: skip


def aten_launch_bytes(name: str, args: tuple, read: dict, written: dict) -> list[int]:
    """Bytes of each launch an aten op makes on a GPU, from what it reads (``read``) and
    writes (``written``), tensors by :func:`_key`: one launch touching all of them, but for
    the ops whose GPU kernels touch something else (:data:`_GPU_BYTES`)."""
    rule = _GPU_BYTES.get(name)
    if rule is not None:
        return rule(args, read, written)
    return [sum(footprint(t) for t in read.values()) + sum(footprint(t) for t in written.values())]


def _others(tensors: dict, skip: torch.Tensor) -> int:
    return sum(footprint(t) for k, t in tensors.items() if k != _key(skip))


def _nll_forward(args, read, written) -> list[int]:
    """nll_loss: one logit per row gathered (at its target), not the whole row."""
    logits, target = args[0], args[1]
    return [target.numel() * logits.element_size() + _others(read, logits) + _others(written, logits)]


def _nll_backward(args, read, written) -> list[int]:
    """nll_loss_backward: the gradient zero-filled (one launch), then one element per row
    written at its target (the logits themselves are never read)."""
    grad_input = next(iter(written.values()))
    rows = args[2].numel()
    return [footprint(grad_input), _others(read, args[1]) + rows * grad_input.element_size()]


def _slice_backward(args, read, written) -> list[int]:
    """slice_backward: the whole gradient zero-filled (one launch), then the slice's gradient
    copied into it (read and written)."""
    grad_input = next(iter(written.values()))
    return [footprint(grad_input), 2 * footprint(args[0])]


#: aten ops whose GPU kernels touch other bytes than their arguments' and outputs' footprints
_GPU_BYTES = {
    "nll_loss_forward": _nll_forward,
    "nll_loss2d_forward": _nll_forward,
    "nll_loss_backward": _nll_backward,
    "nll_loss2d_backward": _nll_backward,
    "slice_backward": _slice_backward,
}


def gemm_role(m: int, n: int, k: int, spec: ModelSpec, backward: bool) -> str:
    """``gemm lm head`` when a dimension is the vocabulary (or a padded copy of it),
    ``gemm wgrad`` when the reduction runs over the step's tokens, else ``gemm dgrad``
    in backward and ``gemm fwd`` in forward."""
    if any(spec.vocab <= d < spec.vocab + 128 for d in (m, n, k)):
        return "gemm lm head"
    if k == spec.tokens:
        return "gemm wgrad"
    return "gemm dgrad" if backward else "gemm fwd"


def _mnk(name: str, args: tuple) -> tuple[int, int, int]:
    """(M, N, K) of an aten matrix product."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm", "addmv") else (args[0], args[1])
    if name in ("mv", "addmv", "dot"):
        return a.shape[0], 1, a.shape[-1]
    return a.shape[-2], b.shape[-1], a.shape[-1]


def attention_flops(name: str, args: tuple) -> int:
    """Model FLOPs of an SDPA call: QK^T and AV, 2 per multiply-add (4*B*H*Sq*Sk*D
    for D = Dv), twice that for the backward (dQ, dK, dV, dP; flash's recompute of
    P not counted), no causal discount."""
    if "backward" in name:
        q, k, v = args[1], args[2], args[3]
        mult = 2
    else:
        q, k, v = args[0], args[1], args[2]
        mult = 1
    b_h = math.prod(q.shape[:-2])
    return mult * 2 * b_h * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def _aten_category(name: str, outs: list[torch.Tensor], phase: str, rec, mnk) -> str:
    """The category of an aten op run in ``phase`` (``rec``: the step's recorder, whose model
    spec gives a GEMM its role from ``mnk``)."""
    if name in _GEMM_OPS:
        return gemm_role(*mnk, rec.spec, phase.startswith("backward"))
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    if phase == "optimizer":
        return "optimizer"
    if any(t.dtype.is_floating_point and t.dtype.itemsize == 1 for t in outs) or name in ("amax", "abs_max"):
        return "fp8 cast/amax"
    if phase == "loss" or name.startswith(_LOSS_OPS):
        return "loss"
    if phase.endswith("norm") or any(n in name for n in _NORM_OPS):
        return "norm"
    if name.startswith("embedding"):
        return "embedding"
    if name in _COPY_OPS:
        return "copies and fills"
    return "elementwise"


# --------------------------------------------------------------------------- Triton launches

#: kernel module -> category (GEMM kernels get their role from their dimensions)
_TRITON_CATEGORY = {
    "activation": "elementwise",
    "swiglu": "elementwise",  # silu(gate) * up and its gradient (gate and up from one GEMM)
    # the rotary embedding of q and k, forward and backward; and its cos / sin tables
    # (_rotary_tables_kernel: each argument once, the position ids, inv_freq and both tables)
    "rotary": "elementwise",
    "norm": "norm",
    "cross_entropy": "loss",
    "float8": "fp8 cast/amax",
    "mx": "fp8 cast/amax",  # MX casts: x's, W's or dY's pair of e8m0-scaled casts (and dY's column sums)
    "adam": "optimizer",
    "sgd": "optimizer",
    "overflow": "optimizer",
    "scale": "optimizer",
    "_update": "optimizer",
}
#: arguments an optimizer kernel reads and writes (each counted twice)
_READ_WRITE = {
    "master_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "max_exp_avg_sq_ptr", "momentum_ptr",
    "exp_avg_absmax_ptr", "exp_avg_sq_absmax_ptr", "max_exp_avg_sq_absmax_ptr",
    "momentum_absmax_ptr"
}  # fmt: skip


def _tensor(x) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    base = getattr(x, "base", None)  # a TMA tensor descriptor
    return base if isinstance(base, torch.Tensor) else None


def triton_cost(name: str, named: dict, spec: ModelSpec, backward: bool) -> tuple[str, int, int, torch.dtype]:
    """(category, bytes, FLOPs, the dtype that sets its peak) of one Triton launch,
    ``named`` its arguments by the kernel's parameter names (constexprs included)."""
    module = name.split(".")[0]
    if module == "gemm_split":  # split-K: partial products into a workspace, then their reduction
        nbytes = _streamed_bytes(named)[0]
        if "K" not in named:  # the reduction: split-K serves the GEMMs with few output tiles, the wgrads
            return ("gemm wgrad" if backward else "gemm fwd"), nbytes, 0, torch.float32
        m, n, k = int(named["M"]), int(named["N"]), int(named["K"])
        return gemm_role(m, n, k, spec, backward), nbytes, 2 * m * n * k, _tensor(named["a_ptr"]).dtype
    if module.startswith("gemm"):
        m, n, k = int(named["M"]), int(named["N"]), int(named["K"])
        a = _tensor(named.get("a_ptr", named.get("a_desc")))
        b = _tensor(named.get("b_ptr", named.get("b_desc")))
        c = named["c_ptr"]
        nbytes = (m * k * a.element_size() + k * n * b.element_size()
                  + m * n * c.element_size() * (2 if "accumulate" in name else 1))  # fmt: skip
        if named.get("HAS_BIAS"):
            nbytes += n * named["bias_ptr"].element_size()
        if module == "gemm_mx":  # its e8m0 scales, a byte per 32 of K (a's rows', b's columns')
            nbytes += footprint(named["scale_a_ptr"]) + footprint(named["scale_b_ptr"])
        if named.get("STORE_PREACT"):
            nbytes += m * n * named["preact_ptr"].element_size()
        if named.get("GRAD_ACT"):  # the dgrad epilogue reads Z; a gated unit's reads gate and up
            glu = 2 if named.get("GRAD_GLU") else 1  # ... and writes d(up) beside d(gate)
            nbytes += m * n * (glu * named["preact_ptr"].element_size() + (glu - 1) * c.element_size())
        if named.get("GLU_FWD"):  # a gated unit's forward in up's GEMM (C is h): gate read, up written
            nbytes += 2 * m * n * named["preact_ptr"].element_size()
        if named.get("ADD_RESIDUAL"):  # the residual stream read beside C and added before the store
            nbytes += m * n * named["preact_ptr"].element_size()
        if named.get("ROW_STATS"):  # the head's softmax statistics, (m, s) per 32 columns, written
            nbytes += footprint(named["preact_ptr"])
        if named.get("A_ACT"):
            nbytes += m * k * named["z_ptr"].element_size()
        if named.get("STORE_A"):
            nbytes += m * k * named["a_out_ptr"].element_size()
        if named.get("SUM_A"):  # written, or read and written (ADD_SUM: dbias into its .grad)
            nbytes += m * named["a_sum_ptr"].element_size() * (2 if named.get("ADD_SUM") else 1)
        if named.get("DELAYED") and "data_ptr" in named:  # the emitting epilogue's fp8 C (and C^T)
            nbytes += m * n * named["data_ptr"].element_size() * (2 if named.get("STORE_T") else 1)
        return gemm_role(m, n, k, spec, backward), nbytes, 2 * m * n * k, a.dtype
    if name == "norm._norm_param_grads_kernel":
        return "norm", _param_grads_bytes(named), 0, torch.float32
    if name == "cross_entropy._target_stats_kernel":
        return "loss", _target_stats_bytes(named), 0, torch.float32
    nbytes, dtype = _streamed_bytes(named)
    if module == "cross_entropy" and "logits_ptr" in named:  # each pass over a row reads its logits again
        # (the lse from the GEMM's row statistics, LSE_FROM_STATS, is no pass over the logits)
        first = named.get("COMPUTE_LSE") and not named.get("LSE_FROM_STATS")
        passes = bool(first) + bool(named.get("WRITE_GRAD"))
        nbytes += max(passes - 1, 0) * _logits_bytes(named)
    return _TRITON_CATEGORY.get(module, "other"), nbytes, 0, dtype


def _param_grads_bytes(named: dict) -> int:
    """The norm's dweight / dbias reduction: for each output it makes, the (P, N) fp32
    partial sums read and the (N,) gradient written, or read and written where it adds into
    it (a fused optimizer's flat buffer); the absent output's dummy pointers touch nothing."""
    p, n = int(named["P"]), int(named["N"])
    nbytes = 0
    for out, has, acc in (("dw_ptr", "HAS_DW", "ACC_DW"), ("db_ptr", "HAS_DB", "ACC_DB")):
        if named.get(has):
            nbytes += 4 * p * n + n * _tensor(named[out]).element_size() * (2 if named.get(acc) else 1)
    return nbytes


def _target_stats_bytes(named: dict) -> int:
    """The targets' check and the loss's scalars: the (N,) targets read, with class weights
    one fp32 weight gathered per target (at most the (V,) weights), the 5 fp32 stats written."""
    n = int(named["n_rows"])
    nbytes = n * _tensor(named["target_ptr"]).element_size() + 5 * 4
    if named.get("HAS_WEIGHT"):
        nbytes += 4 * min(n, int(named["n_cols"]))
    return nbytes


def _logits_bytes(named: dict) -> int:
    """Bytes of one pass over the cross-entropy kernel's logits (``n_rows`` x ``n_cols``)."""
    logits = _tensor(named["logits_ptr"])
    rows, cols = named.get("n_rows", logits.shape[0]), named.get("n_cols", logits.shape[-1])
    return int(rows) * int(cols) * logits.element_size()


def _streamed_bytes(named: dict) -> tuple[int, torch.dtype]:
    """(bytes, the data's dtype) of a streaming kernel: each tensor argument touched once
    (over ``n`` elements where the kernel has an ``n``), the read-and-written ones twice."""
    count = named.get("n")
    seen: dict[tuple, int] = {}
    dtype = torch.float32
    for arg, value in named.items():
        t = _tensor(value)
        if t is None or _key(t) in seen:
            continue
        size = footprint(t)
        if isinstance(count, int) and t.numel() >= count:  # a streaming range of n elements
            size = count * t.element_size()
        seen[_key(t)] = size * (2 if arg in _READ_WRITE else 1)
        if arg in ("x_ptr", "grad_ptr", "logits_ptr", "dy_ptr"):
            dtype = t.dtype
    return sum(seen.values()), dtype


# --------------------------------------------------------------------------- the profile's categories

#: record_function names that carry a category into a profile: ``ledger:<category>`` around
#: every tkern Triton launch (:func:`profiled_launches`, with its FLOPs and bytes) and around the
#: optimizer's and the loss's phases (bench_train --profile)
RANGE = "ledger:"
_GEMM_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|matmul|wgmma|s16816|s1688|_mm_|sm90_|sm80_", re.I)
_KERNEL_RULES = (  # (category, substrings of the kernel's, its op's or an ancestor's name), in order
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")),
    ("fp8 cast/amax", ("float8", "fp8", "amax")),
    ("loss", ("nll_loss", "log_softmax", "logsoftmax", "cross_entropy", "crossentropy")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "norm_fwd", "norm_bwd")),
    ("embedding", ("embedding", "index_select", "indexselect")),
    ("copies and fills", ("memcpy", "memset", "copy", "fill", "zero", "catarray", "cat_")),
)


def kernel_category(
    kernel: str, ancestors: list[str], shapes: list | None, spec: ModelSpec | None
) -> tuple[str, int, int | None]:
    """(category, FLOPs, bytes or None) of one GPU kernel of a profile, in the ledger's
    categories. ``ancestors``: the names of the CPU ranges around its launch, innermost
    first (aten ops, autograd's ``evaluate_function: XBackward0``, ``ledger:`` ranges);
    ``shapes``: the input shapes of the innermost aten op, where recorded. As in the
    ledger, the optimizer's phase (a ``ledger:optimizer`` range) takes everything in it
    and the loss's phase (``ledger:loss``) everything but GEMMs; a tkern launch carries its
    category, FLOPs and bytes in its own range (:func:`profiled_launches`); another GEMM
    kernel (by its name or its op's) takes its role from its op's shapes
    (:func:`gemm_role`); the rest go by substrings of its own, its op's and its ranges'
    names (:data:`_KERNEL_RULES`), elementwise otherwise."""
    ranges = [a[len(RANGE) :].split("|") for a in ancestors if a.startswith(RANGE)]
    phases = {r[0] for r in ranges if len(r) == 1}
    launch = next((r for r in ranges if len(r) > 1), None)
    if launch is not None:
        category, flops, nbytes = launch[0], int(launch[1]), int(launch[2])
    else:
        category, flops, nbytes = _aten_kernel(kernel, ancestors, shapes, spec), 0, None
        if category in GEMM_CATEGORIES:
            op = next((a for a in ancestors if a.startswith("aten::")), "")
            mnk = _shape_mnk(op.split("::")[-1], shapes or [])
            flops = 2 * math.prod(mnk) if mnk is not None else 0
    if "optimizer" in phases:
        return "optimizer", flops, nbytes
    if "loss" in phases and category not in GEMM_CATEGORIES:
        return "loss", flops, nbytes
    return category, flops, nbytes


def _aten_kernel(kernel: str, ancestors: list[str], shapes: list | None, spec: ModelSpec | None) -> str:
    """The category of a kernel torch launched (not tkern)."""
    op = next((a for a in ancestors if a.startswith("aten::")), "").split("::")[-1]
    backward = any("evaluate_function" in a or "Backward" in a for a in ancestors)
    if _GEMM_KERNEL.search(kernel) or op in _GEMM_OPS:
        mnk = _shape_mnk(op, shapes or [])
        if mnk is not None and spec is not None:
            return gemm_role(*mnk, spec, backward)
        return "gemm dgrad" if backward else "gemm fwd"
    text = " ".join([kernel, *ancestors]).lower()
    return next((c for c, words in _KERNEL_RULES if any(w in text for w in words)), "elementwise")


def _shape_mnk(op: str, shapes: list) -> tuple[int, int, int] | None:
    """(M, N, K) of a matrix product from its op's recorded input shapes."""
    dims = [s for s in shapes if isinstance(s, (list, tuple)) and len(s) >= 2]
    if op not in _GEMM_OPS or len(dims) < 2:
        return None
    a, b = dims[0], dims[1]
    return a[-2], b[-1], a[-1]
