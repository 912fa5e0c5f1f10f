#!/usr/bin/env bash
# H200, 2026-11-21: the first 4-bit kernel, rollout and GRPO-step figures, with today's `qerl` commands.
#
#   bash run.sh kernels     # `qerl bench kernels`: 7B NVFP4 weight memory, decoder layer fwd+bwd vs BF16, dequant
#   bash run.sh rollout     # `qerl bench rollout`: 7B BF16 vs NVFP4, batch 1, 2, 8, 256 + 512 tokens, LoRA r16
#   bash run.sh e2e         # the same with a GRPO step: 8 prompts x 8 generations, 256 + 256 tokens
#   bash run.sh 32b         # `qerl bench rollout`: 32B NVFP4, batch 2 and 8
#   bash run.sh hf-step     # `qerl bench e2e --engine hf`: GRPO steps of the 7B NVFP4 base on the HF engine
#   bash run.sh vllm-eval   # `qerl eval --engine vllm` of a tiny NVFP4 model with and without a LoRA adapter:
#                           # the two sample files must differ (the adapter is applied)
#
# Environment (all optional):
#   OUT_DIR       default runs/h200-2026-11-21
#   VLLM_KWARGS   vLLM's extra arguments, e.g. '{attention_backend: TRITON_ATTN}' where flash-attention is
#                 absent (every figure here was measured with it)
set -euo pipefail
OUT_DIR=${OUT_DIR:-runs/h200-2026-11-21}
VLLM_KWARGS=${VLLM_KWARGS:-"{}"}
mkdir -p "$OUT_DIR"
qerl() { python3 -m qerl_cli "$@"; }
shape=(--model qwen2.5-7b --formats bf16,nvfp4 --prompt-len 256 --lora-rank 16)

vllm_eval() {
  local work=$OUT_DIR/vllm_eval
  qerl tiny-base "$work/base" --formats nvfp4  # a warm-started tiny model, NVFP4
  # An adapter that changes the model: a few GRPO steps of the tiny recipe on that base.
  qerl train tiny --set "model.path=$work/base/nvfp4" --set train.max_steps=5 --set output.save_steps=0 \
    --set "output.dir=$work/train"
  local common=(--benchmarks synthetic-addition --engine vllm --samples 4 --max-new-tokens 32 --max-problems 16
                --set "vllm_kwargs=$VLLM_KWARGS" --set template=plain)
  qerl eval "$work/base/nvfp4" "${common[@]}" --output "$work/eval_base"
  qerl eval "$work/base/nvfp4" --adapter "$work/train/adapter" "${common[@]}" --output "$work/eval_lora"
  if cmp -s "$work/eval_base/samples_synthetic-addition.jsonl" "$work/eval_lora/samples_synthetic-addition.jsonl"
  then echo "FAIL: the adapter changed nothing"; return 1; fi
  echo "ok: the adapter changes vLLM's samples"
}

case "${1:-}" in
  kernels) qerl bench kernels --model qwen2.5-7b --formats nvfp4 --batch 8 --seq-len 1024 -o "$OUT_DIR/kernels" ;;
  rollout)
    qerl bench rollout "${shape[@]}" --batch 1,2,8 --gen-len 512 --engine vllm --set "vllm_kwargs=$VLLM_KWARGS" \
      -o "$OUT_DIR/bench_7b_rollout" ;;
  e2e)
    # Recorded as `qerl bench rollout ... --batch 8 --e2e`, that date's form of the same benchmark.
    qerl bench e2e "${shape[@]}" --prompts-per-step 8 --generations 8 --gen-len 256 --engine vllm \
      --set "vllm_kwargs=$VLLM_KWARGS" \
      -o "$OUT_DIR/bench_7b_e2e" ;;
  32b)
    qerl bench rollout --model qwen2.5-32b --formats nvfp4 --batch 2,8 --prompt-len 256 --gen-len 512 \
      --lora-rank 16 --engine vllm --set "vllm_kwargs=$VLLM_KWARGS" -o "$OUT_DIR/bench_32b_nvfp4" ;;
  hf-step)
    qerl bench e2e --model qwen2.5-7b --formats nvfp4 --engine hf --prompts-per-step 8 --generations 8 \
      --prompt-len 256 --gen-len 256 --lora-rank 16 --set repeats=1 --set warmup=1 -o "$OUT_DIR/hf_engine_step" ;;
  vllm-eval) vllm_eval ;;
  *) echo "usage: run.sh kernels|rollout|e2e|32b|hf-step|vllm-eval" >&2; exit 2 ;;
esac
