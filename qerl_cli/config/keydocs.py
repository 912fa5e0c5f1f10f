"""Each config key's documentation, read from the comment above its field (or after it on its line).

The comments in ``sections.py``, ``rl_sections.py`` and ``stages.py`` are the one place a key is
documented: this module reads them from the source with ``tokenize`` and ``ast``, and ``qerl train --keys``
prints them with each key's dotted name, type and default. ``tests/test_config.py`` holds every field to
having one.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Any

import yaml

from qerl_cli.config.coercion import type_name
from qerl_cli.config.loading import _field_types


@dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted recipe key, e.g. "rollout.engine"
    type: str  # as errors spell it: "'hf' | 'vllm'", "int | 'auto'", "list[str]"
    default: str  # YAML spelling: 1e-05, null, [q_proj, k_proj], ''
    help: str


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """{field name: its comment} of dataclass ``cls``: the comment lines right above the field (no blank
    line between) and the comment after it on its own line, joined. {} when the source is not shipped."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}  # line (1-based, within the class) -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if not text.startswith(("fmt:", "noqa", "type:")):  # tool pragmas are no documentation
                comments[tok.start[0]] = text
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    (node,) = ast.parse(source).body
    helps = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        line = stmt.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        inline = comments.get(stmt.end_lineno or stmt.lineno)
        text = " ".join(part for part in [*above, inline] if part)
        if text:
            helps[stmt.target.id] = text
    return helps


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _yaml(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)  # 1e-05, where YAML writes 1.0e-05
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def key_docs(cls: type, prefix: str = "") -> list[KeyDoc]:
    """Every key of config ``cls`` in declaration order, sections expanded (``rollout.engine``)."""
    docs = []
    types = _field_types(cls)
    helps = field_help(cls)
    for f in dataclasses.fields(cls):
        tp = types[f.name]
        if dataclasses.is_dataclass(tp):
            docs.extend(key_docs(tp, f"{prefix}{f.name}."))
            continue
        docs.append(KeyDoc(f"{prefix}{f.name}", type_name(tp), _yaml(_default(f)), helps.get(f.name, "")))
    return docs


def sections(cls: type) -> list[str]:
    """The section names of config ``cls`` (the fields that are dataclasses), in declaration order."""
    types = _field_types(cls)
    return [f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(types[f.name])]
