#!/usr/bin/env bash
# H100, 2026-11-27: rollouts with the LoRA merged into the weights (no LoRA kernels), both BF16 baselines,
# the FP8 update, 7B GRPO steps. Each GPU of the host ran one queue at a time, side by side.
#
#   bash run.sh e2e NAME FORMAT BACKEND PROMPTS [BASE_COMPUTE]
#                       # `qerl bench e2e`: GRPO steps at PROMPTS x 8 x (256 + 2048), gsm8k_7b's memory
#                       # settings on auto, rollout.linear_backend BACKEND, train.base_compute BASE_COMPUTE
#   bash run.sh sweep NAME FORMATS BACKENDS
#                       # `qerl bench concurrency` at 8, 32, 128, 256 sequences (rollout tokens/s, roofline)
#   bash run.sh queue N # the runs of GPU N (below), one after the other
#
# Environment (all optional): OUT_DIR (default runs/h100-2026-11-27-merged), VLLM_KWARGS (vLLM's extra
# arguments; every figure here used '{attention_backend: TRITON_ATTN}': the vLLM build had no
# flash-attention), STEPS (e2e's timed steps; default 2 at 16 x 8, 3 at 1 x 8).
set -euo pipefail
OUT_DIR=${OUT_DIR:-runs/h100-2026-11-27-merged}
VLLM_KWARGS=${VLLM_KWARGS:-"{}"}
mkdir -p "$OUT_DIR"
qerl() { python3 -m qerl_cli "$@"; }

auto_recipe() {  # gsm8k_7b with every memory setting on auto (the memory plan decides)
  qerl train gsm8k_7b --dry-run --set train.micro_batch_size=auto --set train.gradient_checkpointing=auto \
    --set rollout.gpu_memory_utilization=auto > "$OUT_DIR/gsm8k_7b-auto.yaml"
  echo "$OUT_DIR/gsm8k_7b-auto.yaml"
}

e2e() {
  local name=$1 format=$2 backend=$3 prompts=$4 compute=${5:-bf16} steps
  steps=${STEPS:-$([ "$prompts" = 1 ] && echo 3 || echo 2)}
  qerl bench e2e --model qwen2.5-7b --formats "$format" --linear-backend "$backend" --base-compute "$compute" \
    --recipe "$(auto_recipe)" --prompt-len 256 --gen-len 2048 --prompts-per-step "$prompts" --generations 8 \
    --lora-rank 16 --set repeats="$steps" --set warmup=0 --set "vllm_kwargs=$VLLM_KWARGS" -o "$OUT_DIR/e2e-$name"
}

sweep() {
  qerl bench concurrency --model qwen2.5-7b --formats "$2" --backends "$3" --concurrency 8,32,128,256 \
    --prompt-len 256 --gen-len 2048 --lora-rank 16 --set repeats=1 --set "vllm_kwargs=$VLLM_KWARGS" \
    -o "$OUT_DIR/sweep-$1"
}

case "${1:-}" in
  e2e) shift; e2e "$@" ;;
  sweep) shift; sweep "$@" ;;
  queue)
    case "${2:?queue number}" in
      0) e2e bf16-lora-16x8 bf16 marlin 16; e2e bf16-lora-1x8 bf16 marlin 1 ;;
      1) e2e bf16-merged-16x8 bf16 merged 16; e2e bf16-merged-1x8 bf16 merged 1 ;;
      2) e2e nvfp4-merged-16x8 nvfp4 fp8-merged 16; e2e nvfp4-merged-1x8 nvfp4 fp8-merged 1
         sweep nvfp4-merged nvfp4 fp8-merged ;;
      3) e2e nvfp4-merged-fp8update-16x8 nvfp4 fp8-merged 16 fp8; e2e nvfp4-marlin-1x8 nvfp4 marlin 1
         sweep bf16-merged bf16 merged ;;
      *) echo "queues: 0-3" >&2; exit 2 ;;
    esac ;;
  *) echo "usage: run.sh e2e NAME FORMAT BACKEND PROMPTS [BASE_COMPUTE] | sweep NAME FORMATS BACKENDS | queue N" >&2
     exit 2 ;;
esac
