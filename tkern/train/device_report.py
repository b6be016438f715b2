"""``tkern info [--device NAME]``: what tkern would do on a GPU, planned on any machine.

Every line comes from the functions the launchers themselves call with the device's
:class:`tkern.DeviceSpec` (``gemm_plan.plan_gemm`` with its SMs and TMA, the config
tables pruned by ``gemm_configs.offered_configs``, ``float8.fp8_refusal``, the
optimizer's ``step_path``), so a CPU without that GPU prints the GPU's plan.
"""

from __future__ import annotations

from typing import NamedTuple

from tkern.device import DeviceSpec, device_spec, spec_names

__all__ = [
    "COMPILED_EVERY_CONFIG",
    "COMPILED_IN_CI",
    "GPT2_SMALL",
    "device_report",
    "info",
    "spec_or_usage_error",
    "support_table",
]


class Gemm(NamedTuple):
    """One GEMM of a training step: ``(m, k) @ (k, n)``, its layout and whether the
    launch has an epilogue that split-K does not run (a bias)."""

    name: str
    layout: str
    m: int
    n: int
    k: int
    split: bool


def gpt2_gemms(tokens: int = 16384, hidden: int = 768, vocab: int = 50257) -> list[Gemm]:
    """GPT-2 small's GEMMs per step at ``tokens`` tokens: each linear layer's forward
    (NT: x @ W^T, with its bias), dgrad (NN: dY @ W) and wgrad (TN: dY^T @ x)."""
    layers = (("attn qkv", hidden, 3 * hidden, True), ("attn proj", hidden, hidden, True))
    layers += (("mlp fc", hidden, 4 * hidden, True), ("mlp proj", 4 * hidden, hidden, True))
    layers += (("lm head", hidden, vocab, False),)
    out = []
    for name, d_in, d_out, bias in layers:
        out.append(Gemm(name, "forward NT", tokens, d_out, d_in, not bias))
        out.append(Gemm(name, "dgrad NN", tokens, d_in, d_out, True))
        out.append(Gemm(name, "wgrad TN", d_out, d_in, tokens, True))
    return out


#: GPT-2 small (124M) at 16 sequences of 1024 tokens: the shapes the report plans.
GPT2_SMALL = gpt2_gemms()
#: GPT-2 small's parameters (tied embeddings), for the optimizer's step path.
GPT2_SMALL_PARAMS = 124_439_808


def spec_or_usage_error(name: str | None) -> DeviceSpec:
    """The spec named ``name`` (None: the device at hand); ``ValueError`` listing the
    names for one tkern does not know."""
    if name is None:
        return device_spec()
    if name.lower() not in spec_names():
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(spec_names())}")
    return device_spec(name)


#: The AMD backend's knobs a config may carry (gemm_configs.AMD_KNOBS, kpack).
_AMD_KNOBS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")


def _config_text(c) -> str:
    """``128x128x64 s3 w8``: BLOCK_M x BLOCK_N x BLOCK_K, stages, warps."""
    kw = c.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} s{c.num_stages} w{c.num_warps}"


def _knobs_text(c) -> str:
    """The AMD backend's knobs ``c`` carries (``waves_per_eu=2 ...``), empty on NVIDIA."""
    return " ".join(f"{k}={c.kwargs[k]}" for k in _AMD_KNOBS if k in c.kwargs)


def _offered(spec: DeviceSpec, kernel: str, ragged: bool) -> list:
    """The configs the autotuner offers ``kernel`` on ``spec`` (a 16-bit GEMM, no epilogue)."""
    from tkern.kernels import gemm_configs as gc
    from tkern.kernels.gemm_plan import SPLIT_K, TMA

    if kernel == TMA:
        return gc.prune_configs(gc.tma_configs(), spec, tma=True, ragged=ragged)
    table = gc.split_k_configs(interpret=False) if kernel == SPLIT_K else gc.gemm_configs(interpret=False)
    return gc.offered_configs(table, spec, ragged=ragged)


def gemm_lines(spec: DeviceSpec, gemms: list[Gemm] = GPT2_SMALL) -> list[str]:
    """The plan of each GEMM on ``spec`` (kernel, splits) and the configs it is offered,
    each distinct set of configs printed once."""
    from tkern.kernels.gemm_configs import VECTOR_ELEMS
    from tkern.kernels.gemm_plan import SPLIT_K, plan_gemm

    sets: dict[tuple, int] = {}
    rows = []
    for g in gemms:
        ragged = any(d % VECTOR_ELEMS for d in (g.m, g.n, g.k))
        plan = plan_gemm(g.m, g.n, g.k, spec.sms, tma=spec.tma, ragged=ragged, split=g.split)
        offered = _offered(spec, plan.kernel, ragged)
        configs = tuple(map(_config_text, offered))
        knobs = _knobs_text(offered[0])
        configs += (f"each with {knobs}",) if knobs else ()
        label = sets.setdefault((plan.kernel, configs), len(sets) + 1)
        kernel = f"{plan.kernel} x{plan.split_k}" if plan.kernel == SPLIT_K else plan.kernel
        shape = f"{g.m}x{g.n}x{g.k}"
        rows.append(f"  {g.name:<10} {g.layout:<11} {shape:<18} {kernel:<10} configs {label}")
    head = f"GEMMs (GPT-2 small, 16384 tokens; M x N x K; {spec.sms} SMs, TMA {'yes' if spec.tma else 'no'}):"
    lines = [head, *rows, "configs offered (16-bit operands, no epilogue):"]
    lines += [f"  {label} ({kernel}): {', '.join(configs)}" for (kernel, configs), label in sets.items()]
    return lines


def fp8_lines(spec: DeviceSpec) -> list[str]:
    """The fp8 formats and each recipe's verdict (native, or why it is refused), and MX."""
    from tkern.kernels.float8 import format_names
    from tkern.ops.float8_args import RECIPE_FORMATS, recipe_formats

    lines = [f"fp8 formats (native): {format_names(spec.fp8_dtypes)}"]
    for recipe in RECIPE_FORMATS:
        formats = recipe_formats(recipe, spec)
        reason = recipe_refusal(spec, recipe)
        verdict = "native" if reason is None else "refused: " + reason
        lines.append(f"  {recipe:<10} ({format_names(formats)}): {verdict}")
    mx = (
        "native (tl.dot_scaled on the tensor cores)"
        if spec.mx
        else "not native (Triton emulates tl.dot_scaled)"
    )
    lines.append(f"MX block-scaled MMA: {mx}")
    return lines


def optimizer_lines(spec: DeviceSpec) -> list[str]:
    """The fused optimizer's step path (``one_pass`` modes) for a few range sizes."""
    from tkern.kernels._update import GRID_MAX_ELEMENTS, ONE_PASS_MAX_ELEMENTS, step_path

    lines = ["optimizer step (one flat range):"]
    cases = (("auto", ONE_PASS_MAX_ELEMENTS), ("grid", GRID_MAX_ELEMENTS), ("auto", GPT2_SMALL_PARAMS))
    for mode, n in cases:
        path = step_path(n, mode, device_programs=spec.sms, interpret=False)
        lines.append(f"  one_pass={mode!r:<7} {n:>11,} elements: {path.path} ({path.reason})")
    return lines


def device_report(spec: DeviceSpec) -> str:
    """Everything above for ``spec``, one block of text."""
    return "\n".join(
        ["spec    " + spec.describe(), *gemm_lines(spec), *fp8_lines(spec), *optimizer_lines(spec)]
    )


#: The targets the compile gate (tests/test_compiled.py, its ``TARGETS``) compiles for:
#: every architecture of :data:`tkern.device.SPECS` (every offered GEMM config on sm_90 and
#: sm_100, the first per family and layout on the others).
COMPILED_IN_CI = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950")
#: Of those, the targets whose every offered GEMM config the gate compiles under Triton 3.7+
#: (benchmarks/aot_targets.swept reads it): the datacenter GPUs the GEMMs are tuned for.
COMPILED_EVERY_CONFIG = ("sm_90", "sm_100")


def recipe_refusal(spec: DeviceSpec, recipe: str) -> str | None:
    """Why Float8Linear(``recipe``) is refused on ``spec`` (its fp8 formats in the
    device's native family, and for "mxfp8" native MX), or None where it runs."""
    from tkern.kernels.float8 import fp8_refusal
    from tkern.ops.float8_args import recipe_formats

    if recipe == "mxfp8" and spec.fp8 and not spec.mx:
        return f"{spec.name} ({spec.arch}) has no native MX (e8m0 block-scaled) MMA"
    return fp8_refusal(spec, f"Float8Linear({recipe!r})", recipe_formats(recipe, spec))


def _recipes(spec: DeviceSpec) -> str:
    """The fp8 recipes' verdict on ``spec``, in a few words."""
    from tkern.ops.float8_args import RECIPE_FORMATS

    runs = [r for r in RECIPE_FORMATS if recipe_refusal(spec, r) is None]
    if not spec.fp8:
        return "refused: no fp8 tensor cores"
    return ", ".join(runs)


def support_table() -> str:
    """docs/devices.md's GPU x feature table, from :data:`tkern.device.SPECS` and what
    tkern's planners decide for each (tests check the page holds exactly this)."""
    from tkern.device import SPECS
    from tkern.kernels.float8 import format_names

    rows = [
        "| GPU | arch | 16-bit GEMM kernels | fp8 formats (tkern's recipes) | MX MMA in hardware | graphs "
        "| FSDP2 | compiled in CI |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for spec in SPECS.values():
        gemm = "TMA, split-K, pointer" if spec.tma else "split-K, pointer"
        fp8 = (
            f"{format_names(spec.fp8_dtypes)} ({_recipes(spec)})" if spec.fp8 else f"none ({_recipes(spec)})"
        )
        graphs = "HIP graphs through torch.cuda, untested" if spec.is_amd else "CUDA graphs"
        fsdp = "torch's FSDP2 over RCCL, untested" if spec.is_amd else "torch's FSDP2 over NCCL"
        ci = "not yet" if spec.arch not in COMPILED_IN_CI else "yes, one config per GEMM family and layout"
        ci = "yes, every config" if spec.arch in COMPILED_EVERY_CONFIG else ci
        mx = "native" if spec.mx else "no"
        rows.append(f"| {spec.name} | {spec.arch} | {gemm} | {fp8} | {mx} | {graphs} | {fsdp} | {ci} |")
    return "\n".join(rows)


def info(device: str | None = None) -> int:
    """``tkern info``: versions and mode, the device at hand's spec; with ``device`` (a
    name from ``tkern.device.SPECS``) also the plan there. Raises ``ValueError`` for an
    unknown name (the command exits 2 with the list)."""
    import torch
    import triton

    import tkern

    spec = spec_or_usage_error(device)
    here = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA device)"
    how = "Triton's interpreter on the CPU" if tkern.mode() == "interpreted" else "compiled for the GPU"
    print(f"tkern   {tkern.__version__}")
    print(f"device  {here}")
    print(f"torch   {torch.__version__}")
    print(f"triton  {triton.__version__}")
    print(f"mode    {tkern.mode()}  ({how})")
    if device is None:
        print("spec    " + spec.describe())
    else:
        print(f"\nplanned for {spec.name}, as tkern would run there:")
        print(device_report(spec))
    return 0
