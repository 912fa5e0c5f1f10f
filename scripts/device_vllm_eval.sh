#!/usr/bin/env bash
# Device check of `qerl eval --engine vllm` with an adapter (real vLLM; see
# ../shared/tools/device-vllm/README.md for the install and PYTHONPATH): the tiny model in NVFP4, a
# random LoRA adapter, the held-out synthetic-addition problems, with and without the adapter.
# The two sample files must differ: the adapter is applied through a LoRARequest.
set -euo pipefail
work=${1:-/tmp/qerl-vllm-eval}
out=${OUT:-$work}
python3 - "$work" <<'PY'
import sys
from pathlib import Path

from qerl_cli.bench.adapter import write_random_lora
from qerl_cli.modeling.random_checkpoint import write_random_checkpoint

work = Path(sys.argv[1])
model = write_random_checkpoint(work / "tiny-nvfp4", shape="tiny", fmt="nvfp4", seed=0)
write_random_lora(model, work / "adapter", rank=16, seed=0)
PY
common=(--benchmarks synthetic-addition --engine vllm --samples 4 --max-new-tokens 32 --max-problems 16
        --set 'vllm_kwargs={attention_backend: TRITON_ATTN}' --set template=plain)
python3 -m qerl_cli.cli eval "$work/tiny-nvfp4" "${common[@]}" --output "$out/eval_base"
python3 -m qerl_cli.cli eval "$work/tiny-nvfp4" --adapter "$work/adapter" "${common[@]}" --output "$out/eval_lora"
if cmp -s "$out/eval_base/samples_synthetic-addition.jsonl" "$out/eval_lora/samples_synthetic-addition.jsonl"; then
  echo "FAIL: the adapter changed nothing"; exit 1
fi
echo "ok: the adapter changes vLLM's samples"
