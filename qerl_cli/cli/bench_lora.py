"""``qerl bench lora-tune``: tuned Triton configs for vLLM's LoRA kernels on this GPU
(:mod:`qerl_cli.bench.lora_tune`), written in vLLM's names and layout, optionally into qerl's shipped
folder. Its flags are checked before torch is imported; ``--dry-run`` prints the plan (YAML) and needs no
GPU."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.markup import escape

from qerl_cli.bench.lora_tune_settings import DEFAULT_MODEL, DEFAULT_OUTPUT, DEFAULT_RANK, DEFAULT_ROWS
from qerl_cli.bench.preflight import check_output
from qerl_cli.cli.app import DryRunOption, command_line, console, positive_ints
from qerl_cli.errors import QerlError

LoraModelOption = Annotated[
    str,
    typer.Option(
        "--model", metavar="MODEL", help="A model SHAPE (qwen2.5-7b, ...) or a folder with a config.json."
    ),
]
RankOption = Annotated[int, typer.Option("--rank", metavar="RANK", help="The LoRA rank (one of vLLM's).")]
RowsOption = Annotated[
    str | None,
    typer.Option(
        "--rows",
        metavar="N,...",
        help="Token counts per kernel call: decode batches and prefill chunks.",
        show_default=",".join(map(str, DEFAULT_ROWS)),
    ),
]
OutputOption = Annotated[
    str, typer.Option("--output", "-o", metavar="DIR", help="Folder of the config files and lora_tune.json.")
]
InstallOption = Annotated[
    bool,
    typer.Option(
        "--install",
        help="Also copy the config files into qerl_cli/rollout/lora_configs/ of this source tree.",
    ),
]


def lora_tune(
    model: LoraModelOption = DEFAULT_MODEL,
    rank: RankOption = DEFAULT_RANK,
    rows: RowsOption = None,
    output: OutputOption = DEFAULT_OUTPUT,
    install: InstallOption = False,
    dry_run: DryRunOption = False,
) -> None:
    """Tune vLLM's LoRA kernels (lora_shrink, lora_expand) for this GPU, a model shape and a LoRA rank.

    Each linear as vLLM calls its LoRA ops (qkv: 3 slices, gate_up: 2, o and down: 1) at each --rows
    token count: vLLM's default config, then a grid of candidates, timed in CUDA graphs; a candidate
    that fails to compile or whose output differs from the default's is skipped. The fastest per key goes
    into {GPU}_SHRINK.json and {GPU}_EXPAND_TRUE.json (vLLM's names and layout; every qerl engine on this
    GPU reads them once they are in qerl's shipped folder: --install), with lora_tune.json (every
    candidate's time, the default's, the speed-up). Needs a CUDA GPU and vLLM; --dry-run prints the plan.
    """
    if rank < 1:
        raise QerlError(f"--rank must be a positive integer, got {rank}")
    chosen_rows = positive_ints(rows, "--rows") if rows is not None else list(DEFAULT_ROWS)
    check_output(output)
    from qerl_cli.bench.lora_tune import lora_tune_table, plan
    from qerl_cli.bench.lora_tune_settings import LoraTuneSettings

    settings = LoraTuneSettings(model=model, rank=rank, rows=tuple(sorted(set(chosen_rows or []))),
                                output=output, install=install)  # fmt: skip
    planned = plan(settings)  # the shape and the rank checked, GPU or not
    if dry_run:
        sys.stdout.write(yaml.safe_dump(planned, sort_keys=False, default_flow_style=False))
        return
    from qerl_cli.bench.lora_tune_gpu import run_lora_tune

    data = run_lora_tune(settings, command_line())
    console.print(lora_tune_table(data))
    console.print(f"wrote {escape(', '.join(data['files']) or 'no config file')} and lora_tune.json in "
                  f"{escape(str(Path(output)))}")  # fmt: skip
    if data.get("installed"):
        console.print(f"installed {escape(', '.join(data['installed']))}")
    if data["errors"]:  # keys whose default could not be timed: in the report
        raise typer.Exit(1)
