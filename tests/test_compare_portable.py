"""A comparison's bases keep their identity when its folder or qerl's cache moves (another path, another
machine): the runs record it portably, the untrained bases' figures stay found, and only a real change of
base is warned about."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_compare import TINY_SETS, _recipe, _score

from qerl_cli.compare import heldout as heldout_mod
from qerl_cli.compare import runner
from qerl_cli.compare.base_identity import base_identity, base_path
from qerl_cli.modeling import sources
from qerl_cli.quantize.report import REPORT_NAME

MIXES = "the report mixes the two"
FIGURES = {None: 0.10}  # the untrained base's held-out pass@1 (no adapter); a trained run's is 0.30


def _train_nothing(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The real run_one (so the base is recorded as it records it) around a training that only writes a
    metrics line; returns the adapters evaluated (None: an untrained base)."""
    evaluated: list[str | None] = []

    def train(conf, resume=None, progress=False, overwrite=False):
        out = Path(conf.output.dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.2, "entropy": 1.0}) + "\n")
        return SimpleNamespace(adapter=str(out / "adapter"), steps=1, resumed_from=None, linear_backend=None)

    def evaluate(conf, settings, adapter, out, linear_backend=None):
        evaluated.append(adapter)
        return _score(FIGURES.get(adapter, 0.30), 0.05)

    monkeypatch.setattr(runner.trainer_mod, "train", train)
    monkeypatch.setattr(heldout_mod, "evaluate_heldout", evaluate)
    monkeypatch.setattr(heldout_mod, "base_entropy", lambda *a: {"exact_entropy": 1.5})
    return evaluated


def _made_and_moved(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path, list[str | None]]:
    """Two arms x 2 seeds made in one folder, the BF16 base in the cache (as a converted GGUF is); then
    the folder and the cache moved elsewhere, the originals gone. Returns (the moved folder, the recipe
    pointing at the moved cache's model, the adapters evaluated)."""
    evaluated = _train_nothing(monkeypatch)
    old_cache = tmp_path / "machine-a" / "cache"
    model = old_cache / "gguf" / "tiny-0123456789ab" / "tiny"
    shutil.copytree(tiny_model_dir, model)
    monkeypatch.setenv("QERL_CACHE_DIR", str(old_cache))
    made = tmp_path / "machine-a" / "cmp"
    runner.run_compare(_recipe(tmp_path / "machine-a", model), ["bf16-lora", "nvfp4-lora"], 2, made,
                       sets=TINY_SETS)  # fmt: skip
    result = json.loads((made / "nvfp4-lora" / "seed-1" / "result.json").read_text())
    assert result["model"] == "$COMPARE_DIR/bases/nvfp4"
    result = json.loads((made / "bf16-lora" / "seed-0" / "result.json").read_text())
    assert result["model"] == "$QERL_CACHE_DIR/gguf/tiny-0123456789ab/tiny"
    assert evaluated.count(None) == 2  # each untrained base once

    moved, new_cache = tmp_path / "machine-b" / "runs" / "cmp", tmp_path / "machine-b" / "qerl-cache"
    moved.parent.mkdir(parents=True)
    shutil.move(made, moved)
    shutil.move(old_cache, new_cache)
    monkeypatch.setenv("QERL_CACHE_DIR", str(new_cache))
    (tmp_path / "machine-b").mkdir(exist_ok=True)
    recipe = _recipe(tmp_path / "machine-b", new_cache / "gguf" / "tiny-0123456789ab" / "tiny")
    evaluated.clear()
    return moved, recipe, evaluated


def test_a_moved_folder_keeps_its_base_figures_and_warns_of_no_mixing(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    moved, recipe, evaluated = _made_and_moved(tmp_path, tiny_model_dir, monkeypatch)
    arms = ["bf16-lora", "nvfp4-lora"]
    with caplog.at_level(logging.WARNING):
        report = runner.run_compare(recipe, arms, 2, moved, sets=TINY_SETS, report_only=True).report
    assert [row.base_heldout_accuracy for row in report.arms] == [0.10, 0.10]
    assert MIXES not in caplog.text
    # Run there again (nothing left to train): the same bases, their figures found, nothing evaluated.
    with caplog.at_level(logging.WARNING):
        report = runner.run_compare(recipe, arms, 2, moved, sets=TINY_SETS).report
    assert evaluated == [] and [row.base_heldout_accuracy for row in report.arms] == [0.10, 0.10]
    assert MIXES not in caplog.text


def test_a_real_change_of_base_is_still_warned_about(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    moved, recipe, evaluated = _made_and_moved(tmp_path, tiny_model_dir, monkeypatch)
    # An AWQ base made elsewhere and copied in (qerl quantize's record says so): compare.base_method=awq.
    shutil.copytree(moved / "bases" / "nvfp4", moved / "bases" / "nvfp4-awq")
    record = json.loads((moved / "bases" / "nvfp4-awq" / REPORT_NAME).read_text())
    (moved / "bases" / "nvfp4-awq" / REPORT_NAME).write_text(json.dumps({**record, "method": "awq"}))
    sets = [*TINY_SETS, "compare.base_method=awq"]
    with caplog.at_level(logging.WARNING):
        report = runner.run_compare(recipe, ["bf16-lora", "nvfp4-lora"], 2, moved, sets=sets).report
    warned = [r.getMessage() for r in caplog.records if MIXES in r.getMessage()]
    assert len(warned) == 2 and all("trained on $COMPARE_DIR/bases/nvfp4, but" in w for w in warned)
    assert evaluated == [None]  # the AWQ base is evaluated: it is another base
    assert report.arms[1].base_heldout_accuracy == 0.10
    # Seed ranges merged from machines with different bases: --report-only says so too.
    caplog.clear()
    result = moved / "nvfp4-lora" / "seed-1" / "result.json"
    result.write_text(json.dumps({**json.loads(result.read_text()), "model": "$COMPARE_DIR/bases/nvfp4-awq"}))
    with caplog.at_level(logging.WARNING):
        runner.run_compare(recipe, ["nvfp4-lora"], 2, moved, sets=TINY_SETS, report_only=True)
    (warned,) = [r.getMessage() for r in caplog.records if MIXES in r.getMessage()]
    assert warned.startswith("nvfp4-lora seed 0 was trained on $COMPARE_DIR/bases/nvfp4, but the arm's base")


def test_base_identity_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, cache = tmp_path / "cmp", tmp_path / "cache"
    monkeypatch.setenv("QERL_CACHE_DIR", str(cache))
    monkeypatch.chdir(tmp_path)
    (out / "bases" / "nvfp4").mkdir(parents=True)
    assert base_identity(str(out / "bases" / "nvfp4"), out) == "$COMPARE_DIR/bases/nvfp4"
    assert base_identity("cmp/bases/nvfp4", Path("cmp")) == "$COMPARE_DIR/bases/nvfp4"  # relative, as given
    assert base_identity(str(cache / "gguf" / "m-abc" / "m"), out) == "$QERL_CACHE_DIR/gguf/m-abc/m"
    for other in ("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "mine"), "$COMPARE_DIR/bases/x"):
        assert base_identity(other, out) == other  # a hub id, a folder of the user's, an identity already
    assert base_path("$COMPARE_DIR/bases/nvfp4", out) == str(out / "bases" / "nvfp4")
    assert base_path("$QERL_CACHE_DIR/gguf/m-abc/m", out) == str(cache / "gguf" / "m-abc" / "m")
    assert base_path("/elsewhere/model", out) == "/elsewhere/model"


def test_figures_kept_under_an_earlier_qerls_key_are_still_found(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """base-heldout folders named by the digest of the base's absolute path (before bases had an identity)
    are read, not evaluated again."""
    evaluated = _train_nothing(monkeypatch)
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    runner.run_compare(recipe, ["nvfp4-lora"], 1, out, sets=TINY_SETS)
    (kept,) = (out / "base-heldout").iterdir()
    data = json.loads((kept / "heldout.json").read_text())
    absolute = str(out / "bases" / "nvfp4")
    assert data["settings"]["model"] == "$COMPARE_DIR/bases/nvfp4"
    legacy = {**data["settings"], "model": absolute}
    earlier = kept.with_name(f"nvfp4-{heldout_mod._digest(legacy)}")
    kept.rename(earlier)
    (earlier / "heldout.json").write_text(json.dumps({**data, "model": absolute, "settings": legacy}))
    evaluated.clear()
    report = runner.run_compare(recipe, ["nvfp4-lora"], 1, out, sets=TINY_SETS).report
    assert evaluated == [] and report.arms[0].base_heldout_accuracy == 0.10


def test_a_gguf_converted_by_an_earlier_qerl_is_the_base_its_content_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder named by the file's path and mtime (before the content fingerprint) is the same base as
    the one converted now, so an existing comparison's runs are not said to mix two bases."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("QERL_CACHE_DIR", str(cache))
    gguf = tmp_path / "Model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(300))
    now = sources.converted_folder(gguf)
    earlier = cache / "gguf" / "Model-0123456789ab" / "Model"
    earlier.mkdir(parents=True)
    (earlier / sources.SOURCE_RECORD).write_text(json.dumps({"gguf": str(gguf), "size": 304}))  # no sha256
    out = tmp_path / "cmp"
    expected = f"$QERL_CACHE_DIR/gguf/{now.parent.name}/Model"
    assert base_identity(str(earlier), out) == base_identity(str(now), out) == expected
    gguf.write_bytes(b"GGUF" + bytes(301))  # the file changed since: another base
    assert base_identity(str(earlier), out) != expected
    gguf.unlink()  # nor can it be told without the file: the folder as it lies
    assert base_identity(str(earlier), out) == "$QERL_CACHE_DIR/gguf/Model-0123456789ab/Model"
