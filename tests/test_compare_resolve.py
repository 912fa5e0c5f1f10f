"""What an unresolved verdict says would resolve it: the half-width that resolves it at the observed
difference, the seeds for that, and the wording once the interval is already no wider than the margin."""

from __future__ import annotations

import pytest
from test_compare_verdict import _run

from qerl_cli import stats
from qerl_cli.compare.results import ArmVerdict, CompareReport
from qerl_cli.compare.verdict import (
    arm_verdicts,
    decide,
    planning_lines,
    resolving_half_width,
    verdict_cell,
    verdict_line,
)


@pytest.mark.parametrize(
    ("difference", "half_width"),
    [
        (-1.9, 3.1),  # low > -5 needs hw < 5 - 1.9 = 3.1; high < 0 needs hw < 1.9: the easier, 3.1
        (-2.5, 2.5),  # -M/2, the hardest: 5 - 2.5 = 2.5 = 2.5
        (-4.0, 4.0),  # 5 - 4 = 1, or 4 to show it worse: 4
        (1.0, 6.0),  # above 0: low > -5 needs hw < 6 (better would need hw < 1)
    ],
)
def test_the_resolving_half_width_of_hand_worked_differences(difference: float, half_width: float) -> None:
    assert resolving_half_width(difference, 5.0) == pytest.approx(half_width)


@pytest.mark.parametrize(
    ("difference", "narrower"),
    [(-1.0, "not worse"), (-2.5, "not worse"), (-4.0, "worse"), (1.0, "not worse")],
)
def test_an_interval_of_exactly_the_resolving_half_width_stays_unresolved(
    difference: float, narrower: str
) -> None:
    """The edges belong to the weaker verdict: at the half-width the interval reaches -5 or 0 (d = -1:
    [-5, 3]; d = -2.5: [-5, 0], both; d = -4: [-8, 0]; d = 1: [-5, 7]); a hair narrower resolves it."""
    hw = resolving_half_width(difference, 5.0)
    assert decide(difference - hw, difference + hw, 5.0) == "unresolved"
    hw -= 0.01
    assert decide(difference - hw, difference + hw, 5.0) == narrower


# 28 seeds a side, pass@1 in points: the reference 40 + 1.14 x offsets (SD 8.45), the arm 38.14 +
# 1.1628 x the offsets reversed (SD 8.62), so -1.9 [-6.4, +2.7]: inside ±5 and still holding -5.
OFFSETS = [(-1) ** i * (4 + i % 7) for i in range(28)]
REFERENCE = [40.0 + 1.14 * o for o in OFFSETS]
ARM = [38.14 + 1.14 * 1.02 * o for o in reversed(OFFSETS)]


def test_an_interval_inside_the_margin_says_what_would_resolve_it_at_the_observed_difference() -> None:
    """At this scatter ±5 takes 24 seeds per arm, fewer than the 28 run: "24 seeds would narrow it to
    ±5" would be nonsense. At d = -1.86 the interval resolves only narrower than ±(5 - 1.86) = ±3.14:
    t(df 116.0) = 1.9806 x sqrt((8.62^2 + 8.45^2) / 59) = 3.113 < 3.14 at 59 seeds; at 58, t(df 114.0) =
    1.9810 x sqrt(145.74 / 58) = 3.1403, just over."""
    results = {
        "bf16-lora": [_run("bf16-lora", s, p / 100) for s, p in enumerate(REFERENCE)],
        "nvfp4-lora": [_run("nvfp4-lora", s, p / 100) for s, p in enumerate(ARM)],
    }
    (verdict,) = arm_verdicts(results, "bf16-lora", 5.0)
    assert verdict.verdict == "unresolved" and verdict.seeds_needed == 24
    resolving = resolving_half_width(verdict.difference, 5.0)
    assert resolving == pytest.approx(3.14)
    assert (
        verdict.seeds_to_resolve
        == 59
        == stats.seeds_for_half_width(stats.sd(ARM), stats.sd(REFERENCE), resolving, strict=True)
    )
    assert verdict_line(verdict) == (
        "nvfp4-lora vs bf16-lora: -1.9 points, 95% interval [-6.4, +2.7] (Welch, df 54.0; 28 vs 28 seeds), "
        "permutation p = 0.414 (Monte Carlo, 20000 draws): unresolved at a 5-point margin; at ±4.6 points it "
        "still holds -5, and ≈ 59 seeds per arm at this scatter would resolve it if the difference stayed at "
        "-1.9 points"
    )
    assert verdict_cell(verdict) == "unresolved (≈59 seeds/arm at a -1.9 difference)"
    assert planning_lines([verdict])[-1] == (
        "- nvfp4-lora: the interval is already within ±5 (now 28 vs 28); resolving it if the difference "
        "stayed at -1.9 points (an interval narrower than ±3.1) takes ≈ 59 per arm at the scatter seen"
    )
    assert verdict.to_dict()["seeds_to_resolve"] == 59  # compare.json carries it


def _unresolved(difference: float, low: float, high: float, needed: int | None, to_resolve: int | None,
                margin: float = 5.0) -> ArmVerdict:  # fmt: skip
    return ArmVerdict(
        arm="nvfp4-lora", reference="bf16-lora", margin=margin, verdict="unresolved", seeds=[0, 1, 2],
        reference_seeds=[0, 1, 2], difference=difference, low=low, high=high, df=4.0, p_value=0.5,
        p_exact=True, p_relabelings=20, seeds_needed=needed, seeds_needed_assured=None,
        seeds_to_resolve=to_resolve,
    )  # fmt: skip


HEAD = (
    "nvfp4-lora vs bf16-lora: {d} points, 95% interval [{low}, {high}] (Welch, df 4.0; 3 vs 3 seeds), "
    "permutation p = 0.500 (exact, 20 relabelings): unresolved at a 5-point margin; "
)


@pytest.mark.parametrize(
    ("verdict", "tail", "cell"),
    [
        # d exactly -M/2: the interval holds both ends, and neither is nearer.
        (_unresolved(-2.5, -6.5, 1.5, 4, 40), "at ±4.0 points it still holds -5 and 0, and ≈ 40 seeds per "
         "arm at this scatter would resolve it if the difference stayed at -2.5 points",
         "≈40 seeds/arm at a -2.5 difference"),
        # Below -M/2 the nearer verdict is worse: 0 stands in its way.
        (_unresolved(-4.0, -8.5, 0.5, 4, None), "at ±4.5 points it still holds 0, and more than 10000 seeds "
         "per arm at this scatter would be needed to resolve it if the difference stayed at -4.0 points",
         ">10000 seeds/arm at a -4.0 difference"),
        # Wider than ±5: the ±5 count, and the observed difference's after it where larger.
        (_unresolved(-1.5, -8.5, 5.5, 15, 29), "15 seeds per arm at this scatter would narrow it to ±5 "
         "points, and ≈ 29 would resolve it if the difference stayed at -1.5 points",
         "15 seeds/arm for ±5, ≈29 at a -1.5 difference"),
        (_unresolved(-1.5, -8.5, 5.5, 9000, None), "9000 seeds per arm at this scatter would narrow it to ±5 "
         "points, and more than 10000 would be needed to resolve it if the difference stayed at -1.5 points",
         "9000 seeds/arm for ±5, >10000 at a -1.5 difference"),
        # -6.8 [-13.9, +0.4]: ±5 resolves it (as worse) before ±6.8 is needed, so only the ±5 count.
        (_unresolved(-6.8, -13.9, 0.4, 9, 6), "9 seeds per arm at this scatter would narrow it to ±5 points",
         "9 seeds/arm for ±5"),
        (_unresolved(-6.8, -13.9, 0.4, None, None), "more than 10000 seeds per arm at this scatter to narrow "
         "it to ±5", ">10000 seeds/arm for ±5"),
    ],
)  # fmt: skip
def test_the_unresolved_wording_of_each_case(verdict: ArmVerdict, tail: str, cell: str) -> None:
    d, low, high = (f"{x:+.1f}" for x in (verdict.difference, verdict.low, verdict.high))
    assert verdict_line(verdict) == HEAD.format(d=d, low=low, high=high) + tail
    assert verdict_cell(verdict) == f"unresolved ({cell})"


def test_a_compare_json_written_before_the_count_still_loads() -> None:
    old = _unresolved(-1.5, -8.5, 5.5, 15, None).to_dict()
    del old["seeds_to_resolve"]
    report = {"recipe": "r.yaml", "output": "cmp", "threshold": 0.5, "arms": [], "reference": "bf16-lora",
              "margin": 5.0, "verdicts": [old]}  # fmt: skip
    (verdict,) = CompareReport.from_dict(report).verdicts
    assert verdict.seeds_to_resolve is None and verdict.seeds_needed == 15
