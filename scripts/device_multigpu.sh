#!/usr/bin/env bash
# Device check of data-parallel training (issue 13) on an nvidia-h200-x2 or -x4 machine: 3 GRPO steps of a
# random-weight Qwen2.5-7B-shaped NVFP4 checkpoint on 1 GPU, then with torchrun on every count in $GPUS
# (default: 1 2 4, those the machine has), and a tensor-parallel-2 vLLM rollout figure.
#   SCALING=weak (default): PROMPTS_PER_GPU (16) prompts per GPU, so the global batch grows with the GPUs
#                           (how data parallelism is used to go faster per sample);
#   SCALING=strong:         PROMPTS_PER_GPU x the largest count, the same global batch on every count.
# GEN_LEN (256 with vLLM, 32 with the HF engine) and STEPS (3) set the shape.
# Writes $OUT/multigpu.json (scripts/device_multigpu_report.py: step time, rollout tokens/s per GPU,
# scaling efficiency, TP=2 tokens/s) and each run's metrics and log; prints the JSON and exits 1 when a
# phase failed. Uses vLLM (colocated) when importable (see ../shared/tools/device-vllm/README.md: export
# PYTHONPATH=/tmp/vllm-site first), else the HF engine. Never run yet, so its duration is unknown: each
# phase has a 300 s timeout, so start it with setsid, write $OUT to /tmp, and poll.
set -euo pipefail
# NVLink multicast must stay off on the lent machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
work=${QERL_DEVICE_WORKDIR:-/tmp/qerl-multigpu}
out=${OUT:-$work/out}
mkdir -p "$work" "$out"
if python3 -c "import vllm" 2>/dev/null; then engine=vllm; gen_len=${GEN_LEN:-256}; else engine=hf; gen_len=${GEN_LEN:-32}; fi
have=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l || true)
gpus=""
for n in ${GPUS:-1 2 4}; do [ "$n" -le "$have" ] && gpus="$gpus $n"; done
if [ -z "$gpus" ]; then echo "no GPU count of '${GPUS:-1 2 4}' fits the $have GPU(s) here" >&2; exit 2; fi
scaling=${SCALING:-weak}
per_gpu=${PROMPTS_PER_GPU:-16}
largest=$(echo $gpus | tr ' ' '\n' | sort -n | tail -1)
echo "engine: $engine, completion length $gen_len, GPUs:$gpus of $have, $scaling scaling"

# 1. the checkpoint (random weights, NVFP4 compressed-tensors, qerl's byte-level tokenizer)
timeout 300 python3 - "$work" "$root/scripts" <<'PY'
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[2])
from device_vllm_grpo import write_checkpoint  # reuses the issue-6 writer (cached under $work)

path, seconds = write_checkpoint("qwen2.5-7b", "nvfp4", Path(sys.argv[1]))
print(f"checkpoint {path} in {seconds:.0f} s")
PY

cat > "$work/recipe.yaml" <<YAML
model: {path: $work/qwen2.5-7b-nvfp4, dtype: bfloat16}
lora: {rank: 16, alpha: 32}
rollout:
  engine: $engine
  num_generations: 4
  max_prompt_length: 256
  max_completion_length: $gen_len
  temperature: 1.0
  gpu_memory_utilization: 0.3
  max_lora_rank: 16
  generation_batch_size: 64
  vllm_kwargs: {attention_backend: TRITON_ATTN}
aqn: {enabled: true, num_stages: 3, sigma_start: 0.01, sigma_end: 0.005}
data: {dataset: synthetic-addition, max_samples: 256}
train: {max_steps: ${STEPS:-3}, prompts_per_step: 16, micro_batch_size: 8, learning_rate: 1.0e-5, seed: 0}
output: {save_steps: 0}
reward: {grader_workers: 2}
YAML

# 2. each GPU count with the same recipe; a failed run is reported, not fatal
statuses=()
for n in $gpus; do
  if [ "$scaling" = weak ]; then prompts=$((per_gpu * n)); else prompts=$((per_gpu * largest)); fi
  status=0
  rm -rf "$work/run-${n}gpu"  # an earlier run's metrics must not stand in for a failed one
  if [ "$n" = 1 ]; then  # the one-GPU baseline is plain `qerl train`, as a one-GPU user runs it
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m qerl_cli train "$work/recipe.yaml" \
      --set output.dir="$work/run-1gpu" --set train.prompts_per_step=$prompts > "$out/run-1gpu.log" 2>&1 || status=$?
  else
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout 300 torchrun --standalone --nproc-per-node "$n" \
      -m qerl_cli train "$work/recipe.yaml" --set output.dir="$work/run-${n}gpu" \
      --set train.prompts_per_step=$prompts > "$out/run-${n}gpu.log" 2>&1 || status=$?
  fi
  cp "$work/run-${n}gpu/metrics.jsonl" "$out/metrics-${n}gpu.jsonl" 2>/dev/null || true
  statuses+=(--status "$n=$status")
done

# 3. tensor-parallel-2 vLLM rollouts (no LoRA, no training): tokens/s of one engine over both GPUs
status3=skipped
if [ "$engine" = vllm ] && [ "$have" -ge 2 ]; then
  status3=0
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 - "$work" "$out/tp2.json" <<'PY' > "$out/tp2.log" 2>&1 || status3=$?
import json, sys, time
from pathlib import Path

from qerl_cli.rollout.base import SamplingSpec
from qerl_cli.rollout.vllm_engine import VLLMEngine

work, target = Path(sys.argv[1]), Path(sys.argv[2])
engine = VLLMEngine(work / "qwen2.5-7b-nvfp4", enable_lora=False, enable_sleep_mode=False,
                    gpu_memory_utilization=0.5, max_model_len=512, tensor_parallel_size=2,
                    vllm_kwargs={"attention_backend": "TRITON_ATTN"})
prompts = [f"What is {i} + {2 * i}?" for i in range(16)]
spec = SamplingSpec(max_new_tokens=128, temperature=1.0, top_p=1.0, seed=0, ignore_eos=True)
engine.generate(prompts, 4, spec)  # warm-up (CUDA graphs for this batch)
started = time.perf_counter()
result = engine.generate(prompts, 4, spec)
seconds = time.perf_counter() - started
report = {"tensor_parallel_size": 2, "prompts": 16, "n": 4, "gen_len": 128, "load_s": engine.load_seconds,
          "tokens": result.num_generated_tokens, "seconds": seconds,
          "tokens_per_s": result.num_generated_tokens / seconds,
          "tokens_per_s_per_gpu": result.num_generated_tokens / seconds / 2}
target.write_text(json.dumps(report, indent=2))
print(json.dumps(report))
engine.close()
PY
fi

# 4. the summary (exits 1 when a phase failed)
python3 "$root/scripts/device_multigpu_report.py" "$out" --gpus "$(echo $gpus | tr ' ' ',')" \
  --scaling "$scaling" --engine "$engine" "${statuses[@]}" --status "tp2=$status3"
