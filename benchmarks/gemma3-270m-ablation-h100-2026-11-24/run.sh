#!/usr/bin/env bash
# Gemma 3 270M: GRPO + LoRA on BF16 / NVFP4 / NF4 AWQ bases, several seeds per arm (one GPU).
#
#   bash run.sh prep       # the AWQ bases (NVFP4, NF4) into compare's bases folder, by `qerl quantize`
#   bash run.sh compare    # `qerl compare` of $ARMS x $SEEDS, $JOBS runs sharing the GPU
#   bash run.sh all        # both, in the background (setsid), logged to $OUT_DIR/logs/
#   bash run.sh status     # what finished, log tails, steps per run
#   bash run.sh regrade    # SmolLM2's untrained completions, graded by this checkout's grader and by GRADER_REV's
#                          # (regrade_smollm2_with_fixed_grader.json)
#
# Environment (all optional but the first):
#   QERL_CACHE_DIR  holds the gemma3-270m chunk wheels (`qerl models` says how to get them)
#   LC_SITE         a site folder with llm-compressor (`pip install 'qerl[quantize]' --target`), for prep; kept
#                   off PYTHONPATH while vLLM runs: the two pin different compressed-tensors
#   VLLM_SITE       a site folder with vLLM (`pip install 'qerl[vllm]' --target`); empty: vLLM importable
#   OUT_DIR         default runs/gemma-ablation; compare's folder is $OUT_DIR/cmp (runs finished elsewhere
#                   can be copied into $OUT_DIR/cmp/<arm>/seed-<s>/ first: compare skips them)
#   ARMS, SEEDS, JOBS   compare's arms (default bf16-lora,nvfp4-lora,nvfp4-aqn), seeds (3), runs at a time (4)
#   EXTRA           more compare options, e.g. "--set train.fused_kernels=off --only nf4-lora/2"
#   VLLM_KWARGS     compare's rollout.vllm_kwargs, e.g. '{attention_backend: TRITON_ATTN}' where flash-attention
#                   is absent (every run here had it)
#   GRADER_REV      regrade: the git revision whose grader is "old" (default: the grades stored in the samples)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT_DIR=${OUT_DIR:-runs/gemma-ablation}
mkdir -p "$OUT_DIR/logs" "$OUT_DIR/cmp/bases"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
VLLM_KWARGS=${VLLM_KWARGS:-"{}"}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
join() { local IFS=:; echo "$*"; }
with_lc() { PYTHONPATH=$(join "$REPO" ${LC_SITE:-}) "$@"; }
with_vllm() { PYTHONPATH=$(join "$REPO" ${VLLM_SITE:-}) "$@"; }
qerl() { python3 -m qerl_cli "$@"; }

prep() {  # the bases `qerl compare` would make itself where llm-compressor is importable beside vLLM
  : "${QERL_CACHE_DIR:?set QERL_CACHE_DIR to the folder holding the gemma3-270m chunk wheels}"
  local calib=(--calib qerl-text --calib-field text --num-samples 48 --seq-len 256 --method awq)
  with_lc qerl quantize gemma3-270m --format nvfp4 "${calib[@]}" -o "$OUT_DIR/cmp/bases/nvfp4-awq" --overwrite \
    || return 1
  with_lc qerl quantize gemma3-270m --format nf4 "${calib[@]}" -o "$OUT_DIR/cmp/bases/nf4-awq" --overwrite
}

compare() {
  : "${QERL_CACHE_DIR:?set QERL_CACHE_DIR to the folder holding the gemma3-270m chunk wheels}"
  # shellcheck disable=SC2086  # EXTRA is a list of options
  with_vllm qerl compare gemma3_270m_wordproblems -o "$OUT_DIR/cmp" --arms "${ARMS:-bf16-lora,nvfp4-lora,nvfp4-aqn}" \
    --seeds "${SEEDS:-3}" --jobs "${JOBS:-4}" ${EXTRA:-} --set "rollout.vllm_kwargs=$VLLM_KWARGS"
}

regrade() {  # 128 greedy and 64 x 8 sampled completions of the untrained SmolLM2 (its recipe's prompt), regraded
  local system='"Solve the math word problem. Show the sum, then end with: The answer is N."'
  local common=(smollm2-135m-instruct --engine hf --benchmarks synthetic-wordproblems --max-new-tokens 128
                --set template=plain --set "system_prompt=$system" --set top_p=1.0)
  qerl eval "${common[@]}" --samples 1 --max-problems 128 -o "$OUT_DIR/regrade/greedy" --set temperature=0.0 \
    && qerl eval "${common[@]}" --samples 8 --max-problems 64 -o "$OUT_DIR/regrade/sampled" --set temperature=0.7 \
    || return 1
  python3 "$HERE/regrade_samples.py" "$OUT_DIR/regrade/greedy" "$OUT_DIR/regrade/sampled" \
    ${GRADER_REV:+--old-rev "$GRADER_REV"} --output "$OUT_DIR/regrade_smollm2_with_fixed_grader.json"
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
  prep) prep ;;
  compare) compare ;;
  all)  # detached: a device call may end before the runs do
    setsid bash -c "{ bash '$0' prep > '$OUT_DIR/logs/prep.log' 2>&1; echo \$? > '$OUT_DIR/logs/prep.rc'; \
      bash '$0' compare > '$OUT_DIR/logs/compare.log' 2>&1; echo \$? > '$OUT_DIR/logs/compare.rc'; }" \
      < /dev/null > /dev/null 2>&1 &
    echo "started: logs in $OUT_DIR/logs" ;;
  status) status ;;
  regrade) regrade ;;
  *) echo "usage: run.sh prep|compare|all|status|regrade" >&2; exit 2 ;;
esac
