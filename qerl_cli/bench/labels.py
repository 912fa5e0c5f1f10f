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
