"""A sixth walk of the README as a new user, on what the commands say: where a report went, a recipe key
given as another command's flag, a list item named twice. Each stumble held by the test that would have
caught it."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error


def test_the_bench_says_where_its_report_went(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`qerl bench --batch 2,8` (the README's CI form) ended on its tables and "Wall clock": nothing said
    the report, its Markdown and charts were in bench_results/; `qerl bench kernels` says "wrote ..."."""
    import qerl_cli.bench as bench_mod
    from qerl_cli.bench.result import BenchFiles, read_report

    report = read_report(
        Path(__file__).parents[1] / "benchmarks/h100-2026-11-24/sweep-fp8-humming/bench.json"
    )
    out_dir = tmp_path / "bench_results"
    report.files = BenchFiles(
        str(out_dir / "bench.json"), str(out_dir / "bench.md"), [str(out_dir / "m.png")]
    )
    monkeypatch.setattr(bench_mod, "run_bench", lambda conf, command=None: report)
    rc, out, _ = run_cli(capsys, "bench", "--batch", "2,8", "-o", str(out_dir))
    assert rc == 0 and f"wrote {out_dir / 'bench.json'} (and bench.md, m.png beside it)\n" in out  # unwrapped


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["train", "tiny", "--output", "runs/mine"], "--set output.dir=VALUE"),
        (["train", "tiny", "-o", "runs/mine"], "--set output.dir=VALUE"),
        (["train", "tiny", "--format", "nvfp4"], "--set model.format=VALUE"),
        (["train", "tiny", "--max-steps=5"], "--set train.max_steps=VALUE"),
        (["compare", "tiny", "--engine", "hf"], "--set rollout.engine=VALUE"),
    ],
)
def test_a_flag_that_is_a_recipe_key_is_named_as_one(
    capsys: pytest.CaptureFixture[str], argv: list[str], meant: str
) -> None:
    """`qerl train tiny --output runs/mine` (the -o of bench and quantize) said "No such option" alone."""
    rc, _, err = run_cli(capsys, *argv)
    assert usage_error(rc, err) and f"takes it as a recipe key: {meant}" in err, err
    rc, _, err = run_cli(capsys, "quantize", "m", "--max-steps", "5")  # no recipe there: no such hint
    assert usage_error(rc, err) and "recipe key" not in err, err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["eval", "M", "--benchmarks", "synthetic-addition,synthetic-addition"],
            "--benchmarks names synthetic-",
        ),
        (
            ["compare", "tiny", "--arms", "nvfp4-aqn,nvfp4-aqn"],
            "--arms names nvfp4-aqn twice: give each arm once",
        ),
        (["bench", "--batch", "2,8,2"], "--batch names 2 twice: give each size once"),
        (["bench", "concurrency", "--concurrency", "8,8"], "--concurrency names 8 twice"),
        (["bench", "--set", "batch=[2, -1]"], "batch needs positive integers, got -1"),
    ],
)
def test_a_list_item_named_twice_is_refused_in_words(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """`qerl eval M --benchmarks X,X` evaluated X twice (the second run's figures replacing the first's);
    `qerl compare --arms a,a` said "names an arm twice: ['a', 'a']", a Python list; `qerl bench --batch 2,2`
    measured batch 2 twice."""
    rc, _, err = run_cli(capsys, *argv, "--dry-run")
    assert usage_error(rc, err) and said in err and "['" not in err, err


def test_the_bench_quiets_library_bars_in_a_log(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`qerl bench --batch 2,8` in a CI log had transformers' "Loading weights: 0%|...|" bars between its
    [bench] lines: train, eval and quantize quiet them outside a terminal; the bench did not."""
    import os

    for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(name, "")  # restored (unset) after the test, as the bench sets them
        monkeypatch.delenv(name)
    rc, _, err = run_cli(capsys, "bench", "--batch", "2,8", "-o", str(tmp_path / "b"), "--dry-run")
    assert rc == 0 and os.environ.get("TQDM_DISABLE") == "1", err


def test_an_eval_offline_with_one_data_file_says_to_leave_the_others_out(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """docs/eval.md's `qerl eval ./model --engine hf --data-file gsm8k=FILE --samples 4`, offline: every
    benchmark is evaluated by default, so it stopped on math500 from the Hub, naming only --data-file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("qerl_cli.data.datasets._in_local_cache", lambda hub_id: False)
    data = tmp_path / "gsm8k_test.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    argv = ["eval", str(tiny_model_dir), "--engine", "hf", "--data-file", f"gsm8k={data}", "--dry-run"]
    rc, _, err = run_cli(capsys, *argv, "-o", str(tmp_path / "out"))
    assert usage_error(rc, err) and "; or leave math500 out of --benchmarks" in err, err
    rc, _, err = run_cli(
        capsys, *argv, "-o", str(tmp_path / "out"), "--benchmarks", "gsm8k"
    )  # the docs' form
    assert rc == 0, err
