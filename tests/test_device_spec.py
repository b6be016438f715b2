"""tkern.DeviceSpec (issue 52): the named GPUs' fields, the spec of a real GPU from what
torch reports of it, and every device choice planned from a spec on a CPU that has none
of those GPUs (the GEMM route, the configs offered, the fp8 refusals). The only seam the
tests answer through is ``tkern.device.device_spec`` (or a spec passed to a pure planner)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import triton

import tkern
from tkern import device as tkdev
from tkern.device import INTERPRETER, SPECS, DeviceSpec, device_spec, spec_for_cc, spec_from_properties
from tkern.kernels import float8 as f8
from tkern.kernels import gemm, gemm_configs
from tkern.kernels.gemm_plan import TMA
from tkern.kernels.gemm_tma import has_tma

OCP = (torch.float8_e4m3fn, torch.float8_e5m2)
FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)

#: name: (vendor, arch, capability, sms, smem KB, warp, tma, mma, fp8 formats, mx)
EXPECTED = {
    "a100": ("nvidia", "sm_80", (8, 0), 108, 163, 32, False, "mma.sync", (), False),
    "a10": ("nvidia", "sm_86", (8, 6), 72, 99, 32, False, "mma.sync", (), False),
    "l4": ("nvidia", "sm_89", (8, 9), 58, 99, 32, False, "mma.sync", OCP, False),
    "rtx4090": ("nvidia", "sm_89", (8, 9), 128, 99, 32, False, "mma.sync", OCP, False),
    "h100": ("nvidia", "sm_90", (9, 0), 132, 227, 32, True, "wgmma", OCP, False),
    "h200": ("nvidia", "sm_90", (9, 0), 132, 227, 32, True, "wgmma", OCP, False),
    "b200": ("nvidia", "sm_100", (10, 0), 148, 227, 32, True, "tcgen05", OCP, True),
    "rtx5090": ("nvidia", "sm_120", (12, 0), 170, 99, 32, True, "mma.sync", OCP, False),
    "mi300x": ("amd", "gfx942", (9, 4), 304, 64, 64, False, "mfma", FNUZ, False),
    "mi355x": ("amd", "gfx950", (9, 5), 256, 160, 64, False, "mfma", OCP, True),
}
FIELDS = (
    "vendor",
    "arch",
    "capability",
    "sms",
    "smem_per_block",
    "warp_size",
    "tma",
    "mma",
    "fp8_dtypes",
    "mx",
)
AMD = ("mi300x", "mi355x")


def test_every_named_spec_has_its_datasheet_fields():
    assert tuple(SPECS) == tuple(EXPECTED) == tkdev.spec_names()
    for name, want in EXPECTED.items():
        spec = SPECS[name]
        got = tuple(getattr(spec, f) for f in FIELDS)
        assert got == (*want[:4], want[4] * 1024, *want[5:]), name
        assert spec.name == name and spec.is_amd == (want[0] == "amd") and spec.fp8 == bool(want[8])
        assert spec.tflops_16bit > 0 and spec.mem_tbps > 0 and (spec.tflops_fp8 > 0) == spec.fp8
        assert spec.fp8_e4m3 == (want[8][0] if want[8] else None), name
        assert spec.fp8_e5m2 == (want[8][1] if want[8] else None), name
        assert spec.target == (("hip", spec.arch, 64) if spec.is_amd else ("cuda", spec.cc, 32))
        line = spec.describe()
        assert "\n" not in line and name in line and spec.arch in line and f"{spec.sms} SMs" in line


def test_names_are_case_insensitive_and_an_unknown_one_lists_the_known():
    assert device_spec("MI300X") is device_spec("mi300x") is SPECS["mi300x"]
    assert device_spec(SPECS["h100"]) is SPECS["h100"]
    assert device_spec("cpu") is device_spec(torch.device("meta")) is INTERPRETER
    with pytest.raises(ValueError) as excinfo:
        device_spec("h300")
    message = str(excinfo.value)
    assert "'h300'" in message and all(name in message for name in SPECS)


def test_spec_from_properties_knows_an_h100_and_an_mi300x():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h100 = spec_from_properties("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 32)
        mi300x = spec_from_properties(
            "AMD Instinct MI300X", (9, 4), 304, 65536, 64, hip=True, gcn_arch="gfx942:sramecc+:xnack-"
        )
    assert h100 == SPECS["h100"]
    assert mi300x.is_amd and not mi300x.tma and mi300x.arch == "gfx942" and mi300x.warp_size == 64
    assert mi300x.mma == "mfma" and mi300x.fp8_dtypes == FNUZ and mi300x.capability == (9, 4)
    # a capability test alone would take it for Hopper: the gcn arch decides, whatever the name
    anon = spec_from_properties("AMD Radeon Graphics", (9, 4), 304, hip=True, gcn_arch="gfx942:xnack-")
    assert anon.is_amd and not anon.tma and anon.arch == "gfx942"


def test_an_unknown_gpu_gets_its_nearest_family_and_exactly_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = spec_from_properties("NVIDIA Future GPU", (10, 7), 160, 232448, 32)
    assert len(caught) == 1 and "NVIDIA Future GPU" in str(caught[0].message)
    assert "b200" in str(caught[0].message)
    assert spec.mma == "tcgen05" and spec.tma and spec.sms == 160 and spec.arch == "sm_107"
    assert spec.name == "NVIDIA Future GPU"


def test_an_int_capability_maps_to_the_named_spec_of_its_arch():
    for cc, name in ((80, "a100"), (86, "a10"), (89, "l4"), (90, "h100"), (100, "b200"), (120, "rtx5090")):
        spec = spec_for_cc(cc)
        assert (spec.mma, spec.tma, spec.smem_per_block) == (SPECS[name].mma, SPECS[name].tma,
                                                             gemm_configs.smem_limit(cc)), cc  # fmt: skip
    assert gemm_configs.as_spec(87).smem_per_block == gemm_configs.smem_limit(87)


@pytest.fixture
def on_gpu(monkeypatch):
    """Answer every device question for the GPU named by the returned setter."""

    def use(name: str) -> DeviceSpec:
        monkeypatch.setattr(tkdev, "device_spec", lambda device=None, s=SPECS[name]: s)
        return SPECS[name]

    return use


@pytest.mark.parametrize("name", AMD)
def test_amd_gpus_never_take_the_tma_kernel(on_gpu, name):
    assert not has_tma(SPECS[name]) and has_tma(SPECS["h100"])
    on_gpu(name)
    cuda = torch.device("cuda", 0)
    assert gemm.device_gemm_info(cuda) == (SPECS[name].sms, False)
    for m, n, k in ((8192, 8192, 8192), (16384, 50257, 768), (768, 3072, 16384)):
        assert gemm.plan_for_shape(cuda, m, n, k).kernel != TMA, (name, m, n, k)
    on_gpu("h100")
    assert gemm.plan_for_shape(cuda, 8192, 8192, 8192).kernel == TMA  # the same shape on Hopper
    assert tkern.kernels.grid_sync.sm_count(cuda) == 132


@pytest.mark.parametrize("name", AMD)
def test_amd_configs_fit_the_lds_with_64_wide_waves(name):
    spec = SPECS[name]
    for table, elem in ((gemm_configs.gemm_configs(), 2), (gemm_configs.fp8_gemm_configs(), 1)):
        amd = gemm_configs.amd_configs(table, spec.arch)
        offered = gemm_configs.offered_configs(table, spec, elem_bytes=elem)
        assert offered and set(map(_sig, offered)) <= set(map(_sig, amd))
        for c in offered:
            assert gemm_configs.smem_estimate(c, elem) <= spec.smem_per_block, (name, c)
            assert c.num_stages <= gemm_configs.AMD_STAGES
            acc = gemm_configs.acc_per_thread(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, 64)
            assert acc <= gemm_configs.PRE_HOPPER_MAX_ACC, (name, c)  # MFMA's operands sit in registers
            knobs = {
                k: c.kwargs[k] for k in ("waves_per_eu", "matrix_instr_nonkdim", "kpack") if k in c.kwargs
            }
            assert knobs.get("waves_per_eu", 2) == 2 and knobs.get("kpack", 2 if name == "mi300x" else 1) == (
                2 if name == "mi300x" else 1
            )
    assert gemm_configs.acc_per_thread(128, 128, 4, 64) == 64 == gemm_configs.acc_per_thread(128, 128, 8)
    assert gemm_configs.loads_per_thread(64, 64, 64, 2, 64) == 64
    # gfx942's 64 KB of LDS leaves out a tile that gfx950's 160 KB keeps
    tile = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "EPI_SPLIT": 1}
    deep = gemm_configs.amd_configs([triton.Config(tile, num_stages=2, num_warps=8)], spec.arch)
    assert gemm_configs.smem_estimate(deep[0]) == 128 * 1024
    assert gemm_configs.prune_configs(deep + amd, "mi355x")[0] is deep[0]
    assert deep[0] not in gemm_configs.prune_configs(deep + amd, "mi300x")


def _sig(c) -> tuple:
    return (*sorted(c.kwargs.items()), c.num_warps, c.num_stages)


def test_nvidia_configs_carry_no_amd_knobs():
    for table in (gemm_configs.gemm_configs(), gemm_configs.fp8_gemm_configs(), gemm_configs.tma_configs()):
        assert not any({"waves_per_eu", "matrix_instr_nonkdim", "kpack"} & set(c.kwargs) for c in table)


def test_rtx5090_is_pruned_with_mma_sync_rules_not_hoppers():
    table = gemm_configs.gemm_configs()
    sm120 = gemm_configs.prune_configs(table, SPECS["rtx5090"])
    assert (
        sm120 == gemm_configs.prune_configs(table, SPECS["rtx4090"]) == gemm_configs.prune_configs(table, 120)
    )
    assert all(
        gemm_configs.acc_per_thread(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) <= 64
        for c in sm120
    )
    assert gemm_configs.prune_configs(table, 90) == gemm_configs.prune_configs(table, SPECS["h100"])
    assert len(gemm_configs.prune_configs(table, "h100")) > len(sm120)


def test_fp8_refusals_name_the_device_and_its_formats(monkeypatch):
    reason = f8.fp8_refusal(SPECS["a100"], "Float8Linear('tensorwise')", OCP)
    assert "fp8 tensor cores" in reason and "a100" in reason and "sm_80" in reason
    reason = f8.fp8_refusal(SPECS["mi300x"], "Float8Linear('tensorwise')", OCP)
    assert all(
        w in reason for w in ("mi300x", "gfx942", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3fn")
    )
    for name in ("l4", "h100", "b200", "rtx5090", "mi355x"):
        assert f8.fp8_refusal(SPECS[name], "x", OCP) is None, name
    assert f8.fp8_refusal(SPECS["mi300x"], "x", FNUZ) is None
    reason = f8.fp8_refusal(SPECS["h100"], "x", FNUZ)
    assert "h100" in reason and "float8_e4m3fnuz" in reason and "float8_e4m3fn," in reason
    monkeypatch.setattr(f8, "compiled_spec", lambda device: SPECS["mi300x"])  # the fp8 code's seam
    launches = []
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    try:
        InterpretedFunction.run = lambda self, *a, **k: launches.append(self) or run(self, *a, **k)
        with pytest.raises(RuntimeError, match=r"to_float8 uses float8_e4m3fn; mi300x.*not float8_e4m3fn"):
            tkern.to_float8(torch.ones(4, 4))  # OCP asked for by name on an MI300X
        with pytest.raises(RuntimeError, match=r"Float8Linear\('mxfp8'\).*mi300x"):
            tkern.nn.Float8Linear(32, 16, recipe="mxfp8")
    finally:
        InterpretedFunction.run = run
    assert not launches
    assert tkern.nn.Float8Linear(32, 16).recipe.scaling == "tensorwise"  # FNUZ: test_float8_fnuz


def test_only_tkern_device_asks_torch_about_the_gpu():
    root = Path(tkern.__file__).parent
    asked = {
        str(p.relative_to(root.parent))
        for p in root.rglob("*.py")
        if re.search(r"get_device_capability|get_device_properties", p.read_text())
    }
    assert asked == {"tkern/device.py"}


def test_tkern_info_plans_for_a_named_gpu_without_it(capsys):
    from tkern.train import cli

    assert cli.main(["info", "--device", "MI300X"]) == 0
    out = capsys.readouterr().out
    gemm_rows = [line.split() for line in out.splitlines() if re.match(r"  (attn|mlp|lm) ", line)]
    assert len(gemm_rows) == 15 and not any("tma" in row for row in gemm_rows)
    assert {"forward", "dgrad", "wgrad"} <= {word for row in gemm_rows for word in row}
    assert SPECS["mi300x"].describe() in out and "waves_per_eu=2" in out and "split_k" in out
    refused = [line.split()[0] for line in out.splitlines() if "refused: " in line]
    assert refused == ["mxfp8"] and "MX block-scaled MMA: not native" in out
    assert "tensorwise (float8_e4m3fnuz, float8_e5m2fnuz): native" in out
    assert "grid (up to 304 programs" in out

    assert cli.main(["info", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    refused = [line.split()[0] for line in out.splitlines() if "refused" in line]
    assert " tma " in out and refused == ["mxfp8"] and "waves_per_eu" not in out  # no native MX on sm_90

    assert cli.main(["info"]) == 0
    assert "spec    " + device_spec().describe() in capsys.readouterr().out


def test_tkern_info_refuses_an_unknown_device_with_the_names(capsys):
    from tkern.train import cli

    assert cli.main(["info", "--device", "h300"]) == 2
    err = capsys.readouterr().err
    assert "'h300'" in err and all(name in err for name in SPECS) and err.count("\n") == 1


def test_docs_devices_holds_the_support_table_and_the_gates_targets():
    from tkern.train.device_report import COMPILED_IN_CI, support_table

    root = Path(tkern.__file__).parent.parent
    page = (root / "docs" / "devices.md").read_text()
    table = page.split("<!-- support-table:start -->\n")[1].split("\n<!-- support-table:end -->")[0]
    assert table == support_table(), "docs/devices.md: paste support_table()'s output between the markers"
    # the gate compiles for exactly the column's targets: it reads them from COMPILED_IN_CI
    import test_compiled

    assert test_compiled.TARGETS == COMPILED_IN_CI
    assert set(COMPILED_IN_CI) == {s.arch for s in SPECS.values()}
