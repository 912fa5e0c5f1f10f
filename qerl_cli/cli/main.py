"""The console entry point: run the app, and turn every way it can end into an exit code and one
message (user errors exit 2 in red, unexpected errors exit 1, Ctrl-C 130)."""

from __future__ import annotations

import errno
import logging
import os
import sys

import typer
from rich.markup import escape

from qerl_cli.cli.app import app, err_console
from qerl_cli.errors import QerlError

INTERRUPTED = "[red]interrupted[/red] (qerl train continues from its last checkpoint with --resume auto)"
_USER_OS_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}


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


def _internal_error(exc: BaseException, debug: bool) -> int:
    if debug:
        err_console.print_exception()
    else:
        message = escape(f"{type(exc).__name__}: {exc}")
        err_console.print(f"[bold red]internal error:[/bold red] {message}")
        err_console.print("[dim]re-run with --debug for the traceback[/dim]")
    return 1
