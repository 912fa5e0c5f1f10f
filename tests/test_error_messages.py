"""User-facing errors: messages printed verbatim (brackets included), list values naming the bad element."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl_cli.cli import main
from qerl_cli.errors import QerlError, install_hint


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, " ".join(err.split())  # rich wraps long lines


# -- messages are printed verbatim, brackets included -------------------------------------------
def test_yaml_error_keeps_the_bracketed_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    recipe = tmp_path / "[runs]" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text("model: [unclosed\n")
    rc, _, err = run(capsys, "train", str(recipe), "--dry-run")
    assert rc == 2
    assert "[unclosed" in err and "[runs]" in err


def test_vllm_hint_keeps_the_extra_name(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    import qerl_cli.envinfo

    def boom() -> dict:
        raise QerlError(f'rollout engine "vllm" needs vLLM: {install_hint("vllm")}')

    monkeypatch.setattr(qerl_cli.envinfo, "collect", boom)
    rc, _, err = run(capsys, "env")
    assert rc == 2 and 'pip install -e ".[vllm]" in the qerl clone' in err


# -- list values: say which element is wrong -----------------------------------------------------
def test_bench_batch_names_the_bad_element(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "bench", "rollout", "--batch", "2,abc", "--dry-run")
    assert rc == 2 and "--batch takes comma-separated positive integers" in err and "'abc'" in err
    rc, _, err = run(capsys, "bench", "rollout", "--batch", "0", "--dry-run")
    assert rc == 2 and "got '0'" in err


def test_list_of_choices_names_the_item_and_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    # The item and the allowed values in words: no list repr, no "list['auto' | ...] | null".
    choices = "one of auto, marlin, humming, qerl-triton, fp8, fp8-merged, merged"
    rc, _, err = run(capsys, "bench", "e2e", "--linear-backend", "marlinn", "--dry-run")
    assert rc == 2 and f"--linear-backend has 'marlinn', which is not {choices}" in err
    assert "[" not in err and "|" not in err
    rc, _, err = run(capsys, "bench", "e2e", "--set", "linear_backend=fp8,marlinn", "--dry-run")
    assert rc == 2 and f"'linear_backend' has 'marlinn' (item 2), which is not {choices}" in err


def test_config_list_and_dict_errors_name_the_element(capsys, tmp_path: Path) -> None:
    rc, _, err = run(capsys, "bench", "rollout", "--set", "batch=[1, x]", "--dry-run")
    assert rc == 2 and "has 'x' (item 2), which is not an integer" in err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: m}\nreward: {extra: {'a.b:c': lots}}\ndata: {levels: [3, high]}\n")
    rc, _, err = run(capsys, "train", str(recipe), "--dry-run")
    assert rc == 2 and "'a.b:c'" in err and "is not float" in err


# -- an empty comma list where one means nothing: a usage error naming what to give ---------------
def test_empty_benchmark_and_backend_lists_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "eval", "m", "--benchmarks", "", "--dry-run")
    assert rc == 2 and "--benchmarks needs at least one benchmark (choose from gsm8k, math500" in err
    rc, _, err = run(capsys, "eval", "m", "--set", "benchmarks=[]", "--dry-run")
    assert rc == 2 and "benchmarks needs at least one benchmark" in err
    rc, _, err = run(capsys, "bench", "concurrency", "--backends", ",", "--dry-run")
    wanted = "--backends needs at least one backend (choose from marlin, humming, qerl-triton, fp8"
    assert rc == 2 and wanted in err
