#!/usr/bin/env bash
# Completions of SmolLM2-135M-Instruct to regrade (issue 22): no run of
# benchmarks/smollm2-h200-2026-11-23 kept its completions, and generating them on a shared 2-core CPU
# did not finish in an hour. On one GPU (HF engine, the recipe's prompt) this writes, in seconds:
#   greedy/samples_synthetic-wordproblems.jsonl   128 held-out problems, greedy, 128 tokens (compare's eval)
#   sampled/samples_synthetic-wordproblems.jsonl  64 problems x 8 at temperature 0.7 (the rollouts' setting)
# Prepare and carry as for scripts/device_smollm2.sh (bash scripts/device_smollm2_bundle.sh, then the three
# calls its header lists, the last running this script instead).
# Then, here (where git holds the old grader):
#   python scripts/regrade_samples.py FILES_AT/greedy FILES_AT/sampled --old-rev b8cf92e --output regrade.json
set -uo pipefail
out=${OUT:-/tmp/qerl-regrade-out}; work=/tmp/qerl-smol; mkdir -p "$out" "$work"
smol=${SMOL_DIR:-/tmp/smol}
if [ -d "$smol/whl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$smol"/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} QERL_CACHE_DIR=$work/cache PYTHONUNBUFFERED=1
mkdir -p "$QERL_CACHE_DIR"
gguf=$QERL_CACHE_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ]; then
  cat "$smol"/gguf.part-* > "$gguf"
  [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$(cat "$smol/gguf.sha256")" ] || { echo "GGUF parts do not match"; exit 1; }
fi
system='"Solve the math word problem. Show the sum, then end with: The answer is N."'
common=(smollm2-135m-instruct --engine hf --benchmarks synthetic-wordproblems --max-new-tokens 128
        --set template=plain --set "system_prompt=$system" --set top_p=1.0 --set device=cuda)
python3 -m qerl_cli.cli eval "${common[@]}" --samples 1 --max-problems 128 -o "$out/greedy" --set temperature=0.0
python3 -m qerl_cli.cli eval "${common[@]}" --samples 8 --max-problems 64 -o "$out/sampled" --set temperature=0.7
ls -la "$out"/*/
