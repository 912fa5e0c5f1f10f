"""``qerl bench``: the benchmarks, one subcommand each (``qerl bench --help`` lists them).

This module holds the group and the three benchmarks that share ``bench.json`` and its ``--baseline``
gate: ``rollout``, ``concurrency`` and ``e2e``. The others (``kernels``, ``update``, ``scaling``,
``quality``) are in :mod:`qerl_cli.cli.bench_tools`. Every subcommand checks what is cheap to check
(formats against the format registry's names, positive sizes, files that must exist) before torch is
imported, and exits 2 naming the flag.

``qerl bench [OPTIONS]`` without a benchmark is the group's default benchmark: ``qerl bench rollout
[OPTIONS]`` (``concurrency`` when the options have ``--concurrency``). It is the form CI jobs run
(``qerl bench --batch 2,8``), documented and kept.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, get_args

import typer

from qerl_cli.bench import preflight
from qerl_cli.bench.settings import CPU_LENGTHS, E2EConfig, recipe_shape
from qerl_cli.cli import render
from qerl_cli.cli.app import (
    ConfigOption,
    DryRunOption,
    QerlGroup,
    check_recipe_path,
    command_line,
    config_option,
    csv,
    finish_config,
    given_flags,
    given_keys,
    positive_ints,
    print_plan,
    set_option,
    use_free_cpu_threads,
)
from qerl_cli.cli.stages import print_checks
from qerl_cli.config import BenchConfig, QuantFormat, load_config
from qerl_cli.config.choices import BaseCompute, LinearBackend
from qerl_cli.config.stages import SWEPT_BACKENDS
from qerl_cli.errors import QerlError

B = BenchConfig  # the --help defaults below are its own
BenchSet = set_option("repeats=5")
DEFAULT_CONCURRENCY = [8, 32, 128, 256]  # the concurrency RL rollouts run at (qerl bench concurrency)


class BenchGroup(QerlGroup):
    """``qerl bench``: a bare ``qerl bench [OPTIONS]`` runs the default benchmark, ``qerl bench rollout
    [OPTIONS]`` (``concurrency`` with ``--concurrency``); ``qerl bench --help`` lists the benchmarks."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not args or (args[0].startswith("-") and args[0] not in ctx.help_option_names):
            args = [self.default_subcommand(args), *args]
        return super().parse_args(ctx, args)

    def default_subcommand(self, args: list[str]) -> str:
        """The subcommand ``qerl bench ARGS`` runs (what tools that read commands ask, e.g. the docs'
        check of every command shown)."""
        return default_benchmark(args)


def default_benchmark(args: list[str]) -> str:
    """The benchmark a bare ``qerl bench [OPTIONS]`` runs: the rollout benchmark, or the concurrency
    sweep when the options name ``--concurrency``."""
    sweep = any(a == "--concurrency" or a.startswith("--concurrency=") for a in args)
    return "concurrency" if sweep else "rollout"


bench_app = typer.Typer(
    name="bench",
    cls=BenchGroup,
    help="Benchmarks, one subcommand each; every one writes JSON with the command, the device, the date "
    "and the versions of the stack. `qerl bench [OPTIONS]` without a benchmark runs `qerl bench rollout "
    "[OPTIONS]` (the default benchmark; `concurrency` with --concurrency).",
    add_completion=False,
    pretty_exceptions_enable=False,
)


def bench_formats() -> list[str]:
    """What a benchmark can be given: bf16 and the format registry's names (the config's literal of
    them, which tests hold to the registry: reading it imports no torch)."""
    return ["bf16", *get_args(QuantFormat)]


def check_formats(chosen: list[str] | None, name: str) -> None:
    """Refuse a format no benchmark can build before any work (--dry-run included)."""
    valid = bench_formats()
    unknown = [fmt for fmt in chosen or [] if fmt.strip().lower() not in valid]
    if unknown:
        raise QerlError(f"{name}: unknown format(s) {', '.join(unknown)}; choose from {', '.join(valid)}")


def int_list(value: str | None, flag: str) -> list[int] | None:
    """``"2,8"`` -> [2, 8]: positive integers, no empty element (``2,,8`` is a typo, not ``2,8``)."""
    if value is not None and any(not item.strip() for item in value.split(",")):
        raise QerlError(f"{flag} takes comma-separated positive integers (e.g. {flag} 2,8), got '{value}'")
    return positive_ints(value, flag)


def check_exists(path: str | Path | None, flag: str, what: str) -> None:
    """A file (or the folder holding it) the command reads must be there before any work."""
    if path is not None and not Path(path).expanduser().exists():
        raise QerlError(f"{flag} {path}: not found (give {what})")


# -- options shared by rollout, concurrency and e2e -----------------------------------------------------
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        metavar="MODEL",
        help="SHAPE (qwen2.5-7b, tiny, ...), hub id or folder.",
        show_default="qwen2.5-7b with vLLM, else tiny",
    ),
]
FormatsOption = Annotated[
    str | None,
    config_option(
        B, "formats", "--formats", metavar="FMT,...", help=f"Comma list of {', '.join(bench_formats())}."
    ),
]


def length_default(key: str) -> str:
    """A length flag's default as the plan applies it: the config's, the CPU's on the default model."""
    return f"{getattr(B, key)}; {CPU_LENGTHS[key]} on the HF engine's default model, the tiny shape"


PromptLenOption = Annotated[
    int | None,
    config_option(B, "prompt_len", "--prompt-len", metavar="TOKENS", help="Prompt length.",
                  show_default=length_default("prompt_len")),
]  # fmt: skip
GenLenOption = Annotated[
    int | None,
    config_option(B, "gen_len", "--gen-len", metavar="TOKENS", help="Tokens generated.",
                  show_default=length_default("gen_len")),
]  # fmt: skip
LoraRankOption = Annotated[
    int | None,
    config_option(B, "lora_rank", "--lora-rank", metavar="RANK", help="LoRA rank (0: no LoRA cases)."),
]
EngineOption = Annotated[
    str | None, config_option(B, "engine", "--engine", metavar="ENGINE", help="vllm | hf | auto")
]
OutputOption = Annotated[str | None, config_option(B, "output", "--output", "-o", metavar="DIR")]
BaselineOption = Annotated[
    str | None, typer.Option("--baseline", metavar="JSON", help="bench.json to gate against.")
]
ToleranceOption = Annotated[
    float | None,
    config_option(B, "tolerance", "--tolerance", metavar="FRACTION", help="Allowed relative regression."),
]
DeviceOption = Annotated[
    str | None,
    typer.Option("--device", metavar="DEVICE", help="auto, cpu or cuda[:N].", show_default="auto"),
]
MemoryCapOption = Annotated[
    float | None,
    typer.Option(
        "--memory-cap",
        metavar="GIB",
        help="GPU memory the run may use; a helper process holds the rest (a smaller GPU's budget on a "
        "larger one).",
        show_default="the whole GPU",
    ),
]


def run_bench_command(
    cls: type[BenchConfig],
    values: dict[str, Any],
    *,
    config: Path | None,
    sets: list[str] | None,
    dry_run: bool,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Resolve a ``bench.json`` benchmark's settings (``cls``: ``BenchConfig`` for rollout and
    concurrency, ``E2EConfig`` for e2e), check them, then run it and render the report.

    ``values`` are the flags (None: not given); e2e's ``recipe``, a training recipe, fills the shape
    flags not given; ``defaults`` what a subcommand uses for a key that neither flags, ``--config`` nor
    ``--set`` set."""
    check_recipe_path(config, "--config")
    flags = given_flags(values, sets, memory_cap_gib="--memory-cap")
    check_formats(values.get("formats"), "--formats")
    check_exists(values.get("baseline"), "--baseline", "the bench.json of an earlier run")
    if values.get("tolerance") is not None:
        preflight.check_tolerance(values["tolerance"])
    given = given_keys(values, sets, config, cls)  # a saved --dry-run YAML runs as it did
    if values.get("recipe"):  # the recipe's step shape under the flags given (YAML only: no torch yet)
        shape = recipe_shape(values["recipe"])
        values = {**values, **{k: v for k, v in shape.items() if values.get(k) is None}}
    conf = load_config(cls, config, sets, flags=flags, **values)
    check_formats(conf.formats, flags.get("formats", "formats"))
    for key, value in (defaults or {}).items():
        if not getattr(conf, key):
            setattr(conf, key, list(value))
    from qerl_cli.bench.plan import bench_plan

    # The engine, packages, model, output and baseline checked as the run checks them (bench_plan is the
    # run's own check), and the CPU's lengths filled in, before any work.
    plan = bench_plan(conf, given=given, backends_given="backends" in given)
    if finish_config(conf, dry_run):
        print_checks(plan.checks)
        print_plan(plan.lines())
        return
    print("\n".join(plan.lines()), file=sys.stderr, flush=True)  # plain lines: a CI log wraps none
    from qerl_cli.bench import run_bench

    if plan.engine == "hf" and not preflight.gpu_available():
        use_free_cpu_threads()  # the CPU's free cores only: a thread sharing a busy core stalls the others

    # A case without figures, or a regression past --baseline: exit 1.
    if render.print_bench(run_bench(conf, command=command_line())):
        raise typer.Exit(1)


# `qerl bench rollout --e2e` and its options became `qerl bench e2e`: still parsed (hidden), so that a
# command line of the old form is told where they went instead of "No such option".
def _gone(flag: str, is_flag: bool = False) -> Any:
    if is_flag:
        return Annotated[bool | None, typer.Option(flag, hidden=True)]
    return Annotated[str | None, typer.Option(flag, hidden=True)]


def refuse_e2e_flags(given: dict[str, Any]) -> None:
    """Exit 2 naming ``qerl bench e2e`` for the removed ``--e2e`` options of ``qerl bench rollout``."""
    used = [flag for flag, value in given.items() if value is not None]
    if used:
        raise QerlError(
            f"qerl bench rollout {' '.join(used)}: whole GRPO steps are timed by `qerl bench e2e` "
            "(--e2e-recipe is its --recipe; --prompts-per-step and --generations are its own); "
            "run that instead"
        )


def rollout(
    model: ModelOption = None,
    formats: FormatsOption = None,
    batch: Annotated[
        str | None, config_option(B, "batch", "--batch", metavar="N,...", help="Comma list of batch sizes.")
    ] = None,
    prompt_len: PromptLenOption = None,
    gen_len: GenLenOption = None,
    lora_rank: LoraRankOption = None,
    engine: EngineOption = None,
    device: DeviceOption = None,
    memory_cap: MemoryCapOption = None,
    output: OutputOption = None,
    baseline: BaselineOption = None,
    tolerance: ToleranceOption = None,
    config: ConfigOption = None,
    set_: BenchSet = None,
    dry_run: DryRunOption = False,
    e2e: _gone("--e2e", is_flag=True) = None,
    e2e_recipe: _gone("--e2e-recipe") = None,
    prompts_per_step: _gone("--prompts-per-step") = None,
    generations: _gone("--generations") = None,
) -> None:
    """Rollout tokens/s and memory per format, BF16 vs NF4 vs NVFP4 (MXFP4 with --formats), at --batch."""
    refuse_e2e_flags(
        {
            "--e2e": e2e,
            "--e2e-recipe": e2e_recipe,
            "--prompts-per-step": prompts_per_step,
            "--generations": generations,
        }
    )
    values: dict[str, Any] = dict(
        model=model,
        formats=csv(formats),
        batch=int_list(batch, "--batch"),
        engine=engine,
        device=device,
        output=output,
        baseline=baseline,
        tolerance=tolerance,
        prompt_len=prompt_len,
        gen_len=gen_len,
        lora_rank=lora_rank,
        memory_cap_gib=memory_cap,
    )
    run_bench_command(B, values, config=config, sets=set_, dry_run=dry_run)


def concurrency(
    model: ModelOption = None,
    formats: FormatsOption = None,
    sequences: Annotated[
        str | None,
        typer.Option(
            "--concurrency",
            metavar="N,...",
            help="Comma list of sequences generated at once.",
            show_default=",".join(map(str, DEFAULT_CONCURRENCY)),
        ),
    ] = None,
    backends: Annotated[
        str | None,
        config_option(
            B,
            "backends",
            "--backends",
            metavar="NAME,...",
            help=f"Linear backends: comma list of {', '.join(SWEPT_BACKENDS)}.",
        ),
    ] = None,
    prompt_len: PromptLenOption = None,
    gen_len: GenLenOption = None,
    lora_rank: LoraRankOption = None,
    engine: EngineOption = None,
    device: DeviceOption = None,
    memory_cap: MemoryCapOption = None,
    output: OutputOption = None,
    baseline: BaselineOption = None,
    tolerance: ToleranceOption = None,
    config: ConfigOption = None,
    set_: BenchSet = None,
    dry_run: DryRunOption = False,
) -> None:
    """Rollout tokens/s at RL concurrency per format x linear backend, against the GPU's roofline.

    With vLLM it writes crossover.json, the table rollout.linear_backend=auto reads.
    """
    values: dict[str, Any] = dict(
        model=model,
        formats=csv(formats),
        concurrency=int_list(sequences, "--concurrency"),
        backends=csv(backends),
        engine=engine,
        device=device,
        output=output,
        baseline=baseline,
        tolerance=tolerance,
        prompt_len=prompt_len,
        gen_len=gen_len,
        lora_rank=lora_rank,
        memory_cap_gib=memory_cap,
    )
    run_bench_command(
        B, values, config=config, sets=set_, dry_run=dry_run, defaults={"concurrency": DEFAULT_CONCURRENCY}
    )


def e2e(
    model: ModelOption = None,
    formats: FormatsOption = None,
    prompts_per_step: Annotated[
        int | None,
        typer.Option("--prompts-per-step", metavar="N", help="Prompts per step.", show_default="8"),
    ] = None,
    generations: Annotated[
        int | None,
        config_option(E2EConfig, "generations", "--generations", metavar="N", help="Completions per prompt."),
    ] = None,
    prompt_len: PromptLenOption = None,
    gen_len: GenLenOption = None,
    lora_rank: Annotated[
        int | None, typer.Option("--lora-rank", metavar="RANK", help="LoRA rank.", show_default="16")
    ] = None,
    engine: EngineOption = None,
    device: DeviceOption = None,
    recipe: Annotated[
        str | None,
        typer.Option(
            "--recipe",
            metavar="RECIPE",
            help="A training recipe giving the step's shape and memory settings (flags given win).",
        ),
    ] = None,
    linear_backend: Annotated[
        str | None,
        typer.Option(
            "--linear-backend",
            metavar="NAME,...",
            help=f"rollout.linear_backend of the steps: {' | '.join(get_args(LinearBackend))}; a comma list "
            "times each format on every backend that applies to it, side by side in this run (vLLM only).",
            show_default="the recipe's, else auto",
        ),
    ] = None,
    base_compute: Annotated[
        str | None,
        typer.Option(
            "--base-compute",
            metavar="NAME",
            help=f"train.base_compute of the steps: {' | '.join(get_args(BaseCompute))} (the frozen base's "
            "update GEMMs).",
            show_default="the recipe's, else auto",
        ),
    ] = None,
    memory_cap: MemoryCapOption = None,
    output: OutputOption = None,
    baseline: BaselineOption = None,
    tolerance: ToleranceOption = None,
    config: ConfigOption = None,
    set_: BenchSet = None,
    dry_run: DryRunOption = False,
) -> None:
    """GRPO step seconds per base format and rollout linear backend (generation, logprobs, update,
    engine sync), real trainer.

    The timed steps are `repeats` (--set repeats=N) after `warmup` untimed ones; the rewards are seeded
    random numbers, so every step does a real update. Each row's step time is set against BF16's on
    vLLM's default GEMMs with its LoRA (the `default` backend on bf16) when the run has that row.
    """
    values: dict[str, Any] = dict(
        model=model,
        formats=csv(formats),
        engine=engine,
        device=device,
        recipe=recipe,
        output=output,
        baseline=baseline,
        tolerance=tolerance,
        prompt_len=prompt_len,
        gen_len=gen_len,
        lora_rank=lora_rank,
        generations=generations,
        prompts_per_step=prompts_per_step,
        linear_backend=csv(linear_backend),
        base_compute=base_compute,
        memory_cap_gib=memory_cap,
    )
    run_bench_command(E2EConfig, values, config=config, sets=set_, dry_run=dry_run)
