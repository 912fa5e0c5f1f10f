#!/usr/bin/env bash
# Four H100s of one host, 2026-11-27: data-parallel GRPO (torchrun, NCCL, a colocated vLLM engine on every
# rank) on 1, 2 and 4 GPUs, weak scaling at 16 prompts x 8 completions x (256 + 2048) tokens per GPU; a
# resume of the 4-GPU run on 2 GPUs; a tensor-parallel (TP2) rollout. Random-weight Qwen2.5-7B in NVFP4,
# synthetic prompts and random rewards (`--synthetic`: grading random text measures nothing).
#
#   bash run.sh checkpoint     # write the random 7B NVFP4 checkpoint once (every part below reuses it)
#   bash run.sh dp1            # GPU 0: one process, the reference
#   bash run.sh dp2 [REF]      # GPUs 1,2: torchrun --nproc-per-node 2 (REF: a scaling.json to compare with)
#   bash run.sh dp4            # GPUs 0-3: torchrun --nproc-per-node 4, against dp1
#   bash run.sh resume         # GPUs 0,1: dp4's run, resumed from its last checkpoint on 2 GPUs, one step
#   bash run.sh tp2            # GPUs 2,3: one process, rollout.tensor_parallel_size 2, against dp1
#
# Environment (all optional): OUT_DIR (default runs/h100x4-2026-11-27-scaling), VLLM_KWARGS (vLLM's extra
# arguments; every figure here used '{attention_backend: TRITON_ATTN}': the vLLM build had no
# flash-attention), STEPS (timed steps + 1; default 3).
set -euo pipefail
OUT_DIR=${OUT_DIR:-runs/h100x4-2026-11-27-scaling}
VLLM_KWARGS=${VLLM_KWARGS:-"{}"}
STEPS=${STEPS:-3}
mkdir -p "$OUT_DIR"
qerl() { python3 -m qerl_cli "$@"; }

recipe() {  # gsm8k_7b (AQN, TIS, LoRA r16 on every projection) with every memory setting on auto
  # rollout.linear_backend fp8 (FP8 copy + vLLM's LoRA kernels): what auto chose on the day, pinned so a
  # rerun measures the same backend (auto now picks fp8-merged). Written under a per-process name and
  # renamed: parts started side by side must not read each other's half-written file.
  local tmp="$OUT_DIR/.gsm8k_7b-auto.$$.yaml"
  qerl train gsm8k_7b --dry-run --set train.micro_batch_size=auto --set train.gradient_checkpointing=auto \
    --set rollout.gpu_memory_utilization=auto --set rollout.linear_backend=fp8 \
    --set "rollout.vllm_kwargs=$VLLM_KWARGS" > "$tmp"
  mv -f "$tmp" "$OUT_DIR/gsm8k_7b-auto.yaml"
  echo "$OUT_DIR/gsm8k_7b-auto.yaml"
}

scale() {  # scale GPUS NAME [extra bench scaling flags]: one world size
  local gpus=$1 name=$2 launch=(python3 -m qerl_cli)
  shift 2
  [ "$gpus" -gt 1 ] && launch=(torchrun --nproc-per-node "$gpus" -m qerl_cli)
  "${launch[@]}" bench scaling "$(recipe)" --model qwen2.5-7b --format nvfp4 --synthetic --steps "$STEPS" \
    --prompts-per-gpu 16 -o "$OUT_DIR/$name" "$@"
}

case "${1:-}" in
  checkpoint) python3 -c "from qerl_cli.bench.models import shape_checkpoint; print(shape_checkpoint('qwen2.5-7b', 'nvfp4'))" ;;
  dp1) CUDA_VISIBLE_DEVICES=0 scale 1 dp1 ;;
  dp2) CUDA_VISIBLE_DEVICES=1,2 scale 2 dp2 ${2:+--reference "$2"} ;;
  dp4) CUDA_VISIBLE_DEVICES=0,1,2,3 scale 4 dp4 --reference "$OUT_DIR/dp1/scaling.json" ;;
  resume)  # the same global batch (64 prompts) on half the GPUs: 32 prompts x 8 a rank
    CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m qerl_cli train "$OUT_DIR/dp4/run/config.yaml" \
      --resume "$OUT_DIR/dp4/run" --set train.max_steps=$((STEPS + 1)) ;;  # the grader's reward, not random
  tp2) CUDA_VISIBLE_DEVICES=2,3 scale 1 tp2 --set rollout.tensor_parallel_size=2 \
      --reference "$OUT_DIR/dp1/scaling.json" ;;
  *) echo "usage: run.sh checkpoint|dp1|dp2 [REF]|dp4|resume|tp2" >&2; exit 2 ;;
esac
