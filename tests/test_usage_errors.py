"""Mistakes a new user makes are usage errors (exit 2, a message saying what was wrong and what is
expected), not "internal error" (exit 1): a binary file or a folder as a recipe, missing folders given to
`qerl quality`, a file given as `quantize`'s model."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl_cli.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("command", [["train"], ["compare"], ["eval", "tiny", "--config"]])
def test_a_binary_recipe_is_a_usage_error(
    command: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    recipe = tmp_path / "model.safetensors"
    recipe.write_bytes(b"\x89\xff\xfe\x00binary" * 8)
    rc, err = run(capsys, *command, str(recipe))
    assert rc == 2 and "internal error" not in err
    assert f"{recipe} is not a text YAML file" in err and "give a recipe YAML file" in err


def test_a_folder_as_a_recipe_is_called_a_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("train:\n  max_steps: 1\n")
    rc, err = run(capsys, "train", str(tmp_path))
    assert rc == 2 and "not found" not in err
    assert f"RECIPE {tmp_path} is a folder (it holds mine.yaml)" in err
    assert "give a recipe YAML file in it, or a shipped recipe's name" in err


def test_a_folder_named_as_a_shipped_recipe_does_not_hide_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl tiny-model tiny` then `qerl train tiny` in that folder: the user named the shipped recipe
    (a recipe is a file), and was told that RECIPE tiny is a folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    for command in (["train", "tiny"], ["compare", "tiny"], ["train", "recipes/tiny.yaml"]):
        main([*command, "--dry-run"])
        out, err = capsys.readouterr()
        assert "is a folder" not in err, (command, err)
        assert "runs/tiny-base" in out + err, (command, err)  # the shipped recipe's model.path: it was read


def test_quality_of_missing_folders_names_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rc, err = run(capsys, "quality", "./nosuch", "a=./nosuch2")
    assert rc == 2 and "internal error" not in err and "repo id" not in err.lower()
    assert "BF16_MODEL ./nosuch: no such folder" in err


def test_quality_of_a_missing_candidate_names_it(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    rc, err = run(capsys, "quality", str(tiny_model_dir), f"a={tmp_path / 'nosuch2'}")
    assert rc == 2 and f"candidate a {tmp_path / 'nosuch2'}: no such folder" in err
    rc, err = run(capsys, "quality", str(tiny_model_dir), f"a={tiny_model_dir}+{tmp_path / 'noadapter'}")
    assert rc == 2 and "candidate a's adapter" in err and "no such folder" in err


def test_a_file_as_quantize_model_is_called_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"x")
    rc, err = run(capsys, "quantize", str(model), "-f", "nvfp4", "-o", str(tmp_path / "out"))
    assert rc == 2 and "not found" not in err
    assert f"MODEL {model} is a file, not a model folder" in err
    assert "Hugging Face Hub id" in err and "alias" in err
    assert not (tmp_path / "out").exists()


def test_quantize_of_a_hub_id_offline_answers_at_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, err = run(capsys, "quantize", "qerl-test/not-cached-model", "-f", "nvfp4", "-o", str(tmp_path / "o"))
    assert rc == 2 and "HF_HUB_OFFLINE=1 is set" in err and "pass the folder instead" in err


def test_an_error_keeps_a_long_path_whole_at_any_width(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A narrow COLUMNS (pytest-xdist's workers have 80) must not break the path inside an error: a user
    copies it from there."""
    monkeypatch.setenv("COLUMNS", "40")
    recipe = tmp_path / ("a-rather-long-folder-name-" * 3) / "model.safetensors"
    recipe.parent.mkdir()
    recipe.write_bytes(b"\x89\xff\xfe\x00binary")
    assert main(["train", str(recipe)]) == 2
    assert str(recipe) in capsys.readouterr().err  # raw: no line break inside the path


def test_quality_output_that_is_a_folder_or_another_file_is_refused_before_work(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`qerl quality ... -o results/` measured every base, then failed to write (internal error, exit 1);
    `-o MODEL/config.json` replaced the model's config with the report."""
    folder = tmp_path / "results"
    folder.mkdir()
    rc, err = run(capsys, "quality", str(tiny_model_dir), f"a={tiny_model_dir}", "-o", str(folder))
    assert rc == 2 and f"--output {folder} is a folder, not a file" in err and "quality.json" in err
    other = tmp_path / "config.json"
    other.write_text('{"model_type": "qwen2"}')
    rc, err = run(capsys, "quality", str(tiny_model_dir), f"a={tiny_model_dir}", "-o", str(other))
    assert rc == 2 and f"--output {other} exists and is not the report of an earlier `qerl quality`" in err
    assert other.read_text() == '{"model_type": "qwen2"}'
