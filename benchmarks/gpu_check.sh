#!/usr/bin/env bash
# Everything a GPU session checks and measures, in one device call:
#   bash benchmarks/gpu_check.sh [all|tests|bench]      (default: all)
# 1. the full test suite compiled on the GPU (no interpreter), GPU-only checks
#    included (tests/test_gpu.py: no host sync in step(), compiled bf16
#    rounding, autotuned shapes, a whole training step replayed in a CUDA graph);
# 2. the two ceilings (device copy GB/s, cuBLAS fp16 TFLOP/s);
# 3. bench_host (tkern's host time per call, launches stubbed; ~1 min), then
#    bench_gemm, bench_optimizer, bench_train, writing benchmarks/results/<device>/;
# then a short table last. Logs, a summary and a tarball of the results go to
# $OUT (the device tool brings back at most 8 files). The GPU image has every
# package this needs (torch, triton, pytest, xdist, hypothesis, scikit-learn,
# tqdm, matplotlib), so tkern runs from the checkout through PYTHONPATH.
# Each phase has its own time limit, and all of them share the call's
# 10 minutes (BUDGET): what did not fit is reported as skipped, and a second
# call naming the phase (`tests` or `bench`) runs it.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
: >"$summary"

# One device call may run 600 s: each phase gets at most its cap and what is
# left of BUDGET; a phase with under 20 s left is skipped and says so.
BUDGET=${BUDGET:-580}
limit() {  # limit CAP -> seconds this phase may use
    local left=$((BUDGET - SECONDS))
    if ((left < 20)); then echo 0; elif ((left < $1)); then echo "$left"; else echo "$1"; fi
}
run_phase() {  # run_phase NAME CAP CMD... ; output appended to $OUT/NAME.log
    local name=$1 cap=$2 t
    shift 2
    t=$(limit "$cap")
    if ((t == 0)); then
        echo "$name: skipped, the call's time is spent (run again with the phase named)" | tee -a "$summary"
        return 0
    fi
    timeout "$t" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    if ((rc == 124)); then echo "$name: stopped after ${t}s" | tee -a "$summary"; fi
    return 0
}

python3 -m tkern info | tee -a "$summary"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$summary"

if [[ $phase == all || $phase == tests ]]; then
    # Correctness first, one config per kernel (each autotuned config is a
    # compile of its own); then the GPU-only checks with autotuning on.
    TKERN_AUTOTUNE=0 run_phase pytest 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests
    echo "pytest (compiled, first config): $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest.log" | tail -1)" | tee -a "$summary"
    run_phase pytest_gpu 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
    echo "pytest test_gpu.py (autotuned): $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest_gpu.log" 2>/dev/null | tail -1)" | tee -a "$summary"
fi

if [[ $phase == all || $phase == bench ]]; then
    run_phase ceilings 30 python3 benchmarks/harness.py
    tail -1 "$OUT/ceilings.log" 2>/dev/null | tee -a "$summary"
    # Host time does not depend on the tile chosen: one config per GEMM shape.
    TKERN_AUTOTUNE=0 run_phase bench_host 75 python3 benchmarks/bench_host.py
    for bench in gemm optimizer train; do
        run_phase "bench_$bench" 200 python3 "benchmarks/bench_$bench.py"
    done
    tar czf "$OUT/results.tgz" benchmarks/results
    python3 benchmarks/report.py >>"$summary"
fi

echo
echo "================ summary ================"
cat "$summary"
