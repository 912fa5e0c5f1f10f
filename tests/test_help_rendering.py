"""`--help` reads well: docstring paragraphs reflow to the terminal (not broken where the source wrapped
them), required arguments show as their names in the usage line (not typer 0.29's ``{MODEL}``), and
shell completion is offered."""

from __future__ import annotations

import pytest

from qerl_cli.cli import main
from qerl_cli.cli.app import reflow


def help_of(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    assert main([*command, "--help"]) == 0
    return capsys.readouterr().out


def test_paragraphs_reflow_to_the_width(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    out = help_of(capsys, "tiny-base")
    # The source breaks this paragraph after "stalls the" and after "so beside": here, one line.
    assert any(
        "stalls the others, so beside other" in line and "takes fewer threads" in line
        for line in out.splitlines()
    )


def test_reflow_keeps_paragraphs_and_verbatim_blocks() -> None:
    text = "Summary line\n    goes on.\n\n    Second paragraph,\n    wrapped.\n\n    \b\n    keep\n    these"
    assert reflow(text) == "Summary line goes on.\n\nSecond paragraph, wrapped.\n\n\b\nkeep\nthese"


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        (["quality"], "Usage: qerl quality [OPTIONS] BF16_MODEL [LABEL=]PATH[+ADAPTER]..."),
        (["quantize"], "Usage: qerl quantize [OPTIONS] MODEL"),
        (["tiny-model"], "Usage: qerl tiny-model [OPTIONS] [OUT]"),  # OUT or -o DIR
        (["compare"], "Usage: qerl compare [OPTIONS] RECIPE"),
    ],
)
def test_required_arguments_show_as_their_names(
    command: list[str], usage: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    out = help_of(capsys, *command)
    assert usage in out and "{" not in out.split("\n\n", 2)[1]


def test_shell_completion_is_offered(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    out = help_of(capsys)
    assert "--install-completion" in out and "--show-completion" in out
    monkeypatch.setenv("_QERL_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "qerl tr")
    monkeypatch.setenv("COMP_CWORD", "1")
    with pytest.raises(SystemExit) as done:  # click answers a completion request and exits
        main([])
    assert done.value.code == 0 and capsys.readouterr().out.split() == ["train"]
