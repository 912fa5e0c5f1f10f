"""Human-readable eval results: a rich table for the terminal, Markdown for files and CI summaries."""

from __future__ import annotations

from rich.table import Table

from qerl_cli.evaluation.results import BenchmarkMetrics, EvalResult, PairedDifference


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}"


def _pass1(m: BenchmarkMetrics) -> str:
    se = m.pass_at_1_se
    return f"{_pct(m.pass_at_1)} ± {_pct(se)}" if se is not None else _pct(m.pass_at_1)


def _top_k(m: BenchmarkMetrics) -> str:
    ks = m.pass_at_k
    if len(ks) < 2:
        return "-"
    k = max(ks, key=int)
    return f"{_pct(ks[k])} (k={k})"


def _delta(d: PairedDifference | None) -> str:
    if d is None or d.diff is None:
        return "-"
    se = d.diff_se
    sign = "+" if d.diff >= 0 else ""
    return f"{sign}{_pct(d.diff)} ± {_pct(se)}" if se is not None else f"{sign}{_pct(d.diff)}"


def _rows(results: EvalResult) -> list[list[str]]:
    comparison = results.baseline.benchmarks if results.baseline else {}
    rows = []
    for name, bench in results.benchmarks.items():
        m = bench.metrics
        row = [
            name,
            str(m.num_problems),
            str(m.samples_per_problem or "mixed"),
            _pass1(m),
            _top_k(m),
            _pct(m.truncation_rate),
            _pct(m.extraction_failure_rate),
            str(m.grader_timeouts),
            f"{m.mean_length:.0f}",
        ]
        if results.baseline:
            row.append(_delta(comparison.get(name)))
        rows.append(row)
    return rows


_HEADERS = [
    "Benchmark",
    "Problems",
    "n",
    "Pass@1 % ± SE",
    "pass@k %",
    "Truncated %",
    "No answer %",
    "Timeouts",
    "Mean tokens",
]


def _title(results: EvalResult) -> str:
    model = results.model or "?"
    adapter = results.adapter
    return f"qerl eval: {model}" + (f" + adapter {adapter}" if adapter else "")


def baseline_warnings(results: EvalResult) -> list[str]:
    """Reasons a paired comparison may compare unlike runs."""
    base = results.baseline
    if not base:
        return []
    warnings = []
    if not base.same_prompt:
        warnings.append("the baseline used a different prompt template or system prompt")
    if not base.same_sampling:
        warnings.append("the baseline used different sampling settings")
    return warnings


def eval_table(results: EvalResult) -> Table:
    """The results as a rich Table (one row per benchmark, paired Δ vs baseline when present)."""
    table = Table(title=_title(results))
    headers = _HEADERS + (["Δ vs baseline ± SE"] if results.baseline else [])
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in _rows(results):
        table.add_row(*row)
    prompt = results.prompt or {}
    sampling = results.sampling or {}
    table.caption = (
        f"template {prompt.get('name')} ({prompt.get('template_hash')}), "
        f"T={sampling.get('temperature')} top-p={sampling.get('top_p')} "
        f"max {sampling.get('max_new_tokens')} tokens, seed {sampling.get('seed')}"
    )
    for warning in baseline_warnings(results):
        table.caption += f"\n[yellow]warning: {warning}[/yellow]"
    return table


def results_markdown(results: EvalResult) -> str:
    headers = _HEADERS + (["Δ vs baseline ± SE"] if results.baseline else [])
    lines = [
        f"## {_title(results)}",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(results)]
    prompt = results.prompt or {}
    sampling = results.sampling or {}
    lines += [
        "",
        f"Prompt template `{prompt.get('name')}` (hash `{prompt.get('template_hash')}`), system prompt: "
        f"{'`' + prompt['system_prompt'] + '`' if prompt.get('system_prompt') else 'template default'}. "
        f"Sampling: temperature {sampling.get('temperature')}, top-p {sampling.get('top_p')}, "
        f"{sampling.get('max_new_tokens')} new tokens, seed {sampling.get('seed')}, "
        f"engine {results.engine}.",
        "Pass@1 is the mean over problems of correct/samples; ± is its standard error. "
        "Δ is the paired per-problem difference from the baseline.",
    ]
    if results.rescored_from:
        lines.append(f"Re-graded from `{results.rescored_from}` without generating.")
    if results.baseline:
        lines.append(f"Baseline: `{results.baseline.path}`.")
        lines += [f"**Warning:** {warning}." for warning in baseline_warnings(results)]
    return "\n".join(lines) + "\n"
