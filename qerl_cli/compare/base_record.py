"""Whether a 4-bit base compare made before (``DIR/bases/<fmt>[-<method>]``) is the one this invocation
would make: the same source model, format, method and LoRA start.

A base is made once and reused by every later invocation into the same folder, so a ``model.path`` (or
``compare.base_method``, ``base.method``, ``lora.init``) changed between two invocations would otherwise
have the new runs of the 4-bit arms train on the old model's base while the BF16 arm trains on the new
one. The base's ``qerl_quant.json`` (:class:`~qerl_cli.quantize.report.QuantizeResult`, written by
``qerl quantize`` and by qerl's own RTN writer) records what it was made from; a difference is refused
before any work, ``--dry-run`` included, as finished runs of other settings are
(``runs.check_finished_settings``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from qerl_cli.compare.arms import BaseChoice
from qerl_cli.compare.runs import RESULT_NAME
from qerl_cli.errors import QerlError
from qerl_cli.files import is_complete_folder
from qerl_cli.quantize.report import REPORT_NAME, SourceRecord, source_record

log = logging.getLogger(__name__)


def check_made_base(
    target: Path, source: str, choice: BaseChoice, lora_init: str, rank: int, out: Path, arms: list[str]
) -> None:
    """Refuse ``target``, a base made before for ``arms`` from another model or with other settings than
    this invocation's (``source``: the recipe's model as a folder, a converted GGUF's folder, or a hub
    id); nothing there yet, or the same: nothing to say."""
    report = target / REPORT_NAME
    if not report.is_file():
        if is_complete_folder(target):  # qerl's own RTN base, made by a qerl that wrote no record
            raise _unrecorded(target, source_record(source), out, arms)
        return  # not made yet (or a failed attempt, which is made again)
    saved = json.loads(report.read_text())
    now = source_record(source)
    changes = _source_changes(saved, now, source)
    changes += _settings_changes(saved, choice, lora_init, rank)
    if changes:
        raise _stale(target, changes, out, arms)
    if not saved.get("source"):
        log.info("%s: made by an older qerl, which recorded only its source's path (%s), not its "
                 "weights: reused as made from %s", target, saved.get("model"), now.path)  # fmt: skip


def _source_changes(saved: dict[str, Any], now: SourceRecord, source: str) -> list[str]:
    """``what: old -> new`` of the source model; by the path alone for a record of an older qerl."""
    if not saved.get("source"):  # an older qerl_quant.json: the model as it was given, nothing more
        old = str(saved.get("model") or "")
        if old in (source, now.path) or source_record(old).path == now.path:
            return []
        return [f"source model: {old} -> {now.path} (an older qerl recorded its path only)"]
    was = SourceRecord.from_dict(saved["source"])
    if was.weights is not None and now.weights is not None:
        # The weights decide: a folder moved or copied (another machine, another cache) is the same model.
        if was.weights == now.weights:
            return []
        return [f"source model: {was.path} -> {now.path} (its weights differ: fingerprint {was.weights} -> "
                f"{now.weights})"]  # fmt: skip
    return [] if was.path == now.path else [f"source model: {was.path} -> {now.path}"]


def _settings_changes(saved: dict[str, Any], choice: BaseChoice, lora_init: str, rank: int) -> list[str]:
    """``what: old -> new`` of the format, method and (where an arm needs one) the LoRA start."""
    changes = [
        f"{key}: {saved.get(key)} -> {wanted}"
        for key, wanted in (("format", choice.format), ("method", choice.method))
        if saved.get(key) != wanted
    ]
    init = saved.get("lora_init") or {}
    if lora_init != "zeros":  # a base with a LoRA start serves arms starting from zeros as it is
        was = f"{init.get('method', 'zeros')} rank {init.get('rank')}" if init else "zeros"
        if was != f"{lora_init} rank {rank}":
            changes.append(f"LoRA start (lora.init, lora.rank): {was} -> {lora_init} rank {rank}")
    return changes


def _finished_on(out: Path, arms: list[str]) -> list[str]:
    done = f"seed-*/{RESULT_NAME}"
    return [f"{arm}/{p.parent.name}" for arm in arms for p in sorted((out / arm).glob(done))]


def _remedy(target: Path, out: Path, arms: list[str], source: str) -> str:
    """What to do, the same for every refusal: another folder, or the base (and what was made from it)
    removed and made again."""
    copies = [str(p) for p in sorted(target.parent.glob(f"{target.name}-dequantized")) if p.is_dir()]
    also = f" and its dense copy {', '.join(copies)}" if copies else ""
    runs = _finished_on(out, arms)
    finished = (
        f" The finished runs on the old base ({', '.join(runs)}) are a different experiment: they are "
        "skipped, not trained again, and the report would give them beside the new ones, so remove them "
        "too unless the base was made from this same model."
        if runs
        else ""
    )
    return (
        f"Nothing was changed. Give this comparison its own folder with -o DIR, or remove {target}{also} to "
        f"have it made again from {source}.{finished}"
    )


def _stale(target: Path, changes: list[str], out: Path, arms: list[str]) -> QerlError:
    return QerlError(
        f"{target} was made from another model or with other settings than this invocation would make it "
        f"with ({'; '.join(changes)}); a base is made once and reused, so the new runs of {', '.join(arms)} "
        f"would train on it as this one. {_remedy(target, out, arms, _new_source(changes))}"
    )


def _new_source(changes: list[str]) -> str:
    """The model the base would be made from now, as a change names it (else: model.path)."""
    for change in changes:
        if change.startswith("source model: "):
            return change.split(" -> ", 1)[1].split(" (", 1)[0]
    return "model.path"


def _unrecorded(target: Path, now: SourceRecord, out: Path, arms: list[str]) -> QerlError:
    return QerlError(
        f"{target} records no source model ({REPORT_NAME}: it was made by an older qerl, whose own RTN "
        f"bases kept no record), so it cannot be checked against this invocation's model.path {now.path}; "
        f"the new runs of {', '.join(arms)} could train on another model's base. Round to nearest makes the "
        f"same base from the same model: made again from {now.path}, it is the old one if that was its "
        f"source. {_remedy(target, out, arms, now.path)}"
    )
