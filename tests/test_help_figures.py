"""`--help` says what a command and each option do, never what a run measured: figures from runs (times,
rates, speed-ups, memory, shares) live in `benchmarks/<run>/` and the docs, where they say on what
machine and under what load they were taken. `qerl tiny-base --help` carried "about 76 s of CPU time"
and "13 min 38 s"."""

from __future__ import annotations

import re

import pytest
from typer.main import get_command

from qerl_cli.cli import app, main

# A measured-looking figure: a number with a unit of time, of rate, of memory, a speed-up or a share.
# "[default: ...]" is left out first (a default is a setting, not a measurement); a percentage that
# names a confidence level ("a 95% interval") is a definition.
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?\s*(?:"
    r"s|sec|seconds?|ms|µs|us|min|minutes?|h|hours?"  # time
    r"|tok/s|tokens/s|GB/s|TB/s|GFLOP/s|TFLOP/s"  # rate
    r"|[KMGT]i?B"  # memory
    r")(?![\w/])"
    r"|\b\d+(?:\.\d+)?x\b"  # a speed-up (1.58x), not a product (16 x 8)
    r"|\b\d+(?:\.\d+)?\s*%(?! interval)"
)
DEFAULT = re.compile(r"\[default: [^\]]*\]")


def _commands(command, path: tuple[str, ...] = ()):  # noqa: ANN001, ANN202 (typer's click classes)
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = list(_commands(get_command(app)))


def figures(text: str) -> list[str]:
    return [match.group(0) for match in FIGURE.finditer(DEFAULT.sub("", " ".join(text.split())))]


def test_the_scan_finds_what_tiny_base_carried() -> None:
    """The rule catches the figures that were there (so a pass below means something)."""
    text = (
        "It needs about 76 s of CPU time. with one of 2 cores busy, one thread, about 1.5 min (13 min 38 s); "
        "243 µs, 1.58x, 25% of its roofline bound, 1.6 GiB, 900 tok/s"
    )
    found = ["76 s", "1.5 min", "13 min", "38 s", "243 µs", "1.58x", "25%", "1.6 GiB", "900 tok/s"]
    assert figures(text) == found
    assert figures("a 95% interval; --rows 64 [default: 30 s]; qwen2.5-7b; 4-bit; 2 cores; 16 x 8") == []


@pytest.mark.parametrize("command", COMMANDS, ids=lambda path: " ".join(("qerl", *path)))
def test_no_help_carries_a_measured_figure(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # one line per option: a figure is not split by the wrap
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert not figures(out), f"qerl {' '.join(command)} --help: move {figures(out)} to the docs"
