#!/usr/bin/env bash
# End-to-end GRPO at real lengths, 32B under an 80 GB cap and bench wall time on a lent H200 (first written
# for issue 11 as scripts/device_issue11.sh), one PART per device call (vLLM installed as
# /work/shared/tools/device-vllm/README.md says; this script only exports its settings):
#
#   bash scripts/device_e2e.sh e2e7b-bf16     # (a) 7B BF16 LoRA e2e, 16 x 8 x (256 + 2048), 3 steps
#   bash scripts/device_e2e.sh e2e7b-nvfp4    # (a) the same with the NVFP4 base
#   bash scripts/device_e2e.sh grpo32b        # (b) recipes/bigmath_32b.yaml, 5 steps, 80 GB cap
#   bash scripts/device_e2e.sh batch          # (c) qerl bench --batch 2,8, defaults, wall clock
#
# The batch part's NF4 case needs bitsandbytes, which the device lacks: unzip its wheel here (keeping only
# libbitsandbytes_cuda130.so, ~4 MB), carry the folder, copy it to /tmp/bnb-site there and run the part
# with PYTHONPATH=/tmp/bnb-site (this script keeps a PYTHONPATH it is given).
# CAP_GIB=79.2 (default for grpo32b, "none" elsewhere) caps the free GPU memory with a ballast
# process; GEN_LEN / PROMPTS / GENERATIONS / STEPS override part (b)'s shape. Results: JSON in $OUT.
# The JSON is written when a part ends; while it runs, the trainer's per-step rows (phase seconds, memory
# peaks) are in /tmp/qerl-device-e2e/<part>/metrics.jsonl: copy that file to $OUT if device time runs short.
set -uo pipefail
PART=${1:?usage: device_e2e.sh e2e7b-bf16|e2e7b-nvfp4|grpo32b|batch}
export PYTHONPATH="$PWD:/tmp/vllm-site${PYTHONPATH:+:$PYTHONPATH}" VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
export QERL_CACHE_DIR=${QERL_CACHE_DIR:-/tmp/qerl-cache}
OUT=${OUT:-/tmp/qerl-device-e2e-out}
mkdir -p "$OUT" /tmp/qerl-device-e2e
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/nvidia-smi-$PART.txt"

case "$PART" in
  grpo32b) CAP=${CAP_GIB:-79.2} ;;
  *) CAP=${CAP_GIB:-none} ;;
esac
BALLAST=""
if [ "$CAP" != "none" ]; then
  rm -f /tmp/qerl-device-e2e/ballast.json
  setsid python scripts/device_e2e.py ballast --cap-gib "$CAP" --ready /tmp/qerl-device-e2e/ballast.json \
    > /tmp/qerl-device-e2e/ballast.log 2>&1 &
  BALLAST=$!
  trap '[ -n "$BALLAST" ] && kill -- -"$BALLAST" 2>/dev/null' EXIT
  for _ in $(seq 60); do [ -f /tmp/qerl-device-e2e/ballast.json ] && break; sleep 1; done
  cat /tmp/qerl-device-e2e/ballast.json || { echo "ballast did not start"; cat /tmp/qerl-device-e2e/ballast.log; exit 1; }
  cp /tmp/qerl-device-e2e/ballast.json "$OUT/ballast-$PART.json"
fi

case "$PART" in
  e2e7b-bf16|e2e7b-nvfp4)
    FMT=${PART#e2e7b-}
    python scripts/device_e2e.py e2e --name "$PART" --model qwen2.5-7b --format "$FMT" --prompt-len 256 \
      --gen-len 2048 --prompts "${PROMPTS:-16}" --generations "${GENERATIONS:-8}" --steps "${STEPS:-3}" \
      --recipe recipes/gsm8k_7b.yaml --auto-memory --share recipe --out "$OUT/$PART.json" ;;
  grpo32b)
    python scripts/device_e2e.py e2e --name grpo32b --model qwen2.5-32b --format nvfp4 \
      --recipe recipes/bigmath_32b.yaml --share recipe --prompt-len "${PROMPT_LEN:-1024}" \
      --gen-len "${GEN_LEN:-4096}" --prompts "${PROMPTS:-1}" --generations "${GENERATIONS:-8}" \
      --steps "${STEPS:-5}" --out "$OUT/grpo32b.json" ;;
  batch)
    python scripts/device_e2e.py batch --out "$OUT/bench-batch.json" ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
RC=$?
echo "part $PART exit $RC"
exit $RC
