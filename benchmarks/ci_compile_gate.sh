#!/usr/bin/env bash
# The compile gate (every tests/test_compiled*.py) under each Triton version tkern
# supports: the environment's own (3.9 in CI) and 3.6, the version on the GPU
# machines. No GPU is needed: Triton's compiler targets sm_80 to sm_120 and AMD's
# gfx942 / gfx950 on the CPU with the ptxas/cuobjdump and the LLVM AMDGPU backend
# shipped in its wheel, one process per core (static_report.run), every test file in
# one pytest process over one compile of the cases. Under 3.9 the gate covers all eight
# targets (every offered config on sm_90 and sm_100, the reduced set elsewhere: each GEMM
# launch on its first offered config, the other kernels' heaviest variants:
# aot_targets.depth). Under 3.6 it compiles the reduced set on the targets 3.6 compiles
# tkern's plans for cleanly, TRITON36_TARGETS (sm_80, sm_90 and gfx950): on the others
# Triton 3.6 itself falls short of what 3.9 compiles from the same source (sm_86/sm_89: a
# backward-prologue config needs 102,400 B of shared memory against 101,376; sm_100: two
# fp8-emitting GEMM configs fail in its PassManager; sm_120: 8-32 B spills in TMA and
# blockwise GEMMs; gfx942: a ragged prologue GEMM spills 132 B), listed in docs/devices.md.
# TKERN_GATE_TARGETS=sm_90,gfx942 runs some targets only (under every Triton).
#
# Triton's compile cache is kept per version under $CACHE/triton-cache-<version>
# (TRITON_CACHE_DIR): the tests that read a case's code again (the grid barrier's
# order, the reductions' layouts) find it there, and a second run compiles only what
# changed; CI may keep that directory between runs (e.g. actions/cache keyed on
# tkern/kernels/).
#
# Triton 3.6 is installed alone (--no-deps, ~7 s) into a side directory that is
# put first on PYTHONPATH for the second run only; torch and everything else
# come from the environment. Set TKERN_GATE_TRITONS to change the list of extra
# versions (space separated; empty: the environment's version only).
#
#   benchmarks/ci_compile_gate.sh            # from the project root, after `make test`'s venv exists
#   PYTHON=/path/to/python benchmarks/ci_compile_gate.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
EXTRA=${TKERN_GATE_TRITONS-3.6.0}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/tkern-compile-gate
export TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1
TRITON36_TARGETS=sm_80,sm_90,gfx950

gate() {  # $1: label; runs the gate with whatever triton PYTHONPATH selects
    local start=$SECONDS
    local version
    version=$("$PY" -c 'import triton; print(triton.__version__)')
    echo "== compile gate, triton $version ($1)"
    TRITON_CACHE_DIR=${TKERN_GATE_TRITON_CACHE:-$CACHE/triton-cache-$version} \
        "$PY" -m pytest -q -p no:cacheprovider -m compiled tests/test_compiled*.py
    echo "== triton $1: $((SECONDS - start)) s"
}

gate environment
for version in $EXTRA; do
    dir=$CACHE/triton-$version
    if [ ! -f "$dir/.complete" ]; then
        rm -rf "$dir"
        "$PY" -m pip install --quiet --no-deps --target "$dir" "triton==$version"
        touch "$dir/.complete"
    fi
    got=$(PYTHONPATH="$dir" "$PY" -c 'import triton; print(triton.__version__)')
    [ "$got" = "$version" ] || { echo "expected triton $version from $dir, got $got" >&2; exit 1; }
    targets=${TKERN_GATE_TARGETS:-}
    [[ -n $targets || $version != 3.6.* ]] || targets=$TRITON36_TARGETS
    PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" TKERN_GATE_TARGETS=$targets gate "$version"
done
