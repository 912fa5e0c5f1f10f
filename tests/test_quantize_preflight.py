"""`qerl quantize` checks what it can before it loads a model (the model source, the output folder, the
calibration source, the packages the method needs), and `qerl quantize --dry-run` runs exactly these
checks, saying what each found, and writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from cli_runner import run_cli as run


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks must answer before the BF16 model (or its tokenizer) loads."""
    import transformers

    import qerl_cli.quantize.run as run_module

    monkeypatch.setattr(run_module, "_load_model", lambda *a, **k: pytest.fail("model loaded before checks"))
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("tokenizer loaded first")
    )


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working folder (the default output goes there), whose listing proves nothing was written."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    return folder


def test_dry_run_lists_the_checks_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], workdir: Path, tiny_model_dir: Path
) -> None:
    rc, out, err = run(
        capsys, "quantize", str(tiny_model_dir), "-f", "nvfp4", "--method", "gptq", "--lora-init", "eora",
        "--calib", "qerl-text", "--device", "cpu", "--dry-run",
    )  # fmt: skip
    assert rc == 0, err
    assert yaml.safe_load(out)["model"] == str(tiny_model_dir)  # the YAML stays reusable on stdout
    assert "checked, nothing loaded or written:" in err
    assert "--format / --method: nvfp4 by gptq, then the eora LoRA start (rank 16)" in err
    assert f"MODEL: {tiny_model_dir}: a model folder" in err
    assert f"--output: {workdir / 'model-NVFP4'}: a new folder" in err
    assert "--calib: 256 calibration samples from qerl-text (shipped with qerl, offline)" in err
    assert "packages: llm-compressor" in err and "--device: cpu -> cpu" in err
    assert list(workdir.iterdir()) == [] and not (workdir.parent / "cache").exists()


def test_rtn_takes_no_calibration_and_nf4_rtn_needs_no_package(
    capsys: pytest.CaptureFixture[str], workdir: Path, tiny_model_dir: Path
) -> None:
    rc, _, err = run(capsys, "quantize", str(tiny_model_dir), "-f", "nf4", "--method", "rtn", "--dry-run")
    assert rc == 0, err
    assert "--calib: not used (rtn takes no calibration samples)" in err
    assert "packages: none beyond qerl's own (nf4 by rtn)" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--calib", "missing.jsonl"], "--calib missing.jsonl: no such file; give a .jsonl or .parquet file"),
        (["--calib", "open-thoughts/OpenThoughts-114k"], "calibrate offline with --calib qerl-text"),
        (["-f", "nf4", "--method", "gptq"], "--method gptq has no NF4 scheme"),
        (["--method", "awq", "--lora-init", "eora"], "--lora-init eora cannot follow --method awq"),
        (["-f", "int3"], "--format has value 'int3' (str); expected 'nvfp4' | 'mxfp4' | 'nf4'"),
    ],
)
def test_a_bad_setting_exits_2_naming_it_before_any_model_loads(
    capsys: pytest.CaptureFixture[str], workdir: Path, tiny_model_dir: Path, no_model_load, args, message
) -> None:
    for dry in ([], ["--dry-run"]):
        rc, _, err = run(capsys, "quantize", str(tiny_model_dir), "-o", "out", *args, *dry)
        assert rc == 2 and message in err, err
    assert list(workdir.iterdir()) == []


RANK_UNUSED = "sizes the error-compensating LoRA start, but --lora-init is zeros, which writes no start"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--lora-init-rank", "8"], "--lora-init-rank 8"),
        (["--lora-init", "zeros", "--lora-init-rank", "8"], "--lora-init-rank 8"),
        (["--set", "lora_init_rank=8"], "lora_init_rank 8"),
        (["--config", "rank.yaml"], "lora_init_rank 32"),
    ],
)
def test_a_lora_init_rank_without_a_lora_init_start_is_refused(
    capsys: pytest.CaptureFixture[str], workdir: Path, tiny_model_dir: Path, no_model_load, args, named
) -> None:
    """`qerl quantize MODEL --lora-init-rank 8` wrote no start (--lora-init stays zeros) and said nothing
    of the rank it dropped."""
    settings = workdir.parent / "rank.yaml"
    settings.write_text("lora_init_rank: 32\n")
    args = [str(settings) if a == "rank.yaml" else a for a in args]
    for dry in ([], ["--dry-run"]):
        rc, out, err = run(capsys, "quantize", str(tiny_model_dir), "--method", "rtn", *args, *dry)
        assert rc == 2 and f"{named} {RANK_UNUSED}" in err and out == "", err
        assert "add --lora-init eora or --lora-init svd (with --method gptq or rtn), or drop" in err
    assert list(workdir.iterdir()) == []


def test_the_rank_left_at_its_default_or_with_a_start_is_no_mistake(
    capsys: pytest.CaptureFixture[str], workdir: Path, tiny_model_dir: Path
) -> None:
    """A dry run's YAML holds the default rank beside lora_init zeros: given back with --config, it runs."""
    rc, out, err = run(capsys, "quantize", str(tiny_model_dir), "--method", "rtn", "--dry-run")
    assert rc == 0, err
    saved = workdir.parent / "saved.yaml"
    saved.write_text(out)
    rc, _, err = run(capsys, "quantize", str(tiny_model_dir), "--config", str(saved), "--dry-run")
    assert rc == 0, err
    rc, _, err = run(capsys, "quantize", str(tiny_model_dir), "--method", "rtn", "--lora-init", "svd",
                     "--lora-init-rank", "8", "--calib", "qerl-text", "--dry-run")  # fmt: skip
    assert rc == 0 and "then the svd LoRA start (rank 8)" in err, err


def test_a_missing_model_exits_2_naming_how_to_give_one(
    capsys: pytest.CaptureFixture[str], workdir: Path, no_model_load
) -> None:
    for model, message in (
        ("./no-such-model", "MODEL ./no-such-model: no such folder"),
        ("missing.gguf", "GGUF file 'missing.gguf' not found: check the path"),
    ):
        rc, _, err = run(capsys, "quantize", model, "--dry-run")
        assert rc == 2 and message in err, err
    assert list(workdir.iterdir()) == []


def test_the_output_folder_is_checked(
    capsys: pytest.CaptureFixture[str], workdir: Path, tiny_model_dir: Path, no_model_load
) -> None:
    (workdir / "taken").mkdir()
    (workdir / "taken" / "keep.txt").write_text("mine")
    (workdir / "a-file").write_text("x")
    for args, message in (
        (["-o", "a-file/out"], "--output a-file/out cannot be written: a-file is a file, not a folder"),
        (["-o", str(tiny_model_dir)], "is the input model folder: choose another --output"),
    ):
        rc, _, err = run(
            capsys, "quantize", str(tiny_model_dir), "-f", "nf4", "--method", "rtn", *args, "--dry-run"
        )
        assert rc == 2 and message in err, err
    # `-o runs` (runs/ meant as the parent): the folder holds other work, not a model, so --overwrite is
    # refused too and no remedy (it said "pass --overwrite to replace it", which was then refused)
    for overwrite in ([], ["--overwrite"]):
        rc, _, err = run(
            capsys, "quantize", str(tiny_model_dir), "-f", "nf4", "--method", "rtn", "-o", "taken",
            *overwrite, "--dry-run",
        )  # fmt: skip
        assert rc == 2 and "output taken holds keep.txt, not a model (no config.json)" in err, err
        assert "give a new sub-folder as --output" in err and "pass --overwrite" not in err
    (workdir / "taken" / "config.json").write_text("{}")  # an earlier output: replaced
    rc, _, err = run(capsys, "quantize", str(tiny_model_dir), "-f", "nf4", "--method", "rtn", "-o", "taken",
                     "--dry-run")  # fmt: skip
    assert rc == 2 and "output folder taken already exists: pass --overwrite to replace it" in err, err
    overwrite = ["quantize", str(tiny_model_dir), "-f", "nf4", "--method", "rtn", "-o", "taken"]
    overwrite.append("--overwrite")
    rc, _, err = run(capsys, *overwrite, "--dry-run")  # the folder is replaced whole: keep.txt would go
    assert rc == 2 and "taken holds keep.txt beside the model, which --overwrite would delete" in err, err
    assert (workdir / "taken" / "keep.txt").read_text() == "mine"
    (workdir / "taken" / "keep.txt").rename(workdir / "keep.txt")
    rc, _, err = run(capsys, *overwrite, "--dry-run")
    assert (
        rc == 0
        and "--output: taken: exists, replaced by --overwrite once the new checkpoint is complete" in err
    )
    (workdir / "keep.txt").rename(workdir / "taken" / "keep.txt")
    assert sorted(p.name for p in workdir.iterdir()) == ["a-file", "taken"]


def test_llm_compressor_missing_names_the_extra(
    capsys: pytest.CaptureFixture[str], workdir: Path, tiny_model_dir: Path, no_model_load, hide_packages
) -> None:
    hide_packages("llmcompressor")
    rc, _, err = run(capsys, "quantize", str(tiny_model_dir), "--method", "rtn", "--dry-run")
    assert rc == 2 and 'need llm-compressor: pip install -e ".[quantize]" in the qerl clone' in err
    assert "--format nf4 --method rtn, which does not" in err
    rc, _, err = run(capsys, "quantize", str(tiny_model_dir), "-f", "nf4", "--method", "rtn", "--dry-run")
    assert rc == 0, err  # NF4 by round to nearest is qerl's own code


def test_a_gguf_file_is_found_not_converted(
    capsys: pytest.CaptureFixture[str], workdir: Path, tmp_path: Path
) -> None:
    gguf = tmp_path / "Tiny-Model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")  # never read by the checks: converting it is the run's first work
    rc, _, err = run(capsys, "quantize", str(gguf), "-f", "nf4", "--method", "rtn", "--dry-run")
    assert rc == 0, err
    assert f"MODEL: {gguf}: the GGUF file {gguf}, converted to a BF16 folder at the start, once" in err
    assert f"--output: {workdir / 'Tiny-Model-NF4'}: a new folder" in err
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("calib", ["qerl-txt", "qerl_text"])
def test_a_misspelt_shipped_calibration_set_is_named(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, calib: str
) -> None:
    """`--calib qerl-txt` was taken for a Hub dataset: refused offline as one, and online streamed from the
    Hub until it failed there."""
    rc, _, err = run(capsys, "quantize", str(tiny_model_dir), "-f", "nvfp4", "--method", "gptq",
                     "--calib", calib, "-o", str(tmp_path / "out"), "--dry-run")  # fmt: skip
    assert (
        rc == 2
        and f"--calib {calib}: no such file, and not the shipped set: did you mean --calib qerl-text?" in err
    )
