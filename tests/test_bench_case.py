"""One bench case (an engine, measured at every batch size): what it builds once for all its batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from qerl_cli.bench import engines, rollout


def test_one_prompt_maker_serves_every_batch_of_a_case(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its pool round-trips thousands of tokens through the tokenizer and depends on nothing a batch
    changes: it was built again for every batch."""
    made: list[rollout.PromptMaker] = []
    build = rollout.PromptMaker.__init__

    def counted(self: rollout.PromptMaker, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        build(self, *args, **kwargs)

    monkeypatch.setattr(rollout.PromptMaker, "__init__", counted)
    settings = {"prompt_len": 4, "gen_len": 2, "warmup": 0, "repeats": 1, "min_repeats": 1}
    case = engines.Case(
        engine="hf",
        format="bf16",
        model_dir=str(tiny_model_dir),
        batches=[1, 2, 3],
        settings=settings,
        device="cpu",
    )
    result = engines.measure_case(case)
    assert [row["batch"] for row in result["rollout"]] == [1, 2, 3]
    assert len(made) == 1
