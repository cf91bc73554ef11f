#!/usr/bin/env bash
# The whole GPU check in one call, on a bare GPU machine (its own python3 and torch, no network, no .venv)
# as on any machine with a CUDA device; under 8 minutes:
#   bash tests/gpu/run.sh                        (after carrying tests/gpu/wheels: tests/gpu/fetch_wheels.sh)
#   PY=.venv/bin/python bash tests/gpu/run.sh    (with the project's .venv)
# 1. builds megatron_dapo._C in place against that torch (TORCH_CUDA_ARCH_LIST default 9.0: H100 / H200);
#    without a CUDA device it stops there (exit status 0 if the build passed);
# 2. installs the wheels in tests/gpu/wheels (megatron-core, math-verify, ...) into a folder put on
#    PYTHONPATH after the repository;
# 3. runs each check under a time limit, going on after a failure: the CUDA tests of the fused op, its
#    benchmark and host overhead, the policy in bf16 against transformers (dense, and a MoE at EP = 1), a
#    short DAPO run end to end (tests/gpu/e2e_dapo.py), a train step's MFU and peak memory against preflight's,
#    packed against padded micro-batches (tokens/s, MFU), the weights' export bandwidth, megatron-core's fusions
#    each against the step as shipped, the log-prob memory benchmark, the SDPA attention's memory at 22.5k tokens
#    against megatron's;
# 4. writes the summary table (step, status, seconds, key figures) to ${OUT:-tests/gpu/results}/gpu_check.md,
#    each step's log beside it, prints it, and exits 1 if any step failed.
# Settings: PY, OUT, TORCH_CUDA_ARCH_LIST, GPU_CHECK_BUDGET_S (default 440: the seconds all steps may take).
# shellcheck disable=SC2317  # the figure functions and install_wheels are called by name, through run_step
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/../.." || exit 2
repo=$PWD
PY=${PY:-python3}
out=${OUT:-tests/gpu/results}
[[ $out == /* || -z ${OUT:-} ]] || out=$caller/$out
site=${MEGATRON_DAPO_SITE:-/tmp/megatron_dapo_site}
wheels=tests/gpu/wheels
budget_s=${GPU_CHECK_BUDGET_S:-440}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONUNBUFFERED=1
mkdir -p "$out" || exit 2
start=$EPOCHREALTIME

names=()
statuses=()
seconds=()
figures=()
failed=0

since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

record() { # name status seconds figures
    names+=("$1")
    statuses+=("$2")
    seconds+=("$3")
    figures+=("${4//|/\\|}")
    [[ $2 == PASS ]] || failed=1
}

# run_step NAME LIMIT_S FIGURES_FUNCTION COMMAND...: COMMAND under `timeout`, its output shown and kept in
# OUT/NN-name.log; the step passes if it exits 0. The limit is cut to what is left of the budget.
run_step() {
    local name=$1 limit=$2 figures_of=$3
    shift 3
    local log
    log=$out/$(printf '%02d' $((${#names[@]} + 1)))-${name// /_}.log
    local left
    left=$(awk -v s="$start" -v now="$EPOCHREALTIME" -v b="$budget_s" 'BEGIN { printf "%d", b - (now - s) }')
    if ((left < 15)); then
        record "$name" "SKIPPED" 0 "out of the ${budget_s} s budget"
        return
    fi
    ((limit > left)) && limit=$left
    echo
    echo "=== $name (limit ${limit} s): $*"
    local t0=$EPOCHREALTIME
    if declare -F "$1" >/dev/null; then # a function of this script: quick, no time limit
        "$@" 2>&1 | tee "$log"
    else
        timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$log"
    fi
    local rc=${PIPESTATUS[0]}
    local took
    took=$(since "$t0")
    local fig
    fig=$("$figures_of" "$log" 2>/dev/null | sed -e 's/  */ /g' -e 's/^ //' -e 's/ $//' |
        awk 'NF { printf "%s%s", sep, $0; sep = "; " }')
    if ((rc == 0)); then
        record "$name" PASS "$took" "$fig"
    elif ((rc == 124 || rc == 137)); then
        record "$name" "FAIL (timeout ${limit} s)" "$took" "$fig"
    else
        local why
        why=$(grep -E 'Error|error:|FAILED' "$log" | tail -n1 | cut -c1-200)
        [[ -n $why ]] || why=$(grep -v '^[[:space:]]*$' "$log" | tail -n1 | cut -c1-200)
        [[ -n $why && $fig == *"$why"* ]] && why=""
        [[ -n $why || -n $fig ]] || why="see $(basename "$log")"
        record "$name" "FAIL (exit $rc)" "$took" "$fig${fig:+${why:+; }}$why"
    fi
}

# Key figures, from a step's log: one or more lines, joined with "; " in the table.
pytest_figures() { grep -E '[0-9]+ (passed|failed|error|errors|skipped)' "$1" | tail -n1 | tr -d '='; }
build_figures() {
    grep -o 'building the CUDA kernels: .*' "$1" | tail -n1
    echo "TORCH_CUDA_ARCH_LIST $TORCH_CUDA_ARCH_LIST"
}
install_figures() { grep -E '^(installed|no wheel folder)' "$1"; }
figures_lines() { grep -h -e '^figures: ' -e '^FAILED: ' "$1" | sed 's/^figures: //'; }
policy_figures() {
    figures_lines "$1"
    pytest_figures "$1"
}
bench_figures() { # the CUDA table's largest row: tokens, fused ms, GB/s, share of a device copy
    awk '/^== cuda:/ { cuda = 1 } cuda && NF == 12 && $1 ~ /e\+/ { row = $0 } END {
        if (row == "") exit
        split(row, f, " ")
        printf "%s tokens: fused %s ms (eager/fused %s, compile/fused %s), ", f[1], f[2], f[5], f[6]
        printf "%s GB/s = %s of a copy\n", f[10], f[12] }' "$1"
    grep -o 'max |grad fused - grad reference|.*' "$1" | sed 's/over the runs//'
}
overhead_figures() { # per token count: the kernel alone, dapo_loss forward + backward, their difference
    awk '/^== cuda:/ { cuda = 1 } cuda && NF == 7 && $1 ~ /^[0-9]+$/ {
        printf "%s tokens: kernel %s us, dapo_loss %s us (%sx), host overhead %s us\n", $1, $2, $4, $6, $7 }' "$1"
}
attention_figures() { # the longest row: tokens, megatron GiB, sdpa GiB, median seconds, SDPA kernel
    awk '/^== cuda:/ { cuda = 1 } cuda && NF == 8 && $1 ~ /^[0-9]+$/ { row = $0 } END { if (row != "") {
        split(row, f, " "); printf "%s tokens: sdpa %s GiB vs megatron %s GiB, %s s vs %s s (median), %s kernel\n",
            f[1], f[3], f[2], f[6], f[5], f[8] } }' "$1"
}
train_step_figures() { # tokens/s, model TFLOP/s, MFU against the GEMM and the peak, peak memory against preflight
    awk '/^tokens\/s/ { t = $2 } /^model TFLOP\/s/ { f = $3 } /^GEMM TFLOP\/s/ { g = $3 }
        /^MFU vs GEMM/ { mg = $4 } /^MFU vs peak/ { mp = $4 }
        /^peak memory/ { sub(/^peak memory +/, ""); mem = $0 } /^between steps.*estimate \/ measured/ { st = $NF }
        END { if (t != "") printf "%s tokens/s, %s TFLOP/s = %s %% of a %s TFLOP/s GEMM, %s %% of peak; %s%s\n",
            t, f, mg, g, mp, mem, st == "" ? "" : "; between steps estimate / measured " st }' "$1"
}
fusion_figures() { # per fusion: its step time over the shipped step's, or why it is unavailable
    awk '/^== fusions:/ { on = 1; next } on && $1 ~ /_fusion$/ {
        if ($2 == "-") { n = $1; sub(/^[^ ]+ +(- +)+ *unavailable: /, ""); printf "%s: unavailable (%.60s)\n", n, $0 }
        else printf "%s: fused/shipped %s, peak GB %s -> %s\n", $1, $4, $6, $7 }' "$1"
}
packing_figures() { # per layout: padding, tokens/s, MFU, peak GB; then the packed / padded ratio
    awk '($1 == "padded" || $1 == "packed") && NF == 8 {
        printf "%s: padding %s, %s tokens/s, MFU %s %%, peak %s GB\n", $1, $2, $4, $6, $7 }
        /^packed \/ padded tokens\/s/ { print }' "$1"
}
export_figures() { # the export's GB/s and its share of a device copy
    awk '/^export s/ { e = $4 } /^device copy s/ { c = $5 } /^export \/ copy/ { r = $4 }
        END { if (e != "") printf "export %s GB/s, device copy %s GB/s: %s of it\n", e, c, r }' "$1"
}
memory_figures() { # TP=1 row: ours GiB, naive GiB, ratio
    awk '/^== cuda:/ { cuda = 1 }
        cuda && $1 == "1" { printf "TP=1: %s GiB vs naive %s GiB (%s)\n", $2, $3, $4; exit }' "$1"
}

write_summary() { # [note]
    local md=$out/gpu_check.md
    {
        echo "# GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'))"
        echo
        echo "- machine: ${gpu:-no nvidia-smi}"
        echo "- python: $("$PY" -c 'import sys, torch
print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -n1)"
        local commit changes
        commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
        git -C "$repo" diff --quiet HEAD 2>/dev/null || changes=" (with local changes)"
        echo "- commit: $commit${changes:-}"
        echo "- total: $(since "$start") s (budget for the steps: ${budget_s} s); logs beside this file"
        [[ $# -gt 0 ]] && echo "- $1"
        echo
        echo "| step | status | seconds | key figures |"
        echo "| --- | --- | ---: | --- |"
        local i
        for i in "${!names[@]}"; do
            echo "| ${names[$i]} | ${statuses[$i]} | ${seconds[$i]} | ${figures[$i]} |"
        done
    } >"$md"
    echo
    cat "$md"
    echo
    echo "summary: $md"
}

gpu=$(nvidia-smi -L 2>/dev/null | head -n1)
echo "GPU: ${gpu:-none (no nvidia-smi)}"

# 1. The extension, in place, against this interpreter's torch.
run_step "build megatron_dapo._C" "$budget_s" build_figures "$PY" setup.py build_ext --inplace

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo
    torch_version=$("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -n1)
    if ((failed)); then
        echo "no CUDA device: building megatron_dapo._C in place against $torch_version FAILED; nothing else to check"
    else
        echo "no CUDA device: megatron_dapo._C built in place against $torch_version; nothing else to check"
    fi
    write_summary "no CUDA device: only the build was checked"
    exit "$failed"
fi

# 2. What the machine lacks, from the carried wheels (nothing where all of tests/gpu/wheels.txt is installed,
#    as in the .venv).
install_wheels() {
    if "$PY" - tests/gpu/wheels.txt <<'PYEOF'; then
import importlib.metadata as md
import sys

names = [line.split("#")[0].split("==")[0].strip() for line in open(sys.argv[1])]
missing = []
for name in filter(None, names):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(name)
print(f"missing here: {' '.join(missing)}" if missing else f"installed already: {' '.join(filter(None, names))}")
sys.exit(1 if missing else 0)
PYEOF
        return 0
    fi
    shopt -s nullglob
    local found=("$wheels"/*.whl)
    shopt -u nullglob
    if [[ ${#found[@]} -eq 0 ]]; then
        echo "no wheel folder: $wheels has no wheels: run tests/gpu/fetch_wheels.sh on a networked machine" \
            "and carry tests/gpu/wheels"
        return 1
    fi
    rm -rf "$site" &&
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${found[@]}" &&
        echo "installed ${#found[@]} wheels into $site:" \
            "$(printf '%s ' "${found[@]##*/}" | sed -E 's/-(cp|py)[0-9][^ ]*\.whl//g')"
}
run_step "install wheels" 60 install_figures install_wheels
export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"

# 3. The checks, most important first; each runs whatever happened before it.
run_step "fused op CUDA tests" 120 pytest_figures "$PY" -m pytest tests/gpu -q -rfEs -p no:cacheprovider \
    --ignore=tests/gpu/test_policy_cuda.py
run_step "fused op benchmark" 90 bench_figures "$PY" bench/bench_dapo_loss.py --device cuda
run_step "fused op host overhead" 60 overhead_figures "$PY" bench/bench_dapo_loss_overhead.py --device cuda \
    --tokens 1e5 1e7 --reps 200
run_step "policy bf16 vs transformers" 90 policy_figures "$PY" -m pytest tests/gpu/test_policy_cuda.py -q -s -rfE \
    -p no:cacheprovider -k qwen2
run_step "MoE bf16 vs transformers (EP = 1)" 90 policy_figures "$PY" -m pytest tests/gpu/test_policy_cuda.py -q -s \
    -rfE -p no:cacheprovider -k qwen3_moe
run_step "DAPO end to end (1 GPU)" 240 figures_lines "$PY" tests/gpu/e2e_dapo.py --device cuda --out "$out/e2e_dapo"
run_step "train step (Qwen2.5-1.5B shape)" 120 train_step_figures "$PY" bench/bench_train_step.py --device cuda
run_step "packed vs padded step (Qwen2.5-1.5B shape)" 120 packing_figures "$PY" bench/bench_packing.py --device cuda \
    --prompts 8 --max-response 4096 --steps 2
run_step "weight export (Qwen2.5-1.5B shape)" 60 export_figures "$PY" bench/bench_export.py --device cuda
run_step "train step fusions" 150 fusion_figures "$PY" bench/bench_train_step.py --device cuda --fusions \
    --tokens 16384 --steps 2
run_step "log-prob memory benchmark" 60 memory_figures "$PY" bench/bench_logprobs_memory.py --device cuda --tp 1
# The local spec's attention without TE at the paper's length: one Qwen2.5-7B layer at TP4 (7 heads, 1 KV group).
run_step "attention memory at 22.5k tokens" 90 attention_figures "$PY" bench/bench_attention_memory.py --device cuda \
    --tokens 22528 --heads 7 --groups 1 --head-dim 128

write_summary
exit "$failed"
