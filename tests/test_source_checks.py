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


# -- a training run's folder given for a model ----------------------------------------------------
def _run_folder(tmp_path: Path) -> Path:
    """What `qerl train` leaves in output.dir, as far as the checks look: the config, the metrics, the
    final adapter (recording its base) and a checkpoint."""
    run_dir = _interrupted_run(tmp_path, (2,))
    _adapter_in(run_dir / "adapter")
    return run_dir


def _adapter_in(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 4, "base_model_name_or_path": "runs/tiny-base"}')
    (folder / "adapter_model.safetensors").write_bytes(b"")


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["train", "tiny", "--set", "model.path=RUN", "--dry-run"], "model.path"),
        (["eval", "RUN", "--benchmarks", "synthetic-addition", "--dry-run"], "model"),
        (["eval", "RUN", "--benchmarks", "synthetic-addition", "--engine", "hf"], "model"),
    ],
)
def test_a_run_folder_given_for_the_model_names_its_adapter(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], what: str
) -> None:
    """A recipe's model.path (or eval's MODEL) pointing at a `qerl train` run's folder was answered with
    "has no config.json; give a Hugging Face model folder", which said nothing of the trained adapter."""
    monkeypatch.chdir(tmp_path)
    run_dir = _run_folder(tmp_path)
    err = _refused_as_run_folder(capsys, tmp_path, argv, run_dir, what)
    assert f"`qerl eval runs/tiny-base --adapter {run_dir / 'adapter'}`" in err


def _refused_as_run_folder(capsys, tmp_path: Path, argv: list[str], run_dir: Path, what: str) -> str:
    """Run ``argv`` with RUN standing for ``run_dir``: exit 2 naming it as a run folder, with the base
    it was trained on and the --resume advice, nothing under ``tmp_path`` changed; the error text."""
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    rc, _, err = run(capsys, *[a.replace("RUN", str(run_dir)) for a in argv])
    assert rc == 2 and "error:" in err, err
    assert f"{what} {run_dir} is a `qerl train` run's folder (its output.dir), not a model" in err
    assert f"{what} takes the base model it was trained on (runs/tiny-base)" in err
    assert f"`qerl train {run_dir / 'config.yaml'} --resume auto`" in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    return err


def test_an_adapter_folder_given_for_the_model_is_named(capsys, tmp_path: Path) -> None:
    adapter = _run_folder(tmp_path) / "adapter"
    rc, _, err = run(capsys, "eval", str(adapter), "--benchmarks", "synthetic-addition", "--dry-run")
    assert rc == 2 and f"model {adapter} is a PEFT adapter folder, not a model" in err, err
    assert f"`qerl eval runs/tiny-base --adapter {adapter}`" in err and "--resume" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run(capsys, "eval", str(empty), "--benchmarks", "synthetic-addition", "--dry-run")
    assert rc == 2 and f"model {empty} has no config.json; give a Hugging Face model folder" in err, err
    (empty / "adapter").mkdir()  # an empty adapter/ makes no run folder
    rc, _, err = run(capsys, "eval", str(empty), "--benchmarks", "synthetic-addition", "--dry-run")
    assert rc == 2 and f"model {empty} has no config.json; give a Hugging Face model folder" in err, err


def _interrupted_run(tmp_path: Path, checkpoints: tuple[int, ...] = (2, 10)) -> Path:
    """What a `qerl train` run stopped before its final adapter leaves: the config, the metrics and its
    checkpoints, each with its adapter (none, with ``checkpoints`` empty: stopped before the first)."""
    run_dir = tmp_path / "earlier" / "run"
    run_dir.mkdir(parents=True)
    for step in checkpoints:
        _adapter_in(run_dir / f"checkpoint-{step}" / "adapter")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "config.yaml").write_text("model:\n  path: runs/tiny-base\n")
    return run_dir


RUN_GIVEN = [
    (["train", "tiny", "--set", "model.path=RUN", "--dry-run"], "model.path"),
    (["eval", "RUN", "--benchmarks", "synthetic-addition", "--dry-run"], "model"),
    (["bench", "--model", "RUN", "--engine", "hf", "--formats", "bf16", "--dry-run"], "--model"),
]


@pytest.mark.parametrize(("argv", "what"), RUN_GIVEN)
def test_an_interrupted_run_given_for_the_model_names_its_newest_checkpoint(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], what: str
) -> None:
    """A run stopped before its final adapter (checkpoint-N folders only) was not recognised: the user
    heard "has no config.json", nothing of the adapters it holds or of --resume."""
    monkeypatch.chdir(tmp_path)
    run_dir = _interrupted_run(tmp_path)
    err = _refused_as_run_folder(capsys, tmp_path, argv, run_dir, what)
    newest = "To evaluate the adapter of its newest checkpoint (the run stopped before its final adapter)"
    assert newest in err
    assert f"`qerl eval runs/tiny-base --adapter {run_dir / 'checkpoint-10' / 'adapter'}`" in err


def test_a_run_stopped_before_its_first_checkpoint_is_named(capsys, tmp_path: Path) -> None:
    run_dir = _interrupted_run(tmp_path, checkpoints=())
    rc, _, err = run(capsys, "eval", str(run_dir), "--benchmarks", "synthetic-addition", "--dry-run")
    assert rc == 2 and f"model {run_dir} is a `qerl train` run's folder (its output.dir), not a model" in err
    assert "takes the base model it trains (its config.yaml's model.path)" in err
    assert "stopped before its first checkpoint, so it holds no adapter to evaluate or resume from" in err
    rc, _, err = run(capsys, "eval", "tiny-base", "--adapter", str(run_dir), "--dry-run")
    assert rc == 2 and "it holds a run's adapter" not in err, err
    rc, _, err = run(capsys, "eval", "tiny-base", "--adapter", str(_interrupted_run(tmp_path / "b")))
    assert rc == 2 and "it holds a run's adapter: --adapter " in err, err
    assert str(tmp_path / "b" / "earlier" / "run" / "checkpoint-10" / "adapter") in err


def test_the_bench_names_a_run_or_adapter_folder_as_the_stages_do(capsys, tmp_path: Path) -> None:
    """`qerl bench --model RUN` said "has no config.json; give a model folder, a hub id or a shape name"
    where `qerl eval` and `qerl train` name the run and its adapter: the same check now, and its message."""
    from qerl_cli.bench.models import prepare_checkpoints

    run_dir = _run_folder(tmp_path)
    for folder in (run_dir, run_dir / "adapter"):
        args = ["--model", str(folder), "--engine", "hf", "--formats", "bf16", "--dry-run"]
        rc, _, bench_err = run(capsys, "bench", *args)
        assert rc == 2 and f"--model {folder} is " in bench_err, bench_err
        assert "not a model (no config.json)" in bench_err
        rc, _, eval_err = run(capsys, "eval", str(folder), "--benchmarks", "synthetic-addition", "--dry-run")
        assert bench_err.partition(f"{folder} is ")[2] == eval_err.partition(f"{folder} is ")[2].replace(
            "model takes", "--model takes"
        )
        with pytest.raises(QerlError, match="not a model \\(no config.json\\)"):  # a run past the checks
            prepare_checkpoints(str(folder), ["bf16"])
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run(capsys, "bench", "--model", str(empty), "--engine", "hf", "--dry-run")
    assert rc == 2 and f"--model {empty} has no config.json; give a model folder, a hub id or a shape" in err
