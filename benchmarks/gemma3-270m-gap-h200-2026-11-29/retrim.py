"""Re-report this run's gap over each sequence's own tokens: the completions the run sampled carried the
pad tokens transformers fills a row with after its stop string (Gemma's pad, id 0, is no EOS; qerl's HF
engine now cuts there). The logprobs of the tokens before the pads do not depend on them (causal models),
so the figures over those tokens are what the fixed sampler would have measured on these sequences.

    PYTHONPATH=. python benchmarks/gemma3-270m-gap-h200-2026-11-29/retrim.py
"""

import gzip
import json
from dataclasses import replace
from pathlib import Path

from qerl_cli.bench.gap_report import (
    SCHEMA,
    SCORE_TEMPERATURE,
    BackendResult,
    GapReport,
    build_ratios,
    build_rows,
    gap_markdown,
)

HERE = Path(__file__).parent
RUN = HERE / "run"


def load(name: str):
    return json.loads(gzip.decompress((RUN / name).read_bytes()))


def own_tokens(completion_ids: list[int], pad: int) -> int:
    """How many of the completion's tokens come before its trailing pads."""
    end = len(completion_ids)
    while end and completion_ids[end - 1] == pad:
        end -= 1
    return end


def main() -> None:
    report = GapReport.from_dict(json.loads((RUN / "gap.json").read_text()))
    sequences = load("sequences.json.gz")["sequences"]
    kept = [own_tokens(s["completion_ids"], pad=0) for s in sequences]
    trim = lambda rows: [row[:n] for row, n in zip(rows, kept, strict=True)]  # noqa: E731
    trainer = trim(load("trainer_logprobs.json.gz")["trainer_logprobs"])
    results = [
        BackendResult(
            row.backend,
            row.linear_backend,
            row.load_seconds,
            row.score_seconds,
            trim(load(f"logprobs/{row.backend}.json.gz")["logprobs"]),
        )  # fmt: skip
        for row in report.rows
    ]
    report.rows = build_rows(results, trainer)
    settings = report.settings
    report.ratios = build_ratios(report.rows, settings["margin"], settings["seed"])
    # The run's sampler drew at temperature 1 with the recipe's top-p (1.0); every side scored at 1.
    report.trainer = replace(
        report.trainer, tokens=sum(kept), completion_tokens_max=max(kept), sample_temperature=1.0,
        sample_top_p=1.0, score_temperature=SCORE_TEMPERATURE,
    )  # fmt: skip
    report.header = {**report.header, "schema": SCHEMA}
    (HERE / "gap-own-tokens.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (HERE / "gap-own-tokens.md").write_text(gap_markdown(report))
    print(gap_markdown(report))


if __name__ == "__main__":
    main()
