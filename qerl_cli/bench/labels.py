"""How a bench row is named in tables and charts (one place for the report, the roofline rows and the
charts)."""

from __future__ import annotations

from typing import Any


def lora_label(rank: int) -> str:
    return f"r{rank}" if rank else "none"


def format_label(row: dict[str, Any]) -> str:
    """The format, with the linear backend when it is not the format's default (``nvfp4 / humming``)."""
    backend = row.get("backend", "default")
    return row["format"] + ("" if backend in ("default", "marlin") else f" / {backend}")


def e2e_label(row: dict[str, Any]) -> str:
    """An e2e row or pair: the format, with the backend it asked for unless that is ``auto`` (the only
    one of the HF engine, and of a run that names none): ``nvfp4 / fp8``. Unique within a run."""
    backend = row.get("backend")
    return row["format"] + ("" if backend in (None, "auto") else f" / {backend}")


def rollout_label(row: dict[str, Any]) -> str:
    """A rollout row: its format (and backend), LoRA and sequences, ``nvfp4 / merged, LoRA r16, 128 seqs``."""
    return f"{format_label(row)}, LoRA {lora_label(row['lora_rank'])}, {row['batch']} seqs"
