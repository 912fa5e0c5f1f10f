"""``qerl bench lora-tune``: tuned Triton configs for vLLM's LoRA kernels on this GPU
(:mod:`qerl_cli.bench.lora_tune`), written in vLLM's names and layout, optionally into qerl's shipped
folder. Its settings resolve as every benchmark's do (``--config`` < flags < ``--set``) and are checked
before torch is imported; ``--dry-run`` prints them as YAML and the plan as comments, and needs no GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from qerl_cli.bench.lora_tune_settings import DEFAULT_ROWS, LoraTuneSettings
from qerl_cli.bench.preflight import check_output
from qerl_cli.cli.app import (
    ConfigOption,
    DryRunOption,
    command_line,
    console,
    finish_config,
    positive_ints,
    print_plan,
    set_option,
)
from qerl_cli.cli.bench_tools import load_settings, option

L = LoraTuneSettings  # the --help defaults below are its own
LoraTuneSet = set_option("rank=32")
RowsOption = Annotated[
    str | None,
    typer.Option(
        "--rows",
        metavar="N,...",
        help="Token counts per kernel call: decode batches and prefill chunks.",
        show_default=",".join(map(str, DEFAULT_ROWS)),
    ),
]
InstallOption = Annotated[
    bool | None,
    typer.Option(
        "--install",
        help="Also copy the config files into qerl_cli/rollout/lora_configs/ of this source tree.",
    ),
]
OutputOption = Annotated[
    str | None,
    typer.Option(
        "--output",
        "-o",
        metavar="DIR",
        help="Folder of the config files and lora_tune.json.",
        show_default="lora_tune",
    ),
]


def lora_tune(
    model: option(L, "model", "--model", "MODEL", str) = None,
    rank: option(L, "rank", "--rank", "RANK") = None,
    rows: RowsOption = None,
    install: InstallOption = None,
    device: option(L, "device", "--device", "DEVICE", str) = None,
    output: OutputOption = None,
    config: ConfigOption = None,
    set_: LoraTuneSet = None,
    dry_run: DryRunOption = False,
) -> None:
    """Tune vLLM's LoRA kernels (lora_shrink, lora_expand) for this GPU, a model shape and a LoRA rank.

    Each linear as vLLM calls its LoRA ops (qkv: 3 slices, gate_up: 2, o and down: 1) at each --rows
    token count: vLLM's default config, then a grid of candidates, timed in CUDA graphs; a candidate that
    fails to compile or whose output differs from the default's is skipped. The fastest per key goes into
    {GPU}_SHRINK.json and {GPU}_EXPAND_TRUE.json (vLLM's names and layout; every qerl engine on this GPU
    reads them once they are in qerl's shipped folder: --install), with lora_tune.json (every candidate's
    time, the default's, the speed-up). Needs a CUDA GPU and vLLM; --dry-run prints the plan without.
    """
    values = dict(model=model, rank=rank, rows=positive_ints(rows, "--rows"), install=install, device=device,
                  output=output)  # fmt: skip
    conf = load_settings(LoraTuneSettings, values, config, set_)
    check_output(conf.output)  # the GPU and vLLM are checked when it runs: --dry-run needs neither
    from qerl_cli.bench.lora_tune import lora_tune_table, plan_lines

    lines = plan_lines(conf)  # the shape and the rank checked, GPU or not
    if finish_config(conf, dry_run):
        print_plan(lines)
        return
    from qerl_cli.bench.lora_tune_gpu import run_lora_tune

    data = run_lora_tune(conf, command_line())
    console.print(lora_tune_table(data))
    console.print(f"wrote {escape(', '.join(data['files']) or 'no config file')} and lora_tune.json in "
                  f"{escape(str(Path(conf.output)))}")  # fmt: skip
    if data.get("installed"):
        console.print(f"installed {escape(', '.join(data['installed']))}")
    if data["errors"]:  # keys whose default config could not be timed: in the report
        raise typer.Exit(1)
