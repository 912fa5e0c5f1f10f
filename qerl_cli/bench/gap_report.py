"""``qerl bench gap``'s figures and report: per backend, the rollout/trainer logprob gap over the same
teacher-forced sequences; for every other backend, the ratio of its gap to the reference's (the first
backend that is not ``hf``: hf's gap is the floor, ~0) with a paired interval and a verdict against
``1 + margin``.

Per sequence, its gap is the mean over its completion tokens of |engine - trainer| logprob (nats/token).
A backend's figures: the mean of those over sequences with a 95% t interval (its lower end clamped at 0:
a mean of absolute values is not negative), the token-weighted mean (all tokens pooled), the largest one
token's gap, and its engine-vs-engine gap (the same mean of |backend - reference backend|: the kernels'
numerics alone, the trainer left out). The ratio is mean gap / the reference's, a seeded paired bootstrap
over sequences (``stats.paired_ratio_interval``); the verdict is ``stats.ratio_verdict``'s, or
``undefined`` when the reference's gap is under :data:`REFERENCE_FLOOR` (float noise). Plain Python: no
torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from qerl_cli.bench.gap_settings import HF_BACKEND, reference_backend
from qerl_cli.stats import RATIO_RESAMPLES, mean, mean_interval, paired_ratio_interval, ratio_verdict

# /2: trainer.sample_temperature, sample_top_p and score_temperature; the hf row scored by the trainer
# side's own transformers engine over the live policy. /1 reports read with those fields None.
SCHEMA = "qerl-bench-gap/2"
SCORE_TEMPERATURE = 1.0  # every side scores raw log-softmax (vLLM's prompt logprobs take no temperature)
REPORT_NAME = "gap.json"
MARKDOWN_NAME = "gap.md"
# A reference gap under this (nats/token) is float noise, not a backend's numerics (hf's floor is ~1e-7 or
# exactly 0): a ratio to it would read 715204373x, so it is "undefined".
REFERENCE_FLOOR = 1e-6


@dataclass
class BackendResult:
    """One backend's measurement: its engine's logprob of every completion token of every sequence, in
    order, or the error that left it without (JSON between a worker process and the parent)."""

    backend: str
    linear_backend: str | None = None  # what the engine ran (``auto`` resolved; "trainer" for hf)
    load_seconds: float | None = None  # the engine built and the adapter synced
    score_seconds: float | None = None  # every sequence scored
    logprobs: list[list[float]] | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackendResult:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass
class TrainerFigures:
    """``gap.json``'s ``trainer`` section: the model, the sequences and what the trainer side resolved.
    Sampled at the recipe's temperature and ``top_p``; scored at ``score_temperature`` (1) everywhere."""

    model: str = ""
    base_format: str | None = None
    dtype: str | None = None
    lora: dict[str, Any] = field(default_factory=dict)  # rank, alpha, target_modules
    adapter_dir: str | None = None
    gpu_memory_utilization: float | None = None
    sequences: int = 0
    tokens: int = 0
    completion_tokens_max: int = 0
    stopped: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    sample_temperature: float | None = None  # the recipe's rollout.temperature
    sample_top_p: float | None = None
    score_temperature: float | None = SCORE_TEMPERATURE

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerFigures:
        known = {f.name for f in fields(cls)}
        figures = cls(**{k: v for k, v in data.items() if k in known})
        if "score_temperature" not in data:  # a /1 report: not recorded
            figures.score_temperature = None
        return figures


def token_gaps(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    """|a - b| per token of each sequence (the two must have the same shape)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} sequences")
    return [
        [abs(x - y) for x, y in zip(row_a, row_b, strict=True)] for row_a, row_b in zip(a, b, strict=True)
    ]


@dataclass
class BackendRow:
    """One backend's figures (nats/token), or the error that left it without."""

    backend: str
    linear_backend: str | None = None  # what the engine ran (``auto`` resolved; "trainer" for hf)
    error: str | None = None
    sequences: int = 0
    tokens: int = 0
    mean_gap: float | None = None  # mean over sequences of each sequence's mean |engine - trainer|
    mean_gap_low: float | None = None  # its 95% t interval over sequences, the lower end clamped at 0
    mean_gap_high: float | None = None
    token_weighted_gap: float | None = None  # mean over every completion token
    max_token_gap: float | None = None  # the largest one token's |engine - trainer|
    max_sequence_gap: float | None = None
    engine_gap: float | None = None  # mean over sequences of mean |this engine - the reference's|
    engine_gap_low: float | None = None
    engine_gap_high: float | None = None
    load_seconds: float | None = None  # the engine built and the adapter synced
    score_seconds: float | None = None  # every sequence scored
    sequence_gaps: list[float] = field(default_factory=list)
    sequence_engine_gaps: list[float] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackendRow:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass
class GapRatio:
    """A backend's mean gap over the reference backend's, its paired bootstrap interval and the verdict."""

    backend: str
    reference: str
    margin: float
    verdict: str  # within | outside | unresolved | undefined (the reference's gap is under REFERENCE_FLOOR)
    verdict_text: str
    ratio: float | None = None
    low: float | None = None
    high: float | None = None
    sequences_needed: int | None = None  # unresolved: about how many sequences would resolve it
    resamples: int = RATIO_RESAMPLES
    seed: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GapRatio:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass
class GapReport:
    """``gap.json``: the bench header (command, date, device, versions, host load), the settings, the
    trainer side's figures, one row per backend (in ``--backends`` order) and the ratios."""

    header: dict[str, Any]
    settings: dict[str, Any]
    trainer: TrainerFigures
    rows: list[BackendRow] = field(default_factory=list)
    ratios: list[GapRatio] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(row.error for row in self.rows)

    def to_dict(self) -> dict[str, Any]:
        rows, ratios = [asdict(r) for r in self.rows], [asdict(r) for r in self.ratios]
        return {
            **self.header,
            "settings": self.settings,
            "trainer": asdict(self.trainer),
            "rows": rows,
            "ratios": ratios,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GapReport:
        body = ("settings", "trainer", "rows", "ratios")
        return cls(
            header={k: v for k, v in data.items() if k not in body},
            settings=data["settings"],
            trainer=TrainerFigures.from_dict(data["trainer"]),
            rows=[BackendRow.from_dict(r) for r in data["rows"]],
            ratios=[GapRatio.from_dict(r) for r in data["ratios"]],
        )


def shape_mismatch(logprobs: list[list[float]], trainer: list[list[float]]) -> str | None:
    """Why a backend's logprobs cannot be set against the trainer's (None: the same shape)."""
    if len(logprobs) != len(trainer):
        return f"{len(logprobs)} sequences scored, the trainer has {len(trainer)}"
    for index, (row, reference) in enumerate(zip(logprobs, trainer, strict=True)):
        if len(row) != len(reference):
            return f"sequence {index}: {len(row)} completion logprobs, the trainer has {len(reference)}"
    return None


def backend_row(
    result: BackendResult, trainer: list[list[float]], first: list[list[float]] | None
) -> BackendRow:
    """A backend's row from its result (``logprobs`` per completion token, or ``error``) against the
    trainer's logprobs and the reference backend's (None: this is the reference, or it failed or is not
    measured yet). Logprobs of another shape than the trainer's make the row an error naming the
    mismatch. The intervals' lower ends are clamped at 0 (the t interval of a mean of |differences| near 0
    can reach below it)."""
    row = BackendRow(result.backend, result.linear_backend, result.error)
    row.load_seconds, row.score_seconds = result.load_seconds, result.score_seconds
    logprobs = result.logprobs
    if row.error is None and logprobs is None:
        row.error = "no logprobs returned"
    elif row.error is None:
        mismatch = shape_mismatch(logprobs, trainer)
        if mismatch is not None:
            row.error = f"logprobs of the wrong shape: {mismatch}"
    if row.error is not None or logprobs is None:
        return row
    gaps = token_gaps(logprobs, trainer)
    per_sequence = [mean(g) for g in gaps]
    interval = mean_interval(per_sequence)
    pooled = [x for g in gaps for x in g]
    row.sequences, row.tokens = len(gaps), len(pooled)
    row.mean_gap, row.mean_gap_low, row.mean_gap_high = interval.mean, max(0.0, interval.low), interval.high
    row.token_weighted_gap, row.max_token_gap = mean(pooled), max(pooled)
    row.max_sequence_gap, row.sequence_gaps = max(per_sequence), per_sequence
    if first is not None:
        engine = [mean(g) for g in token_gaps(logprobs, first)]
        between = mean_interval(engine)
        row.engine_gap, row.engine_gap_low = between.mean, max(0.0, between.low)
        row.engine_gap_high = between.high
        row.sequence_engine_gaps = engine
    return row


def gap_ratio(row: BackendRow, reference: BackendRow, margin: float, seed: int) -> GapRatio:
    """``row``'s gap over ``reference``'s (both measured), paired over sequences, with the verdict;
    ``undefined`` when the reference's gap is under :data:`REFERENCE_FLOOR` (0 or float noise)."""
    if not (reference.mean_gap or 0.0) >= REFERENCE_FLOOR:
        gap = _fig(reference.mean_gap)
        text = f"undefined: {reference.backend}'s gap ({gap}) is under {REFERENCE_FLOOR:g}, float noise"
        return GapRatio(row.backend, reference.backend, margin, "undefined", text, seed=seed)
    interval = paired_ratio_interval(row.sequence_gaps, reference.sequence_gaps, seed=seed)
    verdict = ratio_verdict(interval, margin)
    return GapRatio(row.backend, reference.backend, margin, verdict.verdict, verdict.text, interval.ratio,
                    interval.low, interval.high, verdict.needed, interval.resamples, seed)  # fmt: skip


def build_rows(results: list[BackendResult], trainer: list[list[float]]) -> list[BackendRow]:
    """One row per backend result, in order; the reference backend's logprobs (the first that is not
    ``hf``) are the engine-vs-engine reference when it was measured (a failed reference leaves that column
    empty)."""
    name = reference_backend([r.backend for r in results])
    reference = next((r for r in results if r.backend == name), None)
    first = None
    if reference is not None and reference.error is None and reference.logprobs is not None:
        first = reference.logprobs if shape_mismatch(reference.logprobs, trainer) is None else None
    return [backend_row(r, trainer, None if r is reference else first) for r in results]


def reference_row(rows: list[BackendRow]) -> BackendRow | None:
    """The reference's row: the first that is not ``hf`` (None: every backend is hf)."""
    name = reference_backend([row.backend for row in rows])
    return next((row for row in rows if row.backend == name), None)


def build_ratios(rows: list[BackendRow], margin: float, seed: int) -> list[GapRatio]:
    """Every other measured backend against the reference (none when the reference failed or is none)."""
    reference = reference_row(rows)
    if reference is None or reference.error is not None:
        return []
    return [gap_ratio(row, reference, margin, seed) for row in rows if row is not reference and not row.error]


def no_ratio_note(report: GapReport) -> str | None:
    """Why the report has no ratio (None: it has some): a line below gap.md's table."""
    if report.ratios:
        return None
    reference = reference_row(report.rows)
    if reference is None:
        return (
            f"No ratios: every backend is {HF_BACKEND} (the floor); name a vLLM backend too, the ratios' "
            "reference."
        )
    if reference.error is not None:
        return f"No ratios: the reference, {reference.backend}, failed."
    if len(report.rows) == 1:
        return f"No ratios: {reference.backend} alone was measured; a ratio needs a second backend."
    return f"No ratios: no backend beside the reference, {reference.backend}, was measured."


def _fig(value: float | None, kind: str = ".3g") -> str:
    """A gap to 3 significant digits (a floor of 1e-7 stays visible), a ratio (``.3f``) to 3 decimals."""
    return "-" if value is None else f"{value:{kind}}"


def _interval(value: float | None, low: float | None, high: float | None, kind: str = ".3g") -> str:
    if value is None:
        return "-"
    return f"{_fig(value, kind)} [{_fig(low, kind)}, {_fig(high, kind)}]"


def gap_markdown(report: GapReport) -> str:
    """``gap.md``: the table, with what each figure is."""
    s, t, h = report.settings, report.trainer, report.header
    reference = reference_backend(s["backends"])
    ratio_to = (
        f"Ratio: to {reference}'s gap (the first backend that is not {HF_BACKEND}), paired bootstrap over "
        f"sequences; verdict against 1 + {s['margin']}."
        if reference
        else f"Ratio: none ({HF_BACKEND}, the floor, is no reference)."
    )
    lines = [
        f"# Rollout/trainer logprob gap: {t.model}",
        "",
        f"{t.sequences} sequences ({t.tokens} completion tokens; adapter {s['adapter']}; sampled at "
        f"temperature {_fig(t.sample_temperature, 'g')}, scored at temperature "
        f"{_fig(t.score_temperature, 'g')} on every side), {h.get('device', '')}, {h.get('created', '')}. "
        "Gap: mean |engine - trainer| "
        "logprob per completion token (nats/token), teacher-forced on the same token ids; mean over "
        f"sequences with its 95% interval (lower end clamped at 0). {ratio_to}",
        "",
        "| backend | runs | gap [95% CI] | token-weighted | max token | vs reference engine | ratio to "
        "reference [95% CI] | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = {r.backend: r for r in report.ratios}
    for row in report.rows:
        if row.error is not None:
            lines.append(f"| {row.backend} | - | failed: {row.error} | | | | | |")
            continue
        ratio = ratios.get(row.backend)
        figures = [
            row.linear_backend or "-",
            _interval(row.mean_gap, row.mean_gap_low, row.mean_gap_high),
            _fig(row.token_weighted_gap),
            _fig(row.max_token_gap),
            _fig(row.engine_gap),
            _interval(ratio.ratio, ratio.low, ratio.high, ".3f")
            if ratio
            else ("(reference)" if row.backend == reference else "-"),
            ratio.verdict_text if ratio else "-",
        ]
        lines.append(f"| {row.backend} | " + " | ".join(figures) + " |")
    note = no_ratio_note(report)
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"
