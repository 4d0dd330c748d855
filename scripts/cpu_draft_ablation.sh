#!/usr/bin/env bash
# The drafter recipe on a small slice, on this CPU (docs/history.md, "Issue 13"): every run continues the
# shipped drafter for 300 optimizer steps on the same data, and only the named setting changes.
#   bash scripts/cpu_draft_ablation.sh            # data ~25 min, then ~10 min a run (2 cores)
#   bash scripts/cpu_draft_ablation.sh mixed-tv   # one run by name
# Each run writes data/runs/draft-ablation/ablate-<name>/ (not committed); its training_stats.json holds the held-out
# teacher-forced tau overall (val_tau) and per training set (val_tau_per_set). Decode tau on the benchmark
# sets: python -m pipeline.evaluate ... model.drafter=data/runs/draft-ablation/ablate-<name> 'eval.methods=[fixed]'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export WANDB_MODE=${WANDB_MODE:-offline} PYTHONUNBUFFERED=1

# chat the target writes itself (greedy and T=1 replies to the same 512 prompts) + sampled math and code replies
SETS='[{name: self_chat, source: self, limit: 512, prompt_max_tokens: 96}, {name: self_chat_t1, source: self, limit: 512, prompt_max_tokens: 96, temperature: 1.0}, {name: gsm8k_train_t1, source: "${paths.shared_data}/train/gsm8k_train.jsonl", limit: 256, temperature: 1.0}, {name: code_alpaca_t1, source: "${paths.shared_data}/train/code_alpaca.jsonl", limit: 128, temperature: 1.0}'
# ... plus greedy replies of the shipped drafter's own families (code, math, stdlib) against forgetting
MIX="$SETS"', {name: stdlib, source: stdlib, limit: 128}, {name: code_alpaca, source: "${paths.shared_data}/train/code_alpaca.jsonl", limit: 128}, {name: gsm8k_train, source: "${paths.shared_data}/train/gsm8k_train.jsonl", limit: 128}, {name: stdlib_source, source: stdlib_source, window: 384, limit: 256}]'
SETS="$SETS]"
COMMON=(logger.enabled=false draft.init_from=data/drafters/smollm2-135m-instruct-dflash-b8
        draft.cache_dir=data/cache/drafter-data/cpu-ablation draft.val_fraction=0.06 draft.trainer.max_time=null
        draft.warmup_steps=20 draft.lr=3e-4 draft.checkpoint_every=100 draft.trainer.val_check_interval=100
        draft.trainer.limit_val_batches=8)

declare -A RUNS=(
  [base]="draft.trainer.max_steps=0"
  [ce]="draft.trainer.max_steps=300"
  [tv]="draft.trainer.max_steps=300 draft.loss={ce:0.1,tv:0.9,kl:0.0}"
  [kl]="draft.trainer.max_steps=300 draft.loss={ce:0.1,tv:0.0,kl:0.9}"
  [ce-gamma7]="draft.trainer.max_steps=300 draft.gamma=7.0"
  [mixed-base]="draft.trainer.max_steps=0 MIX"
  [mixed-tv]="draft.trainer.max_steps=500 draft.loss={ce:0.1,tv:0.9,kl:0.0} MIX"
)
ORDER=(base ce tv kl ce-gamma7 mixed-tv mixed-base)

run() {
  local name=$1 args=() sets="$SETS"
  for a in ${RUNS[$name]}; do if [ "$a" = MIX ]; then sets="$MIX"; else args+=("$a"); fi; done
  echo "=== $name $(date -u +%T)"
  "$PY" -m pipeline.draft run_name="ablate-$name" draft.out="data/runs/draft-ablation/ablate-$name" "${COMMON[@]}" \
      "draft.sets=$sets" "${args[@]}"
}

if [ $# -gt 0 ]; then for name in "$@"; do run "$name"; done; else for name in "${ORDER[@]}"; do run "$name"; done; fi
