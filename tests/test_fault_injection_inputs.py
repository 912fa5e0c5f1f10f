"""Fault injection at the inputs: a wrong type in every recipe section, unusable model folders, output
folders that cannot be written, graders that crash and data rows without an answer; each case checks
the exit code and the message, and that nothing was started.

The tiny-model fixtures come from conftest.py and the training helpers from test_trainer.py.
"""

from __future__ import annotations

import errno
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from qerl_cli.cli import main

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    _, err = capsys.readouterr()
    return rc, " ".join(err.split())


def train_argv(model: Path | str, out: Path, *sets: str) -> list[str]:
    args = [
        "train",
        str(REPO / "recipes" / "tiny.yaml"),
        f"--set=model.path={model}",
        f"--set=output.dir={out}",
    ]
    return args + [f"--set={s}" for s in ("train.max_steps=1", "train.prompts_per_step=2", *sets)]


# -- recipes: a wrong type in every section --------------------------------------------------------
WRONG_TYPES = {
    "model": ("trust_remote_code", "maybe", "expected bool"),
    "lora": ("rank", "big", "expected int"),
    "rollout": ("temperature", "hot", "expected float"),
    "algorithm": ("eps_low", [0.2], "expected float"),
    "aqn": ("enabled", "sometimes", "expected bool"),
    "data": ("levels", [3, "hard"], "has 'hard' (item 2), which is not an integer"),
    "reward": ("extra", {"pkg.mod:fn": "lots"}, "is not float"),
    "train": ("max_steps", 1.5, "expected int"),
    "output": ("save_total_limit", "three", "expected int | null"),
}


@pytest.mark.parametrize("section", sorted(WRONG_TYPES))
def test_a_wrong_type_in_each_recipe_section(capsys, tmp_path: Path, section: str) -> None:
    key, value, expected = WRONG_TYPES[section]
    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        json.dumps({"model": {"path": "m"}, "output": {"dir": str(out)}, section: {key: value}})
    )
    rc, err = run(capsys, "train", str(recipe))
    assert rc == 2
    assert f"'{section}.{key}'" in err and expected in err
    assert not out.exists()  # nothing was started


# -- model folders ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pickle_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qerl_cli.modeling.tiny import build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("pickle") / "model"

    model = build_tiny_model(seed=0)
    out.mkdir()
    model.config.save_pretrained(out)
    torch.save(model.state_dict(), out / "pytorch_model.bin")  # how older checkpoints were shared
    build_tokenizer().save_pretrained(out)
    assert not list(out.glob("*.safetensors"))
    return out


def test_pickle_only_weights_are_refused(capsys, pickle_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("QERL_ALLOW_PICKLE", raising=False)
    rc, err = run(capsys, *train_argv(pickle_model_dir, tmp_path / "run"))
    assert rc == 2 and "only pickle weights" in err and "QERL_ALLOW_PICKLE=1" in err
    assert not (tmp_path / "run" / "adapter").exists()


def test_pickle_weights_load_when_the_user_opts_in(pickle_model_dir: Path, monkeypatch) -> None:

    from qerl_cli.modeling.loading import load_base_model

    monkeypatch.setenv("QERL_ALLOW_PICKLE", "1")
    model, fmt = load_base_model(str(pickle_model_dir), "auto", torch.float32, torch.device("cpu"))
    assert fmt == "bf16" and sum(p.numel() for p in model.parameters()) > 0


@pytest.fixture
def remote_code_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_model_that_needs_its_own_code_says_how_to_opt_in(
    capsys, remote_code_model_dir: Path, tmp_path
) -> None:
    rc, err = run(capsys, *train_argv(remote_code_model_dir, tmp_path / "run"))
    assert rc == 2 and "needs its own Python code" in err and "--set model.trust_remote_code=true" in err
    rc, err = run(
        capsys, "eval", str(remote_code_model_dir), "--benchmarks", "gsm8k", "-o", str(tmp_path / "e")
    )
    assert rc == 2 and "--set trust_remote_code=true" in err


def test_trust_remote_code_passes_the_check_when_asked(remote_code_model_dir: Path) -> None:
    from qerl_cli.modeling.source_checks import check_model_source

    check_model_source(remote_code_model_dir, trust_remote_code=True)  # no error: the user asked


def test_a_model_path_that_is_a_file(capsys, tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    rc, err = run(capsys, "eval", str(weights), "--benchmarks", "gsm8k", "-o", str(tmp_path / "e"))
    assert rc == 2 and "is a file, not a model folder: give a model folder" in err
    assert weights.read_bytes() == b"x"


def test_an_offline_hub_id_for_train_fails_fast(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    rc, err = run(capsys, *train_argv("nobody/no-such-model", tmp_path / "run"))
    assert rc == 2 and "Hugging Face Hub id, HF_HUB_OFFLINE=1 is set" in err
    assert time.monotonic() - start < 10


def test_an_offline_hub_dataset_names_the_local_file_option(capsys, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rc, err = run(capsys, *train_argv(tiny_model_dir, tmp_path / "run", "data.dataset=nobody/no-such-data"))
    assert rc == 2 and "offline" in err and "data.dataset=PATH" in err


# -- output folders --------------------------------------------------------------------------------
def test_train_output_folder_that_is_a_file(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "run"
    target.write_text("keep me")
    rc, err = run(capsys, *train_argv(tiny_model_dir, target))
    assert rc == 2 and f"output.dir {target} is a file" in err
    assert target.read_text() == "keep me"


def test_eval_output_folder_that_is_a_file(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "results"
    target.write_text("keep me")
    rc, err = run(
        capsys, "eval", str(tiny_model_dir), "--benchmarks", "synthetic-addition", "-o", str(target)
    )
    assert rc == 2 and f"--output {target} is a file" in err
    assert target.read_text() == "keep me"


def test_an_output_folder_under_a_file(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("keep me")
    rc, err = run(capsys, *train_argv(tiny_model_dir, tmp_path / "blocker" / "run"))
    assert rc == 2 and "cannot be written" in err and "blocker" in err
    assert (tmp_path / "blocker").read_text() == "keep me"


def test_an_unwritable_output_folder(capsys, tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Root ignores chmod, so the refusal is simulated where the probe write happens."""
    import qerl_cli.files

    real = qerl_cli.files.tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):  # noqa: A002 - mkstemp's own keyword
        if dir is not None and Path(dir) == tmp_path / "ro":
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(qerl_cli.files.tempfile, "mkstemp", refuse)
    rc, err = run(capsys, *train_argv(tiny_model_dir, tmp_path / "ro"))
    assert rc == 2 and f"output.dir {tmp_path / 'ro'} cannot be written: Permission denied" in err


# -- graders and data ---------------------------------------------------------------------------
def test_a_grader_that_kills_its_worker_scores_zero_and_the_pool_goes_on() -> None:
    from qerl_cli.rewards import Grader

    with Grader(workers=1, timeout_s=5.0, grade_fn="grader_hooks:crash_on_seven") as grader:
        results = grader.grade_many(["1", "7", "3"], ["1", "7", "3"])
        assert [r.correct for r in results] == [True, False, True]
        assert results[1].error or results[1].timed_out
        assert grader.grade_many(["5"], ["5"])[0].correct  # the pool replaced the dead worker


def test_rows_without_an_answer_are_skipped_and_counted(tmp_path: Path, caplog) -> None:
    from qerl_cli.data.datasets import load_problems

    data = tmp_path / "d.jsonl"
    rows = [
        {"question": "1+1?", "answer": "2"},
        {"question": "no answer"},
        {"question": "empty", "answer": "  "},
        {"question": "word answer?", "answer": "seven"},
        {"question": "null", "answer": None},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    with caplog.at_level("WARNING"):
        problems = load_problems(str(data), shuffle=False)
    assert [p.question for p in problems] == ["1+1?", "word answer?"]  # every gradeable row kept
    assert "skipped 3 of 5 rows" in caplog.text and "rows 1, 2, 4" in caplog.text


def test_a_non_numeric_gold_is_graded_not_crashed() -> None:
    from qerl_cli.rewards.grading import grade

    assert grade("<answer>seven</answer>", "seven").correct
    result = grade("<answer>7</answer>", "seven")
    assert not result.correct and result.error is None
