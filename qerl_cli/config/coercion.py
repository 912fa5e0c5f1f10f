"""Typed conversion of one config value: a recipe's or ``--set``'s value onto a field's type (strictly:
what does not fit raises :class:`Mismatch`, which ``loading.from_dict`` turns into an error naming the
key), the type as an error writes it, and the "did you mean" for a value outside a setting's choices."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import yaml

from qerl_cli.errors import closest


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def in_words(tp: Any) -> str:
    """``tp`` as a user reads it in an error about one list item: "one of auto, marlin", "an integer"."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    words = {int: "an integer", float: "a number", bool: "true or false", str: "text"}
    return words.get(tp, type_name(tp))


class Mismatch(Exception):
    """Raised internally when a value does not fit a type; turned into a QerlError with the key.

    ``detail`` says which part of a mapping was wrong ("entry 'a': 'x' is not float"); ``problem``, set
    for a wrong list item, is the whole complaint in words ("has 'abc' (item 2), which is not an
    integer"): the item and what it may be say more than the list's repr and its type expression."""

    def __init__(self, detail: str = "", problem: str = "") -> None:
        super().__init__(detail or problem)
        self.detail = detail
        self.problem = problem


def coerce(value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        return _coerce_literal(value, typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        misses = []
        for arg in typing.get_args(tp):
            try:
                return coerce(value, arg)
            except Mismatch as exc:
                misses.append(exc)
        # The member that got furthest (a list's wrong item) says the most; a bare miss says nothing.
        raise next((m for m in misses if m.detail or m.problem), Mismatch())
    if tp is type(None):
        if value is None:
            return None
        raise Mismatch
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):  # --set train.batch=2,8 and CLI lists
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise Mismatch
        items = []
        for index, v in enumerate(value, 1):
            try:
                items.append(coerce(scalar(v) if isinstance(v, str) else v, item))
            except Mismatch:
                where = f" (item {index})" if len(value) > 1 else ""
                problem = f"has {v!r}{where}, which is not {in_words(item)}{did_you_mean(v, item)}"
                raise Mismatch(problem=problem) from None
        return items
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise Mismatch
        entries = {}
        for k, v in value.items():
            try:
                entries[coerce(k, key_tp)] = coerce(v, val_tp)
            except Mismatch:
                detail = f"entry {k!r}: {v!r} is not {type_name(val_tp)}{did_you_mean(v, val_tp)}"
                raise Mismatch(detail) from None
        return entries
    return _coerce_scalar(value, tp)


def _coerce_literal(value: Any, choices: tuple[Any, ...]) -> Any:
    # YAML 1.1 reads a bare off / on (``--set train.fused_kernels=off``) as false / true: where a
    # choice is spelled so, that is what was meant.
    if isinstance(value, bool) and ("on" if value else "off") in choices:
        return "on" if value else "off"
    if value in choices:
        return value
    # The docs write the formats and methods as names (NVFP4, AWQ): every choice is lower case, so
    # a user's NVFP4 can mean nothing but nvfp4 (bench --formats took it already).
    if isinstance(value, str) and value.lower() in choices:
        return value.lower()
    raise Mismatch


def _coerce_scalar(value: Any, tp: Any) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise Mismatch
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads 1e-5 (no dot) as a string
                return float(value)
            except ValueError:
                raise Mismatch from None
        raise Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # e.g. a numeric revision or dataset split name
        raise Mismatch
    raise TypeError(f"unsupported config type {tp!r}")


def scalar(text: str) -> Any:
    """Parse one ``--set`` value the way YAML would (``true``, ``3``, ``[1, 2]``, ``null``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def literal_choices(tp: Any) -> list[str]:
    """The text choices ``tp`` allows: a ``Literal``'s, or those of each ``Literal`` in a union
    (``Literal["auto"] | int``, an optional one)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return [str(choice) for choice in typing.get_args(tp)]
    if origin in (typing.Union, types.UnionType):
        return [choice for arg in typing.get_args(tp) for choice in literal_choices(arg)]
    return []


def did_you_mean(value: Any, tp: Any) -> str:
    """``"; did you mean 'marlin'?"`` for a value ``tp``'s choices refused (``marlinn``), or "" where no
    choice is close (or ``tp`` has none): the error it ends already lists the choices."""
    choices = literal_choices(tp)
    close = closest(value, choices) if choices and value is not None and not isinstance(value, bool) else None
    return f"; did you mean {close!r}?" if close is not None else ""
