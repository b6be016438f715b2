#!/usr/bin/env bash
# What a GPU session measures, planned for a 15-minute device budget (the machine's
# start and idle waits included): ONE command of at most 420 s, and an optional second.
#
#   bash benchmarks/gpu_check.sh stamp            # HERE, before the call: writes .tkern-commit
#   bash benchmarks/gpu_check.sh quick            # device call 1 (timeout_s 480): what matters most
#   bash benchmarks/gpu_check.sh more             # device call 2, optional (timeout_s 360): the rest
#   bash benchmarks/gpu_check.sh bench NAME...    # single benchmarks, to finish a cut phase
#   bash benchmarks/gpu_check.sh plan [quick|more]       # print the phases, their caps and commands
#   bash benchmarks/gpu_check.sh --dry-run [quick|more]  # on a CPU: the phases at smoke sizes
#
# quick (BUDGET 420 s; issue 44 item 1: where the time goes first, the known rows last):
#        the device stamp; tests/test_gpu.py (real CUDA-graph captures of the optimizer
#        step and of the trainer's whole step against eager, fp8 GEMMs, the wgrad path, no
#        host sync); the GPT-2 small profile (bench_train --profile: tkern, compiled
#        autocast, tkern fp8 tensorwise; device time by the step ledger's categories beside
#        the committed ledger's floor: results/<device>/profile_*.csv and profile.png);
#        GPT-2 small rows: autocast, compiled autocast, tkern, tkern bf16, bf16 autocast
#        (with their MFU); the fp8 GEMMs in the forward, dgrad and wgrad layouts at GPT-2's
#        shapes; the 16-bit GEMMs at GPT-2's 768-wide shapes in the three layouts (bench_gemm
#        --sections fp8_layouts / layouts --layouts fwd,dgrad,wgrad --shapes gpt2); then the
#        optimizer sizes and the MLP rows with what is left; then report.py.
# more (BUDGET 330 s, timeout_s 360: what 15 minutes leave after quick): first the
#        grid-wide one-pass optimizer step (issue 45 item 3), which no GPU has run: its
#        tests (tests/test_gpu_grid_step.py, P programs meeting at a spin barrier, bit for
#        bit the two-pass step; a phase of its own, so a deadlock costs its cap, not the
#        call) and its graphed 1M row against torch's graphed capturable fused AdamW +
#        GradScaler (bench_optimizer --sections grid), the figure that would make it the
#        default; then the fp8 recipes
#        on GPT-2 against bf16 autocast (eager and compiled) and torchao's compiled
#        Float8Linear, with the final loss against bf16's (issue 43), fp8 (forward) and square GEMMs and bias+GELU under torch.compile, the
#        rest of the training recipes (compiled tkern, tf32, the memory modes: state bf16 /
#        8-bit, bf16 split master, with the loss they cost), the Llama-like model's autocast,
#        compiled autocast, tkern and tkern bf16 rows, the Linear-layer GEMMs, the
#        optimizer's memory modes,
#        the cost of mixed-precision health tracking at 10M params (bench_optimizer
#        --sections health), norms, losses, the ceilings, host cost, `tkern train --model
#        gpt` at its GPU default (results/<device>/gpt_job.txt and .png).
# Every phase has its own cap (`timeout`) inside the call's BUDGET; a phase with
# under 20 s left is skipped and says so. Every benchmark writes
# benchmarks/results/<device>/ after every case, so a cut loses only the case running.
# Everything runs with TKERN_GRAPH_STRICT=1: a CUDA-graph capture that fails is a
# FAILED row with its reason, never an eager figure under a graphed name.
# The compile gate (tests/test_compiled.py) is CI's, never run here (it skips on a GPU
# machine); the dry run checks that the suite collected as a GPU machine would runs
# nothing that needs the CPU (tests/gpu_collection.py).
#
# The commit: the device gets a copy of the working tree without .git, so every
# results file takes its commit from $TKERN_COMMIT, else git (a checkout), else
# .tkern-commit at the repository root, which `gpu_check.sh stamp` writes here
# before the call (untracked and not ignored, so it travels with the tree;
# benchmarks/harness.py:commit).
#
# Packages: the GPU image has torch, triton, pytest, xdist, hypothesis, transformers,
# matplotlib. torchao (bench_optimizer's AdamW8bit / _AdamW rows, bench_train's
# Float8Linear rows) and Liger-Kernel (bench_norm / bench_loss rows) are not in it:
# they travel as wheels in .whl/ (device README), made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl torchao==0.18.0 liger-kernel
# (.gitignore has /.whl/) and the call names `.whl` in `carry`; this script installs
# them into /tmp/site (--no-deps) and puts that on PYTHONPATH. Without them those
# rows are recorded as skipped with the ImportError.
#
# Output: at most 6 files in $OUT (the device tool brings back at most 8):
# summary.txt, pytest_gpu.log, bench.log, report.log, results.tgz (benchmarks/results).
# Back here: `tar xzf results.tgz`, then `python benchmarks/report.py --write`
# regenerates the README table and benchmarks/results/TARGETS.md from the result files.
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
quick | more | bench) ;;
plan)
    plans=("$@")
    ((${#plans[@]})) || plans=(quick more)
    ;;
--dry-run)
    plans=("$@")
    ((${#plans[@]})) || plans=(quick more)
    for p in "${plans[@]}"; do
        [[ $p == quick || $p == more ]] || {
            echo "--dry-run takes quick and/or more, not $p" >&2
            exit 2
        }
    done
    ;;
*)
    echo "usage: gpu_check.sh stamp | quick | more | bench NAME... | plan [quick] [more] | --dry-run [quick] [more]" >&2
    exit 2
    ;;
esac

DRY=0
PLAN=0
SCALE=1 # the caps' multiplier: the dry run checks code paths on a slow, shared CPU, not timings
if [[ $phase == plan ]]; then
    PLAN=1
    OUT=$(mktemp -d)
    RES=
    SMOKE=()
elif [[ $phase == --dry-run ]]; then
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
    plans=("$phase")
    unset TRITON_INTERPRET
    # the device's copy of the tree may carry a stale .git: the stamp written here names the code
    if [[ -z ${TKERN_COMMIT:-} && -f .tkern-commit ]]; then export TKERN_COMMIT=$(<.tkern-commit); fi
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TKERN_GRAPH_STRICT=1
PY=$PYTHON # the phases' interpreter
if ((DRY)); then
    # A dry-run phase is seconds of work behind some 4 s of imports (torch, Dynamo, transformers,
    # torchao, matplotlib, tkern): on CI's 2 cores most of the dry run. Its phases fork from
    # one process that imported them once (benchmarks/dry_run_forks.py), each phase still a
    # process of its own running its command line; a GPU session runs each as its own python.
    # The pytest phases stay their own processes (pytest's plugins must be imported after it
    # starts, and transformers imports one, anyio's, first).
    forks=$(mktemp -d)
    $PYTHON benchmarks/dry_run_forks.py serve "$forks/sock" &
    forks_pid=$!
    trap 'kill $forks_pid 2>/dev/null; rm -rf "$forks"' EXIT
    for _ in {1..200}; do [[ -S $forks/sock ]] && break; sleep 0.05; done
    PY="$PYTHON benchmarks/dry_run_forks.py run $forks/sock --"
fi
summary="$OUT/summary.txt"
: >"$summary"
failed=()

# The call's budget: quick 420 s (its device call gets timeout_s 480), more 540 s.
case $phase in
quick) BUDGET=${BUDGET:-420} ;;
*) BUDGET=${BUDGET:-330} ;; # what a 15-minute budget leaves after quick and two machine starts
esac
((DRY)) && BUDGET=$((BUDGET * SCALE * ${#plans[@]}))
limit() { # limit CAP -> seconds this phase may use
    local left=$((BUDGET - SECONDS))
    if ((left < 20)); then echo 0; elif ((left < $1)); then echo "$left"; else echo "$1"; fi
}
run_phase() { # run_phase NAME LOG CAP CMD... ; output appended to $OUT/LOG.log
    local name=$1 log=$2 cap=$3 t rc
    shift 3
    t=$(limit $((cap * SCALE)))
    if ((PLAN)); then
        printf '%-26s cap %4ss  %s\n' "$name" "$cap" "$*"
        return 0
    fi
    if ((t == 0)); then
        echo "$name: skipped, the call's time is spent (run it in another call)" | tee -a "$summary"
        return 0
    fi
    local start=$SECONDS
    echo "======== $name (cap ${t}s): $*" >>"$OUT/$log.log"
    timeout "$t" "$@" 2>&1 | tee -a "$OUT/$log.log"
    rc=${PIPESTATUS[0]}
    if ((rc == 124)); then
        echo "$name: stopped after ${t}s (its results so far are written)" | tee -a "$summary"
        failed+=("$name (time)")
    elif ((rc != 0)); then
        echo "$name: FAILED, exit status $rc (see $log.log)" | tee -a "$summary"
        failed+=("$name")
    else
        echo "$name: ok in $((SECONDS - start)) s" | tee -a "$summary"
    fi
}
pytest_line() { # the last "N passed / failed" line of a log
    grep -E '[0-9]+ (passed|failed|skipped|errors?|tests? collected)' "$OUT/$1.log" 2>/dev/null | tail -1
}
bench() { # bench NAME: one benchmark (its cap, its arguments), output into bench.log
    local py=$PY b=benchmarks
    case $1 in
    ceilings) run_phase ceilings bench 25 $py $b/harness.py "${SMOKE[@]}" ;;
    optimizer) run_phase bench_optimizer bench 140 $py $b/bench_optimizer.py "${SMOKE[@]}" ;;
    optimizer_sizes) run_phase bench_optimizer_sizes bench 75 $py $b/bench_optimizer.py \
        --sections sizes,overhead "${SMOKE[@]}" ;;
    optimizer_modes) run_phase bench_optimizer_modes bench 90 $py $b/bench_optimizer.py \
        --sections modes "${SMOKE[@]}" ;;
    optimizer_health) run_phase bench_optimizer_health bench 45 $py $b/bench_optimizer.py \
        --sections health "${SMOKE[@]}" ;;
    optimizer_grid) run_phase bench_optimizer_grid bench 40 $py $b/bench_optimizer.py \
        --sections grid "${SMOKE[@]}" ;;
    train) run_phase bench_train bench 170 $py $b/bench_train.py "${SMOKE[@]}" ;;
    train_mlp) run_phase bench_train_mlp bench 130 $py $b/bench_train.py --models mlp \
        --recipes "$MLP_QUICK" "${SMOKE[@]}" ;;
    train_gpt2) run_phase bench_train_gpt2 bench 120 $py $b/bench_train.py --models gpt2 \
        --recipes "$GPT2_QUICK" "${SMOKE[@]}" ;;
    train_fp8) run_phase bench_train_fp8 bench 180 $py $b/bench_train.py --models gpt2,mlp \
        --recipes "$FP8_PEERS" "${SMOKE[@]}" ;;
    train_rest) run_phase bench_train_rest bench 120 $py $b/bench_train.py --models gpt2,mlp \
        --recipes "$REST" "${SMOKE[@]}" ;;
    train_llama) run_phase bench_train_llama bench 120 $py $b/bench_train.py --models llama \
        --recipes "$LLAMA" "${SMOKE[@]}" ;;
    train_profile) run_phase bench_train_profile bench 130 $py $b/bench_train.py --profile --models gpt2 \
        --recipes "$PROFILE" "${SMOKE[@]}" ;;
    gemm_fp8_layouts) gemm_layouts gemm_fp8_layouts fp8_layouts ;;
    gemm_gpt2_layouts) gemm_layouts gemm_gpt2_layouts layouts ;;
    gemm) run_phase bench_gemm bench 150 $py $b/bench_gemm.py "${SMOKE[@]}" ;;
    gemm_transformer) run_phase bench_gemm_transformer bench 60 $py $b/bench_gemm.py \
        --sections transformer,linear "${SMOKE[@]}" ;;
    gemm_rest) run_phase bench_gemm_rest bench 130 $py $b/bench_gemm.py --sections fp8,square,gelu_compiled \
        "${SMOKE[@]}" ;;
    gemm_linear) run_phase bench_gemm_linear bench 40 $py $b/bench_gemm.py --sections linear "${SMOKE[@]}" ;;
    norm) run_phase bench_norm bench 40 $py $b/bench_norm.py "${SMOKE[@]}" ;;
    loss) run_phase bench_loss bench 40 $py $b/bench_loss.py "${SMOKE[@]}" ;;
    host) TKERN_AUTOTUNE=0 run_phase bench_host bench 75 $py $b/bench_host.py "${SMOKE[@]}" ;;
    gpt) # the language-model main job at its GPU default (GPT-2 small's shape): its table and picture
        local dir=${RES:-benchmarks/results/<device>}
        ((PLAN)) || dir=${RES:-benchmarks/results/$($py -c 'import sys; sys.path.insert(0, "benchmarks"); import harness; print(harness.device_slug())')}
        mkdir -p "$dir"
        local smoke=()
        ((DRY)) && smoke=(--steps 2 --eval-every 1)
        run_phase gpt_job bench 240 bash -c 'set -o pipefail; "$@" | tee "'"$dir"'/gpt_job.txt"' _ \
            $py -m tkern train --model gpt --plot "$dir/gpt_job.png" "${smoke[@]}" ;;
    *)
        echo "unknown benchmark $1 (${ALL_BENCH[*]})" | tee -a "$summary"
        failed+=("$1")
        ;;
    esac
}
gemm_layouts() { # gemm_layouts PHASE SECTION: bench_gemm's SECTION in the three layouts at GPT-2's shapes
    run_phase "bench_$1" bench 40 $PY benchmarks/bench_gemm.py --sections "$2" \
        --layouts fwd,dgrad,wgrad --shapes gpt2 "${SMOKE[@]}"
}
ALL_BENCH=(ceilings optimizer optimizer_sizes optimizer_modes optimizer_health optimizer_grid train train_mlp train_gpt2 train_fp8
    train_rest train_llama train_profile gemm gemm_transformer gemm_rest gemm_linear gemm_fp8_layouts gemm_gpt2_layouts norm loss
    host gpt)
# The quick call's recipes (`=NAME`: that recipe alone), the fp32 reference first: on the
# MLPs autocast, compiled autocast and tkern with and without the optimizer's graph and
# the trainer's; on GPT-2 small the same without the compiled and eager-optimizer rows.
# Every other recipe is the second call's (train_fp8, train_rest); the rows of both
# calls land in one train.json (a subset merges into the file).
MLP_QUICK="=torch fp32 (no tf32),=torch autocast,=torch autocast fused,=torch autocast compiled,=tkern,=tkern opt eager,=tkern whole-step graph"
# GPT-2 small (issue 44 item 1): compiled autocast and tkern bf16 were never measured there;
# the fused eager baseline (issue 54 item 6: one tanh GELU, the loss on a view of the logits)
# (the fp32 reference of the loss check is the committed train.json's: a subset merges into it)
GPT2_QUICK="=torch autocast,=torch autocast fused,=torch autocast compiled,=torch autocast bf16,=tkern,=tkern bf16"
# issue 43: the fp8 steps (GPT-2 small first, then the MLPs) against their peers: bf16
# autocast eager and compiled, torchao's Float8Linear compiled (bf16 params as torchao
# documents it, and with an fp32 master)
FP8_PEERS="=torch autocast bf16,=torch autocast bf16 compiled,torchao,tkern fp8"
# the Llama-like model (issue 42), and its MXFP8 step against torchao's MX recipe (issue 53:
# skipped with the refusal off Blackwell)
LLAMA="=torch autocast,=torch autocast fused,=torch autocast compiled,=tkern,=tkern bf16,=tkern fp8 mxfp8,=torchao mxfp8 compiled"
# the profile: tkern, compiled autocast (a torch user's best) and tkern fp8
PROFILE="=tkern,=torch autocast compiled,=tkern fp8 tensorwise"
# the second call's other recipes: the fp32 reference of the loss check (the first call's GPT-2 rows
# are checked against the committed one), compiled tkern, tf32, the optimizer's graph off, the
# whole-step graph on GPT-2, the memory modes (issue 45 item 4)
REST="=torch fp32 (no tf32),=tkern compiled,=torch fp32 tf32,=tkern opt eager,=tkern whole-step graph,=tkern bf16,tkern state"
REST+=",=tkern bf16 master=split,=tkern bf16 split + 8-bit state"

((PLAN)) || $PY -m tkern info 2>&1 | tee -a "$summary"
((DRY || PLAN)) || nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv |
    tee -a "$summary"
((PLAN)) || echo "commit: $($PY -c 'import sys; sys.path.insert(0, "benchmarks"); import harness; print(harness.commit())')" |
    tee -a "$summary"

for plan in "${plans[@]}"; do
    case $plan in
    quick)
        # the GPU-only tests, autotuned, strict captures; the whole suite is CI's
        run_phase pytest_gpu pytest_gpu 90 $PYTHON -m pytest -q -rfEs -p no:cacheprovider tests/test_gpu.py
        ((PLAN)) || echo "tests/test_gpu.py: $(pytest_line pytest_gpu)" | tee -a "$summary"
        for name in train_profile train_gpt2 gemm_fp8_layouts gemm_gpt2_layouts optimizer_sizes train_mlp; do
            bench $name
        done
        ;;
    more)
        # the grid step's own phase and cap: a barrier that deadlocked ends there (the test
        # exits with DEADLOCK after 20 s of waiting), the rest of the call goes on
        run_phase pytest_grid pytest_gpu 60 $PYTHON -m pytest -q -rfEs -p no:cacheprovider tests/test_gpu_grid_step.py
        ((PLAN)) || echo "tests/test_gpu_grid_step.py: $(pytest_line pytest_gpu)" | tee -a "$summary"
        for name in optimizer_grid train_fp8 gemm_rest train_rest train_llama gemm_linear optimizer_modes optimizer_health norm loss \
            ceilings host gpt; do
            bench $name
        done
        ;;
    bench)
        (($#)) || set -- "${ALL_BENCH[@]}"
        for name in "$@"; do bench "$name"; done
        ;;
    esac
done

if ((PLAN)); then
    rm -rf "$OUT"
    exit 0
elif ((DRY)); then # the CPU benchmark (results/host/ in a real run), at its smoke size
    # the suite collected as a GPU machine would (tests/gpu_collection.py): nothing
    # collected there may need the CPU recorder, the interpreter or the compile gate
    run_phase gpu_collection pytest_gpu 60 bash -c 'out=$(env -u TRITON_INTERPRET TKERN_FAKE_CUDA_COLLECT=1 \
        "$0" -m pytest --collect-only -q -s -p no:cacheprovider tests 2>&1) || { tail -20 <<<"$out"; exit 1; }
        grep "^GPU-COLLECT" <<<"$out" # every test classified, for tests/test_benchmarks.py to read
        if grep -q "^GPU-COLLECT runs" <<<"$out"; then exit 1; fi
        echo "needs the CPU, skipped on a GPU: $(grep -c "^GPU-COLLECT skipped" <<<"$out") tests"' "$PYTHON"
    run_phase bench_activation_memory bench 90 $PY benchmarks/bench_activation_memory.py --smoke \
        --launches stubbed --out "$OUT/results/host"
    cp README.md "$OUT/README.md"
    run_phase report report 30 $PY benchmarks/report.py --write --results "$OUT/results" --readme "$OUT/README.md"
else
    tar czf "$OUT/results.tgz" benchmarks/results
    run_phase report report 30 $PY benchmarks/report.py
fi

echo
echo "================ summary ================"
cat "$summary"
echo "files in \$OUT: $(find "$OUT" -maxdepth 1 -type f | wc -l) (at most 6)"
if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
