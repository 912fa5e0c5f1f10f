"""Which of a record's fields holds the question and which the answer, and the message when none does:
it says how to name the field for the command that read the file (a recipe's key for qerl train; a
rename for qerl eval's ``--data-file``, which has no such setting)."""

from __future__ import annotations

from collections.abc import Sequence

from qerl_cli.errors import QerlError


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(f"'{name}'" for name in names) or "none"


def _field_hint(what: str, like: str | None) -> str:
    """How to point qerl at the field: a recipe names it; ``qerl eval --data-file`` has no such setting,
    so there the file's field is renamed to its benchmark's (naming a key eval refuses would mislead)."""
    if like is not None:
        return (
            f"qerl eval reads --data-file {like}=PATH with {like}'s field names: rename the file's {what} "
            "field"
        )
    key = "prompt_field" if what == "question" else "answer_field"
    return f"Name the field with --set data.{key}=FIELD (qerl train), or rename it in the file"


def pick_field(
    record_fields: Sequence[str],
    wanted: str | None,
    candidates: Sequence[str],
    what: str,
    where: str,
    like: str | None = None,
) -> str:
    """The field ``wanted``, else the first of ``candidates`` the record has; ``like`` as in
    ``records_to_problems``."""
    if wanted is not None:
        if wanted not in record_fields:
            fields = _quoted(sorted(record_fields))
            raise QerlError(f"{where} has no {what} field '{wanted}'; its fields are {fields}")
        return wanted
    for name in candidates:
        if name in record_fields:
            return name
    raise QerlError(
        f"{where} has none of the {what} fields {_quoted(candidates)}; its fields are "
        f"{_quoted(sorted(record_fields))}. {_field_hint(what, like)}"
    )
