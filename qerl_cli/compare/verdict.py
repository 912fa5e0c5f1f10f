"""Learning verdicts: each arm's held-out pass@1 against a reference arm's, over seeds, in points.

For every arm but the reference, from the per-seed held-out pass@1 of both (in points, 100 x pass@1):

- the difference of the means, arm - reference, with its 95% interval by Welch's t (Welch-Satterthwaite
  degrees of freedom; :func:`qerl_cli.stats.welch_interval`);
- beside it, a two-sided permutation test's p-value (exact over every relabeling of the pooled seeds
  when there are at most 20000, else 20000 seeded random ones; :func:`qerl_cli.stats.permutation_test`);
- a verdict against the margin M (``compare.margin``, ``--margin``, 5 points by default), fixed before
  the runs. With the interval [low, high], the first that holds:

  1. ``better``: low > 0;
  2. ``not worse``: low > -M (not worse by more than M points; this includes an interval wholly in
     (-M, 0): a loss shown to be smaller than the margin);
  3. ``worse``: high < 0;
  4. ``unresolved``: otherwise (the interval holds both -M and 0).

  The edges belong to the weaker verdict: low = 0 is not ``better``, low = -M is not ``not worse``,
  high = 0 is not ``worse``.
- for ``unresolved``, the seeds per arm the observed scatter would need: the least n at which the
  interval, at both arms' standard deviations over seeds, is no wider than ±M
  (:func:`qerl_cli.stats.seeds_for_half_width`; docs/defaults.md's "seeds per arm for ±5"). Such an
  interval resolves a difference above 0 (not worse) or below -M (worse); one between the two needs a
  narrower one: an interval about a difference d resolves it only when narrower than ±max(M + d, -d)
  (:func:`resolving_half_width`), so the seeds at which it would, were the difference to stay at d, are
  counted too (``seeds_to_resolve``). While the interval is wider than ±M the line gives the ±M count,
  and the observed-difference count after it where that is larger; once it is no wider than ±M (the
  seeds run have reached the ±M count), only the latter, with the end (-M or 0) the interval still holds.

An arm or a reference of fewer than 2 seeds gets no interval: its verdict says it needs 2 seeds. Arms
whose seeds each scored alike (no scatter in either, as two seeds of a small held-out set often do) get
none either: Welch's interval is then zero wide, which says only that the seeds did not vary, not that
the difference is known, so the verdict is ``unresolved`` at the seeds run, with that reason and no
interval or seed count (:func:`no_scatter`).
Runs of an arm and its reference made on different GPUs (or CPUs) get a note in the verdict and a
warning; runs from several ``qerl compare`` invocations on the same machine kind are noted only, and so
are runs whose held-out evaluations ran on different engines (``compare.heldout_engine``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

from qerl_cli.compare.results import NEEDS_SEEDS, ArmVerdict, RunResult
from qerl_cli.errors import QerlError
from qerl_cli.stats import (
    PERMUTATION_DRAWS,
    permutation_test,
    sd,
    seeds_for_half_width,
    seeds_with_assurance,
    welch_interval,
)

DEFAULT_REFERENCE = "bf16-lora"
CONFIDENCE = 0.95
# The seeds to plan for: the scatter's SDs are estimates, and sized on them an interval comes out at the
# margin about half the time; at their 80% upper bound, about four times in five.
ASSURANCE = 0.8
_SEED_LIMIT = 10000  # seeds_needed searched up to
# How a verdict line names the seeds it counts (the line's first count; a second one after it omits it).
_UNIT = "seeds per arm at this scatter "
UNRECORDED = "unrecorded"  # a run written before result.json recorded its device or invocation


def decide(low: float, high: float, margin: float) -> str:
    """The verdict of an interval [low, high] of arm - reference (points) at a margin (points, > 0)."""
    if low > 0:
        return "better"
    if low > -margin:
        return "not worse"
    if high < 0:
        return "worse"
    return "unresolved"


def resolving_half_width(difference: float, margin: float) -> float:
    """The half-width an interval about ``difference`` (points) must stay under to be resolved at
    ``margin``: low = d - hw > -M (not worse, or better) needs hw < M + d, high = d + hw < 0 (worse) needs
    hw < -d, and the easier of the two is max(M + d, -d), M + d for d >= 0. It is least, M / 2, at
    d = -M / 2, the hardest difference to resolve. Strictly under: at exactly this half-width the interval
    reaches -M or 0, and the edges belong to the weaker verdict (:func:`decide`)."""
    return max(margin + difference, -difference)


def verdict_words(verdict: str, margin: float) -> str:
    """How a verdict reads in a sentence."""
    return {
        "better": "better",
        "not worse": f"not worse by more than {margin:g} points",
        "worse": "worse",
        "unresolved": f"unresolved at a {margin:g}-point margin",
    }.get(verdict, verdict)


def p_method(v: ArmVerdict) -> str:
    """How the permutation p was had: "exact, 20 relabelings" or "Monte Carlo, 20000 draws"."""
    if v.p_exact is None:
        return ""
    if v.p_exact:
        return f"exact, {v.p_relabelings} relabelings"
    return f"Monte Carlo, {v.p_relabelings} draws"


def within_margin(v: ArmVerdict) -> bool:
    """Whether an unresolved verdict's interval is already no wider than ± the margin: more seeds would
    not narrow it to ±M, only past the narrower half-width that resolves it at the observed difference."""
    return v.low is not None and v.high is not None and (v.high - v.low) / 2 <= v.margin


def resolving_count_is_larger(v: ArmVerdict) -> bool:
    """Whether the seeds to resolve an unresolved verdict at the observed difference exceed the ±M count
    (None: more than the search's limit)."""
    if v.seeds_needed is None:
        return False  # the ±M count is already past the limit: no larger figure to add
    return v.seeds_to_resolve is None or v.seeds_to_resolve > v.seeds_needed


def _count(seeds: int | None) -> str:
    """A resolving count as the cell shows it: "≈62", or ">10000" past the search's limit."""
    return f"≈{seeds}" if seeds else f">{_SEED_LIMIT}"


def no_scatter(v: ArmVerdict) -> bool:
    """Whether an unresolved verdict is one of arms whose seeds all scored alike: a difference, and no
    interval (a zero-wide one would claim the difference known)."""
    return v.verdict == "unresolved" and v.difference is not None and v.low is None


def verdict_cell(v: ArmVerdict) -> str:
    """The table's verdict cell."""
    if v.verdict != "unresolved":
        return v.verdict
    if no_scatter(v):
        return f"unresolved at {_seed_counts(v)} seeds (no scatter)"
    at = f"at a {v.difference:+.1f} difference"
    if within_margin(v):
        return f"unresolved ({_count(v.seeds_to_resolve)} seeds/arm {at})"
    needed = v.seeds_needed or f">{_SEED_LIMIT}"
    later = f", {_count(v.seeds_to_resolve)} {at}" if resolving_count_is_larger(v) else ""
    return f"unresolved ({needed} seeds/arm for ±{v.margin:g}{later})"


def _seed_counts(v: ArmVerdict) -> str:
    """The seeds of a verdict: "3", or "3 vs 2" where the arm's and the reference's differ."""
    n, ref = len(v.seeds), len(v.reference_seeds)
    return f"{n}" if n == ref else f"{n} vs {ref}"


def interval_cell(v: ArmVerdict) -> str:
    """The table's difference cell: "+1.2 [-8.3, +10.7]"."""
    if no_scatter(v):
        return f"{v.difference:+.1f} [no interval]"
    if v.difference is None or v.low is None or v.high is None:
        return "-"
    return f"{v.difference:+.1f} [{v.low:+.1f}, {v.high:+.1f}]"


def verdict_line(v: ArmVerdict) -> str:
    """The verdict as a sentence (compare.md, the log)."""
    head = f"{v.arm} vs {v.reference}"
    if v.verdict == NEEDS_SEEDS:
        text = (
            f"{head}: no verdict, {len(v.seeds)} seed(s) against {len(v.reference_seeds)}; an "
            "interval needs ≥2 seeds in both arms (run the same command with --seeds 2 or more)"
        )
    elif no_scatter(v):
        text = (
            f"{head}: {v.difference:+.1f} points, unresolved at {len(v.seeds)} vs {len(v.reference_seeds)} "
            "seeds: every seed of both arms scored the same, so Welch's interval would be zero wide, "
            "which shows the seeds did not vary, not that the difference is known; run more seeds (and, "
            "where pass@1 moves in coarse steps, more held-out problems), then compare again"
        )
    else:
        text = (
            f"{head}: {v.difference:+.1f} points, 95% interval [{v.low:+.1f}, {v.high:+.1f}] "
            f"(Welch, df {v.df:.1f}; {len(v.seeds)} vs {len(v.reference_seeds)} seeds), "
            f"permutation p = {v.p_value:.3f} ({p_method(v)}): "
            f"{verdict_words(v.verdict, v.margin)}"
        )
        if v.verdict == "unresolved":
            text += f"; {_seeds_words(v)}"
    return text + "".join(f" ({note})" for note in v.notes)


def _held_end(v: ArmVerdict) -> str:
    """The end an unresolved interval still holds that stands between it and the nearer verdict: -M for
    a difference above -M/2 (not worse is nearer), 0 below it (worse is), both at -M/2."""
    m = f"-{v.margin:g}"
    if v.difference > -v.margin / 2:  # type: ignore[operator]  # an unresolved verdict has its difference
        return m
    return "0" if v.difference < -v.margin / 2 else f"{m} and 0"  # type: ignore[operator]


def _resolve_words(v: ArmVerdict, unit: str) -> str:
    """How many seeds (``unit``: "seeds per arm at this scatter", or "" after a count that said it) would
    resolve an unresolved verdict were the difference to stay put."""
    stayed = f"if the difference stayed at {v.difference:+.1f} points"
    if v.seeds_to_resolve:
        return f"≈ {v.seeds_to_resolve} {unit}would resolve it {stayed}"
    return f"more than {_SEED_LIMIT} {unit}would be needed to resolve it {stayed}"


def _seeds_words(v: ArmVerdict) -> str:
    """What the verdict line says of the seeds an unresolved verdict wants: the ±M planning count while
    the interval is wider (with the observed-difference count where larger); once it is no wider, how
    wide it is, the end it still holds and the observed-difference count."""
    if within_margin(v):
        half = (v.high - v.low) / 2  # type: ignore[operator]  # within_margin: both ends are there
        return f"at ±{half:.1f} points it still holds {_held_end(v)}, and {_resolve_words(v, _UNIT)}"
    narrow = (
        f"{v.seeds_needed} seeds per arm at this scatter would narrow it to ±{v.margin:g} points"
        if v.seeds_needed
        else f"more than {_SEED_LIMIT} seeds per arm at this scatter to narrow it to ±{v.margin:g}"
    )
    return f"{narrow}, and {_resolve_words(v, '')}" if resolving_count_is_larger(v) else narrow


def arm_verdicts(
    results: Mapping[str, Sequence[RunResult]], reference: str, margin: float
) -> list[ArmVerdict]:
    """A verdict for every arm of ``results`` but ``reference`` (none of whose runs may have finished:
    then every arm needs its seeds)."""
    ref_runs = list(results.get(reference, []))
    return [_verdict(arm, list(runs), reference, ref_runs, margin) for arm, runs in results.items()
            if arm != reference]  # fmt: skip


def _points(runs: list[RunResult]) -> list[float]:
    return [100.0 * r.heldout.pass_at_1 for r in runs]


def _verdict(
    arm: str, runs: list[RunResult], reference: str, ref_runs: list[RunResult], margin: float
) -> ArmVerdict:
    both = [*runs, *ref_runs]
    devices = sorted({r.device or UNRECORDED for r in both})
    invocations = sorted({r.invocation or UNRECORDED for r in both})
    verdict = ArmVerdict(
        arm=arm, reference=reference, margin=margin, verdict=NEEDS_SEEDS, seeds=[r.seed for r in runs],
        reference_seeds=[r.seed for r in ref_runs], devices=devices, invocations=invocations,
        notes=[*provenance_notes(devices, invocations), *engine_notes(both)],
    )  # fmt: skip
    if len(runs) < 2 or len(ref_runs) < 2:
        return verdict
    a, b = _points(runs), _points(ref_runs)
    interval = welch_interval(a, b, CONFIDENCE)
    test = permutation_test(a, b, draws=PERMUTATION_DRAWS, seed=0)
    verdict.difference, verdict.low, verdict.high, verdict.df = (
        interval.difference, interval.low, interval.high, interval.df,
    )  # fmt: skip
    verdict.p_value, verdict.p_exact, verdict.p_relabelings = test.p_value, test.exact, test.relabelings
    if interval.se == 0:  # no scatter in either arm: a zero-wide interval is no verdict (no_scatter)
        verdict.verdict, verdict.low, verdict.high, verdict.df = "unresolved", None, None, None
        return verdict
    verdict.verdict = decide(interval.low, interval.high, margin)
    if verdict.verdict == "unresolved":
        sd_a, sd_b = sd(a) or 0.0, sd(b) or 0.0
        verdict.seeds_needed = seeds_for_half_width(sd_a, sd_b, margin, CONFIDENCE, _SEED_LIMIT)
        verdict.seeds_needed_assured = seeds_with_assurance(
            sd_a, len(a), sd_b, len(b), margin, CONFIDENCE, ASSURANCE, _SEED_LIMIT
        )
        # Strictly narrower: an interval reaching -M or 0 stays unresolved.
        resolving = resolving_half_width(interval.difference, margin)
        verdict.seeds_to_resolve = seeds_for_half_width(
            sd_a, sd_b, resolving, CONFIDENCE, _SEED_LIMIT, strict=True
        )
    return verdict


def provenance_notes(devices: list[str], invocations: list[str]) -> list[str]:
    """What a verdict line says of where and when its runs were made: several machine kinds (a
    warning too, :func:`verdict_warnings`), several invocations (fine, noted)."""
    notes = []
    if len(devices) > 1:
        notes.append(f"mixed machines: {', '.join(devices)}")
    if len(invocations) > 1:
        notes.append(f"runs from {len(invocations)} invocations")
    return notes


def engine_notes(runs: Sequence[RunResult]) -> list[str]:
    """A note when the runs' held-out answers came from different engines (compare.heldout_engine changed
    between the invocations that made them): each engine's kernels score a little differently, and that
    enters the difference. A run that did not record its engine was evaluated on hf, as all were then."""
    counts = Counter(r.heldout.engine_used for r in runs)
    if len(counts) < 2:
        return []
    parts = [f"{engine} ({n} run{'s' if n != 1 else ''})" for engine, n in sorted(counts.items())]
    return [f"held-out evaluated on {', '.join(parts[:-1])} and {parts[-1]}"]


def verdict_warnings(verdicts: list[ArmVerdict]) -> list[str]:
    """One warning per arm compared on runs from different machine kinds: scatter between machines (their
    kernels, their vLLM) enters the difference."""
    return [
        f"{v.arm} vs {v.reference} mixes runs made on {', '.join(v.devices)}: the difference may hold the "
        "machines' own; compare runs of one machine kind (another --output) to be sure"
        for v in verdicts
        if len(v.devices) > 1
    ]


def check_margin(margin: float) -> float:
    """The margin in points, refused unless finite and > 0."""
    if not (math.isfinite(margin) and margin > 0):
        raise QerlError(
            f"the verdicts' margin must be a positive number of points (5: not worse by more than 5 "
            f"points of held-out pass@1), got {margin}: set compare.margin or --margin"
        )
    return float(margin)


def verdict_cells(arm: str, verdicts: list[ArmVerdict], reference: str | None) -> list[str]:
    """The table's two verdict cells of ``arm``: the difference with its interval, and the verdict."""
    if arm == reference:
        return ["reference", "-"]
    found = next((v for v in verdicts if v.arm == arm), None)
    return [interval_cell(found), verdict_cell(found)] if found else ["-", "-"]


def verdict_headers(reference: str | None) -> list[str]:
    return [f"vs {reference or 'reference'}, points [95% CI]", "verdict"]


def verdict_section(verdicts: list[ArmVerdict], reference: str | None, margin: float | None) -> list[str]:
    """compare.md's verdicts: how they are made, then one line per arm."""
    if reference is None:
        return [
            "## Verdicts",
            "",
            f"None: no reference arm ({DEFAULT_REFERENCE} is not among the arms; name one with --reference "
            "or compare.reference).",
        ]
    m = f"{margin:g}"
    return [
        "## Verdicts",
        "",
        f"Held-out pass@1 of each arm minus {reference}'s, in points, over seeds: the difference of the "
        "means with its 95% interval (Welch's t, Welch-Satterthwaite df), and a two-sided permutation test's "
        f"p. Margin {m} points, fixed before the runs: better (the interval's lower end > 0), else not "
        f"worse by more than {m} points (lower end > -{m}), else worse (upper end < 0), else unresolved, "
        f"with the seeds per arm at which an interval at this scatter is no wider than ±{m} points. An "
        f"interval about a difference d between -{m} and 0 resolves the verdict only when narrower than "
        f"±max({m} + d, -d): where that takes more seeds than ±{m}, their count at the observed d is given "
        "too. Arms whose seeds all scored alike get no interval (a zero-wide one would claim the "
        "difference known): unresolved at the seeds run.",
        "",
        *(f"- {verdict_line(v)}" for v in verdicts),
        *planning_lines(verdicts),
    ]


def planning_lines(verdicts: list[ArmVerdict]) -> list[str]:
    """compare.md's advice on the seeds to run for each unresolved verdict: the SDs are estimates from the
    seeds run, so it gives the count at their 80% upper bound beside the point estimate, and the count
    that would resolve it at the observed difference where that is larger (or the interval is already
    within the margin)."""
    lines = [line for v in verdicts if v.verdict == "unresolved" and (line := _plan_line(v))]
    if not lines:
        return []
    intro = (
        "Seeds to plan for: the standard deviations over seeds are themselves estimates, and an interval "
        "planned on them reaches the margin only about half the time."
    )
    if any(
        v.verdict == "unresolved" and (within_margin(v) or resolving_count_is_larger(v)) for v in verdicts
    ):
        intro += " A count at the observed difference assumes, too, that the difference stays where it is."
    return ["", intro, "", *lines]


def _plan_line(v: ArmVerdict) -> str | None:
    """One unresolved verdict's planning line; None when there is no count to plan for (past the limit)."""
    now = f"now {len(v.seeds)} vs {len(v.reference_seeds)}"
    resolving = resolving_half_width(v.difference, v.margin)  # type: ignore[arg-type]  # unresolved: set
    count = f"≈ {v.seeds_to_resolve}" if v.seeds_to_resolve else f"more than {_SEED_LIMIT}"
    resolve = (
        f"resolving it if the difference stayed at {v.difference:+.1f} points (an interval narrower than "
        f"±{resolving:.1f}) takes {count} per arm at the scatter seen"
    )
    if within_margin(v):
        return f"- {v.arm}: the interval is already within ±{v.margin:g} ({now}); {resolve}"
    if not (v.seeds_needed and v.seeds_needed_assured):
        return None
    line = (
        f"- {v.arm}: {v.seeds_needed} seeds per arm at the scatter seen, {v.seeds_needed_assured} at its "
        f"{ASSURANCE:.0%} upper bound (run --seeds {v.seeds_needed_assured} to reach ±{v.margin:g} about "
        f"{ASSURANCE:.0%} of the time; {now})"
    )
    return f"{line}; {resolve}" if resolving_count_is_larger(v) else line
