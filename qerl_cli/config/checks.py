"""Value checks the config sections share (a message naming the key, exit 2).

A refused value raises ``ConfigValueError``, which keeps the key apart from the message: the CLI then
names what the user typed (``--prompt-len`` for a flag, ``prompt_len`` or ``train.learning_rate`` for a
recipe key or ``--set``) instead of a path it built itself.
"""

from __future__ import annotations

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


def fraction_or_auto(name: str, value: float | str) -> None:
    if value != "auto" and not 0 < float(value) < 1:
        raise ConfigValueError(name, f"must be in (0, 1) or auto, got {value}")


def positive(where: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ConfigValueError(key(where, name), f"must be > 0, got {value}")
