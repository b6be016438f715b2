"""CUDA autocast's op lists on a CPU, for the step ledger (issue 54 item 1): inside
:func:`cuda_autocast_lists`, an op that CUDA autocast runs in fp32 (``pow``, ``exp``,
``softmax``, ``layer_norm``, the losses, ...) or in the autocast dtype (``addmv``, ``mv``,
...) runs so under CPU autocast too, where CPU autocast's own lists would leave it in its
inputs' dtype: HF GPT-2's tanh GELU starts with ``pow(x, 3)``, which CUDA autocast runs in
fp32, and with it the rest of the chain.

The lists are torch's "Autocast Op Reference" (CUDA ops that can autocast to float16 /
to float32), as aten names (``aten/src/ATen/autocast_mode.h``: ``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``). Registered for ``AutocastCPU`` with a
``torch.library.Library`` that is destroyed on the way out, so nothing outlives the ledger.
Where CPU autocast has a kernel for one of these ops it is kept (:func:`policies`). Not modeled: CUDA's
"promote" list (``addcmul``, ``index_put``, ...: widest input type, as without autocast here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils import _pytree as pytree

#: CUDA autocast's ops that run in the autocast dtype (float16 / bfloat16)
LOWER_PRECISION = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm",
    "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "scaled_dot_product_attention",
)  # fmt: skip
#: CUDA autocast's ops that run in fp32 (their 16-bit inputs cast up)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
    "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
    "cdist", "renorm", "logsumexp",
)  # fmt: skip
#: CUDA autocast's ops given ``dtype=torch.float32`` when a 16-bit input has none (one
#: kernel that reads 16-bit and computes and writes fp32: no separate cast)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum", "sum.dim_IntList",
)  # fmt: skip

_LOW = (torch.float16, torch.bfloat16)


def _cast(dtype: torch.dtype):
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 and t.dtype != dtype else t

    return cast


def _kernel(op: torch._ops.OpOverload, policy: str):
    """An ``AutocastCPU`` kernel running ``op`` as CUDA autocast would: its floating-point
    inputs cast to the autocast dtype (``lower``) or to fp32 (``fp32``), or ``dtype=float32``
    passed where a 16-bit input has no dtype given (``opt_dtype``); then ``op`` below autocast."""
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(below):
            if policy == "opt_dtype":
                leaves = pytree.tree_leaves((args, kwargs))
                given = kwargs.get("dtype") is not None or (dtype_at is not None and len(args) > dtype_at
                                                             and args[dtype_at] is not None)  # fmt: skip
                if not given and any(isinstance(t, torch.Tensor) and t.dtype in _LOW for t in leaves):
                    args = args[:dtype_at] if dtype_at is not None else args
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            dtype = torch.get_autocast_dtype("cpu") if policy == "lower" else torch.float32
            args, kwargs = pytree.tree_map_only(torch.Tensor, _cast(dtype), (args, kwargs))
            return op(*args, **kwargs)

    return kernel


def _overload(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def policies() -> dict[str, str]:
    """aten op (``name.overload``) -> the policy its ``AutocastCPU`` kernel gets here: every op
    of CUDA's lists that CPU autocast has no kernel for. Those it has it runs as CUDA does (the
    losses and ``cdist`` in fp32; GEMMs, convolutions and SDPA in the 16-bit dtype, with the
    weights' cast cache), but for ``prod`` (cast to fp32 rather than given ``dtype``)."""
    lists = [(FP32, "fp32"), (FP32_SET_OPT_DTYPE, "opt_dtype"), (LOWER_PRECISION, "lower")]
    return {
        name: policy
        for names, policy in lists
        for name in names
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCPU")
    }


@contextlib.contextmanager
def cuda_autocast_lists() -> Iterator[None]:
    """Inside, CPU autocast runs the ops of CUDA autocast's lists as CUDA autocast does."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        for name, policy in policies().items():
            lib.impl(name, _kernel(_overload(name), policy), "AutocastCPU")
        yield
    finally:
        lib._destroy()
