"""How a bench row is named in tables and charts (one place for the report, the roofline rows and the
charts)."""

from __future__ import annotations

from typing import Any

from qerl_cli.rollout.backends import served_backend


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


def row_backend(row: dict[str, Any]) -> str:
    """An e2e row's ``backend``, the one it asked for (what the gate matches rows by); for a report from
    before it was recorded, the backend that run asked for as its format serves it (one backend a run
    then, ``auto`` unless given)."""
    backend = row.get("backend")
    if backend:
        return str(backend)
    return served_backend(str(row.get("linear_backend_requested") or "auto"), row["format"])


def e2e_backend_label(row: dict[str, Any]) -> str:
    """An e2e row's backend as the table and the gate's messages name it: what the engine ran, with
    ``(auto)`` where auto chose it (``trainer``: the HF engine's own layers), else the one asked for."""
    ran, asked = row.get("linear_backend"), row_backend(row)
    if ran is None:
        return asked
    return f"{ran} (auto)" if asked == "auto" and ran != "trainer" else str(ran)


def rollout_label(row: dict[str, Any]) -> str:
    """A rollout row: its format (and backend), LoRA and sequences, ``nvfp4 / merged, LoRA r16, 128 seqs``."""
    return f"{format_label(row)}, LoRA {lora_label(row['lora_rank'])}, {row['batch']} seqs"
