"""Problems from the Hugging Face Hub, local files or synthetic tasks, through one registry.

``REGISTRY`` is the single record of every dataset qerl knows: its hub id(s), split, field names,
how its gold answer is written and how it is graded into levels. Training (``data.dataset``) and
evaluation (``qerl eval --benchmarks``) both read it. Field names come from the dataset cards:

========== ======================================= ======= ======================= ================
name       hub id (config)                         split   question / answer       notes
========== ======================================= ======= ======================= ================
gsm8k      openai/gsm8k (main)                     any     question / answer       gold after ####
bigmath    SynthLabsAI/Big-Math-RL-Verified        train   problem / answer        levels: solve rate
bigmath-   open-r1/Big-Math-RL-Verified-Processed  train   prompt / solution       config level_3_4_5
openr1     (level_...)                                                             as NVlabs/QeRL
math500    HuggingFaceH4/MATH-500                  test    problem / answer        level 1-5 field
aime24     HuggingFaceH4/aime_2024                 train   problem / answer        30 problems
aime25     math-ai/aime25, else yentinglin/        test,   problem / answer
           aime_2025                               train
amc23      math-ai/amc23                           test    question / answer       40 problems
========== ======================================= ======= ======================= ================

Big-Math has no level field; ``bigmath`` derives one from ``llama8b_solve_rate`` (the share of
Llama-3.1-8B samples that solved it): level 1 above 0.8, 2 above 0.6, 3 above 0.4, 4 above 0.2,
5 at or below 0.2 (rows without a rate have no level). ``bigmath-openr1`` uses open-r1's own
level configs instead, which is what the QeRL code trained on.

A local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file works anywhere a name does; its
fields are the registered dataset's (``like=``), the ones given, or common names found in it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from qerl_cli.data.fields import pick_field
from qerl_cli.data.problem import Problem
from qerl_cli.data.records import (  # noqa: F401 - load_hub_records: tests and callers reach it here
    _LOCAL_FILE_HINT,
    LOCAL_SUFFIXES,
    _hub_failure,
    _hub_records,
    _HubLoadError,
    _in_local_cache,
    _is_local,
    _offline,
    first_record_fields,
    load_hub_records,
    no_records,
    read_records,
)
from qerl_cli.data.synthetic import make_problems
from qerl_cli.errors import QerlError
from qerl_cli.files import folder_given_for_file
from qerl_cli.modeling import source_checks  # module: tests patch hub_reachable
from qerl_cli.rewards.extract import extract_last_boxed

log = logging.getLogger(__name__)
GoldFormat = Literal["plain", "gsm8k", "auto"]
SYNTHETIC_PREFIX = "synthetic"
# Tried in order when a file or an unregistered hub dataset gives no field names.
QUESTION_FIELDS = ("problem", "question", "prompt", "query", "input")
ANSWER_FIELDS = ("answer", "final_answer", "solution", "target", "output")
ID_FIELDS = ("unique_id", "id", "problem_id")


@dataclass(frozen=True)
class HubSource:
    hub_id: str
    config: str | None = None
    # The split to read regardless of the one asked for (benchmarks published as "train" only).
    split: str | None = None


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    sources: tuple[HubSource, ...]  # the first that loads wins; the rest are mirrors
    question_fields: tuple[str, ...]
    answer_fields: tuple[str, ...]
    id_fields: tuple[str, ...] = ()
    gold: GoldFormat = "plain"
    level_field: str | None = None
    level_from_solve_rate: str | None = None  # field holding a solve rate in [0, 1]
    # open-r1 style: the levels pick a hub config ("level_3_4_5") instead of filtering rows.
    level_configs: bool = False
    benchmark: bool = False
    eval_split: str = "test"
    default_samples: int = 4  # samples per problem when evaluated
    description: str = ""
    aliases: tuple[str, ...] = field(default_factory=tuple)


REGISTRY: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            "gsm8k",
            (HubSource("openai/gsm8k", "main"),),
            ("question",),
            ("answer",),
            gold="gsm8k",
            benchmark=True,
            eval_split="test",
            default_samples=4,
            description="grade-school word problems, gold after '####'",
        ),
        DatasetSpec(
            "bigmath",
            (HubSource("SynthLabsAI/Big-Math-RL-Verified", split="train"),),
            ("problem",),
            ("answer",),
            level_from_solve_rate="llama8b_solve_rate",
            description="251k verified problems; levels from Llama-8B solve rate",
        ),
        DatasetSpec(
            "bigmath-openr1",
            (HubSource("open-r1/Big-Math-RL-Verified-Processed", split="train"),),
            ("prompt", "problem"),
            ("solution", "answer"),
            gold="auto",
            level_configs=True,
            description="open-r1's level configs of Big-Math (the QeRL training data)",
        ),
        DatasetSpec(
            "math500",
            (HubSource("HuggingFaceH4/MATH-500", split="test"),),
            ("problem",),
            ("answer",),
            id_fields=("unique_id",),
            level_field="level",
            benchmark=True,
            default_samples=4,
            description="500 MATH test problems",
        ),
        DatasetSpec(
            "aime24",
            (HubSource("HuggingFaceH4/aime_2024", split="train"),),
            ("problem",),
            ("answer",),
            id_fields=("id",),
            benchmark=True,
            default_samples=16,
            description="AIME 2024 I and II",
        ),
        DatasetSpec(
            "aime25",
            (HubSource("math-ai/aime25", split="test"), HubSource("yentinglin/aime_2025", split="train")),
            ("problem", "question"),
            ("answer",),
            id_fields=("id",),
            benchmark=True,
            default_samples=16,
            description="AIME 2025 I and II",
        ),
        DatasetSpec(
            "amc23",
            (HubSource("math-ai/amc23", split="test"),),
            ("question", "problem"),
            ("answer",),
            id_fields=("id",),
            benchmark=True,
            default_samples=16,
            description="AMC 2023",
        ),
    )
}


def get_spec(name: str) -> DatasetSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise QerlError(
            f"unknown dataset '{name}': use one of {', '.join(REGISTRY)}, a synthetic-... task, "
            "a hub id (owner/name) or a .jsonl/.json/.parquet/.csv file"
        ) from None


# --------------------------------------------------------------------------------------------
# Gold answers and levels
# --------------------------------------------------------------------------------------------
def _as_text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # a float column (27.0) holding integer answers
    return str(value).strip()


def gold_answer(raw: Any, rule: GoldFormat) -> str:
    """The gold answer string from a dataset's answer field.

    ``gsm8k``: the text after ``####`` with thousands commas removed (an answer without ``####``,
    e.g. a pre-extracted local file, is taken whole). ``auto``: the same for ``####``, else the last
    ``\\boxed{}`` of a worked solution, else the whole text. ``plain``: the text as it is.
    """
    text = _as_text(raw)
    if rule in ("gsm8k", "auto") and "####" in text:
        return text.split("####")[-1].strip().replace(",", "")
    if rule == "gsm8k":
        return text.replace(",", "")
    if rule == "auto":
        boxed = extract_last_boxed(text)
        if boxed is not None:
            return boxed
    return text


def solve_rate_level(rate: float | None) -> int | None:
    """Big-Math difficulty level 1 (easy) to 5 (hard) from a solve rate in [0, 1]."""
    if rate is None:
        return None
    for level, floor in ((1, 0.8), (2, 0.6), (3, 0.4), (4, 0.2)):
        if rate > floor:
            return level
    return 5


def _candidate_fields(spec: DatasetSpec | None) -> tuple[Sequence[str], Sequence[str]]:
    """The question and answer fields looked for: the dataset's own, else the common names."""
    return (spec.question_fields, spec.answer_fields) if spec else (QUESTION_FIELDS, ANSWER_FIELDS)


def check_file_fields(
    path: str, prompt_field: str | None = None, answer_field: str | None = None, like: str | None = None
) -> None:
    """A local file's first record has the question and answer fields its reading will look for: a
    file with other columns fails the checks before work, not after the model has loaded."""
    spec = get_spec(like) if like else None
    fields = first_record_fields(path)
    questions, answers = _candidate_fields(spec)
    pick_field(fields, prompt_field, questions, "question", path, like)
    pick_field(fields, answer_field, answers, "answer", path, like)


# --------------------------------------------------------------------------------------------
# Records -> problems
# --------------------------------------------------------------------------------------------
def records_to_problems(
    records: list[dict[str, Any]],
    *,
    name: str,
    source: str,
    spec: DatasetSpec | None = None,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    like: str | None = None,
) -> list[Problem]:
    """Problems with stable ids (the dataset's id field, else the row index). ``like``: the benchmark
    whose field names a ``qerl eval --data-file`` follows (only named in a missing field's message)."""
    if not records:
        raise no_records(source)
    fields = list(records[0].keys())
    questions, answers = _candidate_fields(spec)
    q_field = pick_field(fields, prompt_field, questions, "question", source, like)
    a_field = pick_field(fields, answer_field, answers, "answer", source, like)
    id_candidates = spec.id_fields if spec else ID_FIELDS
    id_field = next((f for f in id_candidates if f in fields), None)
    if id_field is not None and len({str(r.get(id_field)) for r in records}) != len(records):
        id_field = None  # ids that repeat cannot key paired comparisons; fall back to the row index
    rule: GoldFormat = spec.gold if spec else "auto"
    problems = []
    skipped: list[int] = []
    for index, row in enumerate(records):
        question, answer = row.get(q_field), row.get(a_field)
        if question is None or answer is None or not str(answer).strip() or not str(question).strip():
            skipped.append(index)  # a row without a question or an answer cannot be graded
            continue
        meta: dict[str, Any] = {"dataset": name, "source": source, "index": index}
        level = _level_of(row, spec)
        if level is not None:
            meta["level"] = level
        problems.append(
            Problem(
                id=str(row[id_field]) if id_field else str(index),
                question=str(question).strip(),
                answer=gold_answer(answer, rule),
                meta=meta,
            )
        )
    if skipped:
        log.warning(
            "%s: skipped %d of %d rows with an empty or missing %s/%s (rows %s)",
            source, len(skipped), len(records), q_field, a_field,
            ", ".join(str(i) for i in skipped[:10]) + (" ..." if len(skipped) > 10 else ""),
        )  # fmt: skip
    return problems


def _level_of(row: dict[str, Any], spec: DatasetSpec | None) -> int | None:
    if spec is not None and spec.level_from_solve_rate:
        rate = row.get(spec.level_from_solve_rate)
        return solve_rate_level(float(rate)) if rate is not None else None
    level_field = spec.level_field if spec and spec.level_field else "level"
    value = row.get(level_field)
    if value is None:
        return None
    try:  # "Level 3" (MATH), 3, "3"
        return int(str(value).split()[-1])
    except ValueError:
        return None


def _filter_levels(problems: list[Problem], levels: Sequence[int], source: str) -> list[Problem]:
    if not levels:
        return problems
    if not any("level" in p.meta for p in problems):
        raise QerlError(f"{source} has no difficulty level to filter on; remove data.levels")
    wanted = {int(x) for x in levels}
    return [p for p in problems if p.meta.get("level") in wanted]


def _openr1_config(levels: Sequence[int]) -> str:
    return "level_" + "_".join(str(x) for x in sorted(set(levels))) if levels else "all"


def _load_registered(spec: DatasetSpec, split: str, levels: Sequence[int], prompt_field, answer_field):
    failures: list[_HubLoadError] = []
    for src in spec.sources:
        config = _openr1_config(levels) if spec.level_configs else src.config
        try:
            records = _hub_records(src.hub_id, config, src.split or split)
        except _HubLoadError as exc:
            failures.append(exc)  # try the next mirror
            continue
        problems = records_to_problems(
            records,
            name=spec.name,
            source=src.hub_id,
            spec=spec,
            prompt_field=prompt_field,
            answer_field=answer_field,
        )
        # open-r1's configs already hold only the asked levels
        return problems if spec.level_configs else _filter_levels(problems, levels, src.hub_id)
    raise _hub_failure(failures)


def load_problems(
    dataset: str,
    split: str = "train",
    prompt_field: str | None = None,
    answer_field: str | None = None,
    levels: Sequence[int] = (),
    max_samples: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    like: str | None = None,
) -> list[Problem]:
    """Problems of ``dataset``: a registered name, ``synthetic-...``, a hub id or a local file.

    Rows are filtered by ``levels``, shuffled with ``seed`` (when ``shuffle``), then cut to
    ``max_samples``. ``like`` names the registered dataset whose field names and gold format a
    local file follows (``qerl eval --data-file gsm8k=test.jsonl``).
    """
    if max_samples is not None and max_samples < 1:
        raise QerlError(f"max_samples must be >= 1, got {max_samples}")
    if dataset.startswith(SYNTHETIC_PREFIX):
        return make_problems(dataset, split, max_samples, seed)
    if _is_local(dataset):
        spec = get_spec(like) if like else None
        problems = records_to_problems(
            read_records(dataset),
            name=like or Path(dataset).stem,
            source=str(dataset),
            spec=spec,
            prompt_field=prompt_field,
            answer_field=answer_field,
            like=like,
        )
        problems = _filter_levels(problems, levels, str(dataset))
    elif dataset in REGISTRY:
        problems = _load_registered(REGISTRY[dataset], split, levels, prompt_field, answer_field)
    elif "/" in dataset:
        records = load_hub_records(dataset, None, split)
        problems = records_to_problems(
            records, name=dataset, source=dataset, prompt_field=prompt_field, answer_field=answer_field
        )
        problems = _filter_levels(problems, levels, dataset)
    else:
        get_spec(dataset)  # raises the "unknown dataset" error with the choices
        raise AssertionError("unreachable")
    if not problems:
        raise QerlError(f"no problems left in '{dataset}' after filtering (levels={list(levels)})")
    if shuffle:
        random.Random(seed).shuffle(problems)
    return problems[:max_samples] if max_samples else problems


def check_reachable(
    dataset: str,
    what: str = "data.dataset",
    *,
    fields: tuple[str | None, str | None] | None = None,
    like: str | None = None,
) -> str:
    """Where ``dataset``'s problems would come from, checked without loading them (a QerlError at once
    when they cannot come): a synthetic task, a local file that exists, or a Hub dataset that is in the
    local cache or on a reachable Hub. Before minutes of model loading, not after. A local file's first
    record is checked for its fields where the caller says how it is read: ``fields`` (a recipe's
    ``data.prompt_field`` / ``answer_field``) or ``like`` (eval's ``--data-file NAME=PATH``)."""
    if dataset.startswith(SYNTHETIC_PREFIX):
        return "a synthetic task, generated here"
    if _is_local(dataset):
        if not Path(dataset).is_file():
            raise QerlError(f"{what} {dataset}: no such file (.jsonl/.json/.parquet/.csv, or a dataset name)")
        if fields is not None or like is not None:
            check_file_fields(dataset, *(fields or (None, None)), like=like)
        return f"the local file {dataset}"
    if dataset in REGISTRY:
        hub_ids = [src.hub_id for src in REGISTRY[dataset].sources]
    elif Path(dataset).is_dir():  # else named an unknown dataset, or (with a "/") looked for on the Hub
        raise folder_given_for_file(dataset, what, LOCAL_SUFFIXES, "a dataset name (gsm8k, synthetic-...)")
    elif "/" in dataset:
        hub_ids = [dataset]
    else:
        get_spec(dataset)  # raises the "unknown dataset" error with the choices
        raise AssertionError("unreachable")
    cached = [hub_id for hub_id in hub_ids if _in_local_cache(hub_id)]
    if cached:
        return f"{cached[0]}, in the local Hugging Face cache"

    if _offline() or not source_checks.hub_reachable():
        why = (
            "offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)"
            if _offline()
            else "the Hub cannot be reached"
        )
        raise QerlError(
            f"{what} {dataset} comes from the Hugging Face Hub ({', '.join(hub_ids)}), {why}, and it is "
            f"not in the local cache. {_LOCAL_FILE_HINT}"
            # eval's default is every benchmark: one file given, the rest still come from the Hub
            + (f"; or leave {dataset} out of --benchmarks" if what == "benchmark" else "")
        )
    return f"{hub_ids[0]}, on the Hugging Face Hub (reachable; downloaded at the start)"
