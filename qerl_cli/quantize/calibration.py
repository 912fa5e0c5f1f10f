"""Calibration text for AWQ: chat conversations rendered with the model's own chat template.

Sources: ``qerl-text`` (prose and worked word problems shipped with qerl, see
``qerl_cli.data.calib_text``), a Hugging Face dataset id (default ``open-thoughts/OpenThoughts-114k``,
whose rows hold a
``system`` prompt and ``conversations`` as ``[{"from": "user"|"assistant", "value": ...}]``), or a
local ``.jsonl`` / ``.parquet`` file. A record's field may hold chat messages (``role``/``content``
or ``from``/``value`` dicts), rendered with the chat template, or plain text, used as is.

Rows are shuffled with a fixed seed; the first ``num_samples`` non-empty ones calibrate, the next few
are held out for ``--eval-ppl``. Each sample is truncated to ``seq_len`` tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from qerl_cli.data.calib_text import BUILTIN_NAME, builtin_rows
from qerl_cli.errors import QerlError
from qerl_cli.modeling.prompt_tokens import encode_prompt

DEFAULT_CALIB = "open-thoughts/OpenThoughts-114k"
# Field names tried, in order, when --calib-field is not given.
AUTO_FIELDS = ("conversations", "messages", "text")
HELD_OUT_SAMPLES = 16
# Streaming shuffle buffer for hub datasets: reads ~this many rows instead of downloading the whole set.
STREAM_SHUFFLE_BUFFER = 10_000
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}
LOCAL_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}


@dataclass
class CalibrationSet:
    samples: list[list[int]]  # token ids, each at most seq_len long
    held_out: list[list[int]]
    spec: dict[str, Any] = field(default_factory=dict)  # what qerl_quant.json records

    def as_dataset(self):  # -> datasets.Dataset with input_ids / attention_mask, llm-compressor's input
        from datasets import Dataset

        return Dataset.from_dict(
            {"input_ids": self.samples, "attention_mask": [[1] * len(ids) for ids in self.samples]}
        )


def _read_local(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix not in LOCAL_SUFFIXES:
        raise QerlError(f"calibration file {path} must be .jsonl or .parquet (got '{path.suffix}')")
    try:
        if LOCAL_SUFFIXES[suffix] == "parquet":
            return pq.read_table(path).to_pylist()
        with path.open(encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    except (OSError, ValueError) as exc:
        raise QerlError(f"could not read calibration file {path}: {exc}") from None


def _open_rows(source: str, split: str, seed: int) -> tuple[Iterable[dict[str, Any]], list[str], str]:
    """Shuffled rows, their column names, and the source kind ("file", "builtin" or "hub")."""
    if source == BUILTIN_NAME:  # the small text set shipped with qerl, offline
        rows = builtin_rows()
        random.Random(seed).shuffle(rows)
        return rows, ["text"], "builtin"
    path = Path(source).expanduser()
    if path.suffix.lower() in LOCAL_SUFFIXES or path.exists():
        if not path.is_file():
            raise QerlError(f"calibration file {source!r} not found")
        rows = _read_local(path)
        if not rows or not all(isinstance(r, dict) for r in rows):
            raise QerlError(f"calibration file {path} must hold one JSON object (record) per line / row")
        columns = list(dict.fromkeys(key for row in rows for key in row))
        random.Random(seed).shuffle(rows)
        return rows, columns, "file"
    import datasets

    try:
        stream = datasets.load_dataset(source, split=split, streaming=True)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QerlError(
            f"calibration dataset {source!r} could not be opened ({reason}). Check the id and split, or "
            "pass a local .jsonl/.parquet file with --calib (and --calib-field if needed)."
        ) from None
    columns = list(stream.column_names or [])
    return stream.shuffle(seed=seed, buffer_size=STREAM_SHUFFLE_BUFFER), columns, "hub"


def pick_field(columns: list[str], requested: str | None, source: str) -> str:
    if requested is not None:
        if columns and requested not in columns:
            raise QerlError(
                f"calibration data {source} has no field {requested!r}; fields present: "
                f"{', '.join(columns)}. Pass --calib-field with one of them."
            )
        return requested
    for name in AUTO_FIELDS:
        if name in columns:
            return name
    raise QerlError(
        f"calibration data {source} has none of the fields {', '.join(AUTO_FIELDS)}; fields present: "
        f"{', '.join(columns) or '(none)'}. Pass --calib-field naming the one with the text or chat messages."
    )


def _messages(value: list[Any], system: Any) -> list[dict[str, str]]:
    messages = []
    for turn in value:
        if not isinstance(turn, dict):
            raise QerlError(f"chat messages must be dicts with role/content or from/value, got {turn!r:.80}")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role is None or content is None:
            raise QerlError(f"chat message without role/content (or from/value): keys {sorted(turn)}")
        messages.append({"role": ROLE_ALIASES.get(str(role).lower(), str(role)), "content": str(content)})
    if isinstance(system, str) and system and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def render(record: dict[str, Any], field_name: str, tokenizer) -> tuple[str, str]:
    """(text, how): chat messages through the chat template, or a plain string as is."""
    value = record.get(field_name)
    if isinstance(value, str):
        return value, "plain"
    if isinstance(value, list):
        messages = _messages(value, record.get("system"))
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False), "chat_template"
        # A base model without a template: the contents alone still calibrate on realistic text.
        return "\n\n".join(m["content"] for m in messages), "plain"
    if value is None:
        return "", "plain"
    raise QerlError(
        f"calibration field {field_name!r} holds {type(value).__name__}; expected text or chat messages"
    )


def _tokenized(
    rows: Iterable[dict[str, Any]], field_name: str, tokenizer, seq_len: int, how: list[str]
) -> Iterator[list[int]]:
    for record in rows:
        text, kind = render(record, field_name, tokenizer)
        if not text.strip():
            continue
        # The chat template already writes the special tokens; plain text gets the tokenizer's own
        # leading ones (BOS for Gemma or Llama), as a document in pretraining and a prompt in training.
        ids = encode_prompt(text, tokenizer, from_chat_template=kind == "chat_template")[:seq_len]
        if ids:
            how.append(kind)
            yield list(ids)


def load_calibration(
    source: str,
    tokenizer,
    *,
    num_samples: int,
    seq_len: int,
    seed: int,
    split: str = "train",
    field_name: str | None = None,
    held_out: int = 0,
) -> CalibrationSet:
    """Read, shuffle, render and tokenize ``num_samples`` (+ ``held_out``) samples."""
    rows, columns, kind = _open_rows(source, split, seed)
    chosen = pick_field(columns, field_name, source) if columns else (field_name or AUTO_FIELDS[0])
    how: list[str] = []
    ids = list(islice(_tokenized(rows, chosen, tokenizer, seq_len, how), num_samples + held_out))
    if not ids:
        raise QerlError(f"calibration data {source} gave no non-empty samples in field {chosen!r}")
    if held_out and len(ids) <= 1:
        raise QerlError(f"calibration data {source} has one usable sample: --eval-ppl needs at least two")
    # With a small file, keep at least one sample for each side instead of failing.
    n_calib = min(num_samples, len(ids) - 1) if held_out else min(num_samples, len(ids))
    samples, rest = ids[:n_calib], ids[n_calib:]
    spec = {
        "source": source,
        "kind": kind,
        "split": split if kind == "hub" else None,
        "field": chosen,
        "rendering": sorted(set(how)),
        "requested_samples": num_samples,
        "num_samples": len(samples),
        "seq_len": seq_len,
        "tokens": sum(len(s) for s in samples),
        "seed": seed,
        "held_out_samples": len(rest),
    }
    return CalibrationSet(samples=samples, held_out=rest, spec=spec)
