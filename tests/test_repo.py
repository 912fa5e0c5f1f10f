"""Repository hygiene: the README's commands are the ones CI runs, the code is ruff-clean, and the
benchmark folders are indexed and name only files they hold."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\s*(bash scripts/setup\.sh .+)$", quick, flags=re.M)


def test_readme_quick_start_has_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert "qerl demo" in demo
    assert "pytest" in tests
    assert tests in (REPO / ".ci/run").read_text()


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(__import__("sys").executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it comes with qerl[dev])")
    result = subprocess.run(
        [ruff, "check", "qerl_cli", "tests", "scripts"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_changelog_follows_keep_a_changelog() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert "keepachangelog.com" in text


def _run_book_invocations(script: Path) -> list[tuple[str, str, list[str]]]:
    """(command, its first argument, --flags) of every `qerl COMMAND ...` in a benchmark's run.sh,
    continuation lines joined; the first argument is the subcommand of a group (`qerl bench rollout`)."""
    text = re.sub(r"\\\n\s*", " ", script.read_text())
    found = []
    for line in text.splitlines():
        for match in re.finditer(r"\bqerl ([a-z][a-z-]*)((?:\s+[^;|&\n]*)?)", line.split("#", 1)[0]):
            first = (match.group(2).split() or [""])[0]
            flags = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", match.group(2))
            found.append((match.group(1), first, flags))
    return found


def test_benchmark_run_books_parse_and_use_only_options_qerl_has() -> None:
    """A run.sh once passed `qerl compare --runs` (the option is --only) and only a GPU machine said so."""
    from typer.main import get_command

    from qerl_cli.cli import app

    commands = get_command(app).commands
    scripts = sorted(REPO.glob("benchmarks/*/run.sh"))
    assert scripts, "no benchmark run.sh to check"
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script
        invocations = _run_book_invocations(script)
        for name, first, flags in invocations:
            assert name in commands, f"{script}: qerl {name} is no command"
            command = commands[name]
            if hasattr(command, "commands"):  # a group (qerl bench): its subcommand has the options
                assert first in command.commands, f"{script}: qerl {name} {first} is no command"
                command, name = command.commands[first], f"{name} {first}"
            known = {opt for param in command.params for opt in param.opts}
            unknown = [flag for flag in flags if flag not in known]
            assert not unknown, f"{script}: qerl {name} has no option {unknown}"


def test_the_benchmark_index_links_every_run_folder_and_each_has_a_readme() -> None:
    index = (REPO / "benchmarks" / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)/]+)/\)", index))
    folders = {p.name for p in (REPO / "benchmarks").iterdir() if p.is_dir()}
    assert folders <= linked, f"not in benchmarks/README.md: {sorted(folders - linked)}"
    assert linked <= folders, f"linked but missing: {sorted(linked - folders)}"
    # The index promises it: "its README says the GPU, the date, the command and what the figures mean".
    unexplained = sorted(name for name in folders if not (REPO / "benchmarks" / name / "README.md").is_file())
    assert not unexplained, f"run folders without a README.md: {unexplained}"


# A name in a benchmark README is checked when it looks like a file or folder: one path of word
# characters, dots, dashes and slashes that ends in "/" or in one of these suffixes.
FILE_SUFFIXES = (".json", ".jsonl", ".gz", ".md", ".png", ".log", ".txt", ".py", ".sh", ".yaml", ".csv")
_NAMED = re.compile(r"`([^`\s]+)`|\]\(([^)\s]+)\)")
_PATHLIKE = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")


def _named_paths(readme: Path) -> set[str]:
    """Relative paths a README names in backticks or links (commands, globs and placeholders left out)."""
    named = set()
    for match in _NAMED.finditer(readme.read_text()):
        name = (match.group(1) or match.group(2)).split("#", 1)[0]
        hidden_or_absolute = name.startswith(("/", ".", "-")) and not name.startswith("../")
        if not _PATHLIKE.fullmatch(name) or hidden_or_absolute:  # ".json" alone is a suffix, not a file
            continue
        if name.endswith("/") or name.endswith(FILE_SUFFIXES):
            named.add(name)
    return named


def _exists(name: str, folder: Path) -> bool:
    """``name`` is there from the README's folder, from the repository root (``recipes/NAME.yaml``), or as
    the tail of a path inside the run folder (``heldout/results.json`` of every run)."""
    want_dir = name.endswith("/")
    bare = name.rstrip("/")
    roots = [folder, REPO]
    if any((root / bare).is_dir() if want_dir else (root / bare).is_file() for root in roots):
        return True
    inside = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_dir() == want_dir)
    return any(rel == bare or rel.endswith("/" + bare) for rel in inside)


def test_every_file_a_benchmark_readme_names_exists() -> None:
    """A README that names `completions.jsonl` after the file became `completions.jsonl.gz` misleads."""
    readmes = sorted(REPO.glob("benchmarks/*/README.md"))
    assert readmes, "no benchmark README to check"
    missing = [
        f"{readme.relative_to(REPO)}: {name}"
        for readme in readmes
        for name in sorted(_named_paths(readme))
        if not _exists(name, readme.parent)
    ]
    assert not missing, "named but not there:\n" + "\n".join(missing)


# A module past this many lines holds more than one responsibility: split it by responsibility.
MAX_MODULE_LINES = 450


def test_every_module_stays_under_the_line_limit() -> None:
    long = {
        str(path.relative_to(REPO)): n
        for path in sorted((REPO / "qerl_cli").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by responsibility): {long}"


def test_the_recipe_sections_keep_their_import_paths() -> None:
    """The RL loop's sections moved to config/rl_sections.py; config and config.sections still export them."""
    from qerl_cli import config
    from qerl_cli.config import rl_sections, sections

    for name in ("RolloutSection", "AlgorithmSection", "AQNSection", "TrainSection"):
        assert getattr(config, name) is getattr(sections, name) is getattr(rl_sections, name), name
    shared = ("ModelSection", "LoraSection", "DataSection", "RewardSection", "OutputSection", "TrainConfig")
    for name in shared:
        assert getattr(config, name) is getattr(sections, name), name
