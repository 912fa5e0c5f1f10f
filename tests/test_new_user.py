"""A new user's first hour, followed from the README on a CPU machine: each stumble found there, held.

Every bad input exits 2 with one message that says what was wrong and what to do, with no traceback
and no "internal error"; the help says what each option does; the README's commands are ones that run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_runner import usage_error
from typer.main import get_command

from qerl_cli.cli import app, main

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    _, err = capsys.readouterr()
    return rc, " ".join(err.split())


@pytest.fixture
def bad_yamls(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "folder").mkdir()
    malformed = tmp_path / "malformed.yaml"
    malformed.write_text("batch: [2, 8\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\x00\x01qerl")
    return {"malformed": malformed, "binary": binary, "folder": tmp_path / "folder"}


# The bench.json benchmarks read --config's keys before the config itself (to tell the keys given from
# the defaults): a malformed file crashed there, exit 1, "internal error: ParserError".
@pytest.mark.parametrize(
    "bench", [["bench"], ["bench", "rollout"], ["bench", "concurrency"], ["bench", "e2e"]]
)
@pytest.mark.parametrize("kind", ["malformed", "binary"])
def test_a_bench_config_that_is_not_yaml_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], bad_yamls: dict[str, Path], bench: list[str], kind: str
) -> None:
    path = bad_yamls[kind]
    rc, err = run(capsys, *bench, "--config", str(path), "--dry-run")
    assert usage_error(rc, err), err
    assert str(path) in err


@pytest.mark.parametrize(
    "argv", [["bench"], ["bench", "kernels"], ["bench", "lora-tune"], ["eval", "m"], ["quantize", "m"]]
)
def test_a_config_that_is_a_folder_says_so(
    capsys: pytest.CaptureFixture[str], bad_yamls: dict[str, Path], argv: list[str]
) -> None:
    rc, err = run(capsys, *argv, "--config", str(bad_yamls["folder"]), "--dry-run")
    assert usage_error(rc, err), err
    assert "is a folder" in err  # not "not found": it is there


@pytest.mark.parametrize("argv", [["bench"], ["bench", "update"], ["eval", "m"], ["quantize", "m"]])
def test_a_missing_config_is_named_as_the_flag_not_as_a_training_recipe(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    """--config of a stage is that stage's settings: the shipped training recipes are no remedy."""
    missing = tmp_path / "settings.yaml"
    rc, err = run(capsys, *argv, "--config", str(missing), "--dry-run")
    assert usage_error(rc, err), err
    assert f"--config {missing}: no such file" in err
    assert "qerl train NAME" not in err and "--dry-run" in err  # the remedy: a dry run prints one


def test_resume_from_a_folder_that_is_not_there_fails_in_the_checks(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """--dry-run said "--resume continues the run there" of a folder that does not exist; a run found
    out only after the model had loaded."""
    missing = tmp_path / "no-such-run"
    rc, err = run(
        capsys, "train", "tiny", "--set", f"model.path={tiny_model_dir}", "--set",
        f"output.dir={tmp_path / 'run'}", "--resume", str(missing), "--dry-run",
    )  # fmt: skip
    assert usage_error(rc, err), err
    assert f"--resume {missing}: no such directory; give the output.dir of an earlier `qerl train` run" in err
    assert "--resume auto for the recipe's own output.dir" in err  # not only "no such directory"


def test_resume_auto_without_a_checkpoint_fails_in_the_checks(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)  # no state file: the save never finished
    rc, err = run(
        capsys, "train", "tiny", "--set", f"model.path={tiny_model_dir}", "--set", f"output.dir={out}",
        "--resume", "auto", "--dry-run",
    )  # fmt: skip
    assert usage_error(rc, err), err
    assert "no complete checkpoint-N/ inside" in err


def test_a_relative_model_folder_not_written_yet_is_not_only_a_hub_id(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's `--set model.path=runs/smol-nvfp4` before the quantize step has written it reads as
    a Hub id (owner/name): the error told the user to `huggingface-cli download runs/smol-nvfp4`."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    rc, err = run(
        capsys, "train", "tiny", "--set", "model.path=runs/smol-nvfp4", "--set", "output.dir=out",
        "--dry-run",
    )  # fmt: skip
    assert usage_error(rc, err), err
    assert f"no folder {tmp_path / 'runs/smol-nvfp4'}" in err
    # how to make it, or where to point; no guessed Hub owner ("ORG/smol") in the command to copy
    assert "qerl quantize MODEL --format nvfp4 -o runs/smol-nvfp4" in err and "--set model.path=DIR" in err


def _options(command, path: str = "qerl"):  # noqa: ANN001, ANN202 (click's or typer's classes)
    for param in command.params:
        yield path, param
    for name, sub in getattr(command, "commands", {}).items():
        yield from _options(sub, f"{path} {name}")


def test_every_option_says_what_it_does() -> None:
    """An option listed in --help with no text (`qerl compare --output` had none) leaves the user to
    guess what it takes and what its default means."""
    silent = [
        f"{path} {param.opts[0]}"
        for path, param in _options(get_command(app))
        if param.param_type_name == "option" and not param.hidden and not (param.help or "").strip()
    ]
    assert not silent


@pytest.mark.parametrize("command", ["quantize", "eval"])
def test_a_model_argument_names_every_source_it_takes(command: str) -> None:
    """The README: "every command takes a hub id, a folder, a .gguf file or an alias"."""
    cmd = get_command(app).commands[command]
    model = next(p for p in cmd.params if p.name == "model")
    assert "alias" in model.help and ".gguf" in model.help


def test_the_readme_installs_qerl_from_the_clone() -> None:
    """qerl is not on PyPI: `pip install "qerl[vllm]"` finds no such distribution. The install
    section says how to install a clone with its extras."""
    install = REPO.joinpath("README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert re.search(r'pip install -e "\.\[vllm\]"', install), install
    assert not re.search(r"pip install\W+qerl\[", install)


def test_a_recipe_that_is_not_yaml_is_one_line_naming_where(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """PyYAML's own text spans five lines and quotes the file as "<unicode string>", which reads like a
    crash: qerl says where (the line, and the line the unclosed bracket opened on) in one."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("train:\n  max_steps: [5\n")
    rc = main(["train", str(recipe), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "line 3, column 1" in err and "line 2, column 14" in err and "<unicode string>" not in err


def test_a_settings_file_that_is_no_mapping_is_not_asked_for_sections(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """eval's --config is flat (samples: 4), not a recipe's sections (model:, train:)."""
    text = tmp_path / "notes.txt"
    text.write_text("just a sentence\n")
    rc, err = run(capsys, "eval", "m", "--config", str(text), "--dry-run")
    assert usage_error(rc, err), err
    assert "must hold a YAML mapping (key: value lines" in err and "--dry-run prints one" in err


def test_no_option_help_offers_a_value_the_flag_cannot_take(capsys: pytest.CaptureFixture[str]) -> None:
    """A key's comment said "null: all" and "0 takes the benchmark's default": as a flag, null is no
    number (click refuses it) and `--samples 0` is refused; the flag's help says "left out" instead."""
    offers_null = [
        f"{path} {param.opts[0]}"
        for path, param in _options(get_command(app))
        if re.search(r"\bnull\b", param.help or "")
    ]
    assert not offers_null
    samples = next(p for p in get_command(app).commands["eval"].params if p.name == "samples")
    rc, err = run(capsys, "eval", "m", "--samples", "0", "--dry-run")
    assert rc == 2 and "--samples must be at least 1" in err
    assert "0 takes" not in samples.help and "left out: each benchmark's default" in samples.help


def test_an_unknown_benchmark_is_listed_as_words_not_python_lists(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run(capsys, "eval", "m", "--benchmarks", "hellaswag", "--dry-run")
    assert usage_error(rc, err), err
    assert "unknown benchmark(s) hellaswag: choose from gsm8k, math500" in err and "[" not in err
    assert "synthetic-*" in err  # the synthetic tasks are benchmarks too


def test_tiny_model_into_a_folder_holding_a_model_loses_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl tiny-model OUT` on a real model's folder replaced its config.json and weights silently."""
    from qerl_cli.modeling import tiny

    written: list[Path] = []
    monkeypatch.setattr(tiny, "write_tiny_model", lambda out, seed=0: written.append(out) or out)
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    rc, err = run(capsys, "tiny-model", str(model))
    assert usage_error(rc, err), err
    assert "already holds a model (config.json)" in err and "--overwrite" in err
    assert not written and (model / "config.json").read_text() == '{"model_type": "llama"}'
    assert run(capsys, "tiny-model", str(model), "--overwrite")[0] == 0 and written == [model]
    assert run(capsys, "tiny-model", str(tmp_path / "new"))[0] == 0  # a new folder needs no flag


def test_a_missing_eval_baseline_fails_before_any_generation(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--baseline` naming no file was read only after every benchmark had been generated and graded
    (minutes on a CPU), then the run failed: the baseline is read first."""
    from qerl_cli.evaluation import run as eval_run

    def no_generation(*args: object, **kwargs: object) -> None:
        raise AssertionError("generated before the baseline was checked")

    monkeypatch.setattr(eval_run, "evaluate_benchmark", no_generation)
    missing = tmp_path / "nope" / "results.json"
    rc, err = run(
        capsys, "eval", str(tiny_model_dir), "--engine", "hf", "--benchmarks", "synthetic-addition",
        "--max-problems", "1", "--samples", "1", "--max-new-tokens", "2", "-o", str(tmp_path / "e"),
        "--baseline", str(missing),
    )  # fmt: skip
    assert rc == 2 and "internal error" not in err  # after the CPU estimate line, the one error
    assert err.endswith(f"error: {missing} not found: give the results.json of an earlier `qerl eval` run")


def test_rescore_of_a_missing_folder_says_what_to_give(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, err = run(capsys, "eval", "--rescore", str(tmp_path / "nope"))
    assert usage_error(rc, err), err
    assert "no such folder; give the output folder of an earlier `qerl eval` run" in err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--arms", "foo,bar"], "unknown arm(s) foo, bar: built in are bf16-lora"),
        (["--only", "nvfp4-lora/9"], "--only nvfp4-lora/9 matches no run; runs are ARM/SEED of the arms "
         "bf16-lora,nvfp4-lora,nvfp4-aqn and the seeds 0..2"),
    ],
)  # fmt: skip
def test_compare_names_a_wrong_arm_or_run_in_words(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], expected: str
) -> None:
    """They were Python lists (['foo']), and --only did not say which seeds there are."""
    rc, err = run(capsys, "compare", "tiny", *flags, "-o", str(tmp_path / "c"))
    assert rc == 2 and "internal error" not in err and "['" not in err
    assert expected in err


def test_the_readme_extras_table_is_pyproject_s() -> None:
    """Each extra of pyproject.toml is a row of the install table, each row an extra, and the dev row
    names every package dev adds (pytest-xdist was missing: pytest's -n auto needs it)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads(REPO.joinpath("pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = REPO.joinpath("README.md").read_text()
    rows = dict(re.findall(r"^\| `qerl\[(\w+)\]` \| ([^|]+) \|", readme, re.M))
    assert set(rows) == set(extras)
    for requirement in extras["dev"]:
        own = re.fullmatch(r"qerl\[([\w,]+)\]", requirement)  # dev's own extras: qerl[quantize,nf4,gguf]
        names = own[1].split(",") if own else [re.split(r"[<>=\[ ]", requirement)[0]]
        assert all(name in rows["dev"] for name in names), (requirement, rows["dev"])


def test_a_choice_typed_as_the_docs_write_it_is_taken(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The README says NVFP4, AWQ, RTN; `qerl bench --formats NVFP4` took it, `qerl quantize -f NVFP4`
    refused it. A choice is matched regardless of case and stored as the config spells it."""
    import yaml

    rc = main(
        ["quantize", str(tiny_model_dir), "-f", "NVFP4", "--method", "RTN", "--set", "lora_init=EoRA",
         "--calib", "qerl-text", "-o", str(tmp_path / "out"), "--dry-run"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    config = yaml.safe_load(out)
    assert (config["format"], config["method"], config["lora_init"]) == ("nvfp4", "rtn", "eora")
    rc, err = run(capsys, "quantize", "m", "-f", "NVFP5", "--dry-run")
    assert usage_error(rc, err) and "expected 'nvfp4' | 'mxfp4' | 'nf4'" in err  # a wrong one still is not


def test_an_unknown_key_with_nothing_close_names_the_keys_there(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    """A model's config.json given as the recipe said only "unknown config key 'architectures'"."""
    rc, err = run(capsys, "train", str(tiny_model_dir / "config.json"), "--dry-run")
    assert usage_error(rc, err), err
    assert "the keys at the top level: model, lora, rollout, algorithm, aqn, data, reward, train" in err
    rc, err = run(capsys, "eval", "m", "--set", "zzzzzz=1", "--dry-run")
    assert usage_error(rc, err) and "the command's --dry-run prints every key with its value" in err
