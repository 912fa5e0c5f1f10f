"""List settings and their empty value: every list setting of every config dataclass says what [] means
(field metadata read by ``config.loading.validate``), and a meaningless [] is a usage error naming the key,
what to give and an example or the choices."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from dataclasses import dataclass, field

import pytest
from cli_runner import run_cli, usage_error

from qerl_cli.bench.lora_tune_settings import LoraTuneSettings
from qerl_cli.bench.settings import E2EConfig, KernelsSettings, QualitySettings, UpdateSettings
from qerl_cli.compare.settings import CompareSettings
from qerl_cli.config import BenchConfig, EvalConfig, QuantizeConfig, TrainConfig, load_config, validate
from qerl_cli.config.checks import ConfigValueError, NeedsItems
from qerl_cli.config.loading import list_settings

# Every config a recipe, --config or --set is read into, with the values it needs beside the list.
ROOTS: dict[type, list[str]] = {
    TrainConfig: ["model.path=m"],
    QuantizeConfig: ["model=m"],
    EvalConfig: ["model=m"],
    BenchConfig: [],
    E2EConfig: [],
    KernelsSettings: [],
    UpdateSettings: [],
    QualitySettings: [],
    LoraTuneSettings: [],
    CompareSettings: [],
}
# The modules config dataclasses live in: each of their dataclasses is a root or a root's section.
CONFIG_MODULES = [
    "qerl_cli.config.sections",
    "qerl_cli.config.rl_sections",
    "qerl_cli.config.stages",
    "qerl_cli.bench.settings",
    "qerl_cli.bench.lora_tune_settings",
    "qerl_cli.compare.settings",
]


def _sections(cls: type, prefix: str = "") -> list[tuple[type, str]]:
    """``cls`` and its nested sections, each with its keys' prefix ("lora.")."""
    found = [(cls, prefix)]
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            found += _sections(tp, f"{prefix}{name}.")
    return found


def _list_keys(wanted: type) -> list[tuple[type, str]]:
    """(root, dotted key) of every list setting whose [] is ``wanted`` (NeedsItems or str)."""
    return [
        (root, f"{prefix}{name}")
        for root in ROOTS
        for cls, prefix in _sections(root)
        for name, rule in list_settings(cls).items()
        if isinstance(rule, wanted)
    ]


def test_every_list_setting_says_what_empty_means() -> None:
    # list_settings raises TypeError for a list field with neither needs_items nor empty_means metadata.
    for root in ROOTS:
        for cls, _ in _sections(root):
            list_settings(cls)
    reachable = {cls for root in ROOTS for cls, _ in _sections(root)}
    for name in CONFIG_MODULES:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, dataclasses.is_dataclass):
            if cls.__module__ == name:
                assert cls in reachable, f"{name}.{cls.__name__}: add it (or its root config) to ROOTS"


def test_an_unclassified_list_setting_is_a_programming_error() -> None:
    @dataclass
    class Unsaid:
        names: list[str] = field(default_factory=list)

    with pytest.raises(TypeError, match=r"Unsaid\.names is a list setting that does not say what \[\] means"):
        list_settings(Unsaid)


@pytest.mark.parametrize(("root", "key"), _list_keys(NeedsItems), ids=lambda v: getattr(v, "__name__", v))
def test_a_meaningless_empty_list_is_refused_naming_the_key(root: type, key: str) -> None:
    with pytest.raises(ConfigValueError) as caught:
        load_config(root, None, [*ROOTS[root], f"{key}=[]"])
    assert caught.value.key == key
    # What to give, then an example or the choices: "formats needs at least one format (e.g. bf16,nvfp4)".
    assert str(caught.value).startswith(f"{key} needs at least one ")
    assert "(e.g. " in str(caught.value) or "(choose from " in str(caught.value)


@pytest.mark.parametrize(("root", "key"), _list_keys(str), ids=lambda v: getattr(v, "__name__", v))
def test_a_meaningful_empty_list_loads(root: type, key: str) -> None:
    conf = load_config(root, None, [*ROOTS[root], f"{key}=[]"])
    for part in key.split("."):
        conf = getattr(conf, part)
    assert conf == []


def test_an_optional_list_left_unset_is_not_empty() -> None:
    # null (the default) of an optional list means "the default choice", not "no items".
    assert load_config(E2EConfig, None, ["linear_backend=null"]).linear_backend is None


def test_validate_refuses_a_constructed_config_too() -> None:
    # The API's preflights run the same walk as the CLI's loading: a config built in code is checked alike.
    conf = TrainConfig()
    conf.model.path, conf.lora.target_modules = "m", []
    with pytest.raises(ConfigValueError, match=r"^lora\.target_modules needs at least one module"):
        validate(conf)


def test_train_refuses_lora_on_no_module(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "train", "tiny", "--set", "lora.target_modules=[]", "--dry-run")
    assert usage_error(rc, err)
    assert "lora.target_modules needs at least one module (e.g. q_proj,v_proj; the default: q_proj," in err
