"""recipes/tiny.yaml and `qerl tiny-base` on a fresh clone: the missing base names the command that builds it,
the command builds it, a failed rebuild keeps the old base."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl_cli.cli import main

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, " ".join(err.split())  # rich wraps long lines


# -- the tiny recipe works on a fresh clone ------------------------------------------------------
def test_tiny_recipe_names_a_real_command() -> None:
    text = (REPO / "recipes" / "tiny.yaml").read_text()
    assert "qerl tiny-base" in text and "python -m" not in text


def test_tiny_recipe_without_its_base_names_the_command(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rc, _, err = run(capsys, "train", str(REPO / "recipes" / "tiny.yaml"))
    assert rc == 2 and "runs/tiny-base/nvfp4" in err and "qerl tiny-base" in err


@pytest.mark.slow
def test_tiny_recipe_on_a_fresh_clone(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Follow the recipe's instructions from an empty working folder: the missing base names the
    command, the command builds it, and the recipe then trains."""
    import functools

    from qerl_cli.rl import warmstart

    monkeypatch.chdir(tmp_path)
    recipe = str(REPO / "recipes" / "tiny.yaml")
    quick = [
        "--set",
        "train.max_steps=1",
        "--set",
        "train.prompts_per_step=2",
        "--set",
        "output.save_steps=0",
    ]
    rc, _, err = run(capsys, "train", recipe, *quick)
    assert rc == 2 and "runs/tiny-base/nvfp4" in err and "qerl tiny-base" in err
    # A short warm start: this test is about the commands, tests/test_demo.py about the learning.
    monkeypatch.setattr(
        warmstart,
        "WarmStartConfig",
        functools.partial(warmstart.WarmStartConfig, max_steps=2, check_every=2, noisy_steps=1, probe_size=2),
    )
    rc, out, _ = run(capsys, "tiny-base")
    assert rc == 0 and "runs/tiny-base/nvfp4" in out
    assert (tmp_path / "runs" / "tiny-base" / "nvfp4" / "config.json").is_file()
    rc, _, err = run(capsys, "tiny-base")
    assert rc == 2 and "--overwrite" in err
    rc, _, err = run(capsys, "train", recipe, *quick)
    assert rc == 0, err
    assert (tmp_path / "runs" / "tiny" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_failed_tiny_base_rebuild_keeps_the_old_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.rl import warmstart

    old = tmp_path / "base" / "bf16"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_text("the old weights")

    def crash(out_dir, cfg, formats):
        (Path(out_dir) / "bf16").mkdir(parents=True)  # half a new base, then the failure
        raise KeyboardInterrupt

    monkeypatch.setattr(warmstart, "prepare_tiny_base", crash)
    with pytest.raises(KeyboardInterrupt):
        warmstart.build_tiny_base(tmp_path / "base", overwrite=True)
    assert (old / "model.safetensors").read_text() == "the old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # no staging folder left behind
