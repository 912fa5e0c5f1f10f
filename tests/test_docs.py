"""The README and docs/: the README stays short, every relative link resolves, every `qerl` command
(and --option) the pages show is one the CLI has, and every recipe key they name (`rollout.engine`, a
YAML example) is one the config has."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 200
RESULTS_MARKER = "<!-- results-table -->"

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", flags=re.M)
URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# `qerl CMD` as a word of its own (also `.venv/bin/qerl CMD`), and `-m qerl_cli CMD` (python, torchrun).
QERL_CALL = re.compile(r"(?:^|(?<=[\s/(`&;|]))(?:qerl|-m\s+qerl_cli)\s+([a-z][\w-]*)((?:[^\n;|&#`]*))")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# A dotted recipe key as the pages write it (`aqn.target`, `--set train.max_steps=5`), not part of a module
# path (`qerl_cli.rollout.backends`) or a file (`compare.md`, `compare.json`).
RECIPE_KEY = re.compile(r"(?<![\w./$-])([a-z]+)\.([a-z_][a-z0-9_]*)\b(?![\w(/-])")
FILE_SUFFIXES = {"md", "json", "jsonl", "png", "py", "yaml", "yml", "txt", "csv", "parquet", "safetensors"}
YAML_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", flags=re.M | re.S)


def _split_code(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, code lines) of a Markdown page: fenced blocks, indented blocks, inline code spans.
    Backslash-continued code lines are joined, so one command is one line."""
    prose: list[str] = []
    code: list[str] = []
    in_fence = in_indented = False
    previous_blank = True
    for line in text.splitlines():
        blank = not line.strip()
        if FENCE.match(line):
            in_fence, in_indented, previous_blank = not in_fence, False, False
        elif in_fence:
            code.append(line)
        elif in_indented and (line.startswith("    ") or blank):
            code.extend([] if blank else [line])
        elif line.startswith("    ") and not blank and previous_blank and not _continues_list(prose):
            code.append(line)
            in_indented = True
        else:
            in_indented = False
            prose.append(line)
            code.extend(match.group(2) for match in CODE_SPAN.finditer(line))
        previous_blank = blank
    joined = re.sub(r"\\\n\s*", " ", "\n".join(code))
    return prose, joined.splitlines()


def _continues_list(prose: list[str]) -> bool:
    """An indented line after a list item (past blank lines) continues the item, not a code block."""
    for line in reversed(prose):
        if line.strip():
            return bool(re.match(r"^\s*([-*+]|\d+\.)\s", line)) or line.startswith("  ")
    return False


def _headings(text: str) -> set[str]:
    """GitHub's anchors for a page's headings (lowercase, punctuation dropped, spaces to dashes, -N for
    repeats)."""
    seen: dict[str, int] = {}
    anchors = set()
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line)
        if in_fence or not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(page: Path) -> list[str]:
    """Every relative link of ``page`` whose file (or heading anchor, in a Markdown file) is missing."""
    text = page.read_text()
    prose, _ = _split_code(text)
    prose_text = "\n".join(CODE_SPAN.sub("", line) for line in prose)
    targets = INLINE_LINK.findall(prose_text) + REFERENCE_LINK.findall(prose_text)
    broken = []
    for target in targets:
        if URL_SCHEME.match(target) or target.startswith("//"):
            continue
        path_part, _, anchor = target.partition("#")
        file = (page.parent / path_part).resolve() if path_part else page
        if not file.exists():
            broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _headings(file.read_text()):
            broken.append(f"{page.relative_to(REPO)}: {target} (no heading #{anchor} in {file.name})")
    return broken


def _cli() -> Any:
    from typer.main import get_command

    from qerl_cli.cli import app

    return get_command(app)


def qerl_invocations(text: str) -> Iterator[tuple[list[str], list[str]]]:
    """([command, subcommand...] candidates, --flags) of every `qerl ...` in the page's code."""
    _, code = _split_code(text)
    for line in code:
        for match in QERL_CALL.finditer(line):
            words = [match.group(1), *match.group(2).split()]
            yield words, FLAG.findall(match.group(2))


def unknown_commands(text: str, root: Any) -> list[str]:
    """Every `qerl CMD` of the page's code that the CLI lacks, and every --flag that CMD lacks."""
    problems = []
    for words, flags in qerl_invocations(text):
        command, path = root, ["qerl"]
        for word in words:
            children = getattr(command, "commands", None)
            if children is None or word.startswith("-"):
                break
            if word not in children:
                if command is root:
                    problems.append(f"qerl {word}: no such command")
                break
            command = children[word]
            path.append(word)
        if command is root:
            continue
        if hasattr(command, "default_subcommand"):  # `qerl bench --batch 2,8`: the group's default one
            command = command.commands[command.default_subcommand(flags)]
        known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        unknown = [flag for flag in flags if flag not in known | {"--help"}]
        if unknown:
            problems.append(f"{' '.join(path)}: no option {', '.join(unknown)}")
    return problems


def _recipe_keys() -> set[str]:
    """Every dotted key a recipe may hold: the sections' keys and the `compare:` section's."""
    from qerl_cli.compare.settings import CompareSettings
    from qerl_cli.config import TrainConfig
    from qerl_cli.config.keydocs import key_docs

    compare = {f"compare.{doc.key}" for doc in key_docs(CompareSettings)}
    return {doc.key for doc in key_docs(TrainConfig)} | compare


def unknown_recipe_keys(text: str) -> list[str]:
    """Every `section.key` in the page's code whose section is a recipe's and whose key the config lacks."""
    keys = _recipe_keys()
    sections = {key.split(".")[0] for key in keys}
    _, code = _split_code(text)
    return [
        match.group(0)
        for line in code
        for match in RECIPE_KEY.finditer(line)
        if match.group(1) in sections and match.group(2) not in FILE_SUFFIXES and match.group(0) not in keys
    ]


def bad_yaml_recipes(text: str) -> list[str]:
    """The error of every ```yaml block of the page that is a recipe (or its `compare:` section) and does
    not load as one."""
    import yaml

    from qerl_cli.compare.arms import read_settings
    from qerl_cli.config import TrainConfig, from_dict
    from qerl_cli.errors import QerlError

    sections = {key.split(".")[0] for key in _recipe_keys()}
    errors = []
    for block in YAML_BLOCK.findall(text):
        data = yaml.safe_load(block)
        if not isinstance(data, dict) or not set(data) <= sections:
            continue
        try:
            from_dict(TrainConfig, {k: v for k, v in data.items() if k != "compare"})
            read_settings(data.get("compare"))
        except QerlError as err:
            errors.append(str(err))
    return errors


def test_readme_is_at_most_200_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move reference text into docs/"


def test_readme_results_table_sits_under_its_marker_and_links_the_benchmark_index() -> None:
    text = README.read_text()
    assert text.count(RESULTS_MARKER) == 1, f"README.md needs exactly one {RESULTS_MARKER}"
    after = text.split(RESULTS_MARKER, 1)[1].lstrip("\n").splitlines()
    assert after and after[0].startswith("|"), "the results table must start right below the marker"
    assert "](benchmarks/README.md)" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_qerl_command_shown_exists(page: Path) -> None:
    assert unknown_commands(page.read_text(), _cli()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_recipe_key_named_exists(page: Path) -> None:
    assert unknown_recipe_keys(page.read_text()) == []
    assert bad_yaml_recipes(page.read_text()) == []


def test_every_docs_page_is_in_the_index() -> None:
    index = (REPO / "docs" / "index.md").read_text()
    missing = [p.name for p in DOCS if p.name != "index.md" and f"]({p.name})" not in index]
    assert missing == [], f"not linked from docs/index.md: {missing}"


def test_the_checks_catch_what_they_are_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkers themselves: a missing file, a missing heading, a made-up command and a made-up flag."""
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [ok](there.md#a-heading), [gone](missing.md), [bad](there.md#nope), [self](#page),\n"
        "[web](https://example.com) and `[not a link](in-code.md)`.\n\n"
        "```bash\nqerl train --keys\nqerl trian recipe.yaml\nqerl eval ./m --no-such-flag 1\n```\n\n"
        "    .venv/bin/qerl demo --steps 3\n    torchrun -m qerl_cli bogus\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: there.md#nope (no heading #nope in there.md)",
    ]
    assert unknown_commands(page.read_text(), _cli()) == [
        "qerl trian: no such command",
        "qerl eval: no option --no-such-flag",
        "qerl bogus: no such command",
    ]
    keys = (
        "Set `rollout.engine`, `--set aqn.targt=0.03`, `compare.heldout_samples`; see `compare.md`,\n"
        "`qerl_cli.rollout.backends` and `compare.json`.\n\n"
        "```yaml\nrollout: {engine: vllm}\ncompare:\n  margin: 5\n```\n\n"
        "```yaml\nlora: {rank: 16, alfa: 16}\n```\n\n```yaml\ncompare: {heldout_sample: 4}\n```\n"
    )
    assert unknown_recipe_keys(keys) == ["aqn.targt"]
    errors = bad_yaml_recipes(keys)
    assert len(errors) == 2 and "'lora.alfa'" in errors[0] and "'compare.heldout_sample'" in errors[1], errors
