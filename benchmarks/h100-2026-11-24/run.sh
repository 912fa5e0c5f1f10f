#!/usr/bin/env bash
# H100, 2026-11-24: rollout kernels at RL concurrency, the update phase, 7B and 14B GRPO steps, bench wall clock.
#
#   bash run.sh sweep       # `qerl bench concurrency`: BF16 and NVFP4 on Marlin, FP8 and Humming, 8-256 sequences
#   bash run.sh profile     # `qerl bench update`: BF16 / NVFP4 x Liger off / on, MFU, CUDA time by kernel kind
#   bash run.sh e2e NAME FORMAT BACKEND PROMPTS [RECIPE]
#                           # `qerl bench e2e`: GRPO steps at PROMPTS x 8 x (256 + 2048), the recipe's memory
#                           # settings on auto, rollout.linear_backend BACKEND (auto, marlin, fp8, humming)
#   bash run.sh batch       # `qerl bench rollout --batch 2,8` with its defaults, wall clock
#
# Section 3 of the README ran:   bash run.sh e2e bf16-16x8 bf16 auto 16
#                                STEPS=1 bash run.sh e2e nvfp4auto-16x8 nvfp4 auto 16   (and so on)
# Section 4:                     STEPS=1 MODEL=qwen2.5-14b bash run.sh e2e nvfp4-14b-16x8 nvfp4 auto 16 bigmath_14b
#
# Environment (all optional):
#   OUT_DIR        default runs/h100-2026-11-24
#   MODEL          e2e's model shape (default qwen2.5-7b); STEPS: e2e's timed steps (default 2)
#   FORMATS, CONCURRENCY, BACKENDS, GEN_LEN   the sweep's (defaults below)
#   SEQUENCES      the profile's rollouts (default 32)
#   VLLM_KWARGS    vLLM's extra arguments, e.g. '{attention_backend: TRITON_ATTN}' where flash-attention is
#                  absent (every figure here was measured with it)
set -euo pipefail
OUT_DIR=${OUT_DIR:-runs/h100-2026-11-24}
VLLM_KWARGS=${VLLM_KWARGS:-"{}"}
mkdir -p "$OUT_DIR"
qerl() { python3 -m qerl_cli "$@"; }

# A shipped training recipe with every memory setting on auto (the memory plan decides), as the e2e runs had.
auto_recipe() {
  qerl train "$1" --dry-run --set train.micro_batch_size=auto --set train.gradient_checkpointing=auto \
    --set rollout.gpu_memory_utilization=auto > "$OUT_DIR/$1-auto.yaml"
  echo "$OUT_DIR/$1-auto.yaml"
}

case "${1:-}" in
  sweep)
    qerl bench concurrency --model qwen2.5-7b --formats "${FORMATS:-bf16,nvfp4}" \
      --concurrency "${CONCURRENCY:-8,32,128,256}" --backends "${BACKENDS:-marlin,fp8,humming}" --prompt-len 256 \
      --gen-len "${GEN_LEN:-2048}" --lora-rank 16 --set repeats=1 --set "vllm_kwargs=$VLLM_KWARGS" -o "$OUT_DIR/sweep" ;;
  profile)
    qerl bench update --model qwen2.5-7b --formats bf16,nvfp4 --fused off,liger --sequences "${SEQUENCES:-32}" \
      --prompt-len 256 --gen-len 2048 --profile -o "$OUT_DIR/profile" ;;
  e2e)
    name=${2:?name} format=${3:?format} backend=${4:?backend} prompts=${5:?prompts}
    recipe=$(auto_recipe "${6:-gsm8k_7b}")
    qerl bench e2e --model "${MODEL:-qwen2.5-7b}" --formats "$format" --linear-backend "$backend" \
      --recipe "$recipe" --prompt-len 256 --gen-len 2048 --prompts-per-step "$prompts" --generations 8 \
      --lora-rank 16 --set repeats="${STEPS:-2}" --set warmup=0 --set "vllm_kwargs=$VLLM_KWARGS" \
      -o "$OUT_DIR/e2e-$name" ;;
  batch)
    started=$(date +%s)
    qerl bench rollout --batch 2,8 --set "vllm_kwargs=$VLLM_KWARGS" -o "$OUT_DIR/bench_batch_defaults"
    echo "wall clock: $(( $(date +%s) - started )) s" | tee "$OUT_DIR/bench_batch_defaults/wall_clock.txt" ;;
  *) echo "usage: run.sh sweep|profile|e2e NAME FORMAT BACKEND PROMPTS [RECIPE]|batch" >&2; exit 2 ;;
esac
