"""Loading a config: YAML and ``--set a.b=value`` onto the dataclasses, strictly (closest-key hints, typed
conversion), and writing the resolved config back."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from qerl_cli.config.checks import ConfigValueError, NeedsItems, empty_rule
from qerl_cli.config.choices import RESOLVED_CONFIG_NAME
from qerl_cli.config.coercion import Mismatch, coerce, did_you_mean, scalar, type_name
from qerl_cli.config.sections import TrainConfig
from qerl_cli.errors import QerlError, closest

C = TypeVar("C")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _all_keys(cls: type, prefix: str = "", leaves_only: bool = False) -> list[str]:
    """Every key of ``cls`` and of its sections, dotted (``leaves_only``: no section names)."""
    keys = []
    for name, tp in _field_types(cls).items():
        path = f"{prefix}{name}"
        section = dataclasses.is_dataclass(tp)
        if not (section and leaves_only):
            keys.append(path)
        if section:
            keys.extend(_all_keys(tp, f"{path}.", leaves_only))
    return keys


def _unknown_key_hint(root: type, root_prefix: str, path: str) -> str:
    """What to say of one unknown key: the key of its own section it most likely meant, else the key of
    that name in another section (``train.temperature``: ``rollout.temperature``; a section's name is no
    key: ``model.bogus`` did not mean ``model``), else the keys there when they are few (a model's
    config.json given as the recipe, a key of another stage), else where they are all listed."""
    parent, _, name = path.rpartition(".")
    every = _all_keys(root, root_prefix)
    there = [key.rpartition(".")[2] for key in every if key.rpartition(".")[0] == parent]
    close = closest(name, there)
    if close:
        return f"did you mean {parent + '.' if parent else ''}{close}?"
    # Keys of other sections, by their name and by their dotted path with "_" (lora_rank: lora.rank).
    spelled = {}
    for key in _all_keys(root, root_prefix, leaves_only=True):
        if key.rpartition(".")[0] != parent:
            spelled.setdefault(key.rpartition(".")[2], key)
            spelled.setdefault(key.removeprefix(root_prefix).replace(".", "_"), key)
    elsewhere = closest(name, spelled)
    if elsewhere:
        return f"did you mean {spelled[elsewhere]}?"
    where = f"under {parent}" if parent else "at the top level"
    if 0 < len(there) <= 12:
        return f"the keys {where}: {', '.join(there)}"
    return "the command's --dry-run prints every key with its value"


def _unknown_paths(cls: type, data: Any, prefix: str) -> list[str]:
    """Every key of ``data`` (a mapping for ``cls``) and of its sections that ``cls`` has not, in order."""
    if not isinstance(data, dict):
        return []  # from_dict says what a section's value must be
    types_ = _field_types(cls)
    found = []
    for key, value in data.items():
        tp = types_.get(key)
        if tp is None:
            found.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(tp):
            found += _unknown_paths(tp, value, f"{prefix}{key}.")
    return found


def _refuse_unknown_keys(root: type, root_prefix: str, data: Any) -> None:
    """Every unknown key at once: a recipe with three typos is not fixed in three runs."""
    paths = _unknown_paths(root, data, root_prefix)
    hints = [(path, _unknown_key_hint(root, root_prefix, path)) for path in paths]
    if len(hints) == 1:
        raise QerlError(f"unknown config key '{hints[0][0]}'; {hints[0][1]}")
    if hints:
        listed = "; ".join(f"'{path}' ({hint})" for path, hint in hints)
        raise QerlError(f"unknown config keys ({len(hints)}): {listed}")


def _refuse_recipe_sections(data: dict[str, Any], types_: dict[str, Any], prefix: str) -> None:
    """A training recipe as another command's settings: its section named as one, not as a close key."""
    train = _field_types(TrainConfig)
    recipe = [k for k in data if k not in types_ and dataclasses.is_dataclass(train.get(k))]
    if recipe:
        raise QerlError(
            f"unknown config key '{prefix}{recipe[0]}': a section of a training recipe (qerl train, qerl "
            "compare), not a setting of this command: its --dry-run prints those (`... --dry-run > "
            "settings.yaml` writes a --config file)"
        )


def from_dict(
    cls: type[C], data: dict[str, Any], *, prefix: str = "", _root: tuple[type, str] | None = None
) -> C:
    """Build dataclass ``cls`` from a nested mapping, strictly (unknown keys and bad types fail).

    ``prefix``: where the mapping sits in a larger file (``"compare."``), for the keys that errors name.
    """
    root = _root or (cls, prefix)
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the recipe"
        raise QerlError(f"{where} must be a mapping of keys to values, got {type(data).__name__}")
    types_ = _field_types(cls)
    if _root is None:
        if cls is not TrainConfig:
            _refuse_recipe_sections(data, types_, prefix)
        _refuse_unknown_keys(cls, prefix, data)
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in types_:  # the root's walk has refused every unknown key: kept for a direct call
            raise QerlError(f"unknown config key '{path}'; {_unknown_key_hint(*root, path)}")
        tp = types_[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value if value is not None else {}, prefix=f"{path}.", _root=root)
            continue
        try:
            kwargs[key] = coerce(value, tp)
        except Mismatch as exc:
            detail = f": {exc.detail}" if exc.detail else ""
            given = (
                "has no value (null, as `KEY:` or `--set KEY=` with nothing after it gives)"
                if value is None
                else f"has value {value!r} ({type(value).__name__})"
            )
            problem = exc.problem or f"{given}; expected {type_name(tp)}{detail}{did_you_mean(value, tp)}"
            raise ConfigValueError(path, problem, label=f"config key '{path}'") from None
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def changed_keys(before: dict[str, Any], config: Any, skip: tuple[str, ...] = ("output",)) -> list[str]:
    """``section.key: old -> new`` for each key of ``config`` whose value differs from ``before`` (a saved
    config.yaml's mapping), leaving out the sections and ``section.key`` names in ``skip``."""
    return [
        f"{section}.{key}: {before[section].get(key)!r} -> {value!r}"
        for section, values in to_dict(config).items()
        if section not in skip and isinstance(values, dict) and isinstance(before.get(section), dict)
        for key, value in values.items()
        if f"{section}.{key}" not in skip and before[section].get(key) != value
    ]


def apply_overrides(data: dict[str, Any], overrides: list[str], root: type) -> dict[str, Any]:
    """Apply ``a.b=value`` strings to a nested mapping (validated later by ``from_dict``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise QerlError(f"--set expects KEY=VALUE (e.g. train.learning_rate=2e-5), got '{item}'")
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise QerlError(f"--set {key}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
            node = child
        node[parts[-1]] = scalar(raw)
    return data


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that writes one key twice (YAML would silently keep the last value)."""

    def __init__(self, path: str, lines: tuple[int, int]) -> None:
        super().__init__(f"key '{path}' is written twice (lines {lines[0]} and {lines[1]})")
        self.path = path
        self.lines = lines


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping: two ``train:`` sections
    would otherwise merge into the last one without a word, dropping the first one's settings."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._refuse_duplicates(node, "", set())
        return super().construct_document(node)

    def _refuse_duplicates(self, node: yaml.Node, where: str, seen_nodes: set[int]) -> None:
        if id(node) in seen_nodes:  # an alias to a node already checked (or a recursive one)
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self._refuse_duplicates(item, f"{where}[{index}]", seen_nodes)
        if not isinstance(node, yaml.MappingNode):
            return
        first_line: dict[Any, int] = {}
        for key_node, value_node in node.value:
            # "<<: *defaults" merges keys that the mapping may override: that is not a repetition.
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)  # resolved as YAML does: 'lr' and lr are one key
            path = f"{where}.{key}" if where else str(key)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise DuplicateKeyError(path, (first_line[key], line))
            first_line[key] = line
            self._refuse_duplicates(value_node, path, seen_nodes)


def _shipped_recipes_dir() -> Path:
    """Where the shipped recipes are: ``qerl_cli/recipes/`` in an installed wheel (setup.py maps the
    repository's ``recipes/`` onto that package), else ``recipes/`` beside ``qerl_cli/`` in a clone or an
    editable install, their one home. The package's folder is looked at first, so an installed qerl never
    reads a stray ``recipes/`` folder of site-packages."""
    package = Path(__file__).resolve().parents[1]
    in_wheel = package / "recipes"
    return in_wheel if in_wheel.is_dir() else package.parent / "recipes"


SHIPPED_RECIPES = _shipped_recipes_dir()


def shipped_recipes() -> list[str]:
    """The names of the shipped recipes (``qerl train NAME``), sorted."""
    return sorted(p.stem for p in SHIPPED_RECIPES.glob("*.yaml"))


def shipped_recipe_named(path: str | Path) -> Path | None:
    """The shipped recipe a bare name (``tiny``, ``gsm8k_7b.yaml``) or a ``recipes/NAME.yaml`` path names,
    else None. A folder of that name in the working directory does not hide it: a recipe is a file."""
    path = Path(path)
    bare = len(path.parts) == 1
    if (bare or path.parent.name == "recipes") and path.suffix in ("", ".yaml", ".yml"):
        shipped = SHIPPED_RECIPES / f"{path.stem}.yaml"
        if shipped.is_file():
            return shipped
    return None


def resolve_recipe(path: str | Path) -> Path:
    """``path`` when it is a file; else the shipped recipe it names: a bare name (``gsm8k_7b``,
    ``gsm8k_7b.yaml``) or a ``recipes/NAME.yaml`` path (the repository's layout, so the README's
    commands also run outside a clone)."""
    path = Path(path)
    if path.is_file():
        return path
    shipped = shipped_recipe_named(path)
    if shipped is not None:
        return shipped
    bare = len(path.parts) == 1
    names = shipped_recipes()
    # A bare name or a recipes/ path meant a shipped recipe: a misspelt one (tny, gsm8k7b) is named.
    close = closest(path.stem, names) if bare or path.parent.name == "recipes" else None
    guess = f"did you mean {close}? " if close else ""
    raise QerlError(
        f"recipe file not found: {path}; {guess}the recipes shipped with qerl (qerl train NAME): "
        f"{', '.join(names)}"
    )


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = resolve_recipe(path)
    try:
        data = yaml.load(path.read_text(), Loader=_RecipeLoader) or {}
    except DuplicateKeyError as exc:
        raise QerlError(f"{path}: {exc}; keep one of them") from None
    except yaml.YAMLError as exc:
        raise QerlError(f"{path} is not valid YAML: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise QerlError(
            f"{path} must hold a YAML mapping (key: value lines; a recipe's are sections: model:, train:, "
            "...); the command's --dry-run prints one"
        )
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: where (line and column, counted from 1) and what. Its own text spans
    several lines, quoting the document as "<unicode string>", which reads like a crash."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:  # a ReaderError (bytes that are no text): its first line says it
        return f"{str(exc).splitlines()[0]}; give a YAML text file"
    where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, opened = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and opened is not None:  # where the unclosed bracket or block began
        where += f" ({context} at line {opened.line + 1}, column {opened.column + 1})"
    # The line to fix, quoted: the one the bracket or block opened on, else the one the problem is on.
    at = opened if context and opened is not None else mark
    lines = (getattr(at, "buffer", None) or "").splitlines()
    text = lines[at.line].strip() if at.line < len(lines) else ""
    quoted = f": `{text if len(text) <= 80 else text[:77] + '...'}`" if text else ""
    return f"{where}; fix it there{quoted}"


def _is_list(tp: Any) -> bool:
    """A list setting, optional or not (``list[str]``, ``list[FusedKernels] | None``)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_list(arg) for arg in typing.get_args(tp))
    return typing.get_origin(tp) is list


def list_settings(cls: type) -> dict[str, NeedsItems | str]:
    """The list settings of config dataclass ``cls`` (its own, not its sections'), each with what [] means
    there (``checks.empty_rule``: a TypeError for one that does not say)."""
    types_ = _field_types(cls)
    return {f.name: empty_rule(cls, f) for f in dataclasses.fields(cls) if _is_list(types_[f.name])}


def validate(config: Any, prefix: str = "") -> None:
    """Run ``validate(where)`` on the config and every nested section that defines one; ``where`` is the
    section's recipe key ("train"), and "" for the config's root, whose keys are top-level recipe keys.
    A list setting that means nothing empty is refused first, so the section's own checks see items."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            validate(value, f"{prefix}{f.name}.")
    for name, rule in list_settings(type(config)).items():
        values = getattr(config, name)
        if isinstance(rule, NeedsItems) and values is not None:  # None: an optional list left unset
            rule.check(f"{prefix}{name}", values)
    check = getattr(config, "validate", None)
    if check is not None:
        check(prefix.rstrip("."))


def load_config(
    cls: type[C],
    recipe: str | Path | None = None,
    overrides: list[str] | None = None,
    /,  # positional: a config key may be named "recipe" (bench e2e's) and come in ``values``
    *,
    flags: dict[str, str] | None = None,
    **values: Any,
) -> C:
    """Recipe file (optional) < keyword values (CLI flags, None = not given) < ``--set`` overrides.

    ``flags``: the command-line flag behind each keyword value (key -> "--flag"), so that an error about
    that key names the flag the user typed; other errors name the recipe key ("train.learning_rate").
    """
    data = read_yaml(recipe) if recipe else {}
    for key, value in values.items():
        if value is not None:
            data[key] = value
    overrides = list(overrides or [])
    # A key that --set overrides is the user's --set key, not the flag's any more.
    set_keys = {item.partition("=")[0].strip() for item in overrides}
    flags = {key: flag for key, flag in (flags or {}).items() if key not in set_keys}
    data = apply_overrides(data, overrides, cls)
    try:
        config = from_dict(cls, data)
        validate(config)
    except ConfigValueError as exc:
        raise _as_typed(exc, cls, flags) from None
    return config


def _as_typed(exc: ConfigValueError, cls: type, flags: dict[str, str]) -> ConfigValueError:
    """``exc`` naming what the user typed: the flag that set the key, else the recipe key itself."""
    key = exc.key
    head, dot, rest = key.partition(".")
    if dot and head not in _field_types(cls):  # a root check that prefixes its stage ("quantize.seq_len")
        key = rest
    if key in flags:
        return exc.named(flags[key])
    return exc if key == exc.key else exc.named(key)


def dump_yaml(config: Any) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False)


def save_resolved_config(config: Any, out_dir: str | Path) -> Path:
    """Every run keeps the exact configuration it ran with beside its outputs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESOLVED_CONFIG_NAME
    path.write_text(dump_yaml(config))
    return path
