"""``files.staged_folder``: write a folder beside its target, then rename it into place; the one helper
behind cached folders, quantize outputs, training checkpoints and the tiny base."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl_cli.files import TargetExistsError, is_complete_folder, staged_folder, write_folder_once

PACKAGE = Path(__file__).resolve().parents[1] / "qerl_cli"


def _write(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)


def test_a_complete_block_replaces_the_target_and_leaves_no_staging(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    _write(target, "old", "1")
    with staged_folder(target) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".out.partial-")
        assert (target / "old").exists()  # the old folder stays until the new one is complete
        _write(staging, "new", "2")
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failing_block_removes_the_staging_and_keeps_the_old_target(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    _write(target, "old", "1")
    with pytest.raises(RuntimeError, match="disk full"), staged_folder(target) as staging:
        _write(staging, "half", "x")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == ["old"]


def test_refuse_keep_and_merge(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with pytest.raises(TargetExistsError), staged_folder(target, existing="refuse"):
        target.mkdir()  # someone else created it meanwhile
    assert not list(tmp_path.glob(".out.partial-*"))
    with staged_folder(target, existing="keep") as staging:
        _write(target, "theirs", "1")  # another writer finished first
        _write(staging, "mine", "2")
    assert sorted(p.name for p in target.iterdir()) == ["theirs"]
    (target / "sub").mkdir()
    _write(target / "sub", "old", "x")
    with staged_folder(target, existing="merge") as staging:
        (staging / "sub").mkdir()
        _write(staging / "sub", "new", "y")
    assert sorted(p.name for p in target.iterdir()) == ["sub", "theirs"]
    assert sorted(p.name for p in (target / "sub").iterdir()) == ["new"]
    with pytest.raises(ValueError, match="existing must be one of"), staged_folder(target, existing="x"):
        pass


def test_a_fixed_staging_path_clears_what_a_killed_writer_left(tmp_path: Path) -> None:
    stale = tmp_path / ".ckpt.tmp"
    stale.mkdir()
    _write(stale, "junk", "half")
    with staged_folder(tmp_path / "ckpt", staging=stale) as staging:
        assert staging == stale and not list(staging.iterdir())
        _write(staging, "state", "ok")
    assert not stale.exists() and (tmp_path / "ckpt" / "state").is_file()


def test_write_folder_once_marks_complete_and_reuses(tmp_path: Path) -> None:
    calls = []
    target = tmp_path / "cache"
    target.mkdir()
    _write(target, "crashed", "no marker")  # the leftover of a crash: rewritten
    for _ in range(2):
        write_folder_once(target, lambda d: (calls.append(d), _write(d, "w", "1")))
    assert len(calls) == 1 and is_complete_folder(target) and not (target / "crashed").exists()


@pytest.mark.parametrize("module", ["quantize/validate.py", "rl/checkpoint.py", "rl/warmstart.py"])
def test_the_staged_writers_share_the_helper(module: str) -> None:
    source = (PACKAGE / module).read_text()
    assert "staged_folder(" in source
    assert "os.replace(" not in source and ".rename(" not in source and "partial-" not in source
