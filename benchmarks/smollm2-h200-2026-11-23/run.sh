#!/usr/bin/env bash
# SmolLM2-135M-Instruct on one GPU (HF engine): the ablation, and how much of BF16 each 4-bit base keeps.
#
#   bash run.sh compare   # `qerl compare`: $ARMS x $SEEDS, the runs as parallel processes on the GPU; each
#                         # untrained base's held-out pass@1 and rollout entropy in $OUT_DIR/cmp/base-heldout/
#   bash run.sh quality   # `qerl bench quality`: NVFP4 RTN and AWQ, MXFP4 RTN, NF4 RTN against BF16
#   bash run.sh all       # both, the quality table while the ablation runs
#
# Environment (all optional):
#   QERL_CACHE_DIR  where `qerl models` looks for the smollm2-135m-instruct GGUF (it says how to get it)
#   OUT_DIR         default runs/smollm2
#   ARMS, SEEDS, JOBS, STEPS, HELDOUT   compare's arms (bf16-lora,nvfp4-lora,nvfp4-aqn), seeds (3), runs at a time
#                   (9), GRPO steps (30) and held-out problems (128)
#   BASE_METHOD     how compare makes the 4-bit arms' base: rtn (this folder's runs) or awq
#                   (../smollm2-awq-h200-2026-11-24/, with ARMS=bf16-lora,nvfp4-lora HELDOUT=256 JOBS=6)
#   DEVICE          default cuda; OMP_NUM_THREADS: torch threads of this script's own processes (default 4)
set -uo pipefail
OUT_DIR=${OUT_DIR:-runs/smollm2}
mkdir -p "$OUT_DIR"
# Three jobs at 16 threads each on 16 cores spent minutes on a 3-second RTN write; compare gives each of its
# runs its own share.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
qerl() { python3 -m qerl_cli "$@"; }

compare() {
  qerl compare smollm2_wordproblems -o "$OUT_DIR/cmp" --arms "${ARMS:-bf16-lora,nvfp4-lora,nvfp4-aqn}" \
    --seeds "${SEEDS:-3}" --jobs "${JOBS:-9}" --set train.max_steps="${STEPS:-30}" --set output.save_steps=10 \
    --set train.device="${DEVICE:-cuda}" --set compare.heldout_problems="${HELDOUT:-128}" \
    --set compare.base_method="${BASE_METHOD:-rtn}"
}

quality() {  # a row whose packages are missing is recorded as skipped, not fatal
  qerl bench quality smollm2-135m-instruct --rows nvfp4-rtn,nvfp4-awq,mxfp4-rtn,nf4-rtn --heldout-rows 16 \
    --device "${DEVICE:-cuda}" -o "$OUT_DIR/quality"
}

case "${1:-}" in
  compare) compare ;;
  quality) quality ;;
  all)
    compare > "$OUT_DIR/compare.log" 2>&1 &
    pid=$!
    quality > "$OUT_DIR/quality.log" 2>&1
    echo "quality: exit $?"
    wait "$pid"; echo "compare: exit $?" ;;
  *) echo "usage: run.sh compare|quality|all" >&2; exit 2 ;;
esac
