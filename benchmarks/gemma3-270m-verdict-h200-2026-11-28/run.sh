#!/usr/bin/env bash
# Gemma 3 270M: NVFP4 LoRA on the default AWQ base vs BF16 LoRA (and two more NVFP4 arms), equal seeds side by
# side, held-out pass@1 from 4 samples a problem at the training temperature on 1024 held-out problems.
#
#   SEEDS=5 JOBS=10 bash run.sh                      # seeds 0-4 of bf16-lora and nvfp4-lora (one H200)
#   SEEDS=9 JOBS=8 GPUS=0,1 bash run.sh              # seeds 5-8 added to the same folder (two H200s)
#   ARMS=bf16-lora,nvfp4-lora,nvfp4-aqn-t10pct-awq,nvfp4-fp8merged SEEDS=9 JOBS=18 GPUS=0,1 bash run.sh
#                                                    # the AQN and fp8-merged arms, seeds 0-8 (two H200s)
#   REPORT=1 ARMS=... SEEDS=9 bash run.sh            # the report of the runs in $OUT_DIR/cmp, on any machine
#
# Arguments after the variables go to `qerl compare` as they are (e.g. --only ARM/SEED,... or --set KEY=VALUE).
#
# Environment: QERL_CACHE_DIR holds the gemma3-270m chunk wheels (`qerl models` says how to get them);
# LC_SITE a site folder with qerl[quantize] (llm-compressor), VLLM_SITE one with qerl[vllm]: the two pin
# different compressed-tensors, so each command sees only its own. OUT_DIR (default runs/gemma-verdict).
# A later call with more seeds or arms adds the missing runs to the same comparison; finished runs are kept.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${OUT_DIR:-runs/gemma-verdict}
ARMS=${ARMS:-bf16-lora,nvfp4-lora}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The committed runs ran vLLM's default LoRA kernel configs (qerl shipped none then): added seeds keep them,
# through an empty folder, unless the caller names one.
export VLLM_TUNED_CONFIG_FOLDER=${VLLM_TUNED_CONFIG_FOLDER:-$(mktemp -d)}
with_lc() { PYTHONPATH=$REPO:${LC_SITE:-} "$@"; }
with_vllm() { PYTHONPATH=$REPO:${VLLM_SITE:-} "$@"; }
HELDOUT=(--set compare.heldout_problems=1024 --set compare.heldout_samples=4 --set compare.heldout_temperature=0.7)
if [ -n "${REPORT:-}" ]; then  # no GPU, no model, nothing trained: the runs' own records
  exec python3 -m qerl_cli compare gemma3_270m_wordproblems -o "$OUT_DIR/cmp" --arms "$ARMS" --seeds "${SEEDS:-9}" \
    --report-only "${HELDOUT[@]}" "$@"
fi
: "${QERL_CACHE_DIR:?set QERL_CACHE_DIR to the folder holding the gemma3-270m chunk wheels}"
export QERL_CACHE_DIR
mkdir -p "$OUT_DIR/cmp/bases"
# The BF16 model (the GGUF dequantized once) and its NVFP4 AWQ base, as `qerl compare` would make it.
bf16=$(with_lc python3 -c 'from qerl_cli.modeling.sources import resolve_model_source as r; print(r("gemma3-270m"))')
[ -f "$OUT_DIR/cmp/bases/nvfp4-awq/qerl_quant.json" ] || with_lc python3 -m qerl_cli quantize "$bf16" \
  --format nvfp4 --method awq --calib qerl-text --calib-field text --num-samples 48 --seq-len 256 \
  --device auto -o "$OUT_DIR/cmp/bases/nvfp4-awq"
# The GPTQ base with its EoRA LoRA start (BASE/lora_init), for the nvfp4-gptq-* arms, made the same way.
if [[ ",$ARMS,$*" == *gptq* ]] && [ ! -f "$OUT_DIR/cmp/bases/nvfp4-gptq/qerl_quant.json" ]; then
  with_lc python3 -m qerl_cli quantize "$bf16" --format nvfp4 --method gptq --lora-init eora --lora-init-rank 16 \
    --calib qerl-text --calib-field text --num-samples 48 --seq-len 256 --device auto -o "$OUT_DIR/cmp/bases/nvfp4-gptq"
fi
# The runs share the GPUs (each starts once the previous one's vLLM engine on its GPU is up, or after 45 s).
with_vllm python3 -m qerl_cli compare gemma3_270m_wordproblems -o "$OUT_DIR/cmp" --arms "$ARMS" \
  --seeds "${SEEDS:-5}" --jobs "${JOBS:-10}" --gpus "${GPUS:-auto}" "${HELDOUT[@]}" "$@"
