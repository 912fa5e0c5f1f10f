"""A value outside a setting's choices (a ``Literal``) names the closest choice ("did you mean"), as an
unknown key does, beside the list of choices: from a flag, ``--set``, a recipe file, a list item or a
mapping's value alike, for every key of every stage's config."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from qerl_cli.cli import main
from qerl_cli.config import BenchConfig, EvalConfig, QuantizeConfig, TrainConfig, from_dict, load_config
from qerl_cli.config.coercion import literal_choices
from qerl_cli.errors import QerlError


def test_a_flag_off_its_choices_names_the_closest_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", "tiny", "--format", "fp4", "-o", "out", "--dry-run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--format has value 'fp4' (str); expected 'nvfp4' | 'mxfp4' | 'nf4'; did you mean 'nvfp4'?" in err
    assert not (tmp_path / "out").exists()


def test_a_set_key_off_its_choices_names_the_closest() -> None:
    with pytest.raises(QerlError) as caught:
        load_config(TrainConfig, None, ["model.path=m", "rollout.linear_backend=marlinn"])
    message = str(caught.value)
    assert message.startswith(
        "config key 'rollout.linear_backend' has value 'marlinn' (str); expected 'auto'"
    )
    assert message.endswith("'fp8-merged' | 'merged'; did you mean 'marlin'?")


def test_a_recipe_value_off_its_choices_names_the_closest(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  path: m\ntrain:\n  micro_batch_size: atuo\n")  # int | 'auto'
    with pytest.raises(QerlError, match=r"^config key 'train\.micro_batch_size' .*; did you mean 'auto'\?$"):
        load_config(TrainConfig, recipe)


def test_a_value_near_no_choice_gets_no_guess() -> None:
    with pytest.raises(QerlError) as caught:
        load_config(QuantizeConfig, None, flags={"format": "--format"}, model="m", format="int3")
    assert str(caught.value) == "--format has value 'int3' (str); expected 'nvfp4' | 'mxfp4' | 'nf4'"


Colour = Literal["red", "green", "blue"]


@dataclass
class _Palette:
    shades: list[Colour] = field(default_factory=list)
    named: dict[str, Colour] = field(default_factory=dict)
    accent: Colour | None = None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"shades": ["red", "gren"]}, "which is not one of red, green, blue; did you mean 'green'?"),
        ({"named": {"sky": "bleu"}}, "'bleu' is not 'red' | 'green' | 'blue'; did you mean 'blue'?"),
        ({"accent": "rd"}, "expected 'red' | 'green' | 'blue' | null; did you mean 'red'?"),
    ],
)  # fmt: skip
def test_a_list_item_a_mapping_value_and_an_optional_choice_name_the_closest(
    data: dict[str, Any], message: str
) -> None:
    with pytest.raises(QerlError) as caught:
        from_dict(_Palette, data)
    assert message in str(caught.value)


def _choice_keys(cls: type, prefix: str = "") -> list[tuple[str, list[str]]]:
    """Every key of ``cls`` (sections walked) that takes a choice, with its choices."""
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += _choice_keys(tp, f"{prefix}{name}.")
        elif literal_choices(tp):
            keys.append((f"{prefix}{name}", literal_choices(tp)))
    return keys


CHOICE_KEYS = [
    (config, key, choices)
    for config in (TrainConfig, QuantizeConfig, EvalConfig, BenchConfig)
    for key, choices in _choice_keys(config)
]


@pytest.mark.parametrize(
    ("config", "key", "choices"), CHOICE_KEYS, ids=[f"{c.__name__}.{k}" for c, k, _ in CHOICE_KEYS]
)
def test_every_choice_key_names_the_closest_choice(config: type, key: str, choices: list[str]) -> None:
    meant = max(choices, key=len)
    typo = meant[:-1] + "#" + meant[-1]  # one character too many: close to the choice, equal to none
    with pytest.raises(QerlError) as caught:
        load_config(config, None, [f"{key}={typo}"])
    assert f"has value {typo!r}" in str(caught.value)
    assert str(caught.value).endswith(f"; did you mean {meant!r}?")
