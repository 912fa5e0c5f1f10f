"""The synthetic word-problem task and the shipped calibration text (offline, deterministic)."""

from __future__ import annotations

from qerl_cli.data.calib_text import BUILTIN_NAME, PARAGRAPHS, builtin_rows
from qerl_cli.data.synthetic import make_problems, reference_completion, task_names
from qerl_cli.modeling.tiny import build_tokenizer
from qerl_cli.quantize.calibration import load_calibration


def test_word_problems_are_held_out_and_deterministic() -> None:
    assert "synthetic-wordproblems" in task_names()
    train = make_problems("synthetic-wordproblems", "train")
    test = make_problems("synthetic-wordproblems", "test")
    pairs = lambda ps: {(p.meta["a"], p.meta["b"]) for p in ps}  # noqa: E731
    assert not pairs(train) & pairs(test) and len(train) + len(test) == 90 * 90
    assert make_problems("synthetic-wordproblems", "test", n=5) == test[:5]
    problem = test[0]
    assert problem.answer == str(problem.meta["a"] + problem.meta["b"])
    assert str(problem.meta["a"]) in problem.question and str(problem.meta["b"]) in problem.question
    assert reference_completion(problem).endswith(f"<answer>{problem.answer}</answer>")


def test_builtin_calibration_text_splits_calibration_and_held_out() -> None:
    rows = builtin_rows()
    assert len(rows) == len(PARAGRAPHS) + 48 and all(r["text"].strip() for r in rows)
    calib = load_calibration(
        BUILTIN_NAME, build_tokenizer(), num_samples=16, seq_len=64, seed=1, field_name="text", held_out=8
    )
    assert calib.spec["kind"] == "builtin" and len(calib.samples) == 16 and len(calib.held_out) == 8
    assert all(len(ids) <= 64 for ids in calib.samples + calib.held_out)
    assert not {tuple(s) for s in calib.samples} & {tuple(s) for s in calib.held_out}
