"""The stage commands: parse the arguments, load the typed config, call the library, render.

Stage code is imported inside each command so `qerl --help` and `qerl env` stay fast and work
without the optional extras (vLLM, llm-compressor).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from qerl_cli.cli import render
from qerl_cli.cli.app import (
    ConfigOption,
    DryRunOption,
    at_least_one,
    check_recipe_path,
    config_option,
    console,
    csv,
    err_console,
    finish_config,
    flag_values,
    given_flags,
    given_keys,
    pairs,
    set_option,
    set_stop_hint,
    use_free_cpu_threads,
)
from qerl_cli.cli.interrupt import sigterm_interrupts
from qerl_cli.cli.progress import eval_cpu_estimate, say_estimate, stage_log
from qerl_cli.compare.settings import CompareSettings
from qerl_cli.config import EvalConfig, QuantizeConfig, TrainConfig, load_config
from qerl_cli.config.keydocs import field_help, key_docs, sections
from qerl_cli.errors import Checked, QerlError, closest

# Each stage's --set example is a key of its own config (quantize and eval configs are flat; bench's
# commands are in cli/bench.py).
QuantizeSet = set_option("trust_remote_code=true")
TrainSet = set_option("train.learning_rate=2e-5")
EvalSet = set_option("temperature=1.0")
CompareSet = set_option("train.max_steps=50")
# A flag's help is the comment above its config field (config_option: the key's one documentation), its
# default the field's; each parameter is named as the config key it sets (flag_values reads them).
Q, E = QuantizeConfig, EvalConfig


def quantize(
    model: Annotated[str, typer.Argument(metavar="MODEL", help=field_help(Q).get("model"))],
    format: Annotated[str | None, config_option(Q, "format", "--format", "-f", metavar="FORMAT")] = None,
    method: Annotated[str | None, config_option(Q, "method", "--method", metavar="METHOD")] = None,
    calib: Annotated[str | None, config_option(Q, "calib", "--calib", metavar="DATASET")] = None,
    calib_field: Annotated[
        str | None, config_option(Q, "calib_field", "--calib-field", metavar="FIELD", show_default=False)
    ] = None,
    calib_split: Annotated[
        str | None, config_option(Q, "calib_split", "--calib-split", metavar="SPLIT")
    ] = None,
    device: Annotated[str | None, config_option(Q, "device", "--device", metavar="DEVICE")] = None,
    num_samples: Annotated[int | None, config_option(Q, "num_samples", "--num-samples", metavar="N")] = None,
    seq_len: Annotated[int | None, config_option(Q, "seq_len", "--seq-len", metavar="TOKENS")] = None,
    output: Annotated[
        str | None, config_option(Q, "output", "--output", "-o", metavar="DIR", show_default=False)
    ] = None,
    overwrite: Annotated[
        bool | None, config_option(Q, "overwrite", "--overwrite", show_default=False)
    ] = None,
    skip_incompatible: Annotated[
        bool | None, config_option(Q, "skip_incompatible", "--skip-incompatible", show_default=False)
    ] = None,
    eval_ppl: Annotated[bool | None, config_option(Q, "eval_ppl", "--eval-ppl", show_default=False)] = None,
    lora_init: Annotated[str | None, config_option(Q, "lora_init", "--lora-init", metavar="INIT")] = None,
    lora_init_rank: Annotated[
        int | None, config_option(Q, "lora_init_rank", "--lora-init-rank", metavar="R")
    ] = None,
    config: ConfigOption = None,
    set_: QuantizeSet = None,
    dry_run: DryRunOption = False,
) -> None:
    """Quantize a model to NVFP4 / MXFP4 (compressed-tensors; AWQ, GPTQ or RTN) or NF4 (bitsandbytes)."""
    values = flag_values(locals())
    check_recipe_path(config, "--config")
    flags = given_flags(values, set_, model="MODEL")
    conf = load_config(QuantizeConfig, config, set_, flags=flags, **values)
    conf.check_settings_used(
        {key: flags.get(key, key) for key in given_keys(values, set_, config, QuantizeConfig)}
    )
    if finish_config(conf, dry_run):  # the YAML, then the checks a run makes before loading anything
        from qerl_cli.quantize.preflight import preflight as quantize_preflight

        print_checks(quantize_preflight(conf).checks)
        return
    from qerl_cli.quantize import quantize_table, run_quantize
    from qerl_cli.torch_utils import runs_on_cpu

    if runs_on_cpu(conf.device):  # GPTQ and the EoRA start's factorisations stall on oversubscribed cores
        use_free_cpu_threads()
    console.print(quantize_table(run_quantize(conf, log=stage_log)))


def train(
    ctx: typer.Context,
    recipe: Annotated[
        Path | None,
        typer.Argument(
            metavar="RECIPE",
            help="Recipe YAML: a path, or a shipped recipe's name (tiny, gsm8k_7b, ...).",
            show_default=False,
        ),
    ] = None,
    set_: TrainSet = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="DIR|auto",
            help="Continue from the last complete checkpoint in DIR ('auto': the recipe's output dir).",
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Delete the run already in output.dir (metrics, completions, checkpoints, adapter) and "
            "start over; without it, qerl train refuses a folder that holds a run.",
        ),
    ] = False,
    dry_run: DryRunOption = False,
    keys: Annotated[
        bool,
        typer.Option(
            "--keys",
            help="Print every recipe key: its type, default and meaning. `--keys SECTION` (rollout, "
            "aqn.target, ...) in place of RECIPE prints only those.",
        ),
    ] = False,
) -> None:
    """GRPO / DAPO on LoRA adapters over a frozen 4-bit (or BF16) base, with AQN.

    On N GPUs: torchrun --nproc-per-node N -m qerl_cli train RECIPE.yaml (data parallel).
    """
    if keys:
        print_keys(TrainConfig, "" if recipe is None else str(recipe))
        return
    if recipe is None:  # optional only for --keys: otherwise the usage error of any missing argument
        # click's, or typer's vendored copy of click (typer >= 0.28), whichever raised BadParameter here.
        missing = importlib.import_module(typer.BadParameter.__module__).MissingParameter
        raise missing(ctx=ctx, param_type="argument", param_hint="'RECIPE'")
    check_recipe_path(recipe)
    conf = load_config(TrainConfig, recipe, set_)
    from qerl_cli.rl.preflight import cpu_estimate, preflight

    resume_dir = _resume_dir(recipe, conf, resume, overwrite, set_)
    if finish_config(conf, dry_run):  # the YAML, then the checks a run makes before loading anything
        print_checks(preflight(conf, resume=resume_dir, overwrite=overwrite))
        return
    from qerl_cli.rl.checkpoint import resumed_step
    from qerl_cli.rl.run_folder import stop_hint
    from qerl_cli.rl.trainer import train as run_train
    from qerl_cli.torch_utils import runs_on_cpu

    on_cpu = runs_on_cpu(conf.train.device)
    if on_cpu:
        use_free_cpu_threads()
    preflight(conf, resume=resume_dir, overwrite=overwrite)  # seconds, before a model loads for minutes
    if on_cpu and int(os.environ.get("RANK", "0")) == 0:
        say_estimate(cpu_estimate(conf, done=0 if resume_dir is None else resumed_step(resume_dir)))
    set_stop_hint(lambda: stop_hint(conf.output.dir, conf.output.save_steps))
    with sigterm_interrupts():  # a scheduler's preemption stops the run as Ctrl-C does, hint and all
        result = run_train(conf, resume=resume_dir, overwrite=overwrite)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank returns the same summary
        console.print(render.train_summary(result))


def _resume_dir(
    recipe: Path, conf: TrainConfig, resume: str | None, overwrite: bool, set_: list[str] | None
) -> str | None:
    """The run folder ``--resume`` continues (None: a new run), after the checks of the flag itself: not
    beside --overwrite, a run's copied config.yaml not training into the original's folder, and ``auto``
    naming a folder that exists."""
    from qerl_cli.rl.run_folder import check_config_home, check_resume_or_overwrite

    check_resume_or_overwrite(resume, overwrite)
    if not any(item.startswith("output.dir=") for item in set_ or []):  # a --set output.dir is meant
        check_config_home(recipe, conf.output.dir)
    if resume == "auto" and not Path(conf.output.dir).expanduser().exists():
        # Named as the flag the user typed: "--resume runs/tiny: no such directory" read as a typo of theirs.
        raise QerlError(
            f"--resume auto: the recipe's output.dir {conf.output.dir} does not exist, so there is no run to "
            "resume: start the run without --resume (or give --resume DIR, the output.dir of an earlier run)"
        )
    return None if resume is None else (conf.output.dir if resume == "auto" else resume)


def print_checks(checks: list[Checked]) -> None:
    """``--dry-run``'s list of the checks a stage makes before work, on stderr (stdout holds the YAML);
    a failing one has raised its QerlError (exit 2) before this."""
    err_console.print("[bold]checked, nothing loaded or written:[/bold]")
    for check in checks:
        # soft_wrap: a path stays one piece to copy (rich would fold it at the console's width)
        err_console.print(f"  {escape(check.what)}: {escape(check.found)}", highlight=False, soft_wrap=True)


def print_keys(config: type, prefix: str) -> None:
    """Each key of ``config`` under ``prefix`` (a section, a key, or "" for all): dotted name, type,
    default, and the comment that documents it where it is declared (qerl_cli.config.keydocs)."""

    docs = [d for d in key_docs(config) if not prefix or d.key == prefix or d.key.startswith(f"{prefix}.")]
    if not docs:
        # A top-level key a user may ask for too (`compare`, a mapping, is no dataclass section)
        known = ", ".join([*sections(config), *(d.key for d in key_docs(config) if "." not in d.key)])
        close = closest(prefix, [*sections(config), *(d.key for d in key_docs(config))])
        guess = f"did you mean {close}? " if close else ""
        raise QerlError(f"--keys {prefix}: no such section or key; {guess}the sections: {known}")
    for doc in docs:
        console.print(  # never wrapped: the key is what a user copies into --set
            f"[bold]{escape(doc.key)}[/bold]: {escape(doc.type)} = {escape(doc.default)}",
            highlight=False,
            soft_wrap=True,
        )
        meaning = textwrap.fill(doc.help, _wrap_width(), initial_indent=" " * 4, subsequent_indent=" " * 4)
        console.print(escape(meaning), highlight=False, soft_wrap=True)


def _wrap_width() -> int:
    """The key help's line width: the terminal's (or COLUMNS); piped without COLUMNS, PIPED_WIDTH."""
    return max(40, console.width)


def eval_(
    model: Annotated[str | None, typer.Argument(metavar="MODEL", help=field_help(E).get("model"))] = None,
    adapter: Annotated[
        str | None, config_option(E, "adapter", "--adapter", metavar="DIR", show_default=False)
    ] = None,
    benchmarks: Annotated[
        str | None, config_option(E, "benchmarks", "--benchmarks", metavar="NAME,...")
    ] = None,
    samples: Annotated[
        int | None,
        config_option(  # the key's 0 ("the benchmark's default") is refused as a flag: at_least_one
            E,
            "samples",
            "--samples",
            metavar="N",
            show_default="per benchmark",
            help="Samples per problem; left out: each benchmark's default (4 for gsm8k/math500, 16 for "
            "aime/amc).",
        ),
    ] = None,
    engine: Annotated[str | None, config_option(E, "engine", "--engine", metavar="ENGINE")] = None,
    data_files: Annotated[
        list[str] | None,
        config_option(E, "data_files", "--data-file", metavar="BENCH=PATH", show_default=False),
    ] = None,
    output: Annotated[str | None, config_option(E, "output", "--output", "-o", metavar="DIR")] = None,
    max_new_tokens: Annotated[
        int | None, config_option(E, "max_new_tokens", "--max-new-tokens", metavar="TOKENS")
    ] = None,
    max_problems: Annotated[
        int | None, config_option(E, "max_problems", "--max-problems", metavar="N", show_default=False)
    ] = None,
    rescore: Annotated[
        str | None, config_option(E, "rescore", "--rescore", metavar="DIR", show_default=False)
    ] = None,
    baseline: Annotated[
        str | None, config_option(E, "baseline", "--baseline", metavar="JSON", show_default=False)
    ] = None,
    config: ConfigOption = None,
    set_: EvalSet = None,
    dry_run: DryRunOption = False,
) -> None:
    """Pass@1 on GSM8K, MATH500, AIME24/25, AMC23, graded with math-verify."""
    values = flag_values(locals(), benchmarks=csv(benchmarks), data_files=pairs(data_files, "--data-file"))
    at_least_one(
        samples="--samples", max_problems="--max-problems", max_new_tokens="--max-new-tokens", values=values
    )
    flags = given_flags(values, set_, model="MODEL", data_files="--data-file")
    check_recipe_path(config, "--config")
    conf = load_config(EvalConfig, config, set_, flags=flags, **values)
    conf.check_rescore_unused({key: flags.get(key, key) for key in given_keys(values, set_, config, E)})
    if finish_config(conf, dry_run):  # the YAML, then the checks a run makes before loading anything
        from qerl_cli.evaluation.preflight import preflight as eval_preflight

        print_checks(eval_preflight(conf, guard_output=True).checks)
        return
    from qerl_cli.evaluation import eval_table, run_eval
    from qerl_cli.evaluation.preflight import resolve_engine
    from qerl_cli.torch_utils import runs_on_cpu

    on_cpu = False
    if not conf.rescore:  # a rescore has no engine (check_rescore_unused refused one given)
        conf.engine = resolve_engine(conf.engine)  # auto decided here: the thread choice depends on it
        on_cpu = conf.engine == "hf" and runs_on_cpu(conf.device)
        if on_cpu:
            use_free_cpu_threads()
    # The estimate once run_eval's checks pass: a refusal (a run's folder for --adapter) comes without one.
    estimate = (lambda: say_estimate(eval_cpu_estimate(conf))) if on_cpu else None
    results = run_eval(conf, guard_output=True, checked=estimate)  # the default output: every evaluation's
    console.print(eval_table(results))


def demo(
    output: Annotated[
        str, typer.Option("--output", "-o", metavar="DIR", help="Where the demo writes its run.")
    ] = "runs/demo",
    steps: Annotated[
        int, typer.Option("--steps", metavar="N", help="GRPO steps (fewer may end before the reward rises).")
    ] = 60,
    seed: Annotated[
        int, typer.Option("--seed", metavar="SEED", help="Seed of the model, data and sampling.")
    ] = 0,
) -> None:
    """Offline CPU demo: tiny model -> NVFP4 -> GRPO + AQN -> eval before/after, in minutes."""
    from qerl_cli.demo import run_demo

    if steps < 1:
        raise QerlError(f"--steps must be >= 1, got {steps}")
    use_free_cpu_threads()
    run_demo(output, steps=steps, seed=seed, console=console)


# compare's --gpus and --dry-run (its dry run prints the checks and the runs to do, not a config's YAML).
CompareGpusOption = Annotated[
    str,
    typer.Option(
        "--gpus",
        metavar="auto|ID,...",
        help="GPUs to spread the --jobs runs over, one GPU per run process (CUDA_VISIBLE_DEVICES ids); "
        "auto: every GPU this process sees.",
    ),
]
CompareDryRunOption = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Count the runs to do, skip or resume, make the checks a run makes before any work "
        "(recipe, arms, seeds, output folder, model, dataset, engines; exit 2 naming what fails) and "
        "exit: nothing is made or written.",
    ),
]


def compare(
    recipe: Annotated[
        Path, typer.Argument(metavar="RECIPE", help="Recipe YAML; its optional compare: section adds arms.")
    ],
    arms: Annotated[
        str, typer.Option("--arms", metavar="ARM,...", help="Comma list of arms.")
    ] = "bf16-lora,nvfp4-lora,nvfp4-aqn",
    seeds: Annotated[
        int, typer.Option("--seeds", metavar="N", help="Seeds per arm (train.seed, +1, +2, ...).")
    ] = 3,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            metavar="DIR",
            help="Folder of the runs (ARM/seed-S/), the bases made and the report; run again, it resumes.",
            show_default="runs/compare-RECIPE",
        ),
    ] = None,
    jobs: Annotated[
        int,
        typer.Option("--jobs", metavar="N", help="Runs at a time, each in its own process (1: in this one)."),
    ] = 1,
    threshold: Annotated[
        float | None, typer.Option("--threshold", metavar="REWARD", help="Reward for 'steps to threshold'.")
    ] = None,
    only: Annotated[
        str | None,
        typer.Option("--only", metavar="ARM/SEED,...", help="Comma list of ARM/SEED runs to do (no others)."),
    ] = None,
    gpus: CompareGpusOption = "auto",
    no_summary: Annotated[bool, typer.Option("--no-summary", help="Only run; write no table.")] = False,
    report_only: Annotated[
        bool,
        typer.Option(
            "--report-only",
            help="Train nothing, make and evaluate no base: the report of the finished runs in -o, e.g. seed "
            "ranges run on other machines and copied together.",
        ),
    ] = False,
    reference: Annotated[
        str | None,
        config_option(CompareSettings, "reference", "--reference", metavar="ARM", show_default="bf16-lora"),
    ] = None,
    margin: Annotated[
        float | None, config_option(CompareSettings, "margin", "--margin", metavar="POINTS")
    ] = None,
    set_: CompareSet = None,
    dry_run: CompareDryRunOption = False,
) -> None:
    """The ablation: one recipe per arm and seed, then a table and reward/entropy curves. Resumes."""
    from qerl_cli.compare import STOP_HINT, check_compare, compare_table, run_compare
    from qerl_cli.torch_utils import runs_on_cpu

    check_recipe_path(recipe)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if no_summary and report_only:
        raise QerlError("--no-summary (only run) and --report-only (only report) exclude each other")
    if dry_run:
        checks = check_compare(recipe, csv(arms) or [], seeds, output, sets=set_, only=csv(only), jobs=jobs,
                               gpus=gpus, reference=reference, margin=margin)  # fmt: skip
        print_checks(checks)
        return
    # Training in this process (--jobs N: each child chooses; --report-only trains nothing).
    if jobs == 1 and not report_only and runs_on_cpu("auto"):
        use_free_cpu_threads()
    if not report_only:
        set_stop_hint(lambda: STOP_HINT)
    with sigterm_interrupts():  # its runs train here (or in children, each taking SIGTERM alike)
        result = run_compare(
            recipe, csv(arms) or [], seeds, output, sets=set_, only=csv(only), jobs=jobs,
            summarize=not no_summary, threshold=threshold, progress=jobs == 1 and sys.stdout.isatty(),
            gpus=gpus, reference=reference, margin=margin, report_only=report_only,
        )  # fmt: skip
    if result.report is not None:  # None with --no-summary
        console.print(compare_table(result.report))
