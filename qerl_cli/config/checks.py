"""Value checks the config sections share (a message naming the key, exit 2)."""

from __future__ import annotations

from qerl_cli.errors import QerlError


def fraction_or_auto(name: str, value: float | str) -> None:
    if value != "auto" and not 0 < float(value) < 1:
        raise QerlError(f"{name} must be in (0, 1) or auto, got {value}")


def positive(where: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise QerlError(f"{where}.{name} must be > 0, got {value}")
