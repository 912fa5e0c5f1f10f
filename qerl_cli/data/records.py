"""Reading a dataset's records: local files (.jsonl, .json, .parquet, .csv) and the Hugging Face Hub
(cache first; an unreachable Hub fails at once with what to do instead)."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from huggingface_hub import constants

from qerl_cli.errors import QerlError
from qerl_cli.modeling import source_checks  # module: tests patch hub_reachable

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def _is_local(dataset: str) -> bool:
    return Path(dataset).suffix.lower() in LOCAL_SUFFIXES or Path(dataset).is_file()


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local .jsonl / .json (a list, or a dict holding one list) / .parquet / .csv file."""
    path = Path(path)
    if not path.is_file():
        raise QerlError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            lines = path.read_text(encoding="utf-8").splitlines()
            return [json.loads(line) for line in lines if line.strip()]
        if suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                lists = [v for v in data.values() if isinstance(v, list)]
                if len(lists) != 1:
                    raise QerlError(f"{path}: a .json file must hold a list of records (or one list)")
                data = lists[0]
            if not isinstance(data, list):
                raise QerlError(f"{path}: a .json file must hold a list of records")
            return data
        if suffix == ".parquet":
            return pq.read_table(path).to_pylist()
        if suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as f:
                return list(csv.DictReader(f))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise QerlError(f"cannot read {path}: {exc}") from None
    raise QerlError(f"unsupported data file type '{suffix}' ({path}); use one of {', '.join(LOCAL_SUFFIXES)}")


def no_records(source: str | Path) -> QerlError:
    """A dataset with no problems in it: an empty file, a header without rows, an empty list."""
    return QerlError(
        f"{source} holds no records (no problems to read): give a file with one record a problem"
    )


def first_record_fields(path: str | Path) -> list[str]:
    """The field names of a local file's first record, read without loading the whole file where its
    format allows (a check before work: a large .jsonl or .parquet costs its first line or its schema);
    a file with no record is refused (:func:`no_records`), as reading it would be once the model loaded."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                line = next((line for line in f if line.strip()), None)
            if line is None:
                raise no_records(path)
            record = json.loads(line)
            return list(record) if isinstance(record, dict) else []
        if suffix == ".parquet":
            if pq.read_metadata(path).num_rows == 0:
                raise no_records(path)
            return list(pq.read_schema(path).names)
        if suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                if next(reader, None) is None:  # reads the header, then the first row
                    raise no_records(path)
                return list(reader.fieldnames or [])
    except (ValueError, OSError) as exc:  # JSONDecodeError, UnicodeDecodeError, pyarrow's ArrowInvalid
        raise QerlError(f"cannot read {path}: {exc}") from None
    records = read_records(path)  # .json: one document, read whole
    if not records:
        raise no_records(path)
    return list(records[0]) if isinstance(records[0], dict) else []


def _offline() -> bool:
    return any(
        os.environ.get(k, "").lower() in ("1", "true", "yes")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


_LOCAL_FILE_HINT = (
    "Download it on a machine with network access and pass the file instead: --data-file NAME=PATH "
    "for qerl eval, data.dataset=PATH for qerl train (.jsonl/.json/.parquet/.csv)"
)


class _HubLoadError(Exception):
    """One hub source that failed to load (several may be tried before giving up)."""


def _hub_failure(failures: Sequence[_HubLoadError]) -> QerlError:
    reasons = "; ".join(str(f) for f in failures)
    return QerlError(f"could not load from the Hugging Face Hub: {reasons}. {_LOCAL_FILE_HINT}")


def _hub_records(hub_id: str, config: str | None, split: str) -> list[dict[str, Any]]:
    import datasets

    # An unreachable Hub fails at once (datasets would retry for half a minute) unless a copy of the
    # dataset is in the local cache: then datasets loads it, as it always did.
    if not _offline() and not _in_local_cache(hub_id) and not source_checks.hub_reachable():
        where = hub_id + (f" ({config})" if config else "") + f" split '{split}'"
        raise _HubLoadError(
            f"{where}: the Hugging Face Hub cannot be reached (set HF_HUB_OFFLINE=1 to use a copy in "
            "the local cache)"
        )
    try:
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as exc:
        where = hub_id + (f" ({config})" if config else "") + f" split '{split}'"
        why = "offline (HF_HUB_OFFLINE=1) and not in the local cache" if _offline() else str(exc)
        raise _HubLoadError(f"{where}: {why}") from exc
    return ds.to_list()


def _in_local_cache(hub_id: str) -> bool:
    """Whether the Hub cache (or datasets' own, for older script datasets) holds a copy of ``hub_id``."""
    import datasets

    return (Path(constants.HF_HUB_CACHE) / f"datasets--{hub_id.replace('/', '--')}").is_dir() or (
        Path(datasets.config.HF_DATASETS_CACHE) / hub_id.replace("/", "___")
    ).is_dir()


def load_hub_records(hub_id: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """Rows of a hub dataset via ``datasets.load_dataset`` (cache first; a QerlError on failure)."""
    try:
        return _hub_records(hub_id, config, split)
    except _HubLoadError as exc:
        raise _hub_failure([exc]) from exc
