"""Re-report this run's gap over each sequence's own tokens: the completions the run sampled carried the
pad tokens transformers fills a row with after its stop string (Gemma's pad, id 0, is no EOS; qerl's HF
engine now cuts there). The logprobs of the tokens before the pads do not depend on them (causal models),
so the figures over those tokens are what the fixed sampler would have measured on these sequences.

    PYTHONPATH=. python benchmarks/gemma3-270m-gap-h200-2026-11-29/retrim.py
"""

import gzip
import json
from pathlib import Path

from qerl_cli.bench.gap_report import GapReport, build_ratios, build_rows, gap_markdown

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
    results = []
    for row in report.rows:
        logprobs = trim(load(f"logprobs/{row.backend}.json.gz")["logprobs"])
        results.append({"backend": row.backend, "linear_backend": row.linear_backend, "logprobs": logprobs,
                        "load_seconds": row.load_seconds, "score_seconds": row.score_seconds})  # fmt: skip
    report.rows = build_rows(results, trainer)
    settings = report.settings
    report.ratios = build_ratios(report.rows, settings["margin"], settings["seed"])
    report.trainer = {**report.trainer, "tokens": sum(kept), "completion_tokens_max": max(kept),
                      "tokens_with_pads": report.trainer["tokens"]}  # fmt: skip
    (HERE / "gap-own-tokens.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (HERE / "gap-own-tokens.md").write_text(gap_markdown(report))
    print(gap_markdown(report))


if __name__ == "__main__":
    main()
