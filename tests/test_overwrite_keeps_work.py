"""--overwrite replaces only what the command itself wrote (a model folder, a tiny base's format folders),
never trained work or other folders: `qerl quantize -o runs/RUN/adapter --overwrite` deleted a trained
adapter (its .safetensors counted as a model's), `qerl tiny-model -o runs/RUN/checkpoint-3 --overwrite`
mixed a model into a checkpoint, and `qerl tiny-base runs --overwrite` deleted every run in runs/."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error

from qerl_cli.modeling import tiny
from qerl_cli.rl import warmstart


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its text: what must be unchanged after a refusal."""
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def _adapter(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"base_model_name_or_path": "base"}')
    (folder / "adapter_model.safetensors").write_text("trained")
    return folder


def _checkpoint(folder: Path) -> Path:
    """A `qerl train` checkpoint's layout (rl.checkpoint): its adapter, optimizer, RNG and trainer state."""
    _adapter(folder / "adapter")
    for name in ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "trainer_state.json"):
        (folder / name).write_text("state")
    return folder


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A `qerl train` run's folder: its records, its config, a checkpoint and its final adapter."""
    run = tmp_path / "runs" / "run-1"
    _checkpoint(run / "checkpoint-3")
    _adapter(run / "adapter")
    (run / "metrics.jsonl").write_text('{"step": 3}\n')
    (run / "config.yaml").write_text("model: {}\n")
    return run


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import qerl_cli.quantize.run as run_module

    monkeypatch.setattr(run_module, "_load_model", lambda *a, **k: pytest.fail("model loaded before checks"))
    monkeypatch.setattr(tiny, "write_tiny_model", lambda *a, **k: pytest.fail("tiny model written"))


@pytest.mark.parametrize(
    ("where", "kind"),
    [
        ("adapter", "is a PEFT adapter, not a model (it holds adapter_config.json"),
        ("checkpoint-3", "is a `qerl train` checkpoint (trainer_state.json)"),
        (".", "is a `qerl train` run's folder"),
    ],
)
@pytest.mark.usefixtures("no_model_load")
def test_quantize_and_tiny_model_never_replace_trained_work(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, run_dir: Path, where: str, kind: str
) -> None:
    """Refused with exit 2, --overwrite or not, the dry run as the run, naming what the folder is."""
    target = (run_dir / where).resolve()
    before = _files(run_dir)
    quantize = ["quantize", str(tiny_model_dir), "-f", "nf4", "--method", "rtn", "-o", str(target)]
    for argv in (quantize, [*quantize, "--dry-run"], ["tiny-model", "-o", str(target)]):
        for extra in ([], ["--overwrite"]):
            rc, _, err = run_cli(capsys, *argv, *extra)
            assert usage_error(rc, err) and f"{target} {kind}" in err, (argv, extra, err)
            assert "nothing was written" in err and "replaced by --overwrite" not in err, err
            assert "add --overwrite" not in err and "pass --overwrite" not in err, err
    assert _files(run_dir) == before


def test_tiny_model_still_replaces_a_model_with_overwrite(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A folder holding a model qerl wrote (config.json, model.safetensors) stays replaceable."""
    out = tmp_path / "tiny"
    assert run_cli(capsys, "tiny-model", "-o", str(out), "--seed", "1")[0] == 0
    rc, _, err = run_cli(capsys, "tiny-model", "-o", str(out), "--seed", "2", "--overwrite")
    assert rc == 0 and (out / "model.safetensors").is_file(), err


@pytest.fixture
def fake_base(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """``prepare_tiny_base`` without the warm start: each format folder with a config.json, as it writes."""
    calls: list[tuple[str, ...]] = []

    def prepare(out: Path, cfg: object, *, formats: tuple[str, ...], report: object = None) -> dict:
        calls.append(tuple(formats))
        paths = {}
        for fmt in dict.fromkeys(("bf16", *formats)):
            (out / fmt).mkdir()
            (out / fmt / "config.json").write_text(f'{{"built": "{fmt}"}}')
            paths[fmt] = out / fmt
        return {"paths": {fmt: paths[fmt] for fmt in formats}}

    monkeypatch.setattr(warmstart, "prepare_tiny_base", prepare)
    return calls


def test_tiny_base_overwrite_keeps_other_folders(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_base: list[tuple[str, ...]]
) -> None:
    """`qerl tiny-base victim --overwrite` left only bf16/ and nvfp4/, deleting myrun/ without a word; without
    --overwrite it suggested `--formats myrun,notes,bf16,nvfp4`."""
    victim = tmp_path / "victim"
    (victim / "myrun").mkdir(parents=True)
    (victim / "notes").mkdir()
    (victim / "myrun" / "metrics.jsonl").write_text("important")
    for extra in ([], ["--overwrite"]):
        rc, _, err = run_cli(capsys, "tiny-base", str(victim), *extra)
        assert usage_error(rc, err) and f"{victim} holds myrun/, notes/, which qerl tiny-base did not" in err
        assert "nothing was changed" in err and "--formats" not in err and "myrun," not in err, err
    assert not fake_base and _files(victim) == {"myrun/metrics.jsonl": "important"}
    assert sorted(p.name for p in victim.iterdir()) == ["myrun", "notes"]


def test_tiny_base_refuses_a_format_folder_of_other_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_base: list[tuple[str, ...]]
) -> None:
    """A folder named as a format is replaced only when it holds a model: not an adapter put there."""
    out = tmp_path / "base"
    _adapter(out / "nvfp4")
    rc, _, err = run_cli(capsys, "tiny-base", str(out), "--overwrite")
    assert usage_error(rc, err) and f"format folder {out / 'nvfp4'} is a PEFT adapter" in err, err
    assert not fake_base and (out / "nvfp4" / "adapter_model.safetensors").read_text() == "trained"


def test_tiny_base_overwrite_still_rebuilds_its_own_base(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_base: list[tuple[str, ...]]
) -> None:
    """An earlier base's format folders (a model each) are replaced, and a format not asked for again goes."""
    out = tmp_path / "base"
    for fmt in ("bf16", "nf4"):
        (out / fmt).mkdir(parents=True)
        (out / fmt / "config.json").write_text("{}")
    rc, _, err = run_cli(capsys, "tiny-base", str(out), "--formats", "bf16,nf4")
    assert usage_error(rc, err) and "it is built; to rebuild it, add --overwrite" in err, err
    rc, _, err = run_cli(capsys, "tiny-base", str(out), "--formats", "bf16,nvfp4", "--overwrite")
    assert rc == 0 and fake_base == [("bf16", "nvfp4")], err
    assert sorted(p.name for p in out.iterdir()) == ["bf16", "nvfp4"]
    assert (out / "bf16" / "config.json").read_text() == '{"built": "bf16"}'


def test_quantize_overwrite_refuses_a_model_folder_holding_other_things(tmp_path: Path) -> None:
    """--overwrite replaces quantize's output folder whole: notes, an evaluation or a run kept beside an
    earlier model went with it, silently. Only a model's files and quantize's own may be replaced."""
    from qerl_cli.errors import QerlError
    from qerl_cli.modeling.work_folders import check_replaceable_model

    out = tmp_path / "q"
    (out / "lora_init").mkdir(parents=True)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "qerl_quant.json",
        "recipe.yaml",
        ".gitkeep",
    ):
        (out / name).write_text("{}")
    check_replaceable_model(out, "output", {"qerl_quant.json", "lora_init"}, "give another -o")  # a model
    (out / "NOTES.md").write_text("mine")
    (out / "run1").mkdir()
    with pytest.raises(
        QerlError, match=r"output .*q holds NOTES.md, run1/ beside the model, which --overwrite"
    ):
        check_replaceable_model(out, "output", {"qerl_quant.json", "lora_init"}, "give another -o")


def test_a_folder_holding_only_hidden_files_counts_as_empty(tmp_path: Path) -> None:
    from qerl_cli.modeling.work_folders import check_not_other_work

    (tmp_path / ".gitkeep").write_text("")
    check_not_other_work(tmp_path, "output")  # no error: nothing but a hidden file
