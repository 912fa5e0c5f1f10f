"""A key's help (its field comment: ``qerl train --keys``, each stage's flag help) says what the key does:
no figures measured on one machine (those live in benchmarks/ and the docs, which the help may point
to), and no value is spelled as Python's ``None`` where the recipe writes ``null``."""

from __future__ import annotations

import re

import pytest

from qerl_cli.cli import main
from qerl_cli.config import BenchConfig, EvalConfig, QuantizeConfig, TrainConfig
from qerl_cli.config.keydocs import key_docs

# A figure with a unit of time, throughput, memory or a ratio: 48 min, 12 ms, 3.1 tok/s, 10.6 GiB, 17.1%,
# 1.06x. Not a product ("16 x 8"), a count ("2 bytes", "3B") or a setting ("0.25", "1e-2").
MEASURED = re.compile(
    r"\d(?:\.\d+)?(?:x\b|%|\s?(?:ms|s|min|minutes|seconds|hours|tok/s|tokens/s|GB|GiB|MB|MiB|TB)\b)"
)


@pytest.mark.parametrize(
    "text",
    ["took 48 min", "12 ms a step", "3.1 tok/s", "a 7B: 10.6 GiB", "0.3% vs 17.1%", "0.99-1.06x", "90s"],
)
def test_the_scan_knows_a_measured_figure(text: str) -> None:
    assert MEASURED.search(text)


@pytest.mark.parametrize("text", ["16 x 8", "2 bytes per weight", "a 72B base", "1e-2", "nats/token", "x 12"])
def test_the_scan_leaves_other_numbers(text: str) -> None:
    assert not MEASURED.search(text)


def test_train_keys_print_no_measured_figure_and_no_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--keys"]) == 0
    out = capsys.readouterr().out
    assert "rollout.engine" in out and "train.base_compute" in out  # the whole listing was printed
    assert "None:" not in out
    # Lines of help only: the defaults on a key's own line are settings ("grader_timeout_s: float = 5.0").
    helps = [line.strip() for line in out.splitlines() if line.startswith(" ")]
    assert len(helps) >= len(key_docs(TrainConfig))  # a help line (or more) under every key
    assert [m.group() for line in helps for m in [MEASURED.search(line)] if m] == []


@pytest.mark.parametrize("config", [TrainConfig, EvalConfig, QuantizeConfig, BenchConfig])
def test_every_stages_key_help_is_free_of_them(config: type) -> None:
    found = [
        f"{doc.key}: {doc.help}"
        for doc in key_docs(config)
        if "None:" in doc.help or MEASURED.search(doc.help)
    ]
    assert found == []


@pytest.mark.parametrize(
    ("key", "zero"),
    [
        ("output.save_steps", "0: none during the run, so it cannot be resumed"),
        ("train.warmup_steps", "0: none"),
    ],
)
def test_a_steps_key_says_what_0_does(key: str, zero: str) -> None:
    # 0 turns checkpoints (step_loop.run_steps) or warmup (setup.lr_lambda) off: the help must say so.
    (doc,) = [d for d in key_docs(TrainConfig) if d.key == key]
    assert zero in " ".join(doc.help.split())


@pytest.mark.parametrize("setting", ["output.save_steps=-1", "train.warmup_steps=-2"])
def test_a_negative_steps_key_is_refused(setting: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "tiny", "--set", setting, "--dry-run"]) == 2
    assert f"{setting.partition('=')[0]} must be >= 0 (0: no" in capsys.readouterr().err
