"""The console entry point: run the app, and turn every way it can end into an exit code and one
message (user errors exit 2 in red, unexpected errors exit 1, Ctrl-C 130; SIGTERM 143 where a command
takes it as Ctrl-C: ``cli/interrupt.py``).

Usage errors (an unknown command or option, a missing argument, a bad value) exit 2 with the usage line
and ``error: ...``, as click's own commands do. typer >= 0.29 no longer raises click's exceptions but
its own copies of them (click is not even a dependency any more), so they are recognised by what both
have, an int ``exit_code`` and ``format_message()``, not by class.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
from typing import Any

import typer
from rich.markup import escape

from qerl_cli.cli.app import app, console, err_console, record_argv, set_stop_hint, stop_hint
from qerl_cli.cli.interrupt import interrupt_exit_code, reset_interrupt
from qerl_cli.cli.option_hints import recipe_key_hint
from qerl_cli.cli.progress import quiet_library_bars
from qerl_cli.errors import QerlError, closest

_USER_OS_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}


def main(argv: list[str] | None = None) -> int:
    """Console entry point: user errors exit 2 in red, unexpected errors exit 1."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_library_bars()  # every command, before any imports the libraries: a log gets no tqdm bars
    # peft imports bitsandbytes when it is installed; on AVX512-BF16 CPUs bitsandbytes then warns that
    # an optional hub kernel is missing, which reads like a failure in every qerl run. qerl's CPU path
    # never calls bitsandbytes' kernels (NF4 is dequantized by qerl's own code), so that one is muted.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    args = list(argv if argv is not None else sys.argv[1:])
    debug = "--debug" in args
    record_argv(args)  # what the reports of `qerl bench` record as their command
    set_stop_hint(None)  # a command that can be continued sets its own (qerl train)
    reset_interrupt()
    try:
        # standalone_mode=False returns click's exit code instead of calling sys.exit; prog_name keeps
        # usage lines saying "qerl" under `python -m qerl_cli`, torchrun and in-process calls.
        rc = app(args=argv, prog_name="qerl", standalone_mode=False)
    except QerlError as exc:
        if debug:
            err_console.print_exception()
        # soft_wrap: a path or a command in the message stays whole, to be copied (the terminal wraps it)
        err_console.print(f"[bold red]error:[/bold red] [red]{escape(str(exc))}[/red]", soft_wrap=True)
        return 2
    except typer.Exit as exc:
        return exc.exit_code
    except OSError as exc:
        if exc.errno not in _USER_OS_ERRORS:
            return _internal_error(exc, debug)
        # A full disk, a quota, a read-only or foreign folder: the user's to fix, so no traceback.
        where = escape(f" {exc.filename}" if exc.filename else "")
        hint = stop_hint()
        err_console.print(
            f"[bold red]error:[/bold red] [red]cannot write{where}: {escape(exc.strerror or str(exc))}[/red] "
            f"(free space or choose another output folder{escape(f'; {hint}' if hint else '')})",
            soft_wrap=True,
        )
        return 2
    except typer.Abort:
        err_console.print("[red]aborted[/red]")
        return 130
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM under cli.interrupt.sigterm_interrupts
        _print_interrupted()
        return interrupt_exit_code()
    except Exception as exc:  # click's and typer's usage errors are the user's; the rest are bugs
        if _is_click_error(exc):
            return _show_click_error(exc)
        return _internal_error(exc, debug)
    if rc == 130:  # typer turns Ctrl-C (and SIGTERM's Terminated) into a silent Exit(130) when not standalone
        _print_interrupted()
        return interrupt_exit_code()
    return rc if isinstance(rc, int) else 0


def _print_interrupted() -> None:
    """ "interrupted", and how to go on where the command says (qerl train: resume, or start over)."""
    hint = stop_hint()
    # soft_wrap: the command in the hint stays whole, to be copied (rich would fold it at the width)
    err_console.print("[red]interrupted[/red]" + (f" ({escape(hint)})" if hint else ""), soft_wrap=True)


def _is_click_error(exc: BaseException) -> bool:
    """click's ``ClickException`` family or typer's vendored copy of it (``UsageError``, ``NoSuchOption``,
    ``BadParameter``, ...): by shape, so a change of typer's private module paths cannot hide one."""
    return isinstance(getattr(exc, "exit_code", None), int) and callable(getattr(exc, "format_message", None))


def _show_click_error(exc: Any) -> int:
    """What click prints for the error, through the error console: the usage line, where to find help,
    and ``error: ...`` in the red of qerl's own errors. Returns click's exit code (2 for usage errors)."""
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoArgsIsHelpError":  # bare `qerl`: the help, then click's exit code
        # typer's rich help is printed while the error is made; click's plain help is its message.
        if exc.format_message():
            console.print(exc.format_message(), markup=False, highlight=False)
        return exc.exit_code
    if ctx is not None:
        err_console.print(ctx.get_usage(), markup=False, highlight=False)
        if ctx.command.get_help_option(ctx) is not None:
            hint = f"Try '{ctx.command_path} {ctx.help_option_names[0]}' for help."
            err_console.print(hint, markup=False, highlight=False)
    message = exc.format_message()
    if type(exc).__name__ == "NoSuchOption" and ctx is not None:  # a recipe key given as a flag
        named = re.search(r"No such option: (\S+)", message)  # click leaves option_name unset for -o
        option = getattr(exc, "option_name", None) or (named.group(1) if named else "")
        message = exc.message + _option_meant(ctx.command, option)
        hint = recipe_key_hint(ctx.command_path, option)
        message += f"; {hint}" if hint else ""
    err_console.print(f"[bold red]error:[/bold red] [red]{escape(message)}[/red]", soft_wrap=True)
    return exc.exit_code


def _option_meant(command: Any, option: str) -> str:
    """The "did you mean --NAME?" of a mistyped long option, by the one close-match rule
    (:func:`~qerl_cli.errors.closest`, on the names without their dashes) rather than click's own list,
    whose shared "--" made `--baseline` suggest `--seq-len`."""
    names = [name[2:] for param in command.params for name in (*param.opts, *param.secondary_opts)
             if name.startswith("--")]  # fmt: skip
    meant = closest(option.lstrip("-").partition("=")[0], names) if option.startswith("--") else None
    return f" (did you mean --{meant}?)" if meant else ""


def _internal_error(exc: BaseException, debug: bool) -> int:
    if debug:
        err_console.print_exception()
    else:
        message = escape(f"{type(exc).__name__}: {exc}")
        err_console.print(f"[bold red]internal error:[/bold red] {message}")
        err_console.print("[dim]re-run with --debug for the traceback[/dim]")
    return 1
