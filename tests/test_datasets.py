"""Dataset loading: registry, local files, gold extraction, levels, shuffling, hub failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qerl_cli.data import datasets as ds
from qerl_cli.data.benchmarks import benchmark_names, default_samples, load_benchmark
from qerl_cli.data.datasets import gold_answer, load_problems, solve_rate_level
from qerl_cli.errors import QerlError


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 9 more. How many?", "answer": "3 + 9 = 12\n#### 12"},
    {"question": "A car costs 1,000 dollars twice. Total?", "answer": "2 * 1,000\n#### 2,000"},
]


class FakeHubDataset:
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def to_list(self) -> list[dict]:
        return list(self.rows)


def test_registry_covers_the_benchmarks_with_paper_sample_counts() -> None:
    assert benchmark_names() == ["gsm8k", "math500", "aime24", "aime25", "amc23"]
    assert [default_samples(b) for b in benchmark_names()] == [4, 4, 16, 16, 16]
    assert ds.REGISTRY["gsm8k"].sources[0].hub_id == "openai/gsm8k"
    assert ds.REGISTRY["aime25"].sources[1].hub_id == "yentinglin/aime_2025"


@pytest.mark.parametrize(
    ("raw", "rule", "expected"),
    [
        ("work...\n#### 1,234", "gsm8k", "1234"),
        ("72", "gsm8k", "72"),  # a file with the answer already extracted
        ("we get \\boxed{\\frac{1}{2}} in the end", "auto", "\\frac{1}{2}"),
        ("\\frac{1}{2}", "plain", "\\frac{1}{2}"),
        (27.0, "plain", "27"),
        (33, "plain", "33"),
    ],
)
def test_gold_answer_rules(raw, rule, expected) -> None:
    assert gold_answer(raw, rule) == expected


def test_local_file_like_gsm8k(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "gsm8k_test.jsonl", GSM8K_ROWS)
    problems = load_problems(str(path), like="gsm8k", shuffle=False)
    assert [p.answer for p in problems] == ["12", "2000"]
    assert [p.id for p in problems] == ["0", "1"]
    assert problems[0].question.startswith("Tom has 3 apples")
    assert problems[0].meta["dataset"] == "gsm8k"


@pytest.mark.parametrize("suffix", [".json", ".parquet", ".csv"])
def test_other_file_types(tmp_path: Path, suffix: str) -> None:
    rows = [{"problem": "1+1?", "answer": "2", "id": "a"}, {"problem": "2+2?", "answer": "4", "id": "b"}]
    path = tmp_path / f"data{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"data": rows}))
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("problem,answer,id\n1+1?,2,a\n2+2?,4,b\n")
    problems = load_problems(str(path), shuffle=False)
    assert [(p.id, p.question, p.answer) for p in problems] == [("a", "1+1?", "2"), ("b", "2+2?", "4")]


def test_missing_fields_name_the_fields_the_file_has(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "odd.jsonl", [{"text": "1+1?", "label": "2"}])
    with pytest.raises(QerlError, match="its fields are 'label', 'text'"):  # in words, not a Python list
        load_problems(str(path))
    with pytest.raises(QerlError, match="no question field 'query'"):
        load_problems(str(path), prompt_field="query", answer_field="label")
    problems = load_problems(str(path), prompt_field="text", answer_field="label")
    assert problems[0].answer == "2"


def test_missing_file_and_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(QerlError, match="not found"):
        load_problems(str(tmp_path / "absent.jsonl"))
    with pytest.raises(QerlError, match="unknown dataset 'gsm9k'"):
        load_problems("gsm9k")


def test_levels_shuffle_and_max_samples(tmp_path: Path) -> None:
    rows = [{"problem": f"q{i}", "answer": str(i), "level": f"Level {1 + i % 5}"} for i in range(50)]
    path = write_jsonl(tmp_path / "math.jsonl", rows)
    hard = load_problems(str(path), levels=[4, 5], shuffle=False)
    assert {p.meta["level"] for p in hard} == {4, 5} and len(hard) == 20
    a = load_problems(str(path), seed=1, max_samples=10)
    b = load_problems(str(path), seed=1, max_samples=10)
    c = load_problems(str(path), seed=2, max_samples=10)
    assert [p.id for p in a] == [p.id for p in b] != [p.id for p in c]
    assert len(a) == 10
    no_levels = write_jsonl(tmp_path / "flat.jsonl", [{"problem": "q", "answer": "1"}])
    with pytest.raises(QerlError, match="no difficulty level"):
        load_problems(str(no_levels), levels=[3])


def test_bigmath_levels_come_from_the_solve_rate(monkeypatch) -> None:
    rows = [
        {"problem": "easy", "answer": "1", "llama8b_solve_rate": 0.95},
        {"problem": "mid", "answer": "2", "llama8b_solve_rate": 0.5},
        {"problem": "hard", "answer": "3", "llama8b_solve_rate": 0.1},
        {"problem": "unrated", "answer": "4", "llama8b_solve_rate": None},
    ]
    calls = []

    def fake_load(hub_id, config=None, split=None):
        calls.append((hub_id, config, split))
        return FakeHubDataset(rows)

    monkeypatch.setattr("datasets.load_dataset", fake_load)
    problems = load_problems("bigmath", levels=[3, 4, 5], shuffle=False)
    assert [p.question for p in problems] == ["mid", "hard"]
    assert calls == [("SynthLabsAI/Big-Math-RL-Verified", None, "train")]
    assert [solve_rate_level(r) for r in (1.0, 0.7, 0.5, 0.3, 0.2, 0.0)] == [1, 2, 3, 4, 5, 5]


def test_bigmath_openr1_picks_the_level_config(monkeypatch) -> None:
    calls = []

    def fake_load(hub_id, config=None, split=None):
        calls.append((hub_id, config, split))
        return FakeHubDataset([{"prompt": "p", "solution": "\\boxed{7}"}])

    monkeypatch.setattr("datasets.load_dataset", fake_load)
    (problem,) = load_problems("bigmath-openr1", levels=[5, 3, 4])
    assert calls == [("open-r1/Big-Math-RL-Verified-Processed", "level_3_4_5", "train")]
    assert problem.answer == "7"


def test_hub_mirror_fallback_and_offline_error(monkeypatch) -> None:
    def fake_load(hub_id, config=None, split=None):
        if hub_id == "math-ai/aime25":
            raise ConnectionError("no route to host")
        return FakeHubDataset([{"problem": "AIME?", "answer": "033", "id": "2025-I-1"}])

    monkeypatch.setattr("datasets.load_dataset", fake_load)
    (problem,) = load_benchmark("aime25")
    assert (problem.id, problem.answer, problem.meta["source"]) == ("2025-I-1", "033", "yentinglin/aime_2025")

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr("datasets.load_dataset", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(QerlError, match="--data-file") as err:
        load_benchmark("amc23")
    assert "math-ai/amc23" in str(err.value) and "offline" in str(err.value)


def test_benchmarks_from_files_and_custom_names(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS)
    problems = load_benchmark("gsm8k", data_file=str(path), max_problems=1)
    assert [p.answer for p in problems] == ["12"]
    custom = write_jsonl(tmp_path / "mine.jsonl", [{"question": "1+2?", "answer": "3"}])
    assert load_benchmark("mine", data_file=str(custom))[0].answer == "3"
    with pytest.raises(QerlError, match="--data-file mine=PATH"):
        load_benchmark("mine")


def test_synthetic_names_are_delegated() -> None:
    problems = load_problems("synthetic-addition", split="test", max_samples=5, seed=3)
    again = load_problems("synthetic-addition", split="test", max_samples=5, seed=3)
    assert len(problems) == 5 and problems == again
    assert all(p.answer.lstrip("-").isdigit() for p in problems)


def test_synthetic_benchmarks_use_the_held_out_split() -> None:
    problems = load_benchmark("synthetic-addition", max_problems=4)
    assert len(problems) == 4 and all(p.id.startswith("addition-test-") for p in problems)


def test_an_eval_data_file_with_other_fields_says_rename_not_a_key_eval_lacks(tmp_path: Path) -> None:
    """`qerl eval M --benchmarks gsm8k --data-file gsm8k=mine.jsonl` (rows {"q", "a"}) said "--set
    data.prompt_field=...", which qerl eval refuses (a recipe key): it names the fields to rename to."""
    data = write_jsonl(tmp_path / "mine.jsonl", [{"q": "1+1", "a": "2"}])
    with pytest.raises(QerlError) as err:
        load_benchmark("gsm8k", data_file=str(data))
    assert "has none of the question fields 'question'; its fields are 'a', 'q'" in str(err.value)
    assert "--data-file gsm8k=PATH with gsm8k's field names" in str(err.value)
    assert "data.prompt_field" not in str(err.value)
    with pytest.raises(QerlError, match="gsm8k's field names"):  # the checks before work say the same
        ds.check_reachable(str(data), like="gsm8k")
    assert ds.check_reachable(str(write_jsonl(tmp_path / "ok.jsonl", GSM8K_ROWS)), like="gsm8k")


def test_the_fields_check_reads_a_file_s_first_record(tmp_path: Path) -> None:
    """A .jsonl's first non-blank line; a .json's list, also under a key; a first row that is no record."""
    from qerl_cli.data.records import first_record_fields

    (tmp_path / "a.jsonl").write_text('\n{"question": "q", "answer": "a"}\n[1]\n')
    (tmp_path / "b.json").write_text(json.dumps({"rows": [{"problem": "p", "solution": "s"}]}))
    (tmp_path / "c.jsonl").write_text("[1, 2]\n")
    assert first_record_fields(tmp_path / "a.jsonl") == ["question", "answer"]
    assert first_record_fields(tmp_path / "b.json") == ["problem", "solution"]
    with pytest.raises(QerlError, match="its fields are none. Name the field"):
        ds.check_reachable(str(tmp_path / "c.jsonl"), fields=(None, None))
