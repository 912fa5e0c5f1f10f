"""One text per setting: a `qerl quantize` / `qerl eval` flag that sets a config key shows the comment that
documents the key (the text `qerl train --keys` prints for a recipe key), its parameter is named as the
key, and the keys the docs show exist. Also: `lora_init`'s one spelling (zeros) with its old one (none)
still read, and no function of the stage commands or the demo past 80 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml
from typer.main import get_command

from qerl_cli.cli import app, main
from qerl_cli.cli.app import NOT_KEYS, flag_help, flag_values
from qerl_cli.config import EvalConfig, QuantizeConfig, TrainConfig, load_config
from qerl_cli.config.keydocs import field_help, key_docs, sections

REPO = Path(__file__).resolve().parents[1]
STAGES = {"quantize": QuantizeConfig, "eval": EvalConfig}
# Flags whose rule differs from their key's: `--samples 0` is refused (the key's 0 is "each benchmark's
# default"), so the flag's help offers leaving it out instead.
OWN_HELP = {"samples"}


@pytest.mark.parametrize("command", sorted(STAGES))
def test_each_flag_of_a_key_shows_the_key_comment(command: str) -> None:
    cls = STAGES[command]
    helps = field_help(cls)
    params = get_command(app).commands[command].params
    keyed = [p for p in params if p.name not in NOT_KEYS and p.name != "help"]
    assert {p.name for p in keyed} <= set(helps), "every parameter but --config/--set/--dry-run is a key"
    for param in keyed:
        if param.param_type_name == "option" and param.name not in OWN_HELP:
            assert param.help == flag_help(helps[param.name]), (command, param.name)
    assert len(keyed) >= 10  # the check ran over the commands' flags, not over nothing


def test_flag_values_are_the_parameters_named_as_their_keys() -> None:
    given = {"model": "m", "benchmarks": "a,b", "config": None, "set_": ["x=1"], "dry_run": True}
    assert flag_values(given, benchmarks=["a", "b"]) == {"model": "m", "benchmarks": ["a", "b"]}


def _recipes_doc_keys() -> list[str]:
    """The dotted keys of docs/recipes.md's example recipe and of its `--keys` examples."""
    text = (REPO / "docs" / "recipes.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert block is not None
    keys = [f"{section}.{key}" for section, body in yaml.safe_load(block.group(1)).items() for key in body]
    return keys + re.findall(r"qerl train --keys ([a-z_.]+)", text)


def test_every_key_docs_recipes_shows_exists() -> None:
    known = {doc.key for doc in key_docs(TrainConfig)} | set(sections(TrainConfig))
    shown = _recipes_doc_keys()
    assert len(shown) > 20 and [k for k in shown if k not in known] == []


@pytest.mark.parametrize(
    "given", [["--lora-init", "none"], ["--set", "lora_init=none"], ["--lora-init", "zeros"]]
)
def test_lora_init_none_is_read_as_zeros(
    given: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    # nf4 by rtn: the dry run's checks need no calibration set or package
    rtn = ["-f", "nf4", "--method", "rtn", "-o", str(tmp_path / "out")]
    assert main(["quantize", str(tiny_model_dir), *rtn, *given, "--dry-run"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["lora_init"] == "zeros"
    assert QuantizeConfig(lora_init="none").lora_init == "zeros"  # type: ignore[arg-type]


def test_lora_init_from_a_config_file_and_an_unknown_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    conf = tmp_path / "quantize.yaml"
    conf.write_text("model: m\nlora_init: none\n")
    assert load_config(QuantizeConfig, conf).lora_init == "zeros"
    assert main(["quantize", str(tmp_path), "--lora-init", "eora-ish", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--lora-init" in err and "eora-ish" in err and "zeros" in err


@pytest.mark.parametrize("module", ["qerl_cli/cli/stages.py", "qerl_cli/cli/app.py", "qerl_cli/demo.py"])
def test_no_function_is_past_80_lines(module: str) -> None:
    tree = ast.parse((REPO / module).read_text())
    lengths = {
        node.name: (node.end_lineno or node.lineno) - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
    }
    assert lengths and {name: n for name, n in lengths.items() if n > 80} == {}
