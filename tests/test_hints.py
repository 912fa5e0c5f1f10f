"""Hints that work where they appear: `qerl models` prints a pip command that works when pasted (the real
cache folder, not an unset variable), `qerl eval` names `--engine hf` where vLLM cannot run and picks its
engine like the bench does (auto), and out-of-range counts are refused instead of silently replaced."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from qerl_cli.cli import main
from qerl_cli.errors import QerlError


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, " ".join(err.split())


def test_models_prints_the_real_cache_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    monkeypatch.delenv("QERL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    rc, out, _ = run(capsys, "models", "--json")
    assert rc == 0
    for row in json.loads(out):
        assert "$QERL_CACHE_DIR" not in row["get_it"]
        assert row["get_it"].endswith(f"-d {tmp_path / 'xdg' / 'qerl'}")
    from qerl_cli.modeling.sources import ALIASES, alias_status

    _, how = alias_status(ALIASES["smollm2-135m-instruct"])
    assert "$QERL_CACHE_DIR" not in how and str(tmp_path / "xdg" / "qerl") in how


def test_eval_auto_engine_is_chosen_like_the_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    from qerl_cli.config import EvalConfig
    from qerl_cli.evaluation.run import resolve_engine

    assert EvalConfig().engine == "auto"
    real = importlib.util.find_spec
    for has_vllm in (False, True):
        for gpu in (False, True):
            monkeypatch.setattr(
                importlib.util,
                "find_spec",
                lambda name, *a, v=has_vllm: (
                    (real("json") if v else None) if name == "vllm" else real(name, *a)
                ),
            )
            monkeypatch.setattr(torch.cuda, "is_available", lambda g=gpu: g)
            assert resolve_engine("auto") == ("vllm" if has_vllm and gpu else "hf")
            assert resolve_engine("hf") == "hf"
            if has_vllm and gpu:
                assert resolve_engine("vllm") == "vllm"
            else:
                with pytest.raises(QerlError, match="--engine vllm: .*--engine hf"):
                    resolve_engine("vllm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine may run vLLM")
def test_eval_vllm_on_a_cpu_names_the_flag(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    rc, _, err = run(
        capsys,
        "eval",
        str(tiny_model_dir),
        "--engine",
        "vllm",
        "--benchmarks",
        "synthetic-addition",
        "-o",
        str(tmp_path / "e"),
    )
    assert rc == 2 and "--engine hf" in err
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--samples", "0"), ("--samples", "-2"), ("--max-problems", "0"), ("--max-new-tokens", "0")],
)
def test_eval_refuses_counts_below_one(
    flag: str, value: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, _, err = run(capsys, "eval", "tiny", flag, value, "-o", str(tmp_path / "e"), "--dry-run")
    assert rc == 2 and f"{flag} must be at least 1, got {value}" in err
