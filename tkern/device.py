"""One description of the GPU tkern plans for: :class:`DeviceSpec`.

Every device decision in tkern (which GEMM kernel, which configs and how they are
pruned, the fp8 formats, MX, block sizes and warps, the grid step) is a function of
a :class:`DeviceSpec`. This is the only module that asks torch about the device
(``torch.cuda.get_device_properties``, ``torch.version.hip``); everything else asks
:func:`device_spec`. Named specs (:data:`SPECS`) let a CPU plan for a GPU it does
not have (``tkern info --device mi300x``, the compile gate, the step ledger).

Datasheet peaks (dense, no sparsity; 16-bit with fp32 accumulation, as tkern's GEMMs
accumulate): NVIDIA A100 / H100 / H200 / B200 datasheets (SXM parts), the A10 and L4
datasheets, the Ada (RTX 4090) and Blackwell (RTX 5090) GeForce whitepapers ("FP16
tensor with FP32 accumulate"), AMD's MI300X and MI355X datasheets. Shared memory per
block is the opt-in maximum CUDA grants one block (LDS per workgroup on AMD).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

import torch

__all__ = [
    "INTERPRETER",
    "SPECS",
    "DeviceSpec",
    "device_spec",
    "spec_for_cc",
    "spec_from_properties",
    "spec_names",
]

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_OCP = (_E4M3, _E5M2)

#: Tensor-core instruction families, as the compile gate reads them.
MMA_KINDS = ("mma.sync", "wgmma", "tcgen05", "mfma", "none")


@dataclass(frozen=True)
class DeviceSpec:
    """What tkern needs to know of one GPU to plan its kernels there.

    Attributes:
        name: short name (``"h200"``, ``"mi300x"``; for a real GPU its known family's
            name, or torch's device name where none matches).
        vendor: ``"nvidia"`` or ``"amd"`` (``"cpu"`` for Triton's interpreter).
        arch: compile target (``"sm_90"``, ``"gfx942"``).
        capability: (major, minor) as torch reports it (an MI300X reports (9, 4)).
        sms: streaming multiprocessors (compute units on AMD).
        smem_per_block: bytes of shared memory (LDS) one program may use.
        warp_size: threads per warp (64 on AMD's waves).
        tma: whether the tensor memory accelerator (tensor descriptors) exists.
        mma: the tensor-core instruction: ``"mma.sync"``, ``"wgmma"``, ``"tcgen05"``,
            ``"mfma"`` (``"none"`` for the interpreter).
        fp8_dtypes: torch fp8 dtypes its tensor cores take natively, ``()`` where none.
        mx: native block-scaled (MX) MMA (``tl.dot_scaled`` on tensor cores).
        tflops_16bit, tflops_fp8: dense datasheet peaks, TFLOP/s (0 where none).
        mem_tbps: memory bandwidth, TB/s.
    """

    name: str
    vendor: str
    arch: str
    capability: tuple[int, int]
    sms: int
    smem_per_block: int
    warp_size: int
    tma: bool
    mma: str
    fp8_dtypes: tuple[torch.dtype, ...]
    mx: bool
    tflops_16bit: float
    tflops_fp8: float
    mem_tbps: float

    @property
    def cc(self) -> int:
        """The capability as one number (90 for (9, 0)); AMD's as torch reports it."""
        return 10 * self.capability[0] + self.capability[1]

    @property
    def is_amd(self) -> bool:
        return self.vendor == "amd"

    @property
    def fp8(self) -> bool:
        """Whether the tensor cores multiply fp8 at all."""
        return bool(self.fp8_dtypes)

    @property
    def fp8_e4m3(self) -> torch.dtype | None:
        """The native e4m3 format (``float8_e4m3fn``, or ``float8_e4m3fnuz`` on gfx942)."""
        return next((d for d in self.fp8_dtypes if "e4m3" in str(d)), None)

    @property
    def fp8_e5m2(self) -> torch.dtype | None:
        """The native e5m2 format (``float8_e5m2``, or ``float8_e5m2fnuz`` on gfx942)."""
        return next((d for d in self.fp8_dtypes if "e5m2" in str(d)), None)

    @property
    def target(self) -> tuple:
        """``triton.backends.compiler.GPUTarget``'s arguments for this device."""
        if self.vendor == "amd":
            return ("hip", self.arch, self.warp_size)
        return ("cuda", self.cc, self.warp_size)

    def describe(self) -> str:
        """One line: name, arch, SMs, shared memory, warp, MMA, fp8 formats, MX."""
        fp8 = ", ".join(str(d).removeprefix("torch.") for d in self.fp8_dtypes) or "none"
        return (
            f"{self.name} ({self.vendor} {self.arch}, capability {self.capability[0]}.{self.capability[1]}): "
            f"{self.sms} SMs, {self.smem_per_block // 1024} KB shared memory per block, "
            f"warp {self.warp_size}, {self.mma}{', TMA' if self.tma else ''}; fp8: {fp8}; "
            f"MX: {'native' if self.mx else 'no'}; peaks {self.tflops_16bit:g} TFLOP/s 16-bit, "
            f"{self.tflops_fp8:g} fp8, {self.mem_tbps:g} TB/s"
        )


def _nv(name, cc, sms, smem_kb, mma, fp8, mx, t16, t8, tbps, tma=None) -> DeviceSpec:
    return DeviceSpec(
        name=name, vendor="nvidia", arch=f"sm_{10 * cc[0] + cc[1]}", capability=cc, sms=sms,
        smem_per_block=smem_kb * 1024, warp_size=32, tma=cc[0] >= 9 if tma is None else tma, mma=mma,
        fp8_dtypes=_OCP if fp8 else (), mx=mx, tflops_16bit=t16, tflops_fp8=t8, mem_tbps=tbps,
    )  # fmt: skip


def _amd(name, arch, cc, cus, lds_kb, fp8, mx, t16, t8, tbps) -> DeviceSpec:
    return DeviceSpec(
        name=name, vendor="amd", arch=arch, capability=cc, sms=cus, smem_per_block=lds_kb * 1024,
        warp_size=64, tma=False, mma="mfma", fp8_dtypes=fp8, mx=mx, tflops_16bit=t16, tflops_fp8=t8,
        mem_tbps=tbps,
    )  # fmt: skip


#: The GPUs tkern plans for by name (``device_spec("mi300x")``).
SPECS: dict[str, DeviceSpec] = {
    s.name: s
    for s in (
        _nv("a100", (8, 0), 108, 163, "mma.sync", False, False, 312.0, 0.0, 2.039),
        _nv("a10", (8, 6), 72, 99, "mma.sync", False, False, 125.0, 0.0, 0.600),
        _nv("l4", (8, 9), 58, 99, "mma.sync", True, False, 121.0, 242.0, 0.300),
        _nv("rtx4090", (8, 9), 128, 99, "mma.sync", True, False, 165.2, 330.3, 1.008),
        _nv("h100", (9, 0), 132, 227, "wgmma", True, False, 989.0, 1979.0, 3.35),
        _nv("h200", (9, 0), 132, 227, "wgmma", True, False, 989.0, 1979.0, 4.8),
        _nv("b200", (10, 0), 148, 227, "tcgen05", True, True, 2250.0, 4500.0, 8.0),
        # sm_120: TMA, but mma.sync (no wgmma / tcgen05); MX not native in tkern's compiled code
        _nv("rtx5090", (12, 0), 170, 99, "mma.sync", True, False, 209.5, 419.0, 1.792),
        _amd("mi300x", "gfx942", (9, 4), 304, 64, _FNUZ, False, 1307.4, 2614.9, 5.3),
        _amd("mi355x", "gfx950", (9, 5), 256, 160, _OCP, True, 2516.6, 5033.2, 8.0),
    )
}

#: What a CPU run plans with: Triton's interpreter (no tensor cores, no TMA; the
#: kernels' interpreter branches pick their own small configs).
INTERPRETER = DeviceSpec(
    name="interpreter", vendor="cpu", arch="interpreter", capability=(0, 0), sms=4,
    smem_per_block=232448, warp_size=32, tma=False, mma="none", fp8_dtypes=_OCP, mx=True,
    tflops_16bit=0.0, tflops_fp8=0.0, mem_tbps=0.0,
)  # fmt: skip

#: torch's device names for the named specs (lower case, the first match wins).
_NAME_KEYS = (
    ("h200", "h200"), ("h100", "h100"), ("h800", "h100"), ("gh200", "h200"), ("b200", "b200"),
    ("gb200", "b200"), ("a100", "a100"), ("a800", "a100"), ("a10", "a10"), ("l4", "l4"),
    ("4090", "rtx4090"), ("5090", "rtx5090"), ("mi300", "mi300x"), ("mi325", "mi300x"), ("mi355", "mi355x"),
    ("mi350", "mi355x"),
)  # fmt: skip


def spec_names() -> tuple[str, ...]:
    """The names :func:`device_spec` knows."""
    return tuple(SPECS)


#: :func:`device_spec`'s answers by argument (a torch device with an index, a name, the
#: host under the interpreter): a launcher's question for a GPU tensor is one dict lookup.
_SPEC_CACHE: dict = {}


def device_spec(device: torch.device | str | int | None = None) -> DeviceSpec:
    """The :class:`DeviceSpec` of ``device``.

    ``device`` is a named GPU (``"mi300x"``, case-insensitive, see :data:`SPECS`), a
    :class:`DeviceSpec` (returned as it is), a torch device or device index of a real
    GPU (None: the current CUDA/ROCm device), or a CPU / meta device (the
    :data:`INTERPRETER` spec under Triton's interpreter; with Triton compiling, as in an
    ahead-of-time compile on a CPU, the GPU torch reports). A real GPU's spec is built
    from ``torch.cuda.get_device_properties`` and ``torch.version.hip`` once per device;
    a GPU tkern does not know gets the nearest known family's rules and one warning,
    never an error. Raises ``ValueError`` for a name it does not know, listing those it does.
    """
    try:
        return _SPEC_CACHE[device]
    except (KeyError, TypeError):  # TypeError: an unhashable argument
        pass
    spec, cacheable = _lookup(device)
    if cacheable:
        _SPEC_CACHE[device] = spec
    return spec


def _lookup(device) -> tuple[DeviceSpec, bool]:
    """:func:`device_spec`'s answer, and whether it holds for the process's life."""
    if isinstance(device, DeviceSpec):
        return device, False
    if isinstance(device, str) and device.lower() in SPECS:
        return SPECS[device.lower()], True
    if isinstance(device, str) and not _is_device_string(device):
        raise ValueError(f"device must be a torch device or one of {spec_names()}, got {device!r}")
    if device is None:
        if not torch.cuda.is_available():
            return INTERPRETER, False
        return _real_spec(torch.cuda.current_device()), False
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    from tkern.kernels._common import INTERPRET

    if INTERPRET:
        return INTERPRETER, True
    if device.type != "cuda" or not torch.cuda.is_available():
        return _host_compile_spec(device.index if device.type == "cuda" else None), False
    if device.index is None:
        return _real_spec(torch.cuda.current_device()), False
    return _real_spec(device.index), True


def _host_compile_spec(index: int | None) -> DeviceSpec:
    """Triton compiling where torch has no GPU (host tensors, or CUDA unavailable): only an
    ahead-of-time compile gets here (a fake driver, torch's device queries answering for
    the target GPU, as ``../shared/tools/aot_report.py`` does); plan for the GPU torch
    reports (device ``index``, None: the current one), or the interpreter where it reports none."""
    try:
        return _real_spec(torch.cuda.current_device() if index is None else index)
    except (AssertionError, RuntimeError):  # no CUDA in this torch, or no GPU
        return INTERPRETER


def spec_for_cc(cc: int) -> DeviceSpec:
    """The NVIDIA spec of compute capability ``cc`` (e.g. 90, 80, 120): the named spec
    of that architecture (the nearest older one where none is named), with the opt-in
    shared memory per block CUDA grants that capability. For callers that plan by an
    int capability (the compile gate); everything else passes a :class:`DeviceSpec`."""
    by_arch = {s.cc: s for s in reversed(SPECS.values()) if not s.is_amd}  # the first named per arch
    older = [c for c in by_arch if c <= cc and c // 10 == cc // 10] or [c for c in by_arch if c <= cc]
    family = by_arch[max(older) if older else min(by_arch)]
    return dataclasses.replace(
        family, capability=(cc // 10, cc % 10), arch=f"sm_{cc}", smem_per_block=_NV_SMEM.get(cc, 101376)
    )


#: NVIDIA's opt-in shared memory per block, by capability (227 KB: sm_90 / sm_100 / sm_103;
#: 163 KB: sm_80 and Orin's sm_87; 99 KB elsewhere: sm_86, sm_89, sm_120).
_NV_SMEM = {90: 232448, 100: 232448, 103: 232448, 80: 166912, 87: 166912}


def _is_device_string(text: str) -> bool:
    try:
        torch.device(text)
    except RuntimeError:
        return False
    return True


@functools.cache
def _real_spec(index: int) -> DeviceSpec:
    """The spec of CUDA/ROCm device ``index``, asked of torch once per device."""
    props = torch.cuda.get_device_properties(index)
    return spec_from_properties(
        name=props.name,
        capability=(props.major, props.minor),
        sms=props.multi_processor_count,
        smem_per_block=getattr(props, "shared_memory_per_block_optin", 0),
        warp_size=getattr(props, "warp_size", 0),
        hip=torch.version.hip is not None,
        gcn_arch=getattr(props, "gcnArchName", ""),
    )


def spec_from_properties(
    name: str,
    capability: tuple[int, int],
    sms: int,
    smem_per_block: int = 0,
    warp_size: int = 0,
    hip: bool = False,
    gcn_arch: str = "",
) -> DeviceSpec:
    """A :class:`DeviceSpec` from what torch reports of a GPU: the known family's
    spec (by device name, else by architecture) with the device's own SM count,
    shared memory and warp size; an unknown GPU gets the nearest family's rules and
    one warning. Public so that a test can plan for a GPU it does not have."""
    family, known = _family(name, tuple(capability), hip, gcn_arch.split(":")[0])
    if not known:
        warnings.warn(
            f"tkern does not know the GPU {name!r} (capability {capability[0]}.{capability[1]}"
            f"{', ' + gcn_arch if gcn_arch else ''}); planning with {family.name}'s rules "
            f"({family.arch}). Its speed figures are {family.name}'s datasheet peaks.",
            stacklevel=3,
        )
    changes = {"capability": tuple(capability), "sms": sms or family.sms}
    if not known:
        changes["name"] = name
    if smem_per_block:
        changes["smem_per_block"] = smem_per_block
    if warp_size:
        changes["warp_size"] = warp_size
    if hip and gcn_arch:
        changes["arch"] = gcn_arch.split(":")[0]
    elif not hip:
        changes["arch"] = f"sm_{10 * capability[0] + capability[1]}"
    return dataclasses.replace(family, **changes)


def _family(name: str, cc: tuple[int, int], hip: bool, gcn: str) -> tuple[DeviceSpec, bool]:
    """The known spec nearest to a GPU, and whether it is that GPU's own family."""
    lower = name.lower()
    for key, spec in _NAME_KEYS:
        if key in lower and SPECS[spec].is_amd == hip:
            return SPECS[spec], True
    if hip:
        if gcn.startswith("gfx95"):
            return SPECS["mi355x"], gcn == "gfx950"
        return SPECS["mi300x"], gcn == "gfx942"
    by_arch = {s.cc: s for s in reversed(SPECS.values()) if not s.is_amd}  # the first named per arch
    cc_num = 10 * cc[0] + cc[1]
    if cc_num in by_arch:
        return by_arch[cc_num], True
    older = [c for c in by_arch if c <= cc_num and c // 10 == cc[0]] or [c for c in by_arch if c <= cc_num]
    return by_arch[max(older) if older else min(by_arch)], False
