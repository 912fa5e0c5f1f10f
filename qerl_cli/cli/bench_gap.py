"""``qerl bench gap``: the rollout/trainer logprob gap per rollout linear backend, teacher-forced on the
same sequences (:mod:`qerl_cli.bench.gap`). It takes a training recipe (``RECIPE``, its keys with
``--set``, as ``qerl bench scaling`` does) and checks its flags and the recipe before torch is imported,
then, without loading the model, what the run would refuse (each vLLM backend's package and GPU, the
output folder, the device, the model, the data and its prompt count: exit 2 naming it); ``--dry-run``
prints the resolved recipe as YAML, those checks (each input once), and the benchmark's settings as
comments."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from qerl_cli.bench.gap_settings import GAP_ADAPTERS, GAP_BACKENDS, GapSettings
from qerl_cli.bench.preflight import check_output
from qerl_cli.cli.app import (
    DryRunOption,
    check_recipe_path,
    command_line,
    console,
    csv,
    finish_config,
    print_plan,
    set_option,
    use_free_cpu_threads,
)
from qerl_cli.cli.stages import print_checks
from qerl_cli.config import TrainConfig, load_config

G = GapSettings  # the flags' defaults are its own (the backends' list: its default factory's)
GapSet = set_option("model.path=BASE_DIR")


RecipeArg = Annotated[
    Path, typer.Argument(metavar="RECIPE", help="Training recipe: a path or a shipped recipe's name.")
]
BackendsOption = Annotated[
    str,
    typer.Option(
        "--backends",
        metavar="NAME,...",
        help=f"Backends scored, the first that is not hf the ratios' reference: comma list of "
        f"{', '.join(GAP_BACKENDS)} (hf: training's transformers engine over the live policy, the floor; "
        "best listed last).",
    ),
]
SequencesOption = Annotated[
    int, typer.Option("--sequences", metavar="N", help="Sequences scored (prompts of the recipe's data).")
]
MaxTokensOption = Annotated[
    int, typer.Option("--max-tokens", metavar="TOKENS", help="Completion tokens sampled at most.")
]
AdapterOption = Annotated[
    str,
    typer.Option(
        "--adapter",
        metavar="KIND",
        help=f"{' | '.join(GAP_ADAPTERS)}: the recipe's LoRA with seeded random B, or the base alone.",
    ),
]
SeedOption = Annotated[
    int, typer.Option("--seed", metavar="N", help="Seed of the completions, adapter, bootstrap.")
]
MarginOption = Annotated[
    float, typer.Option("--margin", metavar="FRACTION", help="Verdict: a ratio within 1 + FRACTION.")
]
DeviceOption = Annotated[
    str | None,
    typer.Option(
        "--device",
        metavar="DEVICE",
        help="The recipe's train.device: auto, cpu or cuda[:N] "
        "(the trainer side and the hf backend; vLLM runs on the GPU).",
        show_default="the recipe's",
    ),
]
OutputOption = Annotated[
    str,
    typer.Option(
        "--output",
        "-o",
        metavar="DIR",
        help="Folder of gap.json, gap.md, sequences.json, trainer_logprobs.json, logprobs/, adapter/ "
        "(--adapter random) and engines/ (vLLM backends); made once the checks pass.",
    ),
]


def gap(
    recipe: RecipeArg,
    backends: BackendsOption = ",".join(GapSettings(recipe="").backends),
    sequences: SequencesOption = G.sequences,
    max_tokens: MaxTokensOption = G.max_tokens,
    adapter: AdapterOption = G.adapter,
    seed: SeedOption = G.seed,
    margin: MarginOption = G.margin,
    device: DeviceOption = None,
    output: OutputOption = G.output,
    set_: GapSet = None,
    dry_run: DryRunOption = False,
) -> None:
    """The rollout/trainer logprob gap of each rollout linear backend, on the same sequences.

    One completion per prompt of the recipe's training data is sampled by the trainer's policy through
    training's transformers engine, with the recipe's sampling (temperature, top_p, stop strings); the
    trainer and every backend's engine (vLLM, built as training builds it, the adapter synced its own
    way; hf: training's transformers engine over the live policy) score exactly those tokens at
    temperature 1 (vLLM's prompt logprobs take no temperature). Per backend: the mean |engine - trainer|
    logprob per token with its 95% interval; for the others, the ratio to the reference's gap (the first
    backend that is not hf) with a paired bootstrap interval and a verdict against 1 + --margin.
    """
    settings = GapSettings(recipe=str(recipe), backends=csv(backends) or [], sequences=sequences,
                           max_tokens=max_tokens, adapter=adapter, seed=seed, margin=margin,
                           output=output)  # fmt: skip
    settings.validate()
    check_recipe_path(recipe)
    sets = [f"train.device={device}", *(set_ or [])] if device else set_  # --set train.device wins
    conf = load_config(TrainConfig, recipe, sets)
    check_output(settings.output)  # its line is check_inputs' own, as the device's
    from qerl_cli.bench.gap import check_inputs, run_gap, written_files
    from qerl_cli.torch_utils import parse_device

    if device:  # its name, as typed: the recipe's train.device, which it sets, is no key the user gave
        parse_device(device, "--device")
    # The device used (a GPU where it names one) is check_inputs' question, under the key that gave it:
    # --device where the flag did, train.device where a --set of it won over the flag.
    device_key = "--device" if device and conf.train.device == device else "train.device"
    if finish_config(conf, dry_run):  # the YAML, then the checks: the model, device and data, not loaded
        print_checks(check_inputs(conf, settings, device_key)[0])
        print_plan([f"{key}: {value}" for key, value in vars(settings).items()])
        return
    _, chosen = check_inputs(conf, settings, device_key)  # seconds, before the folder is made and work
    from qerl_cli.bench.gap_report import MARKDOWN_NAME
    from qerl_cli.torch_utils import runs_on_cpu

    if runs_on_cpu(conf.train.device):
        use_free_cpu_threads()
    report = run_gap(settings, conf, command=command_line(), chosen=chosen)
    out = Path(settings.output)
    console.print((out / MARKDOWN_NAME).read_text(), markup=False, highlight=False)
    console.print(f"wrote {escape(', '.join(written_files(out)))}")
    if report.failed:  # a backend without figures: its error is in the report
        raise typer.Exit(1)
