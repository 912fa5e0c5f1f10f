#!/usr/bin/env bash
# SmolLM2-135M-Instruct on one H200 (HF engine; torch + transformers + peft there, no vLLM, no Hub):
#   (a) qerl compare: bf16-lora, nvfp4-lora, nvfp4-aqn x 3 seeds, the 9 runs as parallel processes
#   (b) rollout entropy of BF16 vs NVFP4 (RTN) SmolLM2 on the same prompts, before any training
#   (c) the quantization quality table (scripts/quant_quality.py; the bundle carries llm-compressor for AWQ)
# Prepare here first: bash scripts/device_smollm2_bundle.sh, then three device calls back to back:
#   1. command: mkdir -p /tmp/smol && cp .smol/p1/* /tmp/smol/          carry: [".smol/p1"]
#   2. command: cp .smol/p2/* /tmp/smol/                                carry: [".smol/p2"]
#   3. command: cp -r .smol/p3/* /tmp/smol/ && bash scripts/device_smollm2.sh   carry: [".smol/p3"]
# (detached, from a copy, so later device calls cannot change the code it runs: cp -r qerl_cli scripts
# /tmp/smol-repo/ && cd /tmp/smol-repo && (setsid bash scripts/device_smollm2.sh > /tmp/smol.log 2>&1 &))
# Knobs (env): ARMS (bf16-lora,nvfp4-lora,nvfp4-aqn), STEPS (default 30), SEEDS (3), JOBS (9), HELDOUT (128),
# SITE (/tmp/smol-site), COMPARE_ONLY=1 (skip (b) and (c)), COMPARE_SETS (more --set for
# compare, e.g. "--set compare.base_method=awq" for AWQ NVFP4 bases). Writes at most 8 files to $OUT:
# compare.json/.md/.png, entropy.json, quant_quality.json/.md, summary.txt, runs.tar.gz.
set -uo pipefail
start=$(date +%s)
out=${OUT:-/tmp/qerl-smol-out}; work=/tmp/qerl-smol; mkdir -p "$out" "$work"
steps=${STEPS:-30}; seeds=${SEEDS:-3}; jobs=${JOBS:-9}; heldout=${HELDOUT:-128}
smol=${SMOL_DIR:-/tmp/smol}
# Its own site folder: the bundle pins llm-compressor's compressed-tensors, which must not reach a vLLM
# job sharing the machine (scripts/device_gemma_ablation.sh uses /tmp/site and /tmp/vllm-site).
site=${SITE:-/tmp/smol-site}
if [ -d "$smol/whl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$smol"/whl/*.whl || exit 1
  export PYTHONPATH=$site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} QERL_CACHE_DIR=$work/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Four torch threads for this script's own processes (compare's parent, entropy, quality): three jobs at 16
# threads each on the 16 cores spent minutes on a 3-second RTN write (2026-11-23; likely oversubscription);
# compare gives each of its runs its own share.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
mkdir -p "$QERL_CACHE_DIR"
gguf=$QERL_CACHE_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ]; then
  cat "$smol"/gguf.part-* > "$gguf"
  [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$(cat "$smol/gguf.sha256")" ] || { echo "GGUF parts do not match"; exit 1; }
fi
log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$out/summary.txt"; }
python3 -m qerl_cli.cli models | tee -a "$out/summary.txt"
python3 -c "from qerl_cli.modeling.sources import resolve_model_source as r; print(r('smollm2-135m-instruct'))" || exit 1
log "GGUF converted"

# (a) the ablation, in the background: 9 processes on the one GPU
python3 -m qerl_cli.cli compare recipes/smollm2_wordproblems.yaml --arms "${ARMS:-bf16-lora,nvfp4-lora,nvfp4-aqn}" \
  --seeds "$seeds" --jobs "$jobs" --output "$work/compare" --set train.max_steps="$steps" \
  --set output.save_steps=10 --set train.device=cuda --set compare.heldout_problems="$heldout" ${COMPARE_SETS:-} \
  > "$work/compare.log" 2>&1 &
compare_pid=$!

if [ "${COMPARE_ONLY:-0}" != 1 ]; then
# (b) entropy before training, BF16 vs NVFP4 (the same RTN base the ablation uses, made here too)
python3 - "$work" "$out/entropy.json" <<'PY' > "$work/entropy.log" 2>&1
import json, sys
from pathlib import Path
from qerl_cli.compare.entropy import rollout_entropy
from qerl_cli.data.prompts import render_prompt
from qerl_cli.data.synthetic import make_problems
from qerl_cli.modeling.sources import resolve_model_source
from qerl_cli.quantize.native import write_rtn_checkpoint
from qerl_cli.modeling.loading import load_tokenizer
work, target = Path(sys.argv[1]), sys.argv[2]
bf16 = resolve_model_source("smollm2-135m-instruct")
nvfp4 = str(write_rtn_checkpoint(bf16, work / "entropy-nvfp4", "nvfp4"))
tok = load_tokenizer(bf16)
from qerl_cli.config import TrainConfig, load_config
data = load_config(TrainConfig, "recipes/smollm2_wordproblems.yaml").data  # the recipe's own prompt
prompts = [render_prompt(p.question, tok, template=data.template, system_prompt=data.system_prompt)
           for p in make_problems("synthetic-wordproblems", "test", n=64)]
rows = {name: rollout_entropy(path, prompts, 8, 128, seed=0, device="cuda") for name, path in (("bf16", bf16), ("nvfp4", nvfp4))}
rows["prompts"] = len(prompts); rows["samples_per_prompt"] = 8; rows["max_new_tokens"] = 128
from qerl_cli.torch_utils import device_label
rows["temperature"] = 1.0; rows["device"] = device_label("cuda")
Path(target).write_text(json.dumps(rows, indent=2))
print(json.dumps({k: {m: v[m] for m in ("sampled_entropy", "exact_entropy", "mean_length")} for k, v in rows.items() if isinstance(v, dict)}, indent=2))
PY
log "entropy done (rc $?)"; cat "$work/entropy.log" | tail -n 20 | tee -a "$out/summary.txt"

# (c) quantization quality (every row through qerl quantize; a row that fails is recorded, not fatal)
python3 scripts/quant_quality.py smollm2-135m-instruct --out "$work/quality" --device cuda > "$work/quality.log" 2>&1
log "quality done (rc $?)"; cp "$work"/quality/quant_quality.{json,md} "$out"/ 2>/dev/null; cat "$out/quant_quality.md" >> "$out/summary.txt"
fi

wait $compare_pid; rc=$?
log "compare done (rc $rc)"
tail -n 30 "$work/compare.log" >> "$out/summary.txt"
cp "$work"/compare/compare.{json,md,png} "$out"/ 2>/dev/null
# Everything else small (metrics, configs, eval results, logs), no weights or checkpoints.
tar -czf "$out/runs.tar.gz" -C "$work" --exclude='*.safetensors' --exclude='*.pt' --exclude='checkpoint-*' \
  --exclude=cache --exclude='bases' --exclude='entropy-nvfp4' --exclude='quality/*-*' compare quality compare.log entropy.log quality.log 2>/dev/null
log "total wall time"
cat "$out/compare.md" 2>/dev/null
tail -n 12 "$out/summary.txt"
