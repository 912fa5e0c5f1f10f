#!/usr/bin/env bash
# Rollout kernels and the update phase on a lent GPU, one PART per call, each started in the background
# (setsid) from a snapshot of the repository so later edits of the working tree cannot reach it. vLLM
# must be installed first (../shared/tools/device-vllm/README.md); this script exports its settings.
#
#   bash scripts/device_rollout_backends.sh profile   # update phase: BF16 / NVFP4 x Liger off / on, MFU
#   bash scripts/device_rollout_backends.sh sweep     # qerl bench --concurrency 8,32,128,256, 2048 tokens
#   bash scripts/device_rollout_backends.sh e2e NAME FORMAT BACKEND PROMPTS [RECIPE]
#                                                     # GRPO steps at PROMPTS x 8 x (256 + 2048)
#   bash scripts/device_rollout_backends.sh queue AFTER NAME FORMAT BACKEND PROMPTS [RECIPE]
#                                                     # an e2e part that starts when part AFTER has ended
#   bash scripts/device_rollout_backends.sh batch [AFTER]
#                                                     # qerl bench --batch 2,8 with its defaults, wall clock
#                                                     # (NF4 needs bitsandbytes: carry .device/bnb, below)
#   bash scripts/device_rollout_backends.sh status    # what has finished; the tail of the running log
#
# bitsandbytes for the batch part's NF4 case (the device lacks it), built here once:
#   mkdir -p .device/bnb && (cd .device/bnb && unzip -q bitsandbytes-0.50.2-*.whl
#     && find . -name '*.so' ! -name '*cuda130*' -delete)          # 4.4 MB; carry [".device/bnb"]
#
# Results land in /tmp/qerl-dev/out (copy them to $OUT from a later call: `... status` does).
set -uo pipefail
PART=${1:?usage: device_rollout_backends.sh profile|sweep|e2e|status}
RUN=/tmp/qerl-dev
mkdir -p "$RUN/out"
export PYTHONPATH="$RUN/repo:/tmp/vllm-site${PYTHONPATH:+:$PYTHONPATH}" VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_ENABLE_V1_MULTIPROCESSING=0 QERL_CACHE_DIR=${QERL_CACHE_DIR:-/tmp/qerl-cache} PYTHONUNBUFFERED=1
TRITON='vllm_kwargs={attention_backend: TRITON_ATTN}'

snapshot() {  # the code this part runs, frozen now
  rm -rf "$RUN/repo" && mkdir -p "$RUN/repo" && cp -r qerl_cli scripts "$RUN/repo/"
}

start() {  # start NAME 'COMMAND': detached, logged, exit code recorded
  local name=$1 command=$2
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$RUN/out/nvidia-smi-$name.txt"
  echo "$command" > "$RUN/out/$name.cmd"
  (cd "$RUN/repo" && setsid bash -c "$command > $RUN/out/$name.log 2>&1; echo \$? > $RUN/out/$name.rc" &)
  echo "started $name: $command"
}

running() {  # parts started and not finished
  for f in "$RUN"/out/*.log; do [ -f "$f" ] && [ ! -f "${f%.log}.rc" ] && basename "$f" .log; done
}

one_at_a_time() {  # the GPU runs one part at a time: a second one waits for the first to finish
  local busy
  busy=$(running | tr '\n' ' ')
  if [ -n "$busy" ]; then echo "busy: $busy still running; start $PART when it has finished"; exit 0; fi
}

e2e_command() {  # e2e_command NAME FORMAT BACKEND PROMPTS [RECIPE]
  echo "python scripts/device_e2e.py e2e --name $1 --model ${MODEL:-qwen2.5-7b} --format $2 --backend $3 \
    --fused ${FUSED:-auto} --prompt-len 256 --gen-len 2048 --prompts $4 --generations 8 --steps ${STEPS:-2} \
    --recipe ${5:-recipes/gsm8k_7b.yaml} --auto-memory --share recipe --out $RUN/out/e2e-$1.json"
}

case "$PART" in
  queue)  # queue AFTER NAME FORMAT BACKEND PROMPTS [RECIPE]: an e2e part that starts when part AFTER ends
    AFTER=${2:?part to wait for}; shift 2
    start "e2e-$1" "while [ ! -f $RUN/out/$AFTER.rc ]; do sleep 2; done; $(e2e_command "$@")" ;;
  batch)  # batch [AFTER]: the bench defaults, after part AFTER if given
    WAIT=${2:+while [ ! -f $RUN/out/$2.rc ]; do sleep 2; done; }
    [ -z "${2:-}" ] && { one_at_a_time; snapshot; }
    [ -d .device/bnb ] && rm -rf /tmp/bnb-site && cp -r .device/bnb /tmp/bnb-site
    start batch "${WAIT}PYTHONPATH=/tmp/bnb-site:\$PYTHONPATH python scripts/device_e2e.py batch \
      --out $RUN/out/bench-batch.json" ;;
  profile)
    one_at_a_time
    snapshot
    start profile "python scripts/device_update_profile.py --model qwen2.5-7b --formats bf16,nvfp4 \
      --fused off,liger --sequences ${SEQUENCES:-32} --profile --out $RUN/out/update_profile.json" ;;
  sweep)
    SWEEP=${SWEEP:-sweep}
    one_at_a_time
    snapshot
    start "$SWEEP" "python -m qerl_cli bench --model qwen2.5-7b --formats ${FORMATS:-bf16,nvfp4} \
      --concurrency ${CONCURRENCY:-8,32,128,256} --backends ${BACKENDS:-marlin,fp8,humming} \
      --prompt-len 256 --gen-len ${GEN_LEN:-2048} --lora-rank 16 --set repeats=1 --set '$TRITON' \
      -o $RUN/out/$SWEEP" ;;
  e2e)
    NAME=${2:?name} FMT=${3:?format} BACKEND=${4:?backend} PROMPTS=${5:?prompts} RECIPE=${6:-recipes/gsm8k_7b.yaml}
    one_at_a_time
    snapshot
    # BEFORE: commands to run first in the same detached job, so the GPU runs one job at a time. By
    # default, the NVFP4 backends the shipped crossover table lacks for this GPU (fp8, humming), at
    # MORE_CONCURRENCY. Then every crossover.json measured here is merged into
    # the snapshot's table, so rollout.linear_backend=auto sees them.
    MISSING=$(cd "$RUN/repo" && python -c '
import torch
from qerl_cli.rollout.backends import entry_backends, gpu_entry, key_entries, load_table
entries = key_entries(gpu_entry(load_table(None), torch.cuda.get_device_name()), "nvfp4+lora")
have = {b for e in entries for b in entry_backends(e)}
print(",".join(b for b in ("fp8", "humming") if b not in have))' 2>/dev/null)
    if [ -z "${BEFORE+x}" ] && [ ! -e "$RUN/out/sweep-more" ] && [ -n "$MISSING" ]; then
      mkdir -p "$RUN/out/sweep-more"
      BEFORE="python -m qerl_cli bench --model qwen2.5-7b --formats nvfp4 --concurrency ${MORE_CONCURRENCY:-8,128} \
        --backends $MISSING --prompt-len 256 --gen-len 2048 --lora-rank 16 --set repeats=1 \
        --set '$TRITON' -o $RUN/out/sweep-more > $RUN/out/sweep-more.txt 2>&1"
    fi
    MERGE="python -c 'import glob, json; from qerl_cli.rollout.backends import load_table, merge_tables; \
t = merge_tables(load_table(None), *map(load_table, sorted(glob.glob(\"$RUN/out/*/crossover.json\")))); \
open(\"qerl_cli/rollout/crossover.json\", \"w\").write(json.dumps(t, indent=2))'"
    BEFORE="${BEFORE:+$BEFORE; }$MERGE"
    start "e2e-$NAME" "${BEFORE:+$BEFORE; }$(e2e_command "$NAME" "$FMT" "$BACKEND" "$PROMPTS" "$RECIPE")" ;;
  stop)  # stop a running part: stop NAME
    pkill -f "out/${2:?name}" ; sleep 3; pkill -9 -f "qerl_cli.bench.worker"
    rm -rf "$RUN/out/$2.rc" "$RUN/out/$2.log" "$RUN/out/$2"
    echo "stopped $2" ;;
  status)
    for f in "$RUN"/out/*.rc; do [ -f "$f" ] && echo "$(basename "$f" .rc): exit $(cat "$f")"; done
    for f in "$RUN"/out/*.log; do
      [ -f "$f" ] || continue
      [ -f "${f%.log}.rc" ] && continue
      echo "== running: $(basename "$f")"; tail -n "${LINES:-6}" "$f"
    done
    if [ -f "$RUN/out/sweep-more.txt" ] && [ ! -f "$RUN/out/sweep-more/bench.md" ]; then
      echo "== running first (BEFORE): sweep-more"; tail -n "${LINES:-6}" "$RUN/out/sweep-more.txt"
    fi
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    # Everything so far, as one file ($OUT brings back at most 8).
    [ -n "${OUT:-}" ] && tar czf "$OUT/dev-out.tgz" -C "$RUN" out
    true ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
