"""The `qerl` command line: parse, load the typed config, call the library, render with rich.

Stage code is imported inside each command so `qerl --help` and `qerl env` stay fast and work
without the optional extras (vLLM, llm-compressor).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qerl_cli import config as cfg
from qerl_cli.errors import QerlError

app = typer.Typer(
    name="qerl",
    help="Quantization-enhanced RL (QeRL, arXiv 2510.11696): GRPO/DAPO with LoRA on a 4-bit base.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a config key: --set train.learning_rate=2e-5 (repeatable)."),
]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Print the resolved config as YAML and exit.")]
ConfigOption = Annotated[
    Path | None, typer.Option("--config", help="A YAML file with this stage's settings.")
]


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")] = False,
) -> None:
    _state["debug"] = debug


def _csv(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def _positive_ints(value: str | None, flag: str) -> list[int] | None:
    """``"2,8"`` -> [2, 8]; anything else names the element that is wrong."""
    items = _csv(value)
    if items is None:
        return None
    for item in items:
        if not item.isdigit() or int(item) < 1:
            raise QerlError(f"{flag} takes comma-separated positive integers (e.g. {flag} 2,8), got '{item}'")
    if not items:
        raise QerlError(f"{flag} takes comma-separated positive integers (e.g. {flag} 2,8), got '{value}'")
    return [int(item) for item in items]


def _pairs(values: list[str] | None, flag: str) -> dict[str, str] | None:
    if not values:
        return None
    out = {}
    for item in values:
        key, sep, val = item.partition("=")
        if not sep or not key or not val:
            raise QerlError(f"{flag} expects NAME=PATH, got '{item}'")
        out[key.strip()] = val.strip()
    return out


def _use_free_cpu_threads() -> None:
    """Entry of a CPU path: torch runs on the cores free now (on all of them beside a busy process its
    threads stall each other tenfold); says so when that is fewer than torch's own count."""
    from qerl_cli.torch_utils import use_free_cpu_threads

    choice = use_free_cpu_threads()
    if choice.lowered:
        err_console.print(f"[dim]{escape(choice.reason)}[/dim]")


def _finish_config(config: Any, dry_run: bool) -> bool:
    """Print the resolved config for --dry-run; returns True when the command should stop."""
    if dry_run:  # plain YAML, not rich markup, so the output can be saved and reused as a recipe
        sys.stdout.write(cfg.dump_yaml(config))
    return dry_run


# ---------------------------------------------------------------------------------------------
@app.command()
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
    if _finish_config(conf, dry_run):
        return
    from qerl_cli.quantize import quantize_table, run_quantize

    report = run_quantize(conf)
    console.print(quantize_table(report))


@app.command()
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
    if _finish_config(conf, dry_run):
        return
    from qerl_cli.rl.trainer import train as run_train
    from qerl_cli.torch_utils import runs_on_cpu

    if runs_on_cpu(conf.train.device):
        _use_free_cpu_threads()
    result = run_train(
        conf, resume=None if resume is None else (conf.output.dir if resume == "auto" else resume)
    )
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank returns the same summary
        console.print(_train_summary(result))


def _train_summary(result: dict[str, Any]) -> Table:
    table = Table(title="qerl train", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = [
        ("steps", result.get("steps")),
        ("resumed from", result.get("resumed_from") or "-"),
        ("mean reward, first 10 steps", result.get("reward_first10")),
        ("mean reward, last 10 steps", result.get("reward_last10")),
        ("adapter", result.get("adapter")),
        ("outputs", result.get("output_dir")),
        ("plot", result.get("plot") or "-"),
    ]
    for label, value in rows:
        table.add_row(label, f"{value:.3f}" if isinstance(value, float) else escape(str(value)))
    return table


@app.command("eval")
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
        benchmarks=_csv(benchmarks),
        samples=samples,
        engine=engine,
        data_files=_pairs(data_file, "--data-file"),
        output=output,
        max_new_tokens=max_new_tokens,
        max_problems=max_problems,
        rescore=rescore,
        baseline=baseline,
    )
    if _finish_config(conf, dry_run):
        return
    from qerl_cli.evaluation import eval_table, run_eval
    from qerl_cli.torch_utils import runs_on_cpu

    if conf.engine == "hf" and runs_on_cpu(conf.device):
        _use_free_cpu_threads()
    results = run_eval(conf)
    console.print(eval_table(results))


@app.command()
def bench(
    model: Annotated[
        str | None, typer.Option(help="SHAPE (qwen2.5-7b, tiny, ...), hub id or folder.")
    ] = None,
    formats: Annotated[str | None, typer.Option(help="Comma list of bf16,nf4,nvfp4,mxfp4.")] = None,
    batch: Annotated[str | None, typer.Option(help="Comma list of batch sizes, e.g. 2,8.")] = None,
    concurrency: Annotated[
        str | None,
        typer.Option(help="Comma list of concurrent sequences, e.g. 8,32,128,256: each format on every "
                     "linear backend, the roofline, and crossover.json for rollout.linear_backend=auto."),
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
    batches = _positive_ints(batch, "--batch")
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
        formats=_csv(formats),
        batch=batches,
        concurrency=_positive_ints(concurrency, "--concurrency"),
        backends=_csv(backends),
        engine=engine,
        e2e=e2e,
        e2e_recipe=e2e_recipe,
        output=output,
        baseline=baseline,
        tolerance=tolerance,
        **shape,
    )
    if _finish_config(conf, dry_run):
        return
    from qerl_cli.bench import bench_table, failed_cases, gate_failures, run_bench, wall_clock_line

    report = run_bench(conf)
    console.print(bench_table(report))
    console.print(wall_clock_line(report))
    failed = failed_cases(report)
    for line in failed:  # a case without figures (vLLM cannot serve a format, OOM at wake-up, ...)
        err_console.print(f"[red]failed[/red]: {escape(line)}")
    failures = gate_failures(report)
    if failures:  # --baseline regression gate: CI fails, naming each metric that regressed
        for line in failures:
            err_console.print(f"[red]regression[/red]: {escape(line)}")
    if failures or failed:
        raise typer.Exit(1)


@app.command()
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
    _use_free_cpu_threads()
    run_demo(output, steps=steps, seed=seed, console=console)


@app.command()
def env(json_: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """Versions of the stack and the GPUs this machine has."""
    from qerl_cli.envinfo import collect

    info = collect()
    if json_:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
        return
    table = Table(title="qerl environment", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key in ("qerl", "python", "platform", "torch_cuda"):
        table.add_row(key, str(info[key]))
    for name, version in info["packages"].items():
        table.add_row(name, version or "[dim]not installed[/dim]")
    if not info["gpus"]:
        table.add_row("GPUs", "[dim]none (CPU only)[/dim]")
    for gpu in info["gpus"]:
        table.add_row(
            f"GPU {gpu['index']}",
            f"{gpu['name']}, {gpu['memory_gib']} GiB, compute capability {gpu['compute_capability']}",
        )
    console.print(table)


@app.command("tiny-base")
def tiny_base(
    out: Annotated[Path, typer.Argument(help="Where bf16/ and nvfp4/ go.")] = Path("runs/tiny-base"),
    formats: Annotated[str, typer.Option(help="Comma list of bf16,nvfp4,mxfp4,nf4.")] = "bf16,nvfp4",
    seed: Annotated[int, typer.Option(help="Seed of the model and the warm start.")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Rebuild an existing base.")] = False,
) -> None:
    """Build the warm-started tiny base that recipes/tiny.yaml trains (about a minute on 2 free cores).

    It needs about 76 s of CPU time. Beside other CPU-bound work it runs on the cores left free: with one
    of 2 cores busy, one thread, about 1.5 min (two threads there stalled each other: 13 min 38 s); on 2
    cores loaded 10 deep, 5.3 min. QERL_NUM_THREADS=N sets the thread count.
    """
    from qerl_cli.rl.warmstart import build_tiny_base

    _use_free_cpu_threads()
    paths = build_tiny_base(out, formats=tuple(_csv(formats) or ()), seed=seed, overwrite=overwrite)
    for fmt, path in paths.items():
        console.print(f"{fmt}: {path}", markup=False, highlight=False)


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Folder to write the model to.")],
    seed: Annotated[int, typer.Option(help="Weights are a deterministic function of the seed.")] = 0,
) -> None:
    """Write a tiny offline Qwen2 model (transformers and vLLM load it)."""
    from qerl_cli.modeling.tiny import write_tiny_model

    path = write_tiny_model(out, seed=seed)
    console.print(f"wrote tiny Qwen2 model to [bold]{escape(str(path))}[/bold]")


@app.command("models")
def models_(json_: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """Model aliases qerl finds offline (e.g. smollm2-135m-instruct), how to get each, and where it looks."""
    from qerl_cli.modeling.sources import known_models

    rows = known_models()
    if json_:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(title="qerl models (every command taking a model accepts an alias, a .gguf or a folder)")
    for column in ("alias", "description", "get it", "status"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["alias"], row["description"], row["get_it"], row["status"])
    console.print(table)
    for row in rows:
        console.print(f"[dim]{row['alias']} is looked for in: {row['looks_in']}[/dim]")


@app.command()
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
        _use_free_cpu_threads()
    report = run_compare(
        recipe, _csv(arms) or [], seeds, output, sets=set_, only=_csv(only), jobs=jobs,
        summarize=not no_summary, threshold=threshold, progress=jobs == 1 and sys.stdout.isatty(),
    )  # fmt: skip
    if not no_summary:
        console.print(compare_table(report))


def main(argv: list[str] | None = None) -> int:
    """Console entry point: user errors exit 2 in red, unexpected errors exit 1."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # peft imports bitsandbytes when it is installed; on AVX512-BF16 CPUs bitsandbytes then warns that
    # an optional hub kernel is missing, which reads like a failure in every qerl run. qerl's CPU path
    # never calls bitsandbytes' kernels (NF4 is dequantized by qerl's own code), so that one is muted.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        # standalone_mode=False returns click's exit code instead of calling sys.exit.
        rc = app(args=argv, standalone_mode=False)
    except QerlError as exc:
        if debug:
            err_console.print_exception()
        err_console.print(f"[bold red]error:[/bold red] [red]{escape(str(exc))}[/red]")
        return 2
    except typer.Exit as exc:
        return exc.exit_code
    except OSError as exc:
        if exc.errno not in _USER_OS_ERRORS:
            return _internal_error(exc, debug)
        # A full disk, a quota, a read-only or foreign folder: the user's to fix, so no traceback.
        where = escape(f" {exc.filename}" if exc.filename else "")
        err_console.print(
            f"[bold red]error:[/bold red] [red]cannot write{where}: {escape(exc.strerror or str(exc))}[/red] "
            "(free space or choose another output folder; a training run continues with --resume auto)"
        )
        return 2
    except typer.Abort:
        err_console.print("[red]aborted[/red]")
        return 130
    except KeyboardInterrupt:
        err_console.print(INTERRUPTED)
        return 130
    except Exception as exc:  # click usage errors are handled below; the rest are bugs
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            return exc.exit_code
        return _internal_error(exc, debug)
    if rc == 130:  # typer turns Ctrl-C into a silent Exit(130) when not in standalone mode
        err_console.print(INTERRUPTED)
    return rc if isinstance(rc, int) else 0


INTERRUPTED = "[red]interrupted[/red] (qerl train continues from its last checkpoint with --resume auto)"


_USER_OS_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}


def _internal_error(exc: BaseException, debug: bool) -> int:
    if debug:
        err_console.print_exception()
    else:
        message = escape(f"{type(exc).__name__}: {exc}")
        err_console.print(f"[bold red]internal error:[/bold red] {message}")
        err_console.print("[dim]re-run with --debug for the traceback[/dim]")
    return 1


if __name__ == "__main__":
    sys.exit(main())
