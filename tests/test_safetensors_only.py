"""Every load of model weights reads safetensors only: a pickle-only model is refused at the load itself,
not only by the folder checks before it (which a hub id holding only ``*.bin`` gets past)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.modeling import source_checks

REFUSED = "safetensors only"


@pytest.fixture(scope="module")
def pickle_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model folder whose weights are pytorch_model.bin only (transformers 5 writes safetensors
    whatever ``safe_serialization`` says, so the pickle file is written as older checkpoints were)."""
    from qerl_cli.modeling.tiny import build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("pickle") / "model"
    out.mkdir()
    model = build_tiny_model(seed=0)
    model.config.save_pretrained(out)
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    build_tokenizer().save_pretrained(out)
    assert not list(out.glob("*.safetensors"))
    return out


@pytest.fixture(autouse=True)
def no_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(source_checks.ALLOW_PICKLE_ENV, raising=False)


def test_the_loader_refuses_pickle_weights(pickle_model_dir: Path) -> None:
    from qerl_cli.modeling.loading import load_pretrained_lm

    with pytest.raises(QerlError, match=f"{REFUSED}.*QERL_ALLOW_PICKLE=1") as caught:
        load_pretrained_lm(pickle_model_dir, dtype=torch.float32)
    assert str(pickle_model_dir) in str(caught.value)


def test_the_loader_reads_safetensors_and_pickle_once_opted_in(
    pickle_model_dir: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.modeling.loading import load_pretrained_lm

    assert sum(p.numel() for p in load_pretrained_lm(tiny_model_dir, dtype=torch.float32).parameters()) > 0
    monkeypatch.setenv(source_checks.ALLOW_PICKLE_ENV, "1")
    assert sum(p.numel() for p in load_pretrained_lm(pickle_model_dir, dtype=torch.float32).parameters()) > 0


def test_quantize_refuses_pickle_weights_past_its_checks(
    pickle_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The preflight's pickle check patched away, as for a hub id with only ``*.bin``: exit 2 at the load."""
    from qerl_cli.cli import main

    monkeypatch.setattr(source_checks, "model_source_found", lambda name, **_: f"{name}: patched")
    out = tmp_path / "nf4"
    argv = ["quantize", str(pickle_model_dir), "--format", "nf4", "--method", "rtn", "--device", "cpu"]
    assert main([*argv, "-o", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert REFUSED in err and "QERL_ALLOW_PICKLE=1" in err and not out.exists()


def test_native_rtn_writer_refuses_pickle_weights(pickle_model_dir: Path, tmp_path: Path) -> None:
    from qerl_cli.quantize.native import write_rtn_checkpoint

    with pytest.raises(QerlError, match=REFUSED):
        write_rtn_checkpoint(pickle_model_dir, tmp_path / "rtn", "nvfp4")
    assert not (tmp_path / "rtn").exists()


def test_native_rtn_writer_reads_safetensors(tiny_model_dir: Path, tmp_path: Path) -> None:
    from qerl_cli.quantize.native import write_rtn_checkpoint

    out = write_rtn_checkpoint(tiny_model_dir, tmp_path / "rtn", "nvfp4")
    assert (out / "model.safetensors").is_file()


def test_bench_quality_reference_load_refuses_pickle_weights(
    pickle_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``qerl bench quality``'s RTN row without llm-compressor loads the BF16 model only through qerl's
    writer (its weight figures come from the report the writer records): safetensors only, nothing
    written."""
    from qerl_cli.bench import quality

    with pytest.raises(QerlError, match=REFUSED):
        quality._native_rtn(str(pickle_model_dir), tmp_path / "rtn", "nvfp4")
    assert not (tmp_path / "rtn").exists()
