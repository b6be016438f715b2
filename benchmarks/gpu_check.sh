#!/usr/bin/env bash
# Everything a GPU session checks and measures, in two device calls of <= 10 minutes:
#
#   bash benchmarks/gpu_check.sh stamp           # HERE, before the calls: writes .tkern-commit
#   bash benchmarks/gpu_check.sh tests           # device call 1
#   bash benchmarks/gpu_check.sh bench [NAME...] # device call 2 (NAMEs: a subset, to finish a cut run)
#   bash benchmarks/gpu_check.sh --dry-run       # on a CPU: both phases at smoke sizes, into a temp dir
#
# tests: the GPU-only tests first (tests/test_gpu.py, autotuned: real CUDA-graph
#        captures of the optimizer step and the trainer's whole step, fp8 GEMMs, the
#        wgrad path, no host sync), then the whole suite compiled with one config per
#        kernel (TKERN_AUTOTUNE=0), then bench_host (host time, launches stubbed).
# bench: the two ceilings (harness.py), then bench_gemm (fp8 first), bench_optimizer
#        (memory modes first), bench_train (GPT-2 first), bench_norm, bench_loss; each
#        writes benchmarks/results/<device>/ after every case, so a phase stopped by its
#        time limit keeps what it measured. Then report.py prints the table and targets.
# Each phase has its own cap (`timeout`) and all share the call's BUDGET (580 s of the
# 600 a call may run); a phase with under 20 s left is skipped and says so: run
# `gpu_check.sh bench NAME` in another call for it.
#
# The commit: the device gets a copy of the working tree without .git, so every
# results file takes its commit from $TKERN_COMMIT, else git (a checkout), else
# .tkern-commit at the repository root, which `gpu_check.sh stamp` writes here
# before the call (untracked and not ignored, so it travels with the tree;
# benchmarks/harness.py:commit).
#
# Packages: the GPU image has torch, triton, pytest, xdist, hypothesis, transformers,
# matplotlib. torchao (bench_optimizer's AdamW8bit / _AdamW rows, bench_train's
# Float8Linear row) and Liger-Kernel (bench_norm / bench_loss rows) are not in it:
# they travel as wheels in .whl/ (device README), made here with
#   echo /.whl/ >> .git/info/exclude   # (.gitignore already has /.whl/)
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl torchao==0.18.0 liger-kernel
# and the call names `.whl` in `carry`; this script installs them into /tmp/site
# (--no-deps) and puts that on PYTHONPATH. Without them those rows are recorded as
# skipped with the ImportError.
#
# Output: logs, summary.txt and results.tgz (benchmarks/results) go to $OUT (the
# device tool brings back at most 8 files). Back here: `tar xzf results.tgz`, then
# `python benchmarks/report.py --write` regenerates the README table and
# benchmarks/results/TARGETS.md from the result files alone.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

phase=${1:-}
shift || true
case $phase in
stamp)
    commit=$(git rev-parse --short HEAD) || exit 1
    [[ -n $(git status --porcelain --untracked-files=no) ]] && commit+="+dirty"
    echo "$commit" >.tkern-commit
    echo "wrote .tkern-commit: $commit"
    exit 0
    ;;
tests | bench | --dry-run) ;;
*)
    echo "usage: gpu_check.sh stamp | tests | bench [gemm optimizer train norm loss ...] | --dry-run" >&2
    exit 2
    ;;
esac

DRY=0
SCALE=1 # the caps' multiplier: the dry run checks code paths on a slow, shared CPU, not timings
if [[ $phase == --dry-run ]]; then
    DRY=1
    SCALE=${DRY_RUN_SCALE:-5}
    OUT=${OUT:-$(mktemp -d)}
    RES=$OUT/results/cpu # the smoke results; report.py reads them from $OUT/results
    SMOKE=(--smoke --out "$RES")
    mkdir -p "$RES"
else
    OUT=${OUT:-$PWD/gpu-out}
    RES=
    SMOKE=()
    unset TRITON_INTERPRET
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
: >"$summary"
failed=()

BUDGET=${BUDGET:-$((580 * SCALE))}
limit() { # limit CAP -> seconds this phase may use
    local left=$((BUDGET - SECONDS))
    if ((left < 20)); then echo 0; elif ((left < $1)); then echo "$left"; else echo "$1"; fi
}
run_phase() { # run_phase NAME CAP CMD... ; output appended to $OUT/NAME.log
    local name=$1 cap=$2 t rc
    shift 2
    t=$(limit $((cap * SCALE)))
    if ((t == 0)); then
        echo "$name: skipped, the call's time is spent (run \`gpu_check.sh bench $name\` in another call)" |
            tee -a "$summary"
        return 0
    fi
    local start=$SECONDS
    timeout "$t" "$@" 2>&1 | tee -a "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    if ((rc == 124)); then
        echo "$name: stopped after ${t}s (its results so far are written)" | tee -a "$summary"
        failed+=("$name (time)")
    elif ((rc != 0)); then
        echo "$name: FAILED, exit status $rc (see $name.log)" | tee -a "$summary"
        failed+=("$name")
    else
        echo "$name: ok in $((SECONDS - start)) s" | tee -a "$summary"
    fi
}
pytest_line() { # the last "N passed / failed" line of a log
    grep -E '[0-9]+ (passed|failed|skipped|errors?|tests? collected)' "$OUT/$1.log" 2>/dev/null | tail -1
}

$PYTHON -m tkern info 2>&1 | tee -a "$summary"
((DRY)) || nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv |
    tee -a "$summary"
echo "commit: $($PYTHON -c 'import sys; sys.path.insert(0, "benchmarks"); import harness; print(harness.commit())')" |
    tee -a "$summary"

if [[ $phase == tests || $phase == --dry-run ]]; then
    run_phase pytest_gpu 200 $PYTHON -m pytest -q -p no:cacheprovider tests/test_gpu.py
    echo "tests/test_gpu.py (autotuned): $(pytest_line pytest_gpu)" | tee -a "$summary"
    if ((DRY)); then # the whole suite is CI's; here only that it collects
        run_phase pytest 120 $PYTHON -m pytest -q -p no:cacheprovider --collect-only tests
    else
        TKERN_AUTOTUNE=0 run_phase pytest 280 $PYTHON -m pytest -q -n 8 -p no:cacheprovider tests
    fi
    echo "the whole suite (compiled, first config): $(pytest_line pytest)" | tee -a "$summary"
    # Host time does not depend on the tile chosen: one config per GEMM shape.
    TKERN_AUTOTUNE=0 run_phase bench_host 75 $PYTHON benchmarks/bench_host.py "${SMOKE[@]}"
fi

if [[ $phase == bench || $phase == --dry-run ]]; then
    names=("$@")
    ((${#names[@]})) || names=(ceilings gemm optimizer train norm loss)
    for name in "${names[@]}"; do
        case $name in
        ceilings) run_phase ceilings 25 $PYTHON benchmarks/harness.py "${SMOKE[@]}" ;;
        gemm) run_phase bench_gemm 150 $PYTHON benchmarks/bench_gemm.py "${SMOKE[@]}" ;;
        optimizer) run_phase bench_optimizer 140 $PYTHON benchmarks/bench_optimizer.py "${SMOKE[@]}" ;;
        train) run_phase bench_train 170 $PYTHON benchmarks/bench_train.py "${SMOKE[@]}" ;;
        norm) run_phase bench_norm 40 $PYTHON benchmarks/bench_norm.py "${SMOKE[@]}" ;;
        loss) run_phase bench_loss 40 $PYTHON benchmarks/bench_loss.py "${SMOKE[@]}" ;;
        host) TKERN_AUTOTUNE=0 run_phase bench_host 75 $PYTHON benchmarks/bench_host.py "${SMOKE[@]}" ;;
        *)
            echo "unknown benchmark $name (ceilings gemm optimizer train norm loss host)" | tee -a "$summary"
            failed+=("$name")
            ;;
        esac
    done
    if ((DRY)); then # the CPU benchmark (results/host/ in a real run), at its smoke size
        run_phase bench_activation_memory 90 $PYTHON benchmarks/bench_activation_memory.py --smoke \
            --launches stubbed --out "$OUT/results/host"
        cp README.md "$OUT/README.md"
        run_phase report 30 $PYTHON benchmarks/report.py --write --results "$OUT/results" --readme "$OUT/README.md"
    else
        tar czf "$OUT/results.tgz" benchmarks/results
        run_phase report 30 $PYTHON benchmarks/report.py
    fi
fi

echo
echo "================ summary ================"
cat "$summary"
if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
