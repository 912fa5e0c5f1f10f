"""Device acceptance run for the vLLM rollout engine (issue 6): 3 GRPO steps on a 7B shape.

One format per invocation (each fits in ~9 minutes on one H200):

    python scripts/device_vllm_grpo.py --format nvfp4      # writes $OUT/vllm_grpo_nvfp4.json
    python scripts/device_vllm_grpo.py --format bf16       # writes $OUT/vllm_grpo_bf16.json
    python scripts/device_vllm_grpo.py --compare A.json B.json   # NVFP4 vs BF16 step speed-up (no GPU)

With the stripped vLLM bundle of ../shared/tools/device-vllm (see its README) export
``PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0`` first; this script defaults the
attention backend to TRITON_ATTN and keeps the engine in-process.

What it does, for a Qwen2.5-7B-shaped checkpoint with random weights (written by
``qerl_cli.modeling.random_checkpoint``; NVFP4 in compressed-tensors format, or BF16):

1. builds the trainer (policy = 4-bit base in QuantLinear + LoRA r16) and the colocated vLLM engine;
2. runs 3 GRPO steps (AQN on: stage 0 noise-free, then noisy), with per-phase seconds, rollout
   tokens/s, peak memory, memory freed by vLLM's sleep, perturbed-norm count, and a staleness check
   (vLLM vs trainer logprobs on a probe prompt) after every adapter sync;
3. times our wrapper against raw ``LLM.generate`` on the same prompts, batch and lengths (the
   wrapper's cost; target < 5%);
4. an adapter-effect control: random LoRA-B weights make the adapter matter, and vLLM with the
   adapter must match the trainer much more closely than vLLM without it (on random weights
   after 3 small updates the adapter barely moves logprobs, so the per-step gap alone proves little).

Rewards: the weights are random, so correctness is meaningless; a hash of each completion gives
0/1 rewards so that groups differ and every step runs a real update.

``--shape tiny --engine hf`` runs the same plumbing on a CPU (no vLLM figures) as a smoke test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("device_vllm_grpo")
GIB = 2**30


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--format", choices=["nvfp4", "bf16", "mxfp4", "nf4"], help="checkpoint format of this run"
    )
    p.add_argument(
        "--compare", nargs=2, metavar=("FP4_JSON", "BF16_JSON"), help="only compare two result files"
    )
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="generations per prompt")
    p.add_argument("--gen-len", type=int, default=512)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)  # the paper's 7B value
    p.add_argument("--attention-backend", default="TRITON_ATTN")
    p.add_argument("--ab-repeats", type=int, default=2, help="repeats of the wrapper vs raw vLLM timing")
    p.add_argument("--workdir", default=os.environ.get("QERL_DEVICE_WORKDIR", "/tmp/qerl-device"))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if not args.compare and not args.format:
        p.error("give --format (one run) or --compare A.json B.json")
    return args


def write_checkpoint(shape: str, fmt: str, workdir: Path) -> tuple[Path, float]:
    """A random-weight checkpoint of ``shape`` in ``fmt`` (reused when already written)."""
    target = workdir / f"{shape}-{fmt}"
    done = target / ".complete"
    started = time.perf_counter()
    if not done.is_file():
        if shape == "tiny" and fmt == "bf16":
            from qerl_cli.modeling.tiny import write_tiny_model

            write_tiny_model(target, seed=0)
        else:
            from qerl_cli.modeling.random_checkpoint import write_random_checkpoint
            from qerl_cli.modeling.tiny import build_tokenizer

            # Real shapes come without a tokenizer: qerl's byte-level one serves both the trainer
            # and vLLM (ids beyond its vocabulary decode to nothing, which is fine for random weights).
            tokenizer_dir = workdir / "tokenizer"
            build_tokenizer().save_pretrained(tokenizer_dir)
            device = "cuda" if torch.cuda.is_available() else "cpu"  # random draws + packing on the GPU
            write_random_checkpoint(target, shape, fmt, seed=0, device=device, tokenizer_from=tokenizer_dir)
        done.write_text("")
    return target, time.perf_counter() - started


def build_config(args: argparse.Namespace, model_path: Path, run_dir: Path) -> Any:
    from qerl_cli.config import TrainConfig, validate

    cfg = TrainConfig()
    cfg.model.path = str(model_path)
    cfg.lora.rank, cfg.lora.alpha = args.lora_rank, 2 * args.lora_rank
    r = cfg.rollout
    r.engine = args.engine
    r.num_generations = args.n
    r.max_prompt_length = 512
    r.max_completion_length = args.gen_len
    r.temperature, r.top_p = 1.0, 1.0
    r.gpu_memory_utilization = args.gpu_memory_utilization
    r.enable_sleep_mode = True
    r.max_lora_rank = args.lora_rank
    r.vllm_kwargs = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    # 3 stages over 3 steps: step 1 noise-free (only quantization noise), steps 2-3 with AQN.
    cfg.aqn.enabled, cfg.aqn.num_stages = True, max(2, min(args.steps, 10))
    cfg.aqn.sigma_start, cfg.aqn.sigma_end = 1e-2, 5e-3
    cfg.data.dataset, cfg.data.max_samples = "synthetic-addition", 512
    t = cfg.train
    t.max_steps, t.prompts_per_step, t.micro_batch_size = args.steps, args.prompts, 8
    t.learning_rate, t.seed = 1e-5, 0
    t.device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg.output.dir, cfg.output.save_steps = str(run_dir), 0
    validate(cfg)
    return cfg


def hash_reward(texts: list[str], problems: list[Any]) -> tuple[list[float], dict[str, float]]:
    rewards = [float(hashlib.sha256(t.encode()).digest()[0] & 1) for t in texts]
    return rewards, {"accuracy": sum(rewards) / max(len(rewards), 1)}


def gpu_used_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


class PhaseTimer:
    """Wraps engine methods so their seconds (and the device memory after them) are recorded."""

    def __init__(self, engine: Any, names: list[str]) -> None:
        self.events: list[dict[str, Any]] = []
        for name in names:
            method = getattr(engine, name, None)
            if method is not None:
                setattr(engine, name, self._wrap(name, method))

    def _wrap(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = method(*args, **kwargs)
            self.events.append(
                {"phase": name, "seconds": time.perf_counter() - started, "gpu_used_gib": gpu_used_gib()}
            )
            return result

        return timed

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last call (summed when a phase ran more than once)."""
        out: dict[str, float] = {}
        for event in self.events:
            out[f"time_{event['phase']}_s"] = out.get(f"time_{event['phase']}_s", 0.0) + event["seconds"]
            if event["gpu_used_gib"] is not None:
                out[f"gpu_used_after_{event['phase']}_gib"] = event["gpu_used_gib"]
        self.events.clear()
        return out


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------
def trainer_probe_logprobs(policy: Any, probe: list[int]) -> list[float]:
    """The policy's log p(probe[i] | probe[:i]) at temperature 1, adapter on, no noise."""
    model = policy.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = torch.tensor([probe], device=policy.device)
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    finally:
        model.train(was_training)
    return lp.cpu().tolist()


def staleness(trainer: Any, probe: list[int]) -> dict[str, float]:
    started = time.perf_counter()
    gap = trainer.engine.check_staleness(probe, lambda ids: trainer_probe_logprobs(trainer.policy, list(ids)))
    if gap is None:  # the HF engine shares the trainer's weights: nothing to check
        return {}
    return {"staleness_gap": gap, "time_staleness_check_s": time.perf_counter() - started}


def wrapper_vs_raw(trainer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Our generate() against raw LLM.generate on the same prompts, batch and lengths."""
    from qerl_cli.rollout.base import SamplingSpec

    engine = trainer.engine
    engine.wake_up()
    engine.set_norm_noise(trainer.cfg.aqn.sigma_start, seed=123)  # AQN on, as in a noisy step
    prompts = [trainer.prompts[p.id] for p in trainer.problems[: args.prompts]]
    spec = SamplingSpec(
        max_new_tokens=args.gen_len, temperature=1.0, top_p=1.0, top_k=-1, seed=7, ignore_eos=True
    )
    same_params = [engine.sampling_params(args.n, spec, spec.seed + i * args.n) for i in range(len(prompts))]
    from vllm import SamplingParams

    plain = SamplingParams(
        n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.gen_len, seed=7, ignore_eos=True
    )
    expected_tokens = len(prompts) * args.n * args.gen_len

    def ours() -> float:
        result = engine.generate(prompts, args.n, spec)
        assert result.num_generated_tokens == expected_tokens
        return result.stats["rollout/seconds"]

    def raw(params: Any) -> float:
        started = time.perf_counter()
        outputs = engine.llm.generate(prompts, params, lora_request=engine.lora_request, use_tqdm=False)
        seconds = time.perf_counter() - started
        assert sum(len(c.token_ids) for o in outputs for c in o.outputs) == expected_tokens
        return seconds

    ours()  # warm-up (CUDA graphs for this batch size, LoRA slot)
    times: dict[str, list[float]] = {"ours": [], "raw_same_params": [], "raw_no_logprobs": []}
    for _ in range(args.ab_repeats):  # interleaved so drift hits all three alike
        times["ours"].append(ours())
        times["raw_same_params"].append(raw(same_params))
        times["raw_no_logprobs"].append(raw(plain))
    best = {k: min(v) for k, v in times.items()}
    tps = {k: expected_tokens / v for k, v in best.items()}
    return {
        "batch_prompts": len(prompts),
        "n": args.n,
        "gen_len": args.gen_len,
        "tokens": expected_tokens,
        "seconds": times,
        "tokens_per_s": tps,
        "wrapper_overhead_vs_raw_same_params": best["ours"] / best["raw_same_params"] - 1.0,
        "wrapper_overhead_vs_raw_no_logprobs": best["ours"] / best["raw_no_logprobs"] - 1.0,
        "wrapper_overhead_ok": best["ours"] / best["raw_same_params"] - 1.0 < 0.05,
    }


def adapter_effect_control(trainer: Any, probe: list[int]) -> dict[str, float]:
    """Random LoRA-B weights (trainer side), synced to vLLM: vLLM with the adapter must sit much
    closer to the trainer than vLLM without it."""
    engine = trainer.engine
    generator = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.policy.model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator).to(param))
    trainer._sync_engine()
    engine.wake_up()
    engine.set_norm_noise(0.0, seed=0)
    trainer_lp = trainer_probe_logprobs(trainer.policy, probe)
    with_adapter = engine.prompt_logprobs(probe)
    without = engine.prompt_logprobs(probe, with_adapter=False)

    def gap(a: list[float], b: list[float]) -> float:
        return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)

    result = {
        "gap_vllm_adapter_vs_trainer": gap(with_adapter, trainer_lp),
        "gap_vllm_base_vs_trainer": gap(without, trainer_lp),
        "adapter_effect_in_vllm": gap(with_adapter, without),
    }
    result["adapter_served"] = float(
        result["gap_vllm_adapter_vs_trainer"] < 0.25 * result["gap_vllm_base_vs_trainer"]
    )
    return result


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from qerl_cli.rl.trainer import Trainer

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "compare"}
    report: dict[str, Any] = {
        "format": args.format,
        "shape": args.shape,
        "engine": args.engine,
        "settings": settings,
    }
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
        report["gpu_total_gib"] = torch.cuda.mem_get_info()[1] / GIB
    model_path, report["time_write_checkpoint_s"] = write_checkpoint(args.shape, args.format, workdir)
    cfg = build_config(args, model_path, workdir / f"run-{args.format}")

    started = time.perf_counter()
    trainer = Trainer(cfg, reward_fn=hash_reward)
    report["time_build_trainer_and_engine_s"] = time.perf_counter() - started
    report["policy_base_format"] = trainer.policy.base_format
    engine = trainer.engine
    report["vllm_load_s"] = getattr(engine, "load_seconds", None)
    report["vllm_kwargs"] = {k: repr(v) for k, v in getattr(engine, "llm_kwargs", {}).items()}
    report["gpu_used_after_build_gib"] = gpu_used_gib()
    timer = PhaseTimer(engine, ["wake_up", "sleep", "sync_policy", "sync_adapter", "set_norm_noise"])
    probe = list(trainer.policy.tokenizer(trainer.prompts[trainer.problems[0].id])["input_ids"])[:128]
    report["initial"] = staleness(trainer, probe)  # the adapter as synced at start-up (LoRA B = 0)

    steps = []
    for _ in range(args.steps):
        record = trainer.train_step()
        record.update(timer.take())
        record.update(staleness(trainer, probe))  # wakes vLLM, activating the adapter synced asleep
        record.update({f"engine_{k.split('/')[-1]}": v for k, v in engine.stats().items()})
        steps.append({k: v for k, v in record.items() if isinstance(v, int | float | str)})
        log.info("step %s: %s", record["step"], json.dumps(steps[-1], default=str))
    report["steps"] = steps
    report["step_seconds"] = [s["time_step_s"] for s in steps]
    # Step 1 includes one-off warm-up (CUDA graphs for new batch shapes, kernel autotuning).
    report["step_seconds_mean_after_first"] = statistics.mean(
        report["step_seconds"][1:] or report["step_seconds"]
    )

    if args.engine == "vllm":
        report["wrapper_vs_raw"] = wrapper_vs_raw(trainer, args)
        report["adapter_effect_control"] = adapter_effect_control(trainer, probe)
        engine.sleep()
        report["sleep_freed_gib"] = (engine.last_sleep_freed_bytes or 0) / GIB
    if torch.cuda.is_available():
        report["peak_torch_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    return report


def compare(fp4_file: str, bf16_file: str) -> dict[str, Any]:
    fp4, bf16 = (json.loads(Path(f).read_text()) for f in (fp4_file, bf16_file))
    keys = ["time_rollout_s", "time_update_s", "time_step_s", "rollout_tokens_per_s"]

    def mean_after_first(report: dict[str, Any], key: str) -> float:
        values = [s[key] for s in report["steps"] if key in s]
        return statistics.mean(values[1:] or values)

    out: dict[str, Any] = {"formats": [fp4["format"], bf16["format"]]}
    for key in keys:
        out[key] = {fp4["format"]: mean_after_first(fp4, key), bf16["format"]: mean_after_first(bf16, key)}
    out["step_speedup"] = out["time_step_s"][bf16["format"]] / out["time_step_s"][fp4["format"]]
    out["rollout_speedup"] = out["time_rollout_s"][bf16["format"]] / out["time_rollout_s"][fp4["format"]]
    out["paper_step_speedup_range"] = [1.2, 1.5]
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.compare:
        result = compare(*args.compare)
        target = out_dir / "vllm_grpo_compare.json"
    else:
        result = run(args)
        target = out_dir / f"vllm_grpo_{args.format}.json"
    target.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
