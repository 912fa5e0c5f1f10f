"""``qerl demo``: the whole QeRL pipeline on a tiny model, offline, on a CPU, in a few minutes.

1. **Base model.** A tiny Qwen2 (about half a million parameters, built in code) gets a short supervised warm
   start on synthetic additions, standing in for pretraining: clean worked problems until it
   solves most of them, then worked problems of which many hold a small slip (off by 1 or 2), so
   the base model answers correctly only part of the time. (A random model never answers
   correctly, and RL needs some reward to amplify.)
2. **Quantize** it to NVFP4 (compressed-tensors layout, the format vLLM serves).
3. **Evaluate** it on held-out problems (operand pairs never seen in training).
4. **Train** LoRA adapters on the frozen NVFP4 base with GRPO + Adaptive Quantization Noise
   (``recipes/tiny.yaml``'s settings).
5. **Evaluate** again with the adapter, print a summary and write the training-curve plot.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qerl_cli.config import EvalConfig, TrainConfig, load_config
from qerl_cli.errors import QerlError
from qerl_cli.evaluation import run_eval
from qerl_cli.files import ensure_output_dir
from qerl_cli.rl import warmstart
from qerl_cli.rl.run_folder import run_entries
from qerl_cli.rl.trainer import train

DEMO_TASK = "synthetic-addition"
EVAL_SAMPLES = 4  # temperature-1 samples per held-out problem
# What the demo writes into its folder; a folder holding only these (or nothing) is an earlier demo's.
DEMO_ENTRIES = ("base", "eval_before", "train", "eval_after")


def check_demo_folder(out_dir: str | Path) -> None:
    """Refuse an output folder that holds something other than an earlier demo's output (a ``qerl train``
    run's folder above all, whose files the demo's base/, train/ and eval_* would be mixed into), before
    anything is written. A new or empty folder, or an earlier demo's, is fine: the demo runs over it."""
    out = Path(out_dir)
    if not out.is_dir():
        return  # not there yet, or a file: ensure_output_dir names that
    foreign = sorted(
        p.name for p in out.iterdir() if p.name not in DEMO_ENTRIES and not p.name.startswith(".")
    )
    if not foreign:
        return
    run = run_entries(out)  # the run-folder check `qerl train` makes, so a run is named as train names it
    what = (
        "a training run (" + ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in run)) + ")"
        if run
        else f"{', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}, which is not the demo's"
    )
    raise QerlError(
        f"--output {out} already holds {what}; nothing was changed. The demo writes "
        f"{', '.join(e + '/' for e in DEMO_ENTRIES)} into its folder and would mix them into these: give it "
        "a fresh folder (-o runs/demo, the default) or an earlier demo's own"
    )


def demo_train_config(model_path: str | Path, out_dir: str | Path, *, steps: int, seed: int) -> TrainConfig:
    """The shipped ``tiny`` recipe's settings, in code, with the demo's model and output folder."""
    overrides = [
        f"model.path={model_path}",
        "model.dtype=float32",
        "lora.rank=16",
        "lora.alpha=32",
        "rollout.engine=hf",
        "rollout.num_generations=8",
        "rollout.max_prompt_length=64",
        "rollout.max_completion_length=48",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.generation_batch_size=128",
        "algorithm.name=grpo",
        "algorithm.loss_type=grpo",
        "algorithm.beta=0.0",
        "algorithm.tis=auto",
        "algorithm.mask_truncated=true",
        "aqn.enabled=true",
        "aqn.schedule=exponential",
        "aqn.num_stages=10",
        "aqn.sigma_start=1e-2",
        "aqn.sigma_end=1e-4",
        f"data.dataset={DEMO_TASK}",
        "data.template=plain",
        "reward.correctness_weight=1.0",
        "reward.format_weight=0.0",
        "reward.grader_workers=1",
        "train.learning_rate=2e-3",
        f"train.max_steps={steps}",
        "train.prompts_per_step=16",
        "train.micro_batch_size=32",
        "train.gradient_checkpointing=false",
        f"train.seed={seed}",
        "train.device=cpu",
        f"output.dir={out_dir}",
        f"output.save_steps={steps}",
        "output.save_total_limit=1",
    ]
    return load_config(TrainConfig, None, overrides)


def evaluate(
    model_path: Path, adapter: Path | None, out_dir: Path, *, seed: int, samples: int = EVAL_SAMPLES
) -> dict[str, float]:
    """``qerl eval`` on every held-out problem of the demo task: sampled (temperature 1, ``samples``
    each) and greedy pass@1, with the adapter applied when given."""

    def pass_at_1(name: str, temperature: float, n: int) -> float:
        cfg = load_config(
            EvalConfig,
            None,
            model=str(model_path),
            adapter=str(adapter) if adapter else None,
            benchmarks=[DEMO_TASK],
            samples=n,
            engine="hf",
            output=str(out_dir / name),
            temperature=temperature,
            top_p=1.0,
            max_new_tokens=48,
            seed=seed,
            template="plain",
            grader_workers=1,
            device="cpu",
            dtype="float32",
            generation_batch_size=256,
        )
        results = run_eval(cfg, log=lambda _message: None)
        return float(results.benchmarks[DEMO_TASK].metrics.pass_at_1)

    return {
        "sampled_accuracy": pass_at_1("sampled", 1.0, samples),
        "greedy_accuracy": pass_at_1("greedy", 0.0, 1),
    }


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _tiny_nvfp4_base(out: Path, seed: int, console: Any) -> tuple[dict[str, Any], Path]:
    """Steps 1 and 2: the warm-started tiny base and its NVFP4 copy; returns the warm start's figures and
    the NVFP4 folder."""
    console.print("[bold]1/5[/bold] building the tiny base model (supervised warm start) ...")
    base = warmstart.prepare_tiny_base(  # through the module: the slow test hands it a prebuilt base
        out / "base",
        warmstart.WarmStartConfig(task=DEMO_TASK, seed=seed),
        formats=("nvfp4",),
        report=lambda line: console.print(f"    {line}", markup=False, highlight=False),
    )
    ws = base["warm_start"]
    console.print(
        f"    warm start, standing in for pretraining: {ws['clean_steps']} supervised steps on worked "
        f"additions (probe accuracy {ws['clean_accuracy']:.0%}), then {ws['noisy_steps_run']} steps on "
        f"worked additions of which {ws['label_noise']:.0%} carry a slip of 1 or 2. The base model now "
        f"answers {ws['final_accuracy']:.0%} of its probe problems correctly at temperature 1."
    )
    bf16_dir, nvfp4_dir = out / "base" / "bf16", Path(base["paths"]["nvfp4"])
    console.print(
        f"[bold]2/5[/bold] quantized to NVFP4: {escape(str(nvfp4_dir))} "
        f"({_folder_bytes(bf16_dir) / 1e6:.2f} MB BF16 -> {_folder_bytes(nvfp4_dir) / 1e6:.2f} MB; "
        "embeddings and lm_head stay BF16)"
    )
    return ws, nvfp4_dir


def _print_outcome(console: Any, before: dict, after: dict, result: Any, seconds: float) -> None:
    """The before / after table and where the run's files are."""
    table = Table(title="qerl demo: NVFP4 tiny Qwen2, GRPO + AQN on synthetic addition")
    table.add_column("")
    table.add_column("before RL", justify="right")
    table.add_column("after RL", justify="right")
    table.add_row(
        "held-out accuracy, sampled (T=1)",
        f"{before['sampled_accuracy']:.1%}",
        f"{after['sampled_accuracy']:.1%}",
    )
    table.add_row(
        "held-out accuracy, greedy", f"{before['greedy_accuracy']:.1%}", f"{after['greedy_accuracy']:.1%}"
    )
    table.add_row(
        f"training reward (first / last {result.reward_window_label})",
        f"{result.reward_first10:.3f}",
        f"{result.reward_last10:.3f}",
    )
    console.print(table)
    console.print(f"adapter: {result.adapter}", markup=False)
    console.print(f"metrics: {Path(result.output_dir) / 'metrics.jsonl'}", markup=False)
    console.print(f"plot:    {result.plot or 'skipped (pip install matplotlib)'}", markup=False)
    console.print(f"done in {seconds:.0f} s")


def run_demo(
    out_dir: str | Path = "runs/demo", *, steps: int = 60, seed: int = 0, console: Any = None
) -> dict:
    """Run the demo into ``out_dir``; returns the figures it prints."""
    console = console or Console()
    # A folder that cannot be written, or holds another run, fails now, not after minutes of work.
    check_demo_folder(out_dir)
    out = ensure_output_dir(out_dir, "--output")
    start = time.perf_counter()
    # A heading line, not a rule: a rule spans the console's width, which is wide when piped.
    console.print("[bold]qerl demo[/bold]: tiny Qwen2 -> NVFP4 -> GRPO + AQN, offline on the CPU")
    ws, nvfp4_dir = _tiny_nvfp4_base(out, seed, console)

    console.print("[bold]3/5[/bold] qerl eval of the NVFP4 base on held-out problems ...")
    before = evaluate(nvfp4_dir, None, out / "eval_before", seed=seed)

    console.print(f"[bold]4/5[/bold] training LoRA on the NVFP4 base: GRPO + AQN, {steps} steps ...")
    cfg = demo_train_config(nvfp4_dir, out / "train", steps=steps, seed=seed)
    result = train(cfg, overwrite=True)  # the demo's own folder: a re-run replaces its last training

    console.print("[bold]5/5[/bold] qerl eval of the trained adapter on the same held-out problems ...")
    after = evaluate(nvfp4_dir, Path(result.adapter), out / "eval_after", seed=seed)
    seconds = time.perf_counter() - start
    _print_outcome(console, before, after, result, seconds)
    return {
        "output_dir": str(out),
        "warm_start": ws,
        "before": before,
        "after": after,
        "reward_first10": result.reward_first10,
        "reward_last10": result.reward_last10,
        "adapter": result.adapter,
        "plot": result.plot,
        "seconds": seconds,
    }
