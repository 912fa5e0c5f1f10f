"""The Typer app, the consoles and what every command shares: option types, argument parsing,
``--dry-run``, ``--version`` and the CPU thread choice."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.protocol import is_renderable, rich_cast
from typer.core import TyperCommand, TyperGroup

from qerl_cli import __version__
from qerl_cli.cli.table_width import unbreakable_width
from qerl_cli.config import dump_yaml, read_yaml, shipped_recipe_named
from qerl_cli.config.keydocs import field_help
from qerl_cli.errors import QerlError, qerl_command


class _ReadableHelp:
    """Help as a reader expects it:

    - no type column for flags: typer 0.29 prints each option's Python type, a flag's (``--dry-run``,
      ``--help``) as ``<bool>``, though a flag takes no value;
    - docstring paragraphs reflowed to the terminal's width: typer keeps their source line breaks, which
      broke lines mid-sentence in any other width (a paragraph starting with ``\b`` keeps its lines);
    - required arguments in the usage line as their names (``MODEL``), not typer 0.29's ``{MODEL}``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if self.help:  # type: ignore[has-type]
            self.help = reflow(self.help)  # type: ignore[has-type]

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [_plain_usage(piece) for piece in super().collect_usage_pieces(ctx)]  # type: ignore[misc]


def reflow(text: str) -> str:
    """A docstring's paragraphs each on one line (click and typer wrap them to the terminal)."""

    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split()) for p in paragraphs)


def _plain_usage(piece: str) -> str:
    """``{MODEL}`` -> ``MODEL``; ``{[LABEL=]PATH...}...`` -> ``[LABEL=]PATH...`` (the dots said once)."""

    match = re.fullmatch(r"\{(.*)\}(\.\.\.)?", piece)
    if match is None:
        return piece
    inner, dots = match.groups()
    return inner if inner.endswith("...") else inner + (dots or "")


class QerlGroup(_ReadableHelp, TyperGroup):
    pass


class QerlCommand(_ReadableHelp, TyperCommand):
    """Every qerl command's class (``app.command(cls=QerlCommand)``)."""


app = typer.Typer(
    name="qerl",
    cls=QerlGroup,
    help="Quantization-enhanced RL (QeRL, arXiv 2510.11696): GRPO/DAPO with LoRA on a 4-bit base.",
    # A bare `qerl` prints the help and exits 2, as click (>= 8.2) and typer do for a group.
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
    # -h as well, as most CLIs take it (every subcommand inherits it); --help first, the one messages name.
    context_settings={"help_option_names": ["--help", "-h"]},
)
# Piped output (CI logs, `| tee`, a file) has no terminal width: rich would cut tables at 80 columns
# there, and a width of 1000 made tables of prose (`qerl models`) hundreds of columns wide. So a piped
# table wraps its prose at PIPED_WIDTH, yet is made as wide as its longest unbreakable cell needs (a path,
# a command), which would otherwise be cut with an ellipsis. COLUMNS, when set, is the width as given.
PIPED_WIDTH = 100


class _CliConsole(Console):
    """rich's console, at least :data:`PIPED_WIDTH` wide when its stream is not a terminal and COLUMNS is
    unset, wider for one print where a table's unbreakable cells need it (the stream and COLUMNS are both
    read at each print: a test, or a caller, may change either after the console was made)."""

    # The width the renderables of the print under way need, piped; None between prints.
    _needed: int | None = None

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if not self._piped():
            return size
        return ConsoleDimensions(max(PIPED_WIDTH, self._needed or 0), size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]

    def _piped(self) -> bool:
        return not self.is_terminal and not os.environ.get("COLUMNS", "").strip().isdigit()

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if not self.is_terminal and objects and all(_is_message(obj) for obj in objects):
            # A message, not a table, into a log (COLUMNS set or not): each of its lines stays whole (a
            # path cut in two breaks a grep, a copy and paste); only tables wrap at the width.
            kwargs.setdefault("soft_wrap", True)
        if not self._piped() or self._needed is not None:  # a terminal, COLUMNS, or a nested print
            super().print(*objects, **kwargs)
            return
        self._needed = unbreakable_width(self, [obj for obj in objects if not _is_message(obj)])
        try:
            super().print(*objects, **kwargs)
        finally:
            self._needed = None


def _is_message(obj: Any) -> bool:
    """A string, or a value rich prints as its ``str`` (a number, a path): text, not a table."""
    return isinstance(obj, str) or not is_renderable(rich_cast(obj))


def output_console(stderr: bool = False) -> Console:
    """A console of the CLI: the terminal's width on a terminal; piped, COLUMNS or :data:`PIPED_WIDTH` (wider
    for a table whose unbreakable cells need more)."""
    return _CliConsole(stderr=stderr)


console = output_console()
err_console = output_console(stderr=True)
# argv: what main() was given; stop_hint: see set_stop_hint
_state: dict[str, Any] = {"debug": False, "argv": None, "stop_hint": None}


def set_stop_hint(hint: Callable[[], str] | None) -> None:
    """What the running command tells a user whose run stopped (Ctrl-C, a full disk): how to go on.
    A callable, asked when it stops, as the answer depends on what was saved by then; None: nothing
    to add (a command that simply starts over)."""
    _state["stop_hint"] = hint


def stop_hint() -> str | None:
    hint = _state.get("stop_hint")
    return hint() if hint is not None else None


def record_argv(argv: list[str]) -> None:
    """Keep the arguments main() was given, for :func:`command_line`."""
    _state["argv"] = list(argv)


def command_line() -> str:
    """The command as typed (``qerl bench rollout --batch 2,8``), for the reports that record it."""

    argv = _state["argv"] if _state["argv"] is not None else sys.argv[1:]
    return qerl_command(*argv)


def set_option(example: str) -> Any:
    """The ``--set`` option of a stage, with an example key of that stage's config."""
    return Annotated[
        list[str] | None,
        typer.Option(
            "--set", metavar="KEY=VALUE", help=f"Override a config key: --set {example} (repeatable)."
        ),
    ]


DryRunOption = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Print the resolved config as YAML, make the checks a run makes before any work (exit 2 naming "
        "what fails) and exit without the work.",
    ),
]
ConfigOption = Annotated[
    Path | None, typer.Option("--config", metavar="YAML", help="A YAML file with this stage's settings.")
]


def config_default(cls: type, name: str) -> str:
    """A config field's default, for ``--help`` (``show_default=``): the flag itself defaults to None,
    "not given", so that a recipe (``--config``) can set the key; absent both, this value applies."""
    value = _default(next(f for f in dataclasses.fields(cls) if f.name == name))
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def config_option(
    cls: type, key: str, *decls: str, metavar: str | None = None, help: str | None = None,
    show_default: str | bool | None = None,
) -> Any:  # fmt: skip
    """A stage's flag for config key ``key``: None ("not given") unless typed, its --help the comment
    that documents the field (:func:`qerl_cli.config.keydocs.field_help`, the key's one home, which
    ``qerl train --keys`` prints too) unless ``help`` says otherwise, showing the config's default
    (``[default: (256)]``: a default described, as click writes one not the flag's) unless
    ``show_default`` does (False for an on/off flag, whose default is off).

    ``decls`` are the flag's names (``"--format", "-f"``), required: typer 0.27 names an option that
    has none after its metavar when the two differ only in case (``method`` with metavar ``METHOD``
    became ``--METHOD``, so ``--method`` was "No such option"). Every qerl option spells its names."""
    if not any(decl.startswith("--") for decl in decls):
        raise TypeError(f"config_option({cls.__name__}, {key!r}): give the flag's names, e.g. '--{key}'")
    if help is None:
        help = flag_help(field_help(cls).get(key, ""))
    if show_default is None:
        show_default = config_default(cls, key)
    return typer.Option(*decls, metavar=metavar, help=help, show_default=show_default)


def flag_help(key_help: str) -> str:
    """A config key's comment as its flag's help: the key's ``null: X`` (YAML's "no value") is, for a
    flag, the flag left out (``--max-problems null`` is no number: click refuses it)."""
    return re.sub(r"\bnull: ", "left out: ", key_help)


# The parameters of a stage command that are no config key: the rest are named as their keys.
NOT_KEYS = frozenset({"config", "set_", "dry_run"})


def flag_values(params: dict[str, Any], **converted: Any) -> dict[str, Any]:
    """A stage command's config values from its parameters (``locals()`` on entry): each parameter is
    named as the key it sets, so the flag -> key mapping is the signature itself; ``converted`` replaces
    the values a flag spells otherwise (``benchmarks=csv(benchmarks)``)."""
    return {name: converted.get(name, value) for name, value in params.items() if name not in NOT_KEYS}


def given_flags(values: dict[str, Any], sets: list[str] | None, **names: str) -> dict[str, str]:
    """The flag that gave each config value (None: not given), for errors to name:
    ``--key-with-dashes`` unless ``names`` spells it otherwise (``data_files="--data-file"``). A key that
    ``--set`` (``sets``) overrides is the user's ``--set`` key, not the flag's."""
    overridden = {item.partition("=")[0].strip() for item in sets or []}
    return {
        key: names.get(key, "--" + key.replace("_", "-"))
        for key, value in values.items()
        if value is not None and key not in overridden
    }


def given_keys(
    values: dict[str, Any], sets: list[str] | None, config: Path | None, cls: type | None = None
) -> set[str]:
    """The config keys the user set: flags given (``values``, None: not given), ``--set`` keys (a dotted
    one, ``vllm_kwargs.enforce_eager``, as the key it sets inside: ``vllm_kwargs``), and the keys of a
    ``--config`` file. With ``cls``, a file's key at ``cls``'s default is left out: a ``--dry-run``'s
    YAML, saved and given back, holds every key, and must run as it did."""
    keys = {key for key, value in values.items() if value is not None}
    keys |= {item.partition("=")[0].strip().split(".")[0] for item in sets or []}
    if config is not None:  # read as load_config reads it: a file that is no YAML mapping is a QerlError
        defaults = {} if cls is None else {f.name: _default(f) for f in dataclasses.fields(cls)}
        missing = object()
        keys |= {key for key, value in read_yaml(config).items() if defaults.get(key, missing) != value}
    return keys


def _default(field: dataclasses.Field[Any]) -> Any:
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def qerl_version() -> str:
    """The installed distribution's version; the package's own where qerl runs from an uninstalled tree."""
    try:
        return metadata.version("qerl")
    except metadata.PackageNotFoundError:
        return __version__


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"qerl {qerl_version()}\n")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print qerl's version and exit."
        ),
    ] = False,
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


def at_least_one(values: dict[str, object], **flags: str) -> None:
    """Each of ``flags`` (config key -> flag) that was given holds a whole number >= 1: ``--samples 0``
    would otherwise mean "the benchmark's default" in silence, and a negative count nothing sensible."""
    for key, flag in flags.items():
        value = values.get(key)
        if isinstance(value, int) and value < 1:
            default = " (leave it out for each benchmark's default)" if key == "samples" else ""
            raise QerlError(f"{flag} must be at least 1, got {value}{default}")


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


def check_recipe_path(path: Path | str | None, what: str = "RECIPE") -> None:
    """A recipe or ``--config`` argument that names a folder or a binary file is the user's to fix:
    say which, and what is expected, before the YAML reader takes a folder for a missing file or
    fails on undecodable bytes. (A shipped recipe's bare name is not a path: the config resolves it.)

    ``--config`` holds one command's settings, never a shipped training recipe: a missing one is named
    as the flag, with the way to write one, not answered with the list of training recipes."""
    if path is None:
        return
    path = Path(path)
    settings = what == "--config"
    if not settings and not path.is_file() and shipped_recipe_named(path) is not None:
        return  # a shipped recipe's name, though a folder of that name is here (`qerl tiny-model tiny`)
    if settings and not path.exists():
        raise QerlError(
            f"--config {path}: no such file; give a YAML file of this command's settings (the command "
            "with --dry-run prints them as YAML: `... --dry-run > settings.yaml`)"
        )
    if path.is_dir():
        yamls = sorted(p.name for p in path.glob("*.y*ml"))[:4]
        inside = f" (it holds {', '.join(yamls)})" if yamls else ""
        expected = "a YAML file of this command's settings" if settings else (
            "a recipe YAML file in it, or a shipped recipe's name (tiny, gsm8k_7b, ...)"
        )  # fmt: skip
        raise QerlError(f"{what} {path} is a folder{inside}; give {expected}")
    if path.is_file():
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise QerlError(
                f"{what} {path} is not a text YAML file (byte {exc.start} is not UTF-8 text); "
                "give a recipe YAML file"
            ) from None


def print_plan(lines: list[str]) -> None:
    """``--dry-run``'s plan after the config's YAML, as YAML comments (``# plan:``), so that the output
    stays a ``--config`` file: the one way every benchmark prints what it will do."""
    sys.stdout.write("".join(f"# {line}\n" for line in lines))


def finish_config(config: Any, dry_run: bool) -> bool:
    """Print the resolved config for --dry-run; returns True when the command should stop."""
    if dry_run:  # plain YAML, not rich markup, so the output can be saved and reused as a recipe
        sys.stdout.write(dump_yaml(config))
    return dry_run
