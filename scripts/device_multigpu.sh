#!/usr/bin/env bash
# Device check of data-parallel training (issue 13) on the nvidia-h200-x2 machine: 3 GRPO steps of a
# random-weight Qwen2.5-7B-shaped NVFP4 checkpoint on 1 GPU, then on 2 GPUs with torchrun, with the same
# global batch (16 prompts x 4 completions), and a tensor-parallel-2 vLLM rollout figure.
# Writes $OUT/multigpu.json (step time, rollout tokens/s per GPU, scaling efficiency, TP=2 tokens/s) and
# the runs' metrics.jsonl files; prints the JSON. Uses vLLM (colocated) when importable (see
# ../shared/tools/device-vllm/README.md: export PYTHONPATH=/tmp/vllm-site first), else the HF engine with
# shorter completions. Never run yet, so its duration is unknown: the phases' timeouts add up to 650 s,
# over one device command's 600 s, so start it with setsid, write $OUT to /tmp, and poll.
set -euo pipefail
# NVLink multicast must stay off on the lent machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
work=${QERL_DEVICE_WORKDIR:-/tmp/qerl-multigpu}
out=${OUT:-$work/out}
mkdir -p "$work" "$out"
if python3 -c "import vllm" 2>/dev/null; then engine=vllm; gen_len=128; else engine=hf; gen_len=32; fi
echo "engine: $engine, completion length $gen_len"

# 1. the checkpoint (random weights, NVFP4 compressed-tensors, qerl's byte-level tokenizer)
timeout 180 python3 - "$work" "$root/scripts" <<'PY'
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
train: {max_steps: 3, prompts_per_step: 16, micro_batch_size: 8, learning_rate: 1.0e-5, seed: 0}
output: {save_steps: 0}
reward: {grader_workers: 2}
YAML

# 2. one GPU, then two (same recipe, same global batch); a failed phase is reported, not fatal
status1=0; status2=0
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m qerl_cli train "$work/recipe.yaml" \
  --set output.dir="$work/run-1gpu" > "$out/run-1gpu.log" 2>&1 || status1=$?
timeout 170 torchrun --standalone --nproc-per-node 2 -m qerl_cli train "$work/recipe.yaml" \
  --set output.dir="$work/run-2gpu" > "$out/run-2gpu.log" 2>&1 || status2=$?
cp "$work/run-1gpu/metrics.jsonl" "$out/metrics-1gpu.jsonl" 2>/dev/null || true
cp "$work/run-2gpu/metrics.jsonl" "$out/metrics-2gpu.jsonl" 2>/dev/null || true

# 3. tensor-parallel-2 vLLM rollouts (no LoRA, no training): tokens/s of one engine over both GPUs
status3=skipped
if [ "$engine" = vllm ]; then
  status3=0
  timeout 150 python3 - "$work" "$out/tp2.json" <<'PY' > "$out/tp2.log" 2>&1 || status3=$?
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

# 4. the summary
python3 - "$out" "$engine" "$status1" "$status2" "$status3" <<'PY'
import json, statistics, sys
from pathlib import Path

out, engine, s1, s2, s3 = Path(sys.argv[1]), sys.argv[2], *sys.argv[3:]

def summary(name: str, gpus: int) -> dict:
    path = out / f"metrics-{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    if not rows:
        return {"gpus": gpus, "steps": 0}
    timed = rows[1:] or rows  # step 1 holds one-off warm-up (CUDA graphs, autotuning)
    mean = lambda key: statistics.mean(float(r.get(key, 0.0)) for r in timed)  # noqa: E731
    rollout_tps = mean("rollout_tokens") / max(mean("time_rollout_s"), 1e-9)
    return {"gpus": gpus, "steps": len(rows), "world_size": rows[-1].get("world_size"),
            "step_s": mean("time_step_s"), "rollout_s": mean("time_rollout_s"), "update_s": mean("time_update_s"),
            "rollout_tokens_per_step": mean("rollout_tokens"), "rollout_tokens_per_s": rollout_tps,
            "rollout_tokens_per_s_per_gpu": rollout_tps / gpus,
            "device_peak_used_gib": max(float(r.get("memory/device_peak_used_gib", 0.0)) for r in rows)}

one, two = summary("1gpu", 1), summary("2gpu", 2)
report = {"engine": engine, "shape": "qwen2.5-7b", "format": "nvfp4", "global_batch": "16 prompts x 4",
          "exit_status": {"1gpu": s1, "2gpu": s2, "tp2": s3}, "one_gpu": one, "two_gpus": two}
if one.get("step_s") and two.get("step_s"):
    report["speedup_2gpu"] = one["step_s"] / two["step_s"]
    report["scaling_efficiency_2gpu"] = report["speedup_2gpu"] / 2
tp2 = out / "tp2.json"
if tp2.is_file():
    report["tp2_rollout"] = json.loads(tp2.read_text())
(out / "multigpu.json").write_text(json.dumps(report, indent=2))
print(json.dumps(report, indent=2))
PY
