"""A GGUF's converted folder is named by the file's content, so one file gets one base on every machine."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from qerl_cli.modeling import sources


def _unread(*_args: object) -> str:
    raise AssertionError("the file was read again: its recorded SHA-256 should have served")


def test_same_content_at_two_paths_and_mtimes_gets_one_folder_other_content_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    payload = b"GGUF" + bytes(range(256)) * 64
    here, there = tmp_path / "a" / "Model.Q4_1.gguf", tmp_path / "b" / "Model.Q4_1.gguf"
    for path, mtime in ((here, 1_000_000_000), (there, 1_700_000_000)):
        path.parent.mkdir()
        path.write_bytes(payload)
        os.utime(path, (mtime, mtime))
    folder = sources.converted_folder(here)
    name = f"Model-{hashlib.sha256(payload).hexdigest()[:12]}"
    assert folder == tmp_path / "cache" / "gguf" / name / "Model"
    assert sources.converted_folder(there) == folder
    other = tmp_path / "c" / "Model.Q4_1.gguf"
    other.parent.mkdir()
    other.write_bytes(payload[:-1] + b"\x01")
    assert sources.converted_folder(other) != folder
    # Hashed once per (path, size, mtime): later calls read the record, a touched file is hashed again.
    monkeypatch.setattr(sources, "sha256_file", _unread)
    assert sources.converted_folder(here) == folder
    os.utime(here, (1_800_000_000, 1_800_000_000))
    with pytest.raises(AssertionError, match="read again"):
        sources.converted_folder(here)


def test_the_shipped_aliases_name_the_sha256_of_their_files() -> None:
    """Each alias's file is checked when qerl assembles it, and its converted folder is named by it."""
    for alias in sources.ALIASES.values():
        assert alias.sha256 is not None and len(alias.sha256) == 64, alias.name
