"""Model and dataset sources are checked before any work: missing folders, an offline or unreachable Hub."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from qerl_cli.cli import main
from qerl_cli.errors import QerlError


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, " ".join(err.split())  # rich wraps long lines


# -- eval checks the model path before any dataset --------------------------------------------
def test_eval_missing_model_fails_fast_naming_it(capsys, tmp_path: Path, monkeypatch) -> None:
    import qerl_cli.evaluation.run as eval_run

    def no_data(*args, **kwargs):
        raise AssertionError("the dataset was loaded before the model path was checked")

    monkeypatch.setattr(eval_run, "load_benchmark", no_data)
    start = time.monotonic()
    rc, _, err = run(capsys, "eval", "./no-such-model", "--benchmarks", "gsm8k", "-o", str(tmp_path / "e"))
    assert rc == 2 and "./no-such-model: no such folder" in err
    assert time.monotonic() - start < 5


def test_eval_missing_adapter_fails_fast_naming_it(capsys, tiny_model_dir: Path, tmp_path: Path, monkeypatch):
    import qerl_cli.evaluation.run as eval_run

    monkeypatch.setattr(eval_run, "load_benchmark", lambda *a, **k: pytest.fail("dataset loaded first"))
    rc, _, err = run(
        capsys, "eval", str(tiny_model_dir), "--adapter", str(tmp_path / "nope"), "--benchmarks", "gsm8k",
        "-o", str(tmp_path / "e"),
    )  # fmt: skip
    assert rc == 2 and f"--adapter {tmp_path / 'nope'}: no such folder" in err


def test_offline_hub_id_fails_fast(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    rc, _, err = run(
        capsys, "eval", "nobody/no-such-model", "--benchmarks", "gsm8k", "-o", str(tmp_path / "e")
    )
    assert rc == 2 and "HF_HUB_OFFLINE=1 is set" in err and "nobody/no-such-model" in err
    assert time.monotonic() - start < 5


def test_unreachable_hub_fails_fast_without_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from qerl_cli.data import datasets
    from qerl_cli.modeling import source_checks as sources

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(QerlError, match="cannot be reached"):
        sources.check_model_source("nobody/no-such-model")
    with pytest.raises(QerlError, match="cannot be reached"):
        datasets.load_problems("nobody/no-such-dataset")


def test_unreachable_hub_still_loads_a_cached_dataset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A dataset already in the local cache loads without the network, as datasets always allowed."""
    import datasets as hf_datasets
    from huggingface_hub import constants

    from qerl_cli.data import datasets
    from qerl_cli.modeling import source_checks as sources

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout_s=3.0: False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    (tmp_path / "datasets--someone--cached-set").mkdir()
    rows = [{"question": "1 + 1?", "answer": "2"}]
    monkeypatch.setattr(hf_datasets, "load_dataset", lambda *a, **k: hf_datasets.Dataset.from_list(rows))
    assert datasets.load_hub_records("someone/cached-set", None, "train") == rows
    with pytest.raises(QerlError, match="cannot be reached"):  # not cached: still fails at once
        datasets.load_hub_records("someone/not-cached", None, "train")
