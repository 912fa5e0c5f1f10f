"""Nothing tracked names a tracker's issue numbers or the machines and paths of the place it was made in.

A comment, README or benchmark record says what a thing is ("the fixed reward of 2026-11-24", a
benchmark folder), not a ticket number a reader outside the tracker cannot follow, and names no
checkout, scratch or home folder, tool or machine kind that only existed where the work was done (a run
book and a recorded run take such places as environment variables: ``$OUT_DIR``, ``$QERL_CACHE_DIR``,
``$REPO``, ``$VLLM_SITE``). A report names the machine by what its figures depend on (cores, memory, GPU,
driver), never by its host name or network address, and a benchmark's README speaks of the run, not of
how the GPUs were lent (device time, leases, machines given back).
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

# Each pattern starts with a literal (a word boundary checked by a look-behind after it), so the scan of
# the 26 MB of tracked text takes seconds: a pattern opening with \b or a look-behind is tried at every
# character, 30-40 times slower.
ISSUE = re.compile(r"issue(?<![a-z]issue)[ s#]*[0-9]+")  # on the lowered text; also "device_issue11"
LAB = {
    re.compile(r"/work/"): "a checkout on the machine the work was done on",
    re.compile(r"/tmp/qg\b"): "a scratch folder of one GPU session",
    re.compile(r"\.device/(?<![\w.]\.device/)"): "the folder carried to the GPU machines",
    re.compile(r"\.lc/(?<![\w.]\.lc/)"): "the llm-compressor bundle carried to the GPU machines",
    re.compile(r"\.\./shared/"): "the workplace's shared tools",
    re.compile(r"shared/tools\b(?<!\wshared/tools)"): "the workplace's shared tools",
    re.compile(
        r"[Dd]evice[ -]tools?\b(?<!\w[Dd]evice[ -]tool)(?<!\w[Dd]evice[ -]tools)"
    ): "the workplace's GPU tool",
    re.compile(
        r"nvidia-h(?<!\wnvidia-h)[0-9]{3}(?:-x[0-9]+)?\b"
    ): "a machine kind of the workplace (say the GPU)",
    re.compile(r"/tmp/(?:vllm|bnb)-site\b"): "where the GPU machines unpacked a bundle ($VLLM_SITE)",
}

# The patterns below run on the lowered text, written in lower case.
# Absolute scratch and home folders: a literal path, not a word ending in "/tmp" (a URL's, "$OUT_DIR/tmp/").
PATHS = {
    re.compile(
        r"/tmp/(?<![\w.$}/-]/tmp/)"
    ): "a scratch folder ($OUT_DIR, $QERL_CACHE_DIR, or a relative path)",
    re.compile(r"/root/(?<![\w.$}/-]/root/)"): "the root user's home ($HOME)",
    re.compile(r"/home/(?<![\w.$}/-]/home/)[a-z_][\w.-]*/"): "someone's home folder ($HOME)",
}
# The machine's name and network address.
_PRIVATE_IPV4 = r"(?:10\.\d{1,3}|192\.168|172\.(?:1[6-9]|2\d|3[01]))\.\d{1,3}\.\d{1,3}\b"
MACHINE = {
    re.compile(r'"hostname"\s*:'): "a host name recorded in a report (record cores, memory, GPU)",
    re.compile(r"machine: vm\b"): "the machine's host name",
    re.compile(r"@vm\b"): "the machine's host name",
    re.compile(r"tcp://(?!127\.|<)[0-9]"): "a torch distributed init address (write tcp://<host>:<port>)",
    # As an address (a URL, MASTER_ADDR), not a bare number: sampled completions hold "10.10.10.10".
    re.compile(r"://" + _PRIVATE_IPV4): "a private network address",
    re.compile(r"master_addr\s*=\s*['\"]?(?!127\.)[0-9]"): "a machine's network address",
}
# How the GPU machines were lent, which says nothing about a run: precise phrases, so the pytest
# "session" of a fixture or the GPU memory "given back" to the driver pass.
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "earlier", "this", "that")
_TOOL_FIELDS = ("budget_left_s", "held_s", "can_start_another", "give_back", "idle_release_s")
MACHINERY = {
    re.compile(r"device(?<!\wdevice)[ -]time\b"): "the GPU time a session was lent",
    re.compile(
        r"machines?\b(?<!\wmachine)(?<!\wmachines)(?: \w+)? (?:was|were) (?:given|taken|handed) back\b"
    ): ("a machine given back (say the run stopped)"),
    re.compile(r"leas(?<!\wleas)(?:e[sd]?|ing)\b"): "a machine's lease",
    re.compile(r"lent\b(?:(?<=\bwas lent)|(?<=\bwere lent))"): "a machine lent",
    re.compile(r"minute hold\b"): "a machine held for so many minutes",
    **{re.compile(field + r"\b(?<!\w" + field + ")"): "the GPU tool's fields" for field in _TOOL_FIELDS},
    re.compile("session(?:" + "|".join(f"(?<=\\b{word} session)" for word in _ORDINALS) + r")s?\b"): (
        "a session of GPU time (say the run, or the part of the day)"
    ),
    re.compile(r"session's\b"): "a session of GPU time (say the run, or the part of the day)",
    re.compile(r"device run-?book\b"): "the run book of the GPU tool (run.sh)",
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


@functools.cache
def lowered_texts() -> dict[str, str]:
    return {name: text.lower() for name, text in tracked_texts().items()}


def findings(pattern: re.Pattern[str], lowered: bool = False) -> list[str]:
    """``path:line: match`` of every match in the tracked texts (lowered ones for a lower-case pattern)."""
    found = []
    for name, text in (lowered_texts() if lowered else tracked_texts()).items():
        if not pattern.search(text):
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            found += [f"{name}:{number}: {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def test_the_patterns_catch_what_they_are_for() -> None:
    assert ISSUE.search("the fixed reward (Issue 22)".lower()) and ISSUE.search("scripts/device_issue11.py")
    assert ISSUE.search("issues #3 and 4") and not ISSUE.search("github.com/o/r/issues/2522")
    caught = ["/work/main/x", ".device/prior", "../shared/tools/x", "the device tool", "`nvidia-h100-x1`",
              "PYTHONPATH=/tmp/vllm-site", "see .lc/wheels", "--out /tmp/qg/out"]  # fmt: skip
    for text in caught:
        assert any(p.search(text) for p in LAB), text
    kept = ["NVIDIA H100 80GB HBM3", "weight.device", "framework/x", "$VLLM_SITE", "$OUT_DIR/tmp"]
    for text in kept:
        assert not any(p.search(text) for p in LAB), text


@pytest.mark.parametrize(
    ("patterns", "caught", "kept"),
    [
        (
            PATHS,
            [
                '"model": "/tmp/qerl-g/cmp/bases/nvfp4-awq"',
                "-o /tmp/x",
                "'/root/.cache/vllm'",
                "/home/alice/models",
                "Using cache directory: /root/.cache",
            ],
            [
                "$OUT_DIR/bases",
                "$HOME/.cache/vllm",
                "https://example.org/tmp/x",
                "tmp_path / 'out'",
                "tempfile.mkdtemp()",
                "runs/tmp/x",
                "$QERL_CACHE_DIR/gguf",
            ],
        ),
        (
            MACHINE,
            [
                '"hostname": "vm",',
                "Machine: vm (16 CPUs)",
                "distributed_init_method=tcp://10.0.0.4:52999",
                "tcp://192.0.2.2:33661",
                "MASTER_ADDR=192.168.1.20",
                "http://172.16.3.4:8000",
                "http://10.128.0.7:8000/v1",
            ],
            [
                'assert "hostname" not in info',
                "tcp://127.0.0.1:29500",
                "tcp://<host>:<port>",
                "Machine: 16 CPUs",
                "torch 2.10.0",
                "CUDA 10.1",
                "http://172.32.0.1",
                "The answer is 10.10.10.10",
                "vllm 0.10.1.1",
            ],
        ),
        (
            MACHINERY,
            [
                "no device time was left",
                "their machine was taken back",
                "four other machines were taken back",
                "when that machine was given back",
                "stopped at the 30-minute lease",
                "none was lent",
                "its 30-minute hold ended",
                "budget_left_s",
                "the fifth session",
                "the session's device time",
                "a device run-book",
            ],
            [
                "PyTorch's cached GPU blocks given back to the driver",
                'scope="session"',
                "built once per session",
                "release the engine",
                "the caller lent the engine",
                "held-out",
                "the device's evaluation",
                "a session-scoped fixture",
            ],
        ),
    ],
    ids=["paths", "machine", "machinery"],
)
def test_the_new_patterns_catch_what_they_are_for(
    patterns: dict[re.Pattern[str], str], caught: list[str], kept: list[str]
) -> None:
    for text in caught:
        assert any(p.search(text.lower()) for p in patterns), text
    for text in kept:
        assert not any(p.search(text.lower()) for p in patterns), text


def test_no_tracked_file_names_an_issue_number() -> None:
    found = findings(ISSUE, lowered=True)
    assert not found, "say what the issue was instead of its number:\n" + "\n".join(found[:50])


@pytest.mark.parametrize(
    ("patterns", "lowered", "advice"),
    [
        (LAB, False, "use an environment variable or plain words"),
        (PATHS, True, "write the path relative, or as $OUT_DIR / $QERL_CACHE_DIR / $REPO / $HOME"),
        (MACHINE, True, "record the machine by its cores, memory, GPU and driver; write tcp://<host>:<port>"),
        (MACHINERY, True, "say what happened to the run, not to the machine that ran it"),
    ],
    ids=["lab", "paths", "machine", "machinery"],
)
def test_no_tracked_file_names_a_lab_path_machine_or_machinery(
    patterns: dict[re.Pattern[str], str], lowered: bool, advice: str
) -> None:
    found = [f"{hit} ({why})" for pattern, why in patterns.items() for hit in findings(pattern, lowered)]
    assert not found, f"{advice}:\n" + "\n".join(found[:50])
