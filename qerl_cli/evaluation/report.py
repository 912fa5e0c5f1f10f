"""Human-readable eval results: a rich table for the terminal, Markdown for files and CI summaries."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}"


def _pass1(m: dict[str, Any]) -> str:
    se = m.get("pass@1_se")
    return f"{_pct(m['pass@1'])} ± {_pct(se)}" if se is not None else _pct(m["pass@1"])


def _top_k(m: dict[str, Any]) -> str:
    ks = m.get("pass@k") or {}
    if len(ks) < 2:
        return "-"
    k = max(ks, key=int)
    return f"{_pct(ks[k])} (k={k})"


def _delta(d: dict[str, Any] | None) -> str:
    if not d or d.get("diff") is None:
        return "-"
    se = d.get("diff_se")
    sign = "+" if d["diff"] >= 0 else ""
    return f"{sign}{_pct(d['diff'])} ± {_pct(se)}" if se is not None else f"{sign}{_pct(d['diff'])}"


def _rows(results: dict[str, Any]) -> list[list[str]]:
    comparison = (results.get("baseline") or {}).get("benchmarks", {})
    rows = []
    for name, bench in results["benchmarks"].items():
        m = bench["metrics"]
        row = [
            name,
            str(m["num_problems"]),
            str(m.get("samples_per_problem") or "mixed"),
            _pass1(m),
            _top_k(m),
            _pct(m["truncation_rate"]),
            _pct(m["extraction_failure_rate"]),
            str(m["grader_timeouts"]),
            f"{m['mean_length']:.0f}",
        ]
        if results.get("baseline"):
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


def _title(results: dict[str, Any]) -> str:
    model = results.get("model") or "?"
    adapter = results.get("adapter")
    return f"qerl eval: {model}" + (f" + adapter {adapter}" if adapter else "")


def baseline_warnings(results: dict[str, Any]) -> list[str]:
    """Reasons a paired comparison may compare unlike runs."""
    base = results.get("baseline")
    if not base:
        return []
    warnings = []
    if not base.get("same_prompt"):
        warnings.append("the baseline used a different prompt template or system prompt")
    if not base.get("same_sampling"):
        warnings.append("the baseline used different sampling settings")
    return warnings


def eval_table(results: dict[str, Any]) -> Table:
    """The results as a rich Table (one row per benchmark, paired Δ vs baseline when present)."""
    table = Table(title=_title(results))
    headers = _HEADERS + (["Δ vs baseline ± SE"] if results.get("baseline") else [])
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in _rows(results):
        table.add_row(*row)
    prompt = results.get("prompt") or {}
    sampling = results.get("sampling") or {}
    table.caption = (
        f"template {prompt.get('name')} ({prompt.get('template_hash')}), "
        f"T={sampling.get('temperature')} top-p={sampling.get('top_p')} "
        f"max {sampling.get('max_new_tokens')} tokens, seed {sampling.get('seed')}"
    )
    for warning in baseline_warnings(results):
        table.caption += f"\n[yellow]warning: {warning}[/yellow]"
    return table


def results_markdown(results: dict[str, Any]) -> str:
    headers = _HEADERS + (["Δ vs baseline ± SE"] if results.get("baseline") else [])
    lines = [
        f"## {_title(results)}",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(results)]
    prompt = results.get("prompt") or {}
    sampling = results.get("sampling") or {}
    lines += [
        "",
        f"Prompt template `{prompt.get('name')}` (hash `{prompt.get('template_hash')}`), system prompt: "
        f"{'`' + prompt['system_prompt'] + '`' if prompt.get('system_prompt') else 'template default'}. "
        f"Sampling: temperature {sampling.get('temperature')}, top-p {sampling.get('top_p')}, "
        f"{sampling.get('max_new_tokens')} new tokens, seed {sampling.get('seed')}, "
        f"engine {results.get('engine')}.",
        "Pass@1 is the mean over problems of correct/samples; ± is its standard error. "
        "Δ is the paired per-problem difference from the baseline.",
    ]
    if results.get("rescored_from"):
        lines.append(f"Re-graded from `{results['rescored_from']}` without generating.")
    if results.get("baseline"):
        lines.append(f"Baseline: `{results['baseline']['path']}`.")
        lines += [f"**Warning:** {warning}." for warning in baseline_warnings(results)]
    return "\n".join(lines) + "\n"
