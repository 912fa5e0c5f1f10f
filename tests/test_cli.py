from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from qerl_cli.cli import main

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


COMMANDS = {
    "quantize", "train", "eval", "bench", "compare", "demo", "env", "models", "tiny-model", "tiny-base",
    "quality",
}  # fmt: skip


def test_help_lists_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    """The exact set of commands, read from the rows of --help's Commands panel (a word such as
    "train" elsewhere in the help does not count): deleting or renaming a command fails here."""
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    panel = out.split("Commands", 1)[1].split("╰", 1)[0]
    rows = [
        line.strip("│ ").split()[0]
        for line in panel.splitlines()
        if line.startswith("│ ") and not line.startswith("│  ")  # continuation lines are indented further
    ]
    assert sorted(rows) == sorted(COMMANDS)
    from typer.main import get_command

    from qerl_cli.cli import app

    assert set(get_command(app).commands) == COMMANDS  # registered, help text or not


def test_env_json_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "env", "--json")
    assert rc == 0
    info = json.loads(out)
    assert info["packages"]["torch"]
    assert {"transformers", "peft", "vllm", "llmcompressor", "triton", "math-verify"} <= set(info["packages"])
    assert isinstance(info["gpus"], list)


def test_train_dry_run_prints_the_override(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(
        capsys,
        "train",
        str(REPO / "recipes/bigmath_14b.yaml"),
        "--dry-run",
        "--set",
        "train.learning_rate=2e-5",
    )
    # The resolved config comes first; then the checks refuse the recipe's model, not made here.
    assert rc == 2
    resolved = yaml.safe_load(out)
    assert resolved["train"]["learning_rate"] == 2e-5
    assert resolved["algorithm"]["name"] == "dapo"


def test_misspelled_key_exits_2_with_suggestion(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\n")
    rc, _, err = run(capsys, "train", str(recipe), "--dry-run", "--set", "train.lerning_rate=2e-5")
    assert rc == 2
    assert "did you mean train.learning_rate?" in " ".join(err.split())


def test_wrong_type_exits_2_naming_the_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\ntrain:\n  max_steps: many\n")
    rc, _, err = run(capsys, "train", str(recipe), "--dry-run")
    assert rc == 2
    assert "train.max_steps" in err and "expected int" in err


def test_tiny_model_command_writes_a_loadable_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, out, _ = run(capsys, "tiny-model", str(tmp_path / "tiny"), "--seed", "3")
    assert rc == 0
    assert (tmp_path / "tiny" / "model.safetensors").is_file()


def test_unexpected_errors_exit_1_without_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import qerl_cli.envinfo

    def boom() -> dict:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(qerl_cli.envinfo, "collect", boom)
    rc, _, err = run(capsys, "env")
    assert rc == 1
    assert "kaboom" in err and "Traceback" not in err


# -- each stage's typed result, rendered by the CLI -------------------------------------------------
# As qerl printed it when train returned a dict (rich pads the title line; compared without it).
TRAIN_TABLE = [
    "                   qerl train",
    "┌─────────────────────────────┬────────────────┐",
    "│ steps                       │ 4              │",
    "│ resumed from                │ -              │",
    "│ mean reward, first 10 steps │ 0.125          │",
    "│ mean reward, last 10 steps  │ 0.500          │",
    "│ adapter                     │ runs/x/adapter │",
    "│ outputs                     │ runs/x         │",
    "│ plot                        │ -              │",
    "└─────────────────────────────┴────────────────┘",
]


def test_train_renders_its_summary(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import qerl_cli.rl.trainer as trainer_mod
    from qerl_cli.rl.result import TrainResult

    result = TrainResult(
        output_dir="runs/x", adapter="runs/x/adapter", steps=4, world_size=1, resumed_from=None,
        reward_first10=0.125, reward_last10=0.5, plot=None, final={"step": 4},
    )  # fmt: skip
    seen = []
    monkeypatch.setattr(
        trainer_mod, "train", lambda conf, resume=None, overwrite=False: seen.append(resume) or result
    )
    monkeypatch.setattr("qerl_cli.rl.preflight.preflight", lambda *args, **kwargs: [])  # no model "m" here
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  path: m\ntrain:\n  device: cuda\noutput:\n  dir: {tmp_path / 'run'}\n")
    (tmp_path / "run").mkdir()  # --resume auto: a run there to resume
    rc, out, _ = run(capsys, "train", str(recipe), "--resume", "auto")
    assert rc == 0 and seen == [str(tmp_path / "run")]
    assert [line.rstrip() for line in out.splitlines()] == TRAIN_TABLE


def test_bench_renders_its_report_and_exits_1_on_a_regression(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    import qerl_cli.bench as bench_mod
    from qerl_cli.bench.result import RegressionOutcome, read_report

    report = read_report(REPO / "benchmarks" / "h100-2026-11-24" / "sweep-fp8-humming" / "bench.json")
    monkeypatch.setattr(bench_mod, "run_bench", lambda conf, command=None: report)
    rc, out, err = run(capsys, "bench", "rollout")
    assert rc == 0 and "Rollout throughput" in out and "Wall clock:" in out
    assert err.startswith("plan:\n") and "error" not in err and "warning" not in err  # the plan alone
    failures = ["rollout format=nvfp4: slower"]
    regressed = dataclasses.replace(report, regression=RegressionOutcome(0.1, 3, failures, passed=False))
    monkeypatch.setattr(bench_mod, "run_bench", lambda conf, command=None: regressed)
    rc, out, err = run(capsys, "bench", "rollout")
    assert rc == 1 and "Regression gate FAILED" in out and "regression: rollout format=nvfp4: slower" in err


def test_compare_renders_its_report(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import qerl_cli.compare as compare_mod
    from qerl_cli.compare.results import CompareReport, CompareResult

    data = json.loads((REPO / "benchmarks" / "smollm2-h200-2026-11-23" / "compare.json").read_text())
    report = CompareReport.from_dict(data)
    results = iter([CompareResult(output="out", runs=9, ran=0, report=report), CompareResult("out", 9, 0)])
    monkeypatch.setattr(compare_mod, "run_compare", lambda *a, **k: next(results))
    recipe = str(REPO / "recipes" / "tiny.yaml")
    rc, out, _ = run(capsys, "compare", recipe)
    assert rc == 0 and "qerl compare (threshold 0.216)" in out and "compare.json, compare.md" in out
    rc, out, _ = run(capsys, "compare", recipe, "--no-summary")  # nothing to render
    assert rc == 0 and out == ""


# -- usage errors: click's style and exit code 2, never "internal error" -----------------------------
# typer >= 0.29 raises its own copies of click's exception classes; these hold the CLI to both.
@pytest.mark.parametrize(
    ("argv", "usage", "needles"),
    [
        (["trian"], "Usage: qerl [OPTIONS] COMMAND", ["No such command 'trian'", "Did you mean 'train'?"]),
        (["eval", "--samplez", "3"], "Usage: qerl eval [OPTIONS]", ["No such option", "--samplez"]),
        (["train"], "Usage: qerl train [OPTIONS]", ["Missing argument 'RECIPE'"]),
        (["eval", "--samples", "abc"], "Usage: qerl eval [OPTIONS]", ["Invalid value for '--samples'"]),
    ],
)
def test_usage_errors_exit_2_with_the_usage_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], usage: str, needles: list[str]
) -> None:
    rc, out, err = run(capsys, *argv)
    err = " ".join(err.split())  # rich wraps long lines
    assert rc == 2 and out == ""
    assert err.startswith(usage) and "for help" in err and f"error: {needles[0]}" in err
    assert all(needle in err for needle in needles)
    assert "internal error" not in err


def test_usage_errors_of_click_itself_are_shown_too(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """click's own exception classes (what typer < 0.29 raised; click is no longer typer's dependency)
    are shown the same way: they are recognised by their shape, not by class."""
    import importlib

    click = pytest.importorskip("click")
    main_mod = importlib.import_module("qerl_cli.cli.main")  # the package's `main` is the function

    def raise_it(*args: object, **kwargs: object) -> None:
        raise click.UsageError("no such thing")

    monkeypatch.setattr(main_mod, "app", raise_it)
    rc, _, err = run(capsys, "env")
    assert rc == 2 and "error: no such thing" in err and "internal error" not in err

    def raise_file_error(*args: object, **kwargs: object) -> None:
        raise click.FileError("x.txt", "gone")  # a ClickException that is not a usage error: exit 1

    monkeypatch.setattr(main_mod, "app", raise_file_error)
    rc, _, err = run(capsys, "env")
    assert rc == 1 and "error: Could not open file" in err and "internal error" not in err


def test_bare_qerl_prints_the_help_and_exits_2_as_click_does(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys)
    assert rc == 2  # click >= 8.2 and typer: no_args_is_help is a usage error (help, exit 2)
    assert "Usage: qerl [OPTIONS] COMMAND" in out and "Commands" in out and "train" in out
    assert "error" not in err


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    rc, out, err = run(capsys, "--version")
    assert rc == 0 and out == f"qerl {version('qerl')}\n" and err == ""


def test_console_entry_point_maps_usage_errors_and_version() -> None:
    """The installed `qerl` script (the console entry point): exit codes and output from a real process."""
    import subprocess
    import sys

    qerl = Path(sys.executable).with_name("qerl")
    if not qerl.is_file():
        pytest.skip(f"no installed qerl script beside {sys.executable} (pip install -e .)")
    done = subprocess.run([str(qerl), "trian"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "No such command 'trian'" in done.stderr
    assert "internal error" not in done.stderr and done.stderr.startswith("Usage: qerl ")
    done = subprocess.run([str(qerl), "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("qerl ")


# -- errors name what the user typed -----------------------------------------------------------------
def test_bad_flag_values_name_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, _, err = run(capsys, "bench", "rollout", "--prompt-len", "0", "--dry-run")
    assert rc == 2 and "error: --prompt-len must be > 0, got 0" in err and "BenchConfig" not in err
    rc, _, err = run(capsys, "bench", "e2e", "--generations", "0", "--dry-run")
    assert rc == 2 and "--generations must be at least 2" in err
    rc, _, err = run(capsys, "bench", "rollout", "--set", "prompt_len=0", "--dry-run")  # a recipe key
    assert rc == 2 and "error: prompt_len must be > 0" in err
    recipe = tmp_path / "bench.yaml"
    recipe.write_text("repeats: 0\n")
    rc, _, err = run(capsys, "bench", "rollout", "--config", str(recipe), "--dry-run")
    assert rc == 2 and "error: repeats must be > 0" in err


def test_bench_refuses_an_unknown_format_listing_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    from qerl_cli import formats

    rc, out, err = run(capsys, "bench", "rollout", "--formats", "fp3", "--dry-run")
    err = " ".join(err.split())
    assert rc == 2 and out == ""  # nothing resolved, nothing printed
    assert "--formats: unknown format(s) fp3" in err
    assert f"choose from {', '.join(['bf16', *formats.names()])}" in err
    rc, _, err = run(capsys, "bench", "rollout", "--set", "formats=bf16,fp3", "--dry-run")
    assert rc == 2 and "formats: unknown format(s) fp3" in err
    rc, out, _ = run(capsys, "bench", "rollout", "--formats", "bf16,NVFP4", "--dry-run")  # lower-cased later
    assert rc == 0 and yaml.safe_load(out)["formats"] == ["bf16", "NVFP4"]


# Every flag and --set key that takes a weights format: the command line that gives it "fp3", and what
# its refusal lists (the format registry's names, read from the registry here). "4bit": the 4-bit ones,
# as the config's type error writes them; "weights": BF16 and the 4-bit ones, as the checks write them.
TMP_OUT = ("-o", "{tmp}/c")
FORMAT_ARGS = {
    ("quantize", "--format"): (["quantize", "m", "--format", "fp3", "--dry-run"], "4bit"),
    ("quantize", "format"): (["quantize", "m", "--set", "format=fp3", "--dry-run"], "4bit"),
    ("bench", "--formats"): (["bench", "rollout", "--formats", "bf16,fp3", "--dry-run"], "weights"),
    ("bench", "formats"): (["bench", "rollout", "--set", "formats=fp3", "--dry-run"], "weights"),
    ("bench", "--format"): (["bench", "scaling", "tiny", "--format", "fp3", "--dry-run"], "weights"),
    ("tiny-base", "--formats"): (["tiny-base", "{tmp}/base", "--formats", "bf16,fp3"], "weights"),
    ("train", "model.format"): (["train", "{recipe}", "--set", "model.format=fp3", "--dry-run"], "model"),
    ("compare", "model.format"): (["compare", "{recipe}", "--set", "model.format=fp3", *TMP_OUT], "model"),
    ("compare", "compare.arms"): (["compare", "{arms}", "--arms", "mine", *TMP_OUT], "weights"),
}


def _listed(kind: str) -> str:
    from qerl_cli import formats

    if kind == "weights":
        return ", ".join(formats.model_names())
    return " | ".join(map(repr, formats.names() if kind == "4bit" else ["auto", *formats.model_names()]))


def test_every_format_option_is_in_the_table() -> None:
    """A new flag or config key taking a format must join FORMAT_ARGS (and so refuse an unknown one)."""
    import dataclasses

    from typer.main import get_command

    from qerl_cli import config
    from qerl_cli.cli import app

    def commands(name: str, command: Any) -> list[tuple[str, Any]]:  # a group's subcommands go by its name
        subs = getattr(command, "commands", None)
        return [(name, command)] + [pair for sub in (subs or {}).values() for pair in commands(name, sub)]

    flags = {
        (name, opt)
        for top, group in get_command(app).commands.items()
        for name, command in commands(top, group)
        for param in command.params
        for opt in param.opts
        if opt.startswith("--") and "format" in opt
    }

    def keys(cls: type, prefix: str = "") -> set[str]:
        found = set()
        for f in dataclasses.fields(cls):
            if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
                found |= keys(f.default_factory, f"{prefix}{f.name}.")
            elif f.name in ("format", "formats"):
                found.add(prefix + f.name)
        return found

    stage_keys = {"quantize": config.QuantizeConfig, "bench": config.BenchConfig, "train": config.TrainConfig,
                  "eval": config.EvalConfig, "compare": config.TrainConfig}  # fmt: skip
    set_keys = {(stage, key) for stage, cls in stage_keys.items() for key in keys(cls)}
    assert flags | set_keys | {("compare", "compare.arms")} == set(FORMAT_ARGS)


@pytest.mark.parametrize("option", list(FORMAT_ARGS), ids="/".join)
def test_every_format_option_refuses_an_unknown_one_listing_the_registry(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: tuple[str, str]
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\n")
    arms = tmp_path / "arms.yaml"
    arms.write_text("model:\n  path: m\ncompare:\n  arms:\n    mine: {model.format: fp3}\n")
    argv, kind = FORMAT_ARGS[option]
    argv = [a.format(tmp=tmp_path, recipe=recipe, arms=arms) for a in argv]
    rc, out, err = run(capsys, *argv)
    err = " ".join(err.split())
    assert rc == 2 and "fp3" in err and _listed(kind) in err, err
    assert not (tmp_path / "base").exists()  # tiny-base refused before touching its output


def test_a_recipe_with_a_key_written_twice_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\ntrain:\n  max_steps: 3\ntrain:\n  seed: 1\n")
    rc, out, err = run(capsys, "train", str(recipe), "--dry-run")
    assert rc == 2 and out == ""
    assert "key 'train' is written twice (lines 3 and 5)" in " ".join(err.split())


# -- help: each stage's own --set example, readable metavars, defaults -------------------------------
@pytest.mark.parametrize(
    ("command", "example"),
    [
        ("quantize", "trust_remote_code=true"),
        ("train", "train.learning_rate=2e-5"),
        ("eval", "temperature=1.0"),
        ("bench rollout", "repeats=5"),
        ("compare", "train.max_steps=50"),
    ],
)
def test_help_shows_the_stage_own_set_example_and_readable_metavars(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str, example: str
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one line per option
    rc, out, _ = run(capsys, *command.split(), "--help")
    assert rc == 0 and f"--set {example}" in out and "KEY=VALUE" in out
    assert "<bool>" not in out and "<list[str]>" not in out
    key = example.split("=")[0]
    from qerl_cli.config import BenchConfig, EvalConfig, QuantizeConfig, TrainConfig

    conf_cls = {"quantize": QuantizeConfig, "eval": EvalConfig, "bench rollout": BenchConfig}
    if command in conf_cls:  # the example is a key of that stage's own config
        assert key in {f for f in conf_cls[command].__dataclass_fields__}
    else:
        section, name = key.split(".")
        assert name in getattr(TrainConfig(), section).__dataclass_fields__


def test_help_shows_the_config_defaults(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    rc, out, _ = run(capsys, "bench", "rollout", "--help")
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("│ --")}
    assert rc == 0 and "[default: (2,8)]" in lines["--batch"]
    # On the CPU the default model runs shorter lengths (the plan's CPU_LENGTHS): the help said 256 only.
    for flag, gpu, cpu in (("--prompt-len", 256, 64), ("--gen-len", 512, 32)):
        assert f"[default: ({gpu}; {cpu} on the HF engine's default model, the tiny shape)]" in lines[flag]


def test_a_flag_overridden_by_set_is_named_as_the_set_key(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "bench", "rollout", "--formats", "bf16", "--set", "formats=fp3", "--dry-run")
    assert rc == 2 and "error: formats: unknown format(s) fp3" in err
    rc, _, err = run(capsys, "bench", "rollout", "--gen-len", "8", "--set", "gen_len=0", "--dry-run")
    assert rc == 2 and "error: gen_len must be > 0" in err


# -- every option each command documents is registered under its name, on every typer in the pin -----
# typer 0.27.x names an option that has no declarations after its metavar when the two differ only in
# case (`method` with metavar "METHOD" became --METHOD, and `qerl quantize --method gptq` failed with
# "No such option: --method"); so every qerl option spells its names, and this holds the CLI to them.
OPTIONS = {
    "quantize": {
        "--format", "-f", "--method", "--calib", "--calib-field", "--calib-split", "--device",
        "--num-samples", "--seq-len", "--output", "-o", "--overwrite", "--skip-incompatible", "--eval-ppl",
        "--lora-init", "--lora-init-rank", "--config", "--set", "--dry-run",
    },
    "train": {"--set", "--resume", "--overwrite", "--dry-run", "--keys"},
    "eval": {
        "--adapter", "--benchmarks", "--samples", "--engine", "--data-file", "--output", "-o",
        "--max-new-tokens", "--max-problems", "--rescore", "--baseline", "--config", "--set", "--dry-run",
    },
    "bench rollout": {
        "--model", "--formats", "--batch", "--prompt-len", "--gen-len", "--lora-rank", "--engine",
        "--memory-cap", "--output", "-o", "--baseline", "--tolerance", "--config", "--set", "--dry-run",
    },
    "bench concurrency": {
        "--model", "--formats", "--concurrency", "--backends", "--prompt-len", "--gen-len", "--lora-rank",
        "--engine", "--memory-cap", "--output", "-o", "--baseline", "--tolerance", "--config", "--set",
        "--dry-run",
    },
    "bench e2e": {
        "--model", "--formats", "--prompts-per-step", "--generations", "--prompt-len", "--gen-len",
        "--lora-rank", "--engine", "--recipe", "--linear-backend", "--memory-cap", "--output", "-o",
        "--baseline", "--tolerance", "--config", "--set", "--dry-run",
    },
    "bench kernels": {
        "--model", "--formats", "--batch", "--seq-len", "--iters", "--device", "--output", "-o", "--dry-run",
    },
    "bench update": {
        "--model", "--formats", "--fused", "--base-compute", "--sequences", "--group", "--prompt-len",
        "--gen-len", "--micro-batch", "--checkpointing", "--pack", "--lora-rank", "--profile", "--device",
        "--output", "-o", "--dry-run",
    },
    "bench scaling": {
        "--steps", "--prompts-per-gpu", "--reference", "--model", "--format", "--synthetic", "--output", "-o",
        "--set", "--dry-run",
    },
    "bench quality": {
        "--rows", "--calib-samples", "--seq-len", "--heldout-rows", "--device", "--output", "-o", "--dry-run",
    },
    "compare": {
        "--arms", "--seeds", "--output", "-o", "--jobs", "--threshold", "--only", "--no-summary", "--set",
        "--reference", "--margin",
    },
    "demo": {"--output", "-o", "--steps", "--seed"},
    "env": {"--json"},
    "models": {"--json"},
    "tiny-base": {"--formats", "--seed", "--overwrite"},
    "tiny-model": {"--output", "-o", "--seed", "--overwrite"},
    "quality": {"--rows", "--seq-len", "--device", "--output", "-o"},
}  # fmt: skip
# Each stage with --dry-run, typed out with its options, and the keys they set in the resolved config.
DRY_RUNS = [
    (
        ["quantize", "m", "-f", "mxfp4", "--method", "gptq", "--device", "cpu", "--calib-split", "test",
         "--num-samples", "8", "--seq-len", "64", "--lora-init", "svd", "--lora-init-rank", "4"],
        {"format": "mxfp4", "method": "gptq", "device": "cpu", "calib_split": "test", "num_samples": 8,
         "seq_len": 64, "lora_init": "svd", "lora_init_rank": 4},
    ),
    (
        ["train", str(REPO / "recipes" / "tiny.yaml"), "--set", "train.max_steps=3"],
        {"train": lambda train: train["max_steps"] == 3},
    ),
    (
        ["eval", "m", "--engine", "hf", "--benchmarks", "gsm8k", "--samples", "2", "--max-new-tokens", "16",
         "--max-problems", "3", "--adapter", "a"],
        {"engine": "hf", "benchmarks": ["gsm8k"], "samples": 2, "max_new_tokens": 16, "max_problems": 3,
         "adapter": "a"},
    ),
    (
        ["bench", "rollout", "--model", "tiny", "--engine", "hf", "--formats", "bf16,nvfp4", "--batch", "2",
         "--prompt-len", "8", "--gen-len", "4", "--lora-rank", "0", "--tolerance", "0.2"],
        {"model": "tiny", "engine": "hf", "formats": ["bf16", "nvfp4"], "batch": [2], "prompt_len": 8,
         "gen_len": 4, "lora_rank": 0, "tolerance": 0.2},
    ),
]  # fmt: skip
# The commands without --dry-run: what click parses each option into (nothing runs).
PARSES = [
    (["compare", "r.yaml", "--arms", "a,b", "--seeds", "2", "--jobs", "2", "--only", "a/0", "--threshold",
      "0.5", "--reference", "b", "--margin", "2.5"],
     {"arms": "a,b", "seeds": 2, "jobs": 2, "only": "a/0", "threshold": 0.5, "reference": "b",
      "margin": 2.5}),
    (["demo", "--steps", "2", "--seed", "3", "-o", "d"], {"steps": 2, "seed": 3, "output": "d"}),
    (["tiny-base", "--seed", "1", "--formats", "bf16"], {"seed": 1, "formats": "bf16"}),
    (["tiny-model", "out", "--seed", "3"], {"seed": 3}),
    (["tiny-model", "-o", "out", "--overwrite"], {"output": Path("out"), "out": None, "overwrite": True}),
    (["quality", "ref", "c", "--rows", "4", "--seq-len", "8", "--device", "cpu"],
     {"rows": 4, "seq_len": 8, "device": "cpu"}),
]  # fmt: skip


def check_every_option_is_registered() -> None:
    """Each command has its documented options, every name in lower case, and each stage's options parse
    (--dry-run prints the config they resolve to). Plain asserts: tests/ runs it under other typers."""
    import contextlib
    import io

    from typer.main import get_command

    from qerl_cli.cli import app

    commands = get_command(app).commands
    for name, documented in OPTIONS.items():
        group, _, sub = name.partition(" ")  # "bench rollout": a subcommand of the bench group
        command = commands[group].commands[sub] if sub else commands[group]
        have = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts) if opt[0] == "-"}
        assert documented <= have, f"qerl {name} lacks {sorted(documented - have)}; it has {sorted(have)}"
        upper = sorted(opt for opt in have if opt != opt.lower())
        assert not upper, f"qerl {name}: options named after their metavar: {upper}"
    from types import SimpleNamespace
    from unittest import mock

    planned = SimpleNamespace(checks=[])  # a plan whose checks all passed
    for argv, expected in DRY_RUNS:
        out, err = io.StringIO(), io.StringIO()
        # What each option resolves to, not the stages' checks of the machine (tests/test_preflight.py,
        # tests/test_quantize_preflight.py, tests/test_eval_preflight.py).
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch("qerl_cli.rl.preflight.preflight", lambda *args, **kwargs: []))
            for stage in ("quantize", "evaluation"):
                stack.enter_context(
                    mock.patch(f"qerl_cli.{stage}.preflight.preflight", lambda *a, **k: planned)
                )
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
            rc = main([*argv, "--dry-run"])
        assert rc == 0, f"qerl {' '.join(argv)} --dry-run exited {rc}: {err.getvalue()}"
        resolved = yaml.safe_load(out.getvalue())
        for key, value in expected.items():
            ok = value(resolved[key]) if callable(value) else resolved[key] == value
            assert ok, f"qerl {' '.join(argv)}: {key} resolved to {resolved[key]!r}, expected {value!r}"
    for argv, expected in PARSES:
        with commands[argv[0]].make_context(f"qerl {argv[0]}", argv[1:]) as ctx:
            got = {key: ctx.params[key] for key in expected}
        assert got == expected, f"qerl {' '.join(argv)} parsed to {got}"


def test_every_documented_option_is_registered_and_parses(capsys: pytest.CaptureFixture[str]) -> None:
    check_every_option_is_registered()


def test_help_lists_the_options_under_their_own_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    for command in ("quantize", "eval", "bench rollout", "quality"):
        rc, out, _ = run(capsys, *command.split(), "--help")
        listed = {line.split()[1] for line in out.splitlines() if line.startswith("│ --")}
        assert rc == 0 and {o for o in OPTIONS[command] if o.startswith("--")} <= listed, (command, listed)
    rc, out, _ = run(capsys, "quantize", "--help")
    assert "--method" in out and "--METHOD" not in out and "--DEVICE" not in out


def _other_typers() -> list[str]:
    """Folders each holding another typer (``pip install --target DIR typer==0.27.2 click==8.5.0``), from
    QERL_TEST_TYPER_PATHS (separated by os.pathsep): the check above then runs under each of them too."""
    import os

    return [path for path in os.environ.get("QERL_TEST_TYPER_PATHS", "").split(os.pathsep) if path]


@pytest.mark.parametrize("typer_dir", _other_typers() or [None])
def test_every_option_is_registered_under_other_typers(typer_dir: str | None) -> None:
    import os
    import subprocess
    import sys

    if typer_dir is None:
        pytest.skip("set QERL_TEST_TYPER_PATHS to folders with other typer versions (pip install --target)")
    code = (
        "import sys, typer; sys.path.insert(0, sys.argv[1]); import test_cli; "
        "test_cli.check_every_option_is_registered(); print(typer.__version__, typer.__file__)"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [typer_dir, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "tests")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    version, path = done.stdout.split()[-2:]
    assert Path(path).resolve().is_relative_to(Path(typer_dir).resolve()), f"typer {version} came from {path}"


# -- recipe keys documented where declared, shown by `qerl train --keys`; shipped recipes by name --------


def test_train_keys_prints_every_recipe_key_with_type_default_and_meaning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.config import TrainConfig
    from qerl_cli.config.keydocs import key_docs

    monkeypatch.setenv("COLUMNS", "200")
    rc, out, _ = run(capsys, "train", "--keys")
    assert rc == 0
    heads = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert [line.split(":", 1)[0] for line in heads] == [doc.key for doc in key_docs(TrainConfig)]
    assert "rollout.engine: 'hf' | 'vllm' = hf" in heads
    assert "train.learning_rate: float = 1e-05" in heads
    assert "train.micro_batch_size: int | 'auto' = 8" in heads
    assert "[rows, length, vocab]" in out  # the help is printed as written, not read as rich markup
    # One section, or one key, in place of RECIPE.
    rc, out, _ = run(capsys, "train", "--keys", "aqn")
    assert rc == 0
    keys = [line.split(":", 1)[0] for line in out.splitlines() if line and not line.startswith(" ")]
    assert keys and all(key.startswith("aqn.") for key in keys) and "aqn.target" in keys
    rc, out, _ = run(capsys, "train", "--keys", "lora.init")
    assert rc == 0 and out.startswith("lora.init: 'zeros' | 'eora' | 'svd' = zeros\n") and "EoRA" in out
    rc, _, err = run(capsys, "train", "--keys", "rolout")
    assert rc == 2 and "no such section or key" in err and "rollout" in err


def test_train_takes_a_shipped_recipe_by_name_or_by_its_old_path(capsys: pytest.CaptureFixture[str]) -> None:
    for recipe in ("gsm8k_7b", "gsm8k_7b.yaml", "recipes/gsm8k_7b.yaml"):
        rc, out, err = run(capsys, "train", recipe, "--dry-run")
        assert rc == 2 and "model.path ./Qwen2.5-7B-Instruct-NVFP4: no such folder" in err, recipe
        assert yaml.safe_load(out)["model"]["path"] == "./Qwen2.5-7B-Instruct-NVFP4"
    rc, _, err = run(capsys, "train", "gsm8k_9b", "--dry-run")
    assert rc == 2 and "recipe file not found" in err and "gsm8k_7b" in err


def test_models_keeps_each_alias_whole_at_80_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The alias is what a user copies into a command: a table narrower than the content must not wrap it."""
    from qerl_cli.modeling.sources import known_models

    monkeypatch.setenv("COLUMNS", "80")
    rc, out, _ = run(capsys, "models")
    assert rc == 0
    table = out.split("┗", 1)[0] if "┗" in out else out.split("└", 1)[0]
    for row in known_models():
        assert f"│ {row['alias']} " in table, row["alias"]
    assert max(len(line) for line in out.splitlines()) <= 80
