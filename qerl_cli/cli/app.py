"""The Typer app, the consoles and what every command shares: option types, argument parsing,
``--dry-run`` and the CPU thread choice."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

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


def csv(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def positive_ints(value: str | None, flag: str) -> list[int] | None:
    """``"2,8"`` -> [2, 8]; anything else names the element that is wrong."""
    items = csv(value)
    if items is None:
        return None
    for item in items:
        if not item.isdigit() or int(item) < 1:
            raise QerlError(f"{flag} takes comma-separated positive integers (e.g. {flag} 2,8), got '{item}'")
    if not items:
        raise QerlError(f"{flag} takes comma-separated positive integers (e.g. {flag} 2,8), got '{value}'")
    return [int(item) for item in items]


def pairs(values: list[str] | None, flag: str) -> dict[str, str] | None:
    if not values:
        return None
    out = {}
    for item in values:
        key, sep, val = item.partition("=")
        if not sep or not key or not val:
            raise QerlError(f"{flag} expects NAME=PATH, got '{item}'")
        out[key.strip()] = val.strip()
    return out


def use_free_cpu_threads() -> None:
    """Entry of a CPU path: torch runs on the cores free now (on all of them beside a busy process its
    threads stall each other tenfold); says so when that is fewer than torch's own count."""
    from qerl_cli.torch_utils import use_free_cpu_threads as choose

    choice = choose()
    if choice.lowered:
        err_console.print(f"[dim]{escape(choice.reason)}[/dim]")


def finish_config(config: Any, dry_run: bool) -> bool:
    """Print the resolved config for --dry-run; returns True when the command should stop."""
    if dry_run:  # plain YAML, not rich markup, so the output can be saved and reused as a recipe
        sys.stdout.write(cfg.dump_yaml(config))
    return dry_run
