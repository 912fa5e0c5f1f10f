from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from qerl_cli.config import (
    LORA_TARGETS_ALL,
    SHIPPED_RECIPES,
    AlgorithmSection,
    BenchConfig,
    EvalConfig,
    QuantizeConfig,
    TrainConfig,
    load_config,
    read_yaml,
    resolve_recipe,
    save_resolved_config,
    shipped_recipes,
)
from qerl_cli.errors import QerlError


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_recipe_loads_with_types_and_defaults(tmp_path: Path) -> None:
    recipe = write(tmp_path, {"model": {"path": "m"}, "train": {"learning_rate": "1e-5", "max_steps": 7}})
    conf = load_config(TrainConfig, recipe)
    assert conf.train.learning_rate == pytest.approx(1e-5)
    assert conf.train.max_steps == 7
    assert conf.aqn.schedule == "exponential" and conf.aqn.num_stages == 10
    assert conf.lora.target_modules == LORA_TARGETS_ALL


def test_overrides_are_parsed_to_the_field_type(tmp_path: Path) -> None:
    recipe = write(tmp_path, {"model": {"path": "m"}})
    conf = load_config(
        TrainConfig,
        recipe,
        [
            "train.learning_rate=2e-5",
            "train.gradient_checkpointing=false",
            "lora.target_modules=q_proj,v_proj",
            "rollout.vllm_kwargs={attention_backend: TRITON_ATTN}",
            "output.save_total_limit=null",
            "data.levels=[3, 4, 5]",
        ],
    )
    assert conf.train.learning_rate == 2e-5
    assert conf.train.gradient_checkpointing is False
    assert conf.lora.target_modules == ["q_proj", "v_proj"]
    assert conf.rollout.vllm_kwargs == {"attention_backend": "TRITON_ATTN"}
    assert conf.output.save_total_limit is None
    assert conf.data.levels == [3, 4, 5]


def test_a_bare_off_means_the_off_choice_not_false(tmp_path: Path) -> None:
    """YAML reads ``off`` as false; a setting whose choices include "off" takes it as that choice, and a
    bool where no such choice exists is still refused."""
    recipe = write(tmp_path, {"model": {"path": "m"}, "train": {"fused_kernels": False}})
    assert load_config(TrainConfig, recipe).train.fused_kernels == "off"
    plain = write(tmp_path, {"model": {"path": "m"}})
    assert load_config(TrainConfig, plain, ["train.fused_kernels=off"]).train.fused_kernels == "off"
    with pytest.raises(QerlError, match="rollout.engine"):
        load_config(TrainConfig, plain, ["rollout.engine=off"])


def test_completions_logged_per_step_cannot_be_negative(tmp_path: Path) -> None:
    plain = write(tmp_path, {"model": {"path": "m"}})
    assert load_config(TrainConfig, plain).output.log_completions == 1
    assert load_config(TrainConfig, plain, ["output.log_completions=0"]).output.log_completions == 0
    with pytest.raises(QerlError, match=r"output.log_completions must be >= 0"):
        load_config(TrainConfig, plain, ["output.log_completions=-1"])


def test_unknown_key_suggests_the_closest_name(tmp_path: Path) -> None:
    recipe = write(tmp_path, {"model": {"path": "m"}})
    with pytest.raises(QerlError, match=r"train\.lerning_rate.*did you mean train\.learning_rate\?"):
        load_config(TrainConfig, recipe, ["train.lerning_rate=1e-5"])
    with pytest.raises(QerlError, match="did you mean rollout"):
        load_config(TrainConfig, write(tmp_path, {"rolout": {}, "model": {"path": "m"}}))


def test_every_unknown_key_is_reported_at_once_with_hints_from_its_own_section(tmp_path: Path) -> None:
    """``model.bogus`` was answered "did you mean model?" (a section, not a key) and ``foo`` never named."""
    recipe = write(tmp_path, {"model": {"path": "m", "bogus": 1}, "foo": 2, "train": {"lerning_rate": 1}})
    with pytest.raises(QerlError) as caught:
        load_config(TrainConfig, recipe, ["aqn.enabeld=true"])
    message = str(caught.value)
    assert message.startswith("unknown config keys (4): ")
    assert "'model.bogus' (the keys under model: path, " in message
    assert "'foo' (the keys at the top level: model, lora, rollout," in message
    assert "'train.lerning_rate' (did you mean train.learning_rate?)" in message
    assert "'aqn.enabeld' (did you mean aqn.enabled?)" in message
    assert "did you mean model" not in message
    with pytest.raises(QerlError, match=r"^unknown config key 'model\.bogus'; the keys under model: path"):
        load_config(TrainConfig, write(tmp_path, {"model": {"path": "m", "bogus": 1}}))


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("train.temperature", "rollout.temperature"),
        ("rollout.learning_rate", "train.learning_rate"),
        ("train.lora_rank", "lora.rank"),
    ],
)
def test_a_key_in_the_wrong_section_names_where_it_lives(tmp_path: Path, key: str, meant: str) -> None:
    """Nothing close in its own section: the key of that name in another section is the likelier one."""
    with pytest.raises(QerlError, match=rf"^unknown config key '{key}'; did you mean {meant}\?"):
        load_config(TrainConfig, write(tmp_path, {"model": {"path": "m"}}), [f"{key}=1"])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.max_steps=ten", "train.max_steps.*'ten'.*expected int"),
        ("train.max_steps=1.5", "train.max_steps.*expected int"),
        ("aqn.enabled=3", "aqn.enabled.*expected bool"),
        ("aqn.schedule=step", "aqn.schedule.*'exponential'"),
        ("train=3", "train must be a mapping"),
    ],
)
def test_wrong_types_name_key_value_and_type(tmp_path: Path, override: str, needle: str) -> None:
    with pytest.raises(QerlError, match=needle):
        load_config(TrainConfig, write(tmp_path, {"model": {"path": "m"}}), [override])


def test_cross_field_validation(tmp_path: Path) -> None:
    recipe = write(tmp_path, {"model": {"path": "m"}})
    with pytest.raises(QerlError, match=r"aqn.sigma_end must be <= aqn.sigma_start \(1e-05\)"):
        load_config(TrainConfig, recipe, ["aqn.sigma_start=1e-5", "aqn.sigma_end=1e-3"])
    with pytest.raises(QerlError, match="model.path"):
        load_config(TrainConfig, write(tmp_path, {}))


# The one rule for AQN's sigmas (config.checks.aqn_sigmas): each refusal names the key and what to do.
@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["aqn.sigma_start=-1e-3"], "aqn.sigma_start must be a finite number > 0"),
        (["aqn.sigma_start=0"], "to train without noise set aqn.enabled=false"),
        (["aqn.sigma_start=.nan"], "aqn.sigma_start must be a finite number > 0 .*got nan"),
        (["aqn.sigma_start=.inf", "aqn.sigma_end=1"], "aqn.sigma_start must be a finite number > 0"),
        (["aqn.sigma_end=-1e-5"], "aqn.sigma_end must be a finite number >= 0"),
        (["aqn.sigma_end=nan"], "aqn.sigma_end must be a finite number >= 0 .*got nan"),
        (["aqn.sigma_end=0.1"], r"aqn.sigma_end must be <= aqn.sigma_start \(0.01\): the schedule decays"),
        (["aqn.sigma_end=0"], "aqn.sigma_end must be > 0 with aqn.schedule=exponential.*choose the linear"),
    ],
)
def test_invalid_aqn_sigmas_exit_2_naming_the_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, sets: list[str], needle: str
) -> None:
    from qerl_cli.cli import main

    recipe = write(tmp_path, {"model": {"path": "m"}})
    rc = main(["train", str(recipe), "--dry-run", *(arg for s in sets for arg in ("--set", s))])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert re.search(needle, " ".join(err.split())), err


def test_valid_aqn_sigmas_load(tmp_path: Path) -> None:
    recipe = write(tmp_path, {"model": {"path": "m"}})
    linear = load_config(TrainConfig, recipe, ["aqn.schedule=linear", "aqn.sigma_end=0"])
    assert linear.aqn.sigma_end == 0.0  # a linear decay may end without noise
    flat = load_config(TrainConfig, recipe, ["aqn.sigma_start=1e-3", "aqn.sigma_end=1e-3"])
    assert flat.aqn.sigma_start == flat.aqn.sigma_end
    # With AQN off the sigmas are never used, so they are not checked.
    off = load_config(TrainConfig, recipe, ["aqn.enabled=false", "aqn.sigma_end=1"])
    assert not off.aqn.enabled


def test_missing_and_malformed_recipe(tmp_path: Path) -> None:
    with pytest.raises(QerlError, match="not found"):
        load_config(TrainConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(QerlError, match="not valid YAML"):
        load_config(TrainConfig, bad)
    with pytest.raises(QerlError, match="KEY=VALUE"):
        load_config(TrainConfig, write(tmp_path, {"model": {"path": "m"}}), ["train.seed"])


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    conf = load_config(TrainConfig, write(tmp_path, {"model": {"path": "m"}}), ["train.seed=5"])
    path = save_resolved_config(conf, tmp_path / "run")
    again = load_config(TrainConfig, path)
    assert again == conf


def test_cli_values_rank_between_recipe_and_overrides(tmp_path: Path) -> None:
    conf = load_config(BenchConfig, None, ["tolerance=0.3"], batch="1,2", tolerance=0.2)
    assert conf.batch == [1, 2] and conf.tolerance == 0.3


# -- a key written twice is refused, not silently merged into the last one ---------------------------
@pytest.mark.parametrize(
    ("text", "needle"),
    [
        # Two train: sections: YAML would keep only the second, dropping max_steps without a word.
        ("model:\n  path: m\ntrain:\n  max_steps: 3\nrollout: {}\ntrain:\n  seed: 1\n",
         r"key 'train' is written twice \(lines 3 and 6\)"),
        ("model:\n  path: m\ntrain:\n  learning_rate: 1e-5\n  seed: 1\n  learning_rate: 2e-5\n",
         r"key 'train.learning_rate' is written twice \(lines 4 and 6\)"),
        ("model: {path: m, path: n}\n", r"key 'model.path' is written twice \(lines 1 and 1\)"),
    ],
)  # fmt: skip
def test_a_key_written_twice_is_refused_naming_it_and_its_lines(
    tmp_path: Path, text: str, needle: str
) -> None:
    recipe = tmp_path / "twice.yaml"
    recipe.write_text(text)
    with pytest.raises(QerlError, match=needle) as caught:
        load_config(TrainConfig, recipe)
    assert str(recipe) in str(caught.value)


def test_merge_keys_and_repeats_in_other_mappings_are_not_duplicates(tmp_path: Path) -> None:
    """``<<: *anchor`` merges keys that the mapping may override, and the same key in two sections is
    two keys: neither is a repetition."""
    recipe = tmp_path / "merge.yaml"
    recipe.write_text(
        "common: &common {seed: 3, max_steps: 5}\n"
        "model: {path: m}\n"
        "train:\n  <<: *common\n  max_steps: 7\n"
        "rollout: {max_prompt_length: 64}\n"
        "data: {max_prompt_length: 64}\n"
    )
    data = read_yaml(recipe)
    assert data["train"] == {"seed": 3, "max_steps": 7}


# -- errors name the key as the user wrote it, not a class --------------------------------------------
def test_errors_name_the_flag_or_the_recipe_key_not_the_class(tmp_path: Path) -> None:
    with pytest.raises(QerlError, match=r"^--prompt-len must be > 0, got 0$"):
        load_config(BenchConfig, None, flags={"prompt_len": "--prompt-len"}, prompt_len=0)
    # The same key set by --set, or read from a --config file, is named as the recipe key.
    with pytest.raises(QerlError, match=r"^prompt_len must be > 0, got 0$"):
        load_config(BenchConfig, None, ["prompt_len=0"], flags={"prompt_len": "--prompt-len"}, prompt_len=5)
    bench = tmp_path / "bench.yaml"
    bench.write_text("gen_len: 0\n")
    with pytest.raises(QerlError, match=r"^gen_len must be > 0, got 0$"):
        load_config(BenchConfig, bench)
    # A root check that prefixes its stage's name (QuantizeConfig: "quantize.seq_len") is named so too.
    with pytest.raises(QerlError, match=r"^--seq-len must be > 0"):
        load_config(QuantizeConfig, None, flags={"seq_len": "--seq-len"}, model="m", seq_len=0)
    # A wrong type from a flag names the flag; a recipe section's key keeps its path.
    with pytest.raises(QerlError, match=r"^--engine has value 'foo' \(str\); expected 'hf' \| 'vllm'"):
        load_config(EvalConfig, None, flags={"engine": "--engine"}, model="m", engine="foo")
    recipe = write(tmp_path, {"model": {"path": "m"}, "train": {"learning_rate": -1.0}})
    with pytest.raises(QerlError, match=r"train\.learning_rate"):
        load_config(TrainConfig, recipe)


# -- every key documented where it is declared (qerl_cli.config.keydocs) -----------------------------------


@pytest.mark.parametrize("config", [TrainConfig, QuantizeConfig, EvalConfig, BenchConfig])
def test_every_config_key_has_help(config: type) -> None:
    """A new field needs a comment above it (or after it on its line): `qerl train --keys` shows it."""
    from qerl_cli.config.keydocs import key_docs

    docs = key_docs(config)
    assert docs
    undocumented = [doc.key for doc in docs if not doc.help]
    assert not undocumented, f"write a comment above each of these fields: {undocumented}"


def test_key_docs_read_the_comment_block_and_the_line_comment() -> None:
    from qerl_cli.config.keydocs import field_help, key_docs

    helps = field_help(AlgorithmSection)
    assert helps["beta"].startswith("k3 KL to the adapter-free model")  # the comment after the field
    assert helps["loss_type"].startswith("grpo: per-sequence mean") and "dr_grpo" in helps["loss_type"]
    assert "name" in helps and "loss_type" not in helps["name"]  # one block per field, not the next one's
    docs = {doc.key: doc for doc in key_docs(TrainConfig)}
    assert docs["lora.target_modules"].default.startswith("[q_proj, k_proj")
    assert docs["model.revision"].type == "str | null" and docs["model.revision"].default == "null"
    assert "compare" in docs and "aqn" not in docs  # sections are expanded into their keys


# -- shipped recipes: found by name or by their repository path (the wheel: tests/test_packaging.py) ---


def test_every_shipped_recipe_loads() -> None:
    names = shipped_recipes()
    assert {"tiny", "gsm8k_7b", "bigmath_32b", "smollm2_wordproblems"} <= set(names)
    for name in names:
        assert load_config(TrainConfig, name, ["model.path=m"]).model.path == "m"


def test_recipe_names_resolve_to_the_shipped_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = SHIPPED_RECIPES / "tiny.yaml"
    monkeypatch.chdir(tmp_path)  # outside a clone
    for given in ("tiny", "tiny.yaml", "recipes/tiny.yaml", tmp_path / "recipes" / "tiny.yaml"):
        assert resolve_recipe(given) == shipped, given
    own = tmp_path / "recipes" / "tiny.yaml"  # a file that exists wins over the shipped one
    own.parent.mkdir()
    own.write_text("model: {path: mine}\n")
    assert resolve_recipe("recipes/tiny.yaml") == Path("recipes/tiny.yaml")
    assert read_yaml("recipes/tiny.yaml") == {"model": {"path": "mine"}}
    for missing in ("nope", "recipes/nope.yaml", "elsewhere/tiny.yaml", "tiny.json"):
        with pytest.raises(QerlError, match=r"recipe file not found: .*shipped with qerl.*gsm8k_7b"):
            resolve_recipe(missing)
