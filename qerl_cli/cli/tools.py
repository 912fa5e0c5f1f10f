"""The helper commands beside the stages: ``env``, ``tiny-base``, ``tiny-model``, ``models``, ``quality``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, get_args

import typer
from rich.markup import escape

from qerl_cli import config
from qerl_cli.cli import render
from qerl_cli.cli.app import console, csv, use_free_cpu_threads
from qerl_cli.cli.progress import stage_log
from qerl_cli.errors import QerlError
from qerl_cli.files import check_writable_file, write_json

# What a model folder may hold, for the --formats help: the config's names, which follow the registry.
WEIGHT_FORMATS = [name for name in get_args(config.ModelFormat) if name != "auto"]


def env(json_: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """Versions of the stack and the GPUs this machine has."""
    from qerl_cli.envinfo import collect

    info = collect()
    if json_:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
        return
    console.print(render.env_table(info))


def tiny_base(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Where bf16/ and nvfp4/ go.")] = Path(
        "runs/tiny-base"
    ),
    formats: Annotated[
        str, typer.Option("--formats", metavar="FMT,...", help=f"Comma list of {','.join(WEIGHT_FORMATS)}.")
    ] = "bf16,nvfp4",
    seed: Annotated[
        int, typer.Option("--seed", metavar="SEED", help="Seed of the model and the warm start.")
    ] = 0,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Rebuild an existing base with --formats only (the others go)."),
    ] = False,
) -> None:
    """Build the warm-started tiny base that recipes/tiny.yaml trains, on the CPU.

    It runs torch on the CPU cores free when it starts: a thread more than the free cores stalls the
    others, so beside other CPU-bound work it takes fewer threads and longer (docs/tools.md gives the
    times measured, idle and beside other work). QERL_NUM_THREADS=N sets the thread count.
    """
    from qerl_cli.rl.warmstart import build_tiny_base

    use_free_cpu_threads()

    paths = build_tiny_base(
        out, formats=tuple(csv(formats) or ()), seed=seed, overwrite=overwrite, report=stage_log
    )
    for fmt, path in paths.items():
        console.print(f"{fmt}: {path}", markup=False, highlight=False)


def tiny_model(
    out: Annotated[
        Path | None, typer.Argument(metavar="OUT", help="Folder to write the model to (or -o DIR).")
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", metavar="DIR", help="Folder to write the model to, as OUT.", show_default=False
        ),
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", metavar="SEED", help="Weights are a deterministic function of the seed.")
    ] = 0,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the model files of a folder that holds a model.")
    ] = False,
) -> None:
    """Write a tiny offline Qwen2 model (transformers and vLLM load it)."""
    from qerl_cli.modeling.tiny import check_output_folder, write_tiny_model

    # -o is where every other command writing files takes its folder; OUT stays for the commands of old.
    if out is not None and output is not None:
        raise QerlError(f"OUT {out} and --output {output}: give the folder once, as -o DIR")
    if out is None and output is None:
        raise QerlError("give the folder to write the tiny model to: qerl tiny-model -o DIR")
    folder, what = (output, "--output") if output is not None else (out, "OUT")
    check_output_folder(folder, what, overwrite)  # before the model is built
    path = write_tiny_model(folder, seed=seed)
    console.print(f"wrote tiny Qwen2 model to [bold]{escape(str(path))}[/bold]")


def models_(json_: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """Model aliases qerl finds offline (e.g. smollm2-135m-instruct), how to get each, and where it looks."""
    from qerl_cli.modeling.sources import known_models

    rows = known_models()
    if json_:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    render.print_models(rows)


def quality(
    reference: Annotated[str, typer.Argument(metavar="BF16_MODEL", help="The BF16 model (folder or alias).")],
    candidates: Annotated[
        list[str],
        typer.Argument(
            metavar="[LABEL=]PATH[+ADAPTER]...",
            help="4-bit (or BF16) folders to measure, each optionally with a LoRA adapter folder on it, "
            "e.g. gptq+eora=out/gemma-nvfp4-gptq+out/gemma-nvfp4-gptq/lora_init.",
        ),
    ],
    rows: Annotated[int, typer.Option("--rows", metavar="N", help="Held-out text rows.")] = 64,
    seq_len: Annotated[
        int, typer.Option("--seq-len", metavar="TOKENS", help="Tokens per row at most.")
    ] = 256,
    device: Annotated[
        str, typer.Option("--device", metavar="DEVICE", help="auto, cpu or cuda[:N].")
    ] = "auto",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", metavar="FILE", help="Also write the report as JSON.")
    ] = None,
) -> None:
    """How much of the BF16 model each 4-bit base keeps: KL, top-1 agreement, perplexity on held-out text."""
    from qerl_cli.quantize.quality import measure_quality, parse_candidate, quality_table

    if rows <= 0 or seq_len < 2:
        raise QerlError("--rows must be > 0 and --seq-len >= 2")
    parsed = [parse_candidate(text) for text in candidates]
    _check_quality_paths(reference, parsed)
    if output is not None:
        _check_quality_output(output)
    use_free_cpu_threads()
    report = measure_quality(reference, parsed, device=device, rows=rows, seq_len=seq_len)
    console.print(quality_table(report))
    if output is not None:
        write_json(output, report.to_dict())
        console.print(f"wrote {escape(str(output))}")


def _check_quality_output(output: Path) -> None:
    """``-o FILE`` can take the report, before any model loads: not a folder, and not a file of another
    kind (a model's config.json), which the report would replace; an earlier report there is replaced."""
    if not check_writable_file(
        output, "--output", f"give a file for the JSON report, e.g. {output / 'quality.json'}"
    ):
        return
    try:
        data = json.loads(output.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        data = None
    if not (isinstance(data, dict) and {"reference", "rows"} <= data.keys()):
        raise QerlError(
            f"--output {output} exists and is not the report of an earlier `qerl quality`, which the report "
            "would replace: give another FILE"
        )


def _check_quality_paths(reference: str, candidates: list[Any]) -> None:
    """Every model and adapter named, before any model loads: a missing folder is named as one (not
    a failed Hub lookup of a path-shaped "repo id")."""
    from qerl_cli.modeling.adapter import check_folder as check_adapter_folder
    from qerl_cli.modeling.loading import folder_format
    from qerl_cli.modeling.source_checks import check_model_source

    check_model_source(reference, what="BF16_MODEL")
    held = folder_format(reference)
    if held not in (None, "bf16"):  # the BF16 model left out: the first base taken for it
        raise QerlError(
            f"BF16_MODEL {reference} is a 4-bit base ({held}): each base is measured against the BF16 model "
            'it was made from, given first (a base qerl quantize wrote names it as "model" in its '
            "qerl_quant.json)"
        )
    labels = [candidate.label for candidate in candidates]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise QerlError(
            f"the label {', '.join(twice)} names two candidates, whose rows could not be told apart: give "
            "each its own, LABEL=PATH"
        )
    for candidate in candidates:
        check_model_source(candidate.path, what=_candidate_what(candidate))
        if candidate.adapter:
            check_adapter_folder(candidate.adapter, what=f"candidate {candidate.label}'s adapter")


def _candidate_what(candidate: Any) -> str:
    """How the model checks name a candidate: their messages put the path after it, so the label taken
    from the path by default would read twice ("candidate pkl pkl holds ..."); only a label the user
    gave, other than the path's own name, is named beside the path."""
    from qerl_cli.quantize.quality import default_label  # here: the CLI imports no torch up front

    derived = default_label(candidate.path)
    return "candidate" if candidate.label in (derived, candidate.path) else f"candidate {candidate.label}"
