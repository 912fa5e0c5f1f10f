"""The stage commands: parse the arguments, load the typed config, call the library, render.

Stage code is imported inside each command so `qerl --help` and `qerl env` stay fast and work
without the optional extras (vLLM, llm-compressor).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from qerl_cli import config as cfg
from qerl_cli.cli import render
from qerl_cli.cli.app import (
    ConfigOption,
    DryRunOption,
    SetOption,
    console,
    csv,
    finish_config,
    pairs,
    positive_ints,
    use_free_cpu_threads,
)
from qerl_cli.errors import QerlError


def quantize(
    model: Annotated[str, typer.Argument(help="Hub id or local folder of a BF16 model.")],
    format: Annotated[str | None, typer.Option("--format", "-f", help="nvfp4 | mxfp4 | nf4")] = None,
    method: Annotated[str | None, typer.Option(help="awq (calibrated, default) | rtn")] = None,
    calib: Annotated[
        str | None, typer.Option(help="Calibration dataset: hub id, .jsonl or .parquet.")
    ] = None,
    calib_field: Annotated[str | None, typer.Option(help="Field with chat messages or text.")] = None,
    calib_split: Annotated[str | None, typer.Option(help="Split of a hub calibration dataset.")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda")] = None,
    num_samples: Annotated[int | None, typer.Option(help="Calibration samples (default 256).")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per calibration sample (default 2048).")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Default ./<model>-<FORMAT>.")] = None,
    overwrite: Annotated[bool | None, typer.Option("--overwrite", help="Replace an existing output.")] = None,
    skip_incompatible: Annotated[
        bool | None, typer.Option("--skip-incompatible", help="Leave layers the format can't tile in BF16.")
    ] = None,
    eval_ppl: Annotated[bool | None, typer.Option("--eval-ppl", help="Perplexity BF16 vs 4-bit.")] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    dry_run: DryRunOption = False,
) -> None:
    """Quantize a model to NVFP4 / MXFP4 (compressed-tensors, AWQ) or NF4 (bitsandbytes)."""
    conf = cfg.load_config(
        cfg.QuantizeConfig,
        config,
        set_,
        model=model,
        format=format,
        method=method,
        calib=calib,
        calib_field=calib_field,
        calib_split=calib_split,
        device=device,
        num_samples=num_samples,
        seq_len=seq_len,
        output=output,
        overwrite=overwrite,
        skip_incompatible=skip_incompatible,
        eval_ppl=eval_ppl,
    )
    if finish_config(conf, dry_run):
        return
    from qerl_cli.quantize import quantize_table, run_quantize

    console.print(quantize_table(run_quantize(conf)))


def train(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML (see recipes/).")],
    set_: SetOption = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            help="Continue from the last complete checkpoint in DIR ('auto': the recipe's output dir).",
        ),
    ] = None,
    dry_run: DryRunOption = False,
) -> None:
    """GRPO / DAPO on LoRA adapters over a frozen 4-bit (or BF16) base, with AQN.

    On N GPUs: torchrun --nproc-per-node N -m qerl_cli train RECIPE.yaml (data parallel).
    """
    conf = cfg.load_config(cfg.TrainConfig, recipe, set_)
    if finish_config(conf, dry_run):
        return
    from qerl_cli.rl.trainer import train as run_train
    from qerl_cli.torch_utils import runs_on_cpu

    if runs_on_cpu(conf.train.device):
        use_free_cpu_threads()
    result = run_train(
        conf, resume=None if resume is None else (conf.output.dir if resume == "auto" else resume)
    )
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank returns the same summary
        console.print(render.train_summary(result))


def eval_(
    model: Annotated[str | None, typer.Argument(help="Hub id or local folder (BF16 or qerl 4-bit).")] = None,
    adapter: Annotated[str | None, typer.Option(help="LoRA adapter folder (PEFT format).")] = None,
    benchmarks: Annotated[
        str | None, typer.Option(help="Comma list: gsm8k,math500,aime24,aime25,amc23")
    ] = None,
    samples: Annotated[int | None, typer.Option(help="Samples per problem (default per benchmark).")] = None,
    engine: Annotated[str | None, typer.Option(help="vllm | hf")] = None,
    data_file: Annotated[
        list[str] | None, typer.Option("--data-file", help="BENCH=PATH local data file (repeatable).")
    ] = None,
    output: Annotated[str | None, typer.Option("--output", "-o")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Default 4096.")] = None,
    max_problems: Annotated[int | None, typer.Option(help="Evaluate only the first N problems.")] = None,
    rescore: Annotated[str | None, typer.Option(help="Re-grade the samples saved in DIR.")] = None,
    baseline: Annotated[str | None, typer.Option(help="results.json to compare against, paired.")] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    dry_run: DryRunOption = False,
) -> None:
    """Pass@1 on GSM8K, MATH500, AIME24/25, AMC23, graded with math-verify."""
    conf = cfg.load_config(
        cfg.EvalConfig,
        config,
        set_,
        model=model,
        adapter=adapter,
        benchmarks=csv(benchmarks),
        samples=samples,
        engine=engine,
        data_files=pairs(data_file, "--data-file"),
        output=output,
        max_new_tokens=max_new_tokens,
        max_problems=max_problems,
        rescore=rescore,
        baseline=baseline,
    )
    if finish_config(conf, dry_run):
        return
    from qerl_cli.evaluation import eval_table, run_eval
    from qerl_cli.torch_utils import runs_on_cpu

    if conf.engine == "hf" and runs_on_cpu(conf.device):
        use_free_cpu_threads()
    results = run_eval(conf)
    console.print(eval_table(results))


def bench(
    model: Annotated[
        str | None, typer.Option(help="SHAPE (qwen2.5-7b, tiny, ...), hub id or folder.")
    ] = None,
    formats: Annotated[str | None, typer.Option(help="Comma list of bf16,nf4,nvfp4,mxfp4.")] = None,
    batch: Annotated[str | None, typer.Option(help="Comma list of batch sizes, e.g. 2,8.")] = None,
    concurrency: Annotated[
        str | None,
        typer.Option(
            help="Comma list of concurrent sequences, e.g. 8,32,128,256: each format on every "
            "linear backend, the roofline, and crossover.json for rollout.linear_backend=auto."
        ),
    ] = None,
    backends: Annotated[
        str | None, typer.Option(help="--concurrency: comma list of marlin,humming,fp8 (default all).")
    ] = None,
    prompt_len: Annotated[int | None, typer.Option()] = None,
    gen_len: Annotated[int | None, typer.Option()] = None,
    lora_rank: Annotated[int | None, typer.Option()] = None,
    engine: Annotated[str | None, typer.Option(help="vllm | hf | auto")] = None,
    e2e: Annotated[bool | None, typer.Option("--e2e", help="Also time a whole GRPO step.")] = None,
    e2e_recipe: Annotated[
        str | None,
        typer.Option(help="--e2e: a training recipe giving the step's shape and memory settings."),
    ] = None,
    prompts_per_step: Annotated[
        int | None, typer.Option(help="--e2e: prompts per step (default: the largest --batch).")
    ] = None,
    generations: Annotated[int | None, typer.Option(help="--e2e: completions per prompt (8).")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o")] = None,
    baseline: Annotated[str | None, typer.Option(help="bench.json to gate against.")] = None,
    tolerance: Annotated[float | None, typer.Option(help="Allowed relative regression.")] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    dry_run: DryRunOption = False,
) -> None:
    """Rollout tokens/s and memory, BF16 vs NF4 vs NVFP4 (MXFP4 with --formats); --e2e GRPO step time."""
    batches = positive_ints(batch, "--batch")
    shape: dict[str, Any] = {}
    if e2e_recipe:  # the recipe's step shape, under the flags given explicitly
        from qerl_cli.bench.e2e import recipe_shape

        shape = recipe_shape(e2e_recipe)
    given = {"prompt_len": prompt_len, "gen_len": gen_len, "lora_rank": lora_rank,
             "e2e_generations": generations, "e2e_prompts_per_step": prompts_per_step}  # fmt: skip
    shape.update({k: v for k, v in given.items() if v is not None})
    conf = cfg.load_config(
        cfg.BenchConfig,
        config,
        set_,
        model=model,
        formats=csv(formats),
        batch=batches,
        concurrency=positive_ints(concurrency, "--concurrency"),
        backends=csv(backends),
        engine=engine,
        e2e=e2e,
        e2e_recipe=e2e_recipe,
        output=output,
        baseline=baseline,
        tolerance=tolerance,
        **shape,
    )
    if finish_config(conf, dry_run):
        return
    from qerl_cli.bench import run_bench

    if render.print_bench(run_bench(conf)):  # a case without figures, or a regression past --baseline
        raise typer.Exit(1)


def demo(
    output: Annotated[
        str, typer.Option("--output", "-o", help="Where the demo writes its run.")
    ] = "runs/demo",
    steps: Annotated[int, typer.Option(help="GRPO steps (the reward rise needs about 60).")] = 60,
    seed: Annotated[int, typer.Option(help="Seed of the model, data and sampling.")] = 0,
) -> None:
    """Offline CPU demo: tiny model -> NVFP4 -> GRPO + AQN -> eval before/after, in minutes."""
    from qerl_cli.demo import run_demo

    if steps < 1:
        raise QerlError(f"--steps must be >= 1, got {steps}")
    use_free_cpu_threads()
    run_demo(output, steps=steps, seed=seed, console=console)


def compare(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML; its optional compare: section adds arms.")],
    arms: Annotated[str, typer.Option(help="Comma list of arms.")] = "bf16-lora,nvfp4-lora,nvfp4-aqn",
    seeds: Annotated[int, typer.Option(help="Seeds per arm (train.seed, +1, +2, ...).")] = 3,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Default runs/compare-RECIPE.")] = None,
    jobs: Annotated[int, typer.Option(help="Runs at a time, each in its own process (1: in this one).")] = 1,
    threshold: Annotated[float | None, typer.Option(help="Reward for 'steps to threshold'.")] = None,
    only: Annotated[str | None, typer.Option(help="Comma list of ARM/SEED runs to do (no others).")] = None,
    no_summary: Annotated[bool, typer.Option("--no-summary", help="Only run; write no table.")] = False,
    set_: SetOption = None,
) -> None:
    """The ablation: one recipe per arm and seed, then a table and reward/entropy curves. Resumes."""
    from qerl_cli.compare import compare_table, run_compare
    from qerl_cli.torch_utils import runs_on_cpu

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if jobs == 1 and runs_on_cpu("auto"):  # runs train in this process (--jobs N: each child chooses)
        use_free_cpu_threads()
    result = run_compare(
        recipe, csv(arms) or [], seeds, output, sets=set_, only=csv(only), jobs=jobs,
        summarize=not no_summary, threshold=threshold, progress=jobs == 1 and sys.stdout.isatty(),
    )  # fmt: skip
    if result.report is not None:  # None with --no-summary
        console.print(compare_table(result.report))
