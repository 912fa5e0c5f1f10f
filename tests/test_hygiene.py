"""Nothing tracked names a tracker's issue numbers or the machines and paths of the place it was made in.

A comment, README or benchmark record says what a thing is ("the fixed reward of 2026-11-24", a
benchmark folder), not a ticket number a reader outside the tracker cannot follow, and names no
checkout, scratch folder, tool or machine kind that only existed where the work was done (a run
book takes such places as environment variables: ``$VLLM_SITE``, ``$QERL_CACHE_DIR``).
CHANGELOG.md is history and keeps what it said; this file names the patterns, so it is exempt too.
"""

from __future__ import annotations

import functools
import gzip
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXEMPT = {"CHANGELOG.md", Path(__file__).relative_to(REPO).as_posix()}

ISSUE = re.compile(r"(?<![a-z])issue[ s#]*[0-9]+", re.IGNORECASE)  # also "device_issue11"
LAB = {
    re.compile(r"/work/"): "a checkout on the machine the work was done on",
    re.compile(r"/tmp/qg\b"): "a scratch folder of one GPU session",
    re.compile(r"(?<![\w.])\.device/"): "the folder carried to the GPU machines",
    re.compile(r"(?<![\w.])\.lc/"): "the llm-compressor bundle carried to the GPU machines",
    re.compile(r"\.\./shared/|\bshared/tools\b"): "the workplace's shared tools",
    re.compile(r"\bdevice[ -]tools?\b", re.IGNORECASE): "the workplace's GPU tool",
    re.compile(r"\bnvidia-h[0-9]{3}(?:-x[0-9]+)?\b"): "a machine kind of the workplace (say the GPU)",
    re.compile(r"/tmp/(?:vllm|bnb)-site\b"): "where the GPU machines unpacked a bundle ($VLLM_SITE)",
}


@functools.cache
def tracked_texts() -> dict[str, str]:
    """``{path: text}`` of every tracked text file but the exempt ones (a .gz read decompressed)."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing says which files are tracked")
    listing = subprocess.run([git, "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    names = [name for name in listing.decode().split("\0") if name and name not in EXEMPT]
    texts = {name: text_of(REPO / name) for name in names if (REPO / name).is_file()}
    return {name: text for name, text in texts.items() if text is not None}


def text_of(path: Path) -> str | None:
    """The file's text (a .gz decompressed), or None for a binary file."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def findings(pattern: re.Pattern[str]) -> list[str]:
    found = []
    for name, text in tracked_texts().items():
        if not pattern.search(text):
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            found += [f"{name}:{number}: {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def test_the_patterns_catch_what_they_are_for() -> None:
    assert ISSUE.search("the fixed reward (Issue 22)") and ISSUE.search("scripts/device_issue11.py")
    assert ISSUE.search("issues #3 and 4") and not ISSUE.search("github.com/o/r/issues/2522")
    caught = ["/work/main/x", ".device/prior", "../shared/tools/x", "the device tool", "`nvidia-h100-x1`",
              "PYTHONPATH=/tmp/vllm-site", "see .lc/wheels", "--out /tmp/qg/out"]  # fmt: skip
    for text in caught:
        assert any(p.search(text) for p in LAB), text
    kept = ["NVIDIA H100 80GB HBM3", "weight.device", "framework/x", "$VLLM_SITE", "/tmp/qerl-smol"]
    for text in kept:
        assert not any(p.search(text) for p in LAB), text


def test_no_tracked_file_names_an_issue_number() -> None:
    found = findings(ISSUE)
    assert not found, "say what the issue was instead of its number:\n" + "\n".join(found[:50])


def test_no_tracked_file_names_a_lab_path_or_machine() -> None:
    found = [f"{hit} ({why})" for pattern, why in LAB.items() for hit in findings(pattern)]
    assert not found, "use an environment variable or plain words:\n" + "\n".join(found[:50])
