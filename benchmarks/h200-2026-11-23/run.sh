#!/usr/bin/env bash
# H200, 2026-11-23: 7B GRPO steps at a GSM8K-recipe shape, 32B GRPO under an 80 GB cap, bench wall clock.
#
#   bash run.sh e2e7b-bf16    # 7B BF16 LoRA: 16 x 8 x (256 + 2048), gsm8k_7b with its memory settings on auto
#   bash run.sh e2e7b-nvfp4   # the same on the NVFP4 base
#   bash run.sh grpo32b       # 32B NVFP4: bigmath_32b, 1 x 8 x (1024 + 4096), 79.2 GiB of the GPU (--memory-cap)
#   bash run.sh batch         # `qerl bench rollout --batch 2,8` with its defaults, wall clock
#
# Environment (all optional):
#   OUT_DIR       default runs/h200-2026-11-23
#   PROMPTS, GENERATIONS, STEPS, PROMPT_LEN, GEN_LEN   the step shape (defaults per part, below)
#   CAP_GIB       the GPU memory grpo32b may use (default 79.2: what an H100 80GB offers)
#   VLLM_KWARGS   vLLM's extra arguments, e.g. '{attention_backend: TRITON_ATTN}' where flash-attention is
#                 absent (every figure here was measured with it)
set -euo pipefail
OUT_DIR=${OUT_DIR:-runs/h200-2026-11-23}
VLLM_KWARGS=${VLLM_KWARGS:-"{}"}
mkdir -p "$OUT_DIR"
qerl() { python3 -m qerl_cli "$@"; }

e2e7b() {  # e2e7b FORMAT: the recipe with every memory setting on auto (the memory plan decides)
  qerl train gsm8k_7b --dry-run --set train.micro_batch_size=auto --set train.gradient_checkpointing=auto \
    --set rollout.gpu_memory_utilization=auto > "$OUT_DIR/gsm8k_7b-auto.yaml"
  qerl bench e2e --model qwen2.5-7b --formats "$1" --recipe "$OUT_DIR/gsm8k_7b-auto.yaml" --prompt-len 256 \
    --gen-len "${GEN_LEN:-2048}" --prompts-per-step "${PROMPTS:-16}" --generations "${GENERATIONS:-8}" \
    --lora-rank 16 --set repeats="${STEPS:-2}" --set warmup=0 --set "vllm_kwargs=$VLLM_KWARGS" \
    -o "$OUT_DIR/e2e7b-$1"
}

case "${1:-}" in
  e2e7b-bf16) e2e7b bf16 ;;
  e2e7b-nvfp4) e2e7b nvfp4 ;;
  grpo32b)  # the recipe's lengths, one prompt of 8 completions a step, memory on auto as the recipe has it
    qerl bench e2e --model qwen2.5-32b --formats nvfp4 --recipe bigmath_32b --memory-cap "${CAP_GIB:-79.2}" \
      --prompt-len "${PROMPT_LEN:-1024}" --gen-len "${GEN_LEN:-4096}" --prompts-per-step "${PROMPTS:-1}" \
      --generations "${GENERATIONS:-8}" --lora-rank 16 --set repeats="${STEPS:-5}" --set warmup=0 \
      --set "vllm_kwargs=$VLLM_KWARGS" -o "$OUT_DIR/grpo32b_80gb_cap" ;;
  batch)  # bitsandbytes must be importable for the NF4 case
    started=$(date +%s)
    qerl bench rollout --batch 2,8 --set "vllm_kwargs=$VLLM_KWARGS" -o "$OUT_DIR/bench_batch_defaults"
    echo "wall clock: $(( $(date +%s) - started )) s" | tee "$OUT_DIR/bench_batch_defaults/wall_clock.txt" ;;
  *) echo "usage: run.sh e2e7b-bf16|e2e7b-nvfp4|grpo32b|batch" >&2; exit 2 ;;
esac
