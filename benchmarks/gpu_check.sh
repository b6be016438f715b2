#!/usr/bin/env bash
# Everything a GPU session checks and measures, in one device call:
#   bash benchmarks/gpu_check.sh [all|tests|bench]      (default: all)
# 1. the full test suite compiled on the GPU (no interpreter), GPU-only checks
#    included (tests/test_gpu.py: no host sync in step(), compiled bf16
#    rounding, autotuned shapes);
# 2. the two ceilings (device copy GB/s, cuBLAS fp16 TFLOP/s);
# 3. bench_gemm, bench_optimizer, bench_train, writing benchmarks/results/<device>/;
# then a short table last. Logs, a summary and a tarball of the results go to
# $OUT (the device tool brings back at most 8 files). The GPU image has every
# package this needs (torch, triton, pytest, xdist, hypothesis, scikit-learn,
# tqdm, matplotlib), so tkern runs from the checkout through PYTHONPATH.
# Each phase has its own time limit so that the call ends inside 10 minutes
# and still reports what finished; rerun with `bench` if the tests took long.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
: >"$summary"

python3 -m tkern info | tee -a "$summary"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$summary"

if [[ $phase == all || $phase == tests ]]; then
    timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log"
    echo "pytest (compiled): $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest.log" | tail -1)" | tee -a "$summary"
fi

if [[ $phase == all || $phase == bench ]]; then
    timeout 30 python3 benchmarks/harness.py 2>&1 | tee -a "$OUT/bench.log" | tail -1 | tee -a "$summary"
    for bench in gemm optimizer train; do
        timeout 200 python3 "benchmarks/bench_$bench.py" 2>&1 | tee -a "$OUT/bench.log" \
            || echo "bench_$bench: stopped (exit $?)" | tee -a "$summary"
    done
    tar czf "$OUT/results.tgz" benchmarks/results
    python3 benchmarks/report.py >>"$summary"
fi

echo
echo "================ summary ================"
cat "$summary"
