#!/usr/bin/env bash
# Old commit and new in one run: bench_step, the HumanEval eval and bench_batch on OLD (a git worktree) and on this
# checkout, back to back, with this checkout's .venv. Run it alone on the machine; figures land in OUT.
#   [OUT=data/bench/compare] [EXTRA="model.precision=int8"] bash scripts/compare_commits.sh e37a086
# EXTRA: overrides for an extra run of both commits (e.g. model.precision=int8), after the exact ones.
set -euo pipefail
old="${1:?usage: scripts/compare_commits.sh OLD_COMMIT}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$here/data/bench/compare}"
tree="${OLD_TREE:-$here/data/bench/worktree-$old}"
py="$here/.venv/bin/python"
# the old tree builds its kernel into a folder of its own: one shared folder would rebuild it at every switch
old_ext="${OLD_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions_blockpilot_old}"
export WANDB_MODE="${WANDB_MODE:-offline}" PYTHONUNBUFFERED=1
mkdir -p "$out"
[ -d "$tree" ] || git -C "$here" worktree add --detach "$tree" "$old"
date -u; grep -m1 'model name' /proc/cpuinfo; grep -o -w 'avx512f\|avx512_vnni\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
runs=("old:$tree:" "new:$here:")
ext_of() { if [[ "$1" == old* ]]; then echo "TORCH_EXTENSIONS_DIR=$old_ext"; fi; }
[ -n "${EXTRA:-}" ] && runs+=("old-extra:$tree:$EXTRA" "new-extra:$here:$EXTRA")
for run in "${runs[@]}"; do
  IFS=: read -r name dir extra <<<"$run"
  (cd "$dir" && env $(ext_of "$name") $py -m pipeline.bench_step 'contexts=[128,512]' 'backends=[auto]' $extra out="$out/step-$name.json")
done
for run in "${runs[@]}"; do
  IFS=: read -r name dir extra <<<"$run"
  methods='[ar,fixed,verify_width,hf_generate]'; [ -n "$extra" ] && methods='[ar,fixed,verify_width]'
  (cd "$dir" && env $(ext_of "$name") $py -m pipeline.evaluate data=humaneval data.limit=20 decode.max_new_tokens=128 "eval.methods=$methods" \
     $extra run_name="compare-$name" paths.data="$out/data-$name")
done
for run in "${runs[@]}"; do
  IFS=: read -r name dir extra <<<"$run"
  (cd "$dir" && env $(ext_of "$name") $py -m pipeline.bench_batch data.limit=20 bench.max_new_tokens=128 'bench.concurrency=[1,16]' \
     'bench.methods=[ar,budget]' 'bench.arrivals=[burst]' $extra out="$out/batch-$name.json")
done
date -u
echo "figures: $out/step-*.md, $out/data-*/eval/compare-*/results.md, $out/batch-*.md"
