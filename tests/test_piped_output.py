"""Output that is not a terminal (CI logs, `| tee`, `nohup`): `qerl train` prints a line per step as the
steps happen (a live bar there prints nothing until the end), and tables keep long cells whole instead of
cutting them at 80 columns."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import tiny_cpu_recipe
from rich.table import Table

from qerl_cli.cli.app import PIPED_WIDTH, output_console
from qerl_cli.rl.tracking import StepLines, progress_bar
from qerl_cli.torch_utils import duration

REPO = Path(__file__).resolve().parents[1]


def test_piped_train_prints_step_lines_as_they_happen(tiny_model_dir: Path, tmp_path: Path) -> None:
    recipe = tiny_cpu_recipe(
        tmp_path / "recipe.yaml", tiny_model_dir, tmp_path / "run", max_steps=3, save_steps=3
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "QERL_NUM_THREADS": "1"}
    env.pop("COLUMNS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "qerl_cli", "train", str(recipe)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.stdout is not None
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("train step 1/3 "):
                # The line arrived while the run still had steps, the adapter and the summary to do.
                assert proc.poll() is None
                break
        else:
            pytest.fail(f"no step line in the piped output: {''.join(lines)}")
        assert "reward" in line and "eta" in line and "step " in line
        rest = proc.stdout.read()
    finally:
        rc = proc.wait(timeout=300)
    assert rc == 0
    assert "train step 3/3 " in rest and "qerl train" in rest  # the last step, then the summary


def test_step_lines_throttle_fast_steps() -> None:
    out = io.StringIO()
    lines = StepLines(total=5, done=0, out=out, every_s=3600)
    for _ in range(5):
        lines({"reward_mean": 0.5, "accuracy": 0.25, "time_step_s": 0.1})
    printed = out.getvalue().splitlines()
    assert [line.split()[2] for line in printed] == ["1/5", "5/5"]  # the first and the last
    assert "reward 0.500 acc 0.250" in printed[0] and "step 0.1s" in printed[0]


def test_progress_is_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    with progress_bar(True, 2, 1, stream=out) as update:
        update({"reward_mean": 1.0})
    assert out.getvalue().startswith("train step 2/2 reward 1.000")


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (59.6, "1m00s"), (75, "1m15s"), (3725, "1h02m"), (200_000, "2.3 days")]
)
def test_duration(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_a_piped_table_keeps_a_long_cell_whole(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    console = output_console()  # stdout is pytest's capture here, not a terminal
    assert console.width == PIPED_WIDTH
    long_cell = "runs/" + "a-very-long-folder-name/" * 8 + "adapter"
    table = Table(title="t")
    table.add_column("what")
    table.add_column("value")
    table.add_row("adapter", long_cell)
    console.print(table)
    assert long_cell in capsys.readouterr().out  # on one line, not cut or wrapped at 80 columns


def test_piped_models_fits_a_readable_width(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl models | cat` printed a table about 400 columns wide: piped, its prose now wraps at
    PIPED_WIDTH (COLUMNS, when set, is the width), and each alias stays whole on its line."""
    from qerl_cli.cli import main
    from qerl_cli.modeling.sources import known_models

    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    # The table's lines (the folders below it are messages, as long as the paths of this machine).
    assert max(len(line) for line in _table_lines(out)) <= PIPED_WIDTH == 100
    for row in known_models():
        assert f"│ {row['alias']} " in out, row["alias"]
        for folder in row["looks_in"]:  # one a line, whole
            assert f"\n  {folder}\n" in out, folder
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["models"]) == 0
    assert max(len(line) for line in _table_lines(capsys.readouterr().out)) <= 120


def _table_lines(out: str) -> list[str]:
    lines = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert lines, out
    return lines


def test_a_piped_message_is_never_wrapped_and_any_value_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Piped at PIPED_WIDTH, a message longer than it stays on one line (a path cut in two broke a grep),
    and a value that is no rich renderable (a number, a path, None) prints as rich prints it, where the
    table measure raised NotRenderableError on it."""
    from qerl_cli.cli.app import output_console

    monkeypatch.delenv("COLUMNS", raising=False)
    console = output_console()
    path = "/" + "/".join(f"folder-{i}" for i in range(20))
    console.print(f"wrote the model to {path}")
    for value in (3, Path(path), None, {"a": 1}):
        console.print(value)
    out = capsys.readouterr().out.splitlines()
    assert out == [f"wrote the model to {path}", "3", path, "None", "{'a': 1}"]
    monkeypatch.setenv("COLUMNS", "80")  # a width given for tables: messages still keep their lines
    console.print(f"wrote the model to {path}")
    assert capsys.readouterr().out == f"wrote the model to {path}\n"


def test_a_piped_table_of_prose_wraps_at_the_piped_width(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any table of the CLI's consoles (stdout and stderr), not only `qerl models`: words wrap at
    PIPED_WIDTH, none is cut, and a column that folds long words does not widen the table."""
    monkeypatch.delenv("COLUMNS", raising=False)
    prose = " ".join(f"word{i}" for i in range(80))
    for stderr in (False, True):
        table = Table(title="t")
        table.add_column("what")
        table.add_column("value")
        table.add_column("command", overflow="fold")
        table.add_row("prose", prose, "pip download " + "x" * 150)
        output_console(stderr=stderr).print(table)
        captured = capsys.readouterr()
        out = captured.err if stderr else captured.out
        assert max(len(line) for line in out.splitlines()) == PIPED_WIDTH
        words = " ".join(line.split("│")[2] for line in out.splitlines()[4:-1])
        assert words.split() == prose.split()  # every word whole, in order


@pytest.mark.parametrize(
    ("argv", "stage"),
    [
        (["demo", "-o", "DIR"], "qerl_cli.demo.run_demo"),
        (["tiny-base", "DIR"], "qerl_cli.rl.warmstart.build_tiny_base"),
    ],
)
def test_piped_demo_and_tiny_base_silence_the_libraries_bars(
    argv: list[str], stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside a terminal the demo's and tiny-base's saves and loads print no tqdm bars (carriage-return
    noise in a log): tqdm and huggingface_hub are told before the stage imports them."""
    from qerl_cli.cli import main

    for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    seen: dict[str, str | None] = {}

    def stage_stub(*args: object, **kwargs: object) -> dict:
        seen.update({name: os.environ.get(name) for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")})
        return {}

    monkeypatch.setattr(stage, stage_stub)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # piped: not a terminal
    assert main([str(tmp_path / "out") if a == "DIR" else a for a in argv]) == 0
    assert seen == {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def test_a_piped_table_of_many_columns_cuts_and_splits_no_value(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl compare > cmp.out` printed `bf16-lo…` and `[-140.…`, `qerl eval > ev.out` `syntheti…` and
    "31.2 ±" with "13.2" on the next line: rich shrinks many columns evenly below their longest word,
    at a width the table's minimum measure said was enough. Piped, each value is whole on its line."""
    monkeypatch.delenv("COLUMNS", raising=False)
    values = ["bf16-lora-baseline", "nvfp4-aqn-gptq-long", "31.2 ± 13.2", "[-140.25, 12.50]", "unresolved"]
    table = Table(title="t")
    for i in range(14):
        table.add_column(f"column header {i}", justify="right")
    cells = [values[i % len(values)] for i in range(14)]
    table.add_row(*cells)
    output_console().print(table)
    out = capsys.readouterr().out
    assert "…" not in out, out
    row = next(line for line in out.splitlines() if "bf16" in line)
    assert [cell.strip() for cell in row.strip("│").split("│")] == cells
