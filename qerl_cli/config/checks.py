"""Value checks the config sections share (a message naming the key, exit 2).

A refused value raises ``ConfigValueError``, which keeps the key apart from the message: the CLI then
names what the user typed (``--prompt-len`` for a flag, ``prompt_len`` or ``train.learning_rate`` for a
recipe key or ``--set``) instead of a path it built itself. AQN's sigma rules live here too, so the
recipe, the schedule built from it and the engines' noise refuse the same values alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qerl_cli.errors import QerlError


class ConfigValueError(QerlError):
    """A config value refused by a check: ``key`` (dotted, from the config's root), what is wrong with
    it, and the label the message opens with (the key itself unless said otherwise)."""

    def __init__(self, key: str, problem: str, label: str | None = None) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{label or key} {problem}")

    def named(self, name: str) -> ConfigValueError:
        """The same error, naming ``name`` (e.g. the flag that set the key) instead of the key."""
        return ConfigValueError(name, self.problem)


def key(where: str, name: str) -> str:
    """``name`` inside section ``where`` ("" at a config's root, whose keys are top-level recipe keys)."""
    return f"{where}.{name}" if where else name


# -- List settings: what an empty one means -------------------------------------------------------
# Every list setting of a config dataclass says in its field's metadata what [] means: nothing
# (``needs_items``) or something (``empty_means``, e.g. data.levels: every level). ``loading.validate``
# reads it for every section, before the section's own checks, so the refusal of a meaningless [] has
# this one home, and a list setting that says neither is a programming error there, not a silent pass.
_EMPTY = "qerl_empty_list"


@dataclass(frozen=True)
class NeedsItems:
    """A list setting that means nothing empty (``--benchmarks ""``, ``formats: []``)."""

    what: str  # one item, in words: "benchmark", "module"
    hint: str  # what to give: "e.g. bf16,nvfp4" or "choose from ..."

    def check(self, key: str, values: Sequence[Any]) -> None:
        if not values:
            raise ConfigValueError(key, f"needs at least one {self.what} ({self.hint})")


def needs_items(what: str, hint: str) -> dict[str, Any]:
    """Field metadata of a list setting that [] leaves meaningless: refused, naming ``what`` to give."""
    return {_EMPTY: NeedsItems(what, hint)}


def empty_means(meaning: str) -> dict[str, Any]:
    """Field metadata of a list setting whose [] means something: ``meaning`` says what (its record)."""
    return {_EMPTY: meaning}


def empty_rule(owner: type, f: dataclasses.Field) -> NeedsItems | str:
    """What [] means for list setting ``f`` of ``owner``: a ``NeedsItems`` or the meaning it has."""
    rule = f.metadata.get(_EMPTY)
    if rule is None:
        raise TypeError(
            f"{owner.__name__}.{f.name} is a list setting that does not say what [] means: give its field "
            "metadata=needs_items(...) or metadata=empty_means(...) (qerl_cli.config.checks)"
        )
    return rule


def fraction_or_auto(name: str, value: float | str) -> None:
    if value != "auto" and not 0 < float(value) < 1:
        raise ConfigValueError(name, f"must be in (0, 1) or auto, got {value}")


def positive(where: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ConfigValueError(key(where, name), f"must be > 0, got {value}")


def group_size(name: str, value: int) -> None:
    """Completions per prompt (``rollout.num_generations``, ``qerl bench e2e``'s ``generations``): a
    group of one has no spread of rewards, so every advantage is 0."""
    if value < 2:
        raise ConfigValueError(
            name,
            "must be at least 2 (GRPO learns from the spread of rewards within a prompt's group), "
            f"got {value}",
        )


# -- AQN's sigmas ---------------------------------------------------------------------------------
# One rule, used by the recipe's aqn section, by the schedule built from it (as configured, calibrated
# or restored from a checkpoint) and by every engine's norm noise.
def _finite(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def noise_sigma(name: str, value: float) -> None:
    """A sigma the rollout noise is drawn with: a finite number >= 0 (0: no noise)."""
    if not (_finite(value) and value >= 0):
        raise ConfigValueError(name, f"must be a finite number >= 0 (0: no noise), got {value}")


def aqn_sigmas(where: str, sigma_start: float, sigma_end: float, schedule: str) -> None:
    """The end points of an AQN decay (section ``where``, e.g. "aqn"): ``sigma_start`` finite and > 0,
    ``sigma_end`` finite, at most ``sigma_start`` (every schedule decays) and > 0 for the exponential
    schedule (a geometric decay never reaches 0; the others may end at 0)."""
    start, end = key(where, "sigma_start"), key(where, "sigma_end")
    if not (_finite(sigma_start) and sigma_start > 0):
        raise ConfigValueError(
            start,
            f"must be a finite number > 0 (the first noisy stage's sigma; the paper's is 1e-2), got "
            f"{sigma_start}; to train without noise set {key(where, 'enabled')}=false",
        )
    noise_sigma(end, sigma_end)
    if sigma_end > sigma_start:
        raise ConfigValueError(
            end,
            f"must be <= {start} ({sigma_start}): the schedule decays from {start} to {end}; got {sigma_end}",
        )
    if schedule == "exponential" and sigma_end == 0:
        raise ConfigValueError(
            end,
            f"must be > 0 with {key(where, 'schedule')}=exponential (a geometric decay never reaches 0), "
            "got 0; to decay to 0 choose the linear, cosine or logarithmic schedule",
        )
