"""One PNG: training reward and rollout entropy per step, per arm (mean over seeds, band min..max), and,
with verdicts, each arm's held-out difference from the reference with its 95% interval (not ± SE bars:
the interval is what the verdict reads), beside the margin."""

from __future__ import annotations

import logging
from pathlib import Path

from qerl_cli.compare.curves import FINAL_FRACTION, trailing_mean, window
from qerl_cli.compare.results import ArmVerdict, RunResult
from qerl_cli.compare.verdict import verdict_cell

log = logging.getLogger(__name__)


def _stack(series: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    steps = min(len(s) for s in series)
    columns = [[s[i] for s in series] for i in range(steps)]
    return [sum(c) / len(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns]


# Matplotlib's default cycle has ten colours: an eleventh arm would repeat the first one's look.
_COLOURS = 10
_LINESTYLES = ("-", "--", ":", "-.")


def arm_styles(arms: list[str]) -> dict[str, tuple[str, str]]:
    """{arm: (colour, line style)}, distinct for up to 40 arms: the colours first, then the styles."""
    return {
        arm: (f"C{i % _COLOURS}", _LINESTYLES[(i // _COLOURS) % len(_LINESTYLES)])
        for i, arm in enumerate(arms)
    }


def plot_curves(
    results: dict[str, list[RunResult]], path: Path, device: str = "",
    verdicts: list[ArmVerdict] | None = None,
) -> Path | None:  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s (pip install matplotlib)", path.name)
        return None
    verdicts = verdicts or []
    fig, axes = plt.subplots(1, 3 if verdicts else 2, figsize=(16.5 if verdicts else 11, 4))
    styles = arm_styles(list(results))
    for key, ax, label in (("reward", axes[0], "training reward"), ("entropy", axes[1], "rollout entropy")):
        for arm, runs in results.items():
            curves = [r.reward if key == "reward" else r.entropy for r in runs]
            steps_window = window(min(len(c) for c in curves), FINAL_FRACTION)
            mean, low, high = _stack([trailing_mean(c, steps_window) for c in curves])
            steps = list(range(1, len(mean) + 1))
            colour, linestyle = styles[arm]
            ax.plot(steps, mean, color=colour, linestyle=linestyle, label=f"{arm} (n={len(runs)})")
            ax.fill_between(steps, low, high, color=colour, alpha=0.2)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{label} (trailing mean)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small" if len(results) > 6 else None)
    if verdicts:
        _plot_intervals(axes[2], verdicts, styles)
    where = f" ({device})" if device else ""
    fig.suptitle(f"mean over seeds, band: min..max over seeds{where}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_intervals(ax, verdicts: list[ArmVerdict], styles: dict[str, tuple[str, str]]) -> None:
    """One row per arm: the difference from the reference (points) and its 95% interval, with 0 and
    -margin drawn; an arm without an interval (under 2 seeds, or no scatter) is named with its verdict."""
    margin, reference = verdicts[0].margin, verdicts[0].reference
    for row, v in enumerate(verdicts):
        colour = styles.get(v.arm, ("C0", "-"))[0]
        if v.difference is None or v.low is None or v.high is None:
            ax.text(v.difference or 0, row, verdict_cell(v), ha="center", va="center", fontsize="small")
            continue
        ax.errorbar([v.difference], [row], xerr=[[v.difference - v.low], [v.high - v.difference]], fmt="o",
                    color=colour, capsize=4)  # fmt: skip
        ax.annotate(verdict_cell(v), (v.difference, row), textcoords="offset points", xytext=(0, 7),
                    ha="center", fontsize="small")  # fmt: skip
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.axvline(-margin, color="grey", linestyle="--", linewidth=0.8, label=f"-margin ({margin:g})")
    ax.set_yticks(range(len(verdicts)), [v.arm for v in verdicts], fontsize="small")
    ax.set_ylim(len(verdicts) - 0.5, -0.5)  # the first arm on top, room above each for its verdict
    ax.set_xlabel("held-out pass@1 difference (points), 95% interval")
    ax.set_title(f"vs {reference}, margin {margin:g} points", fontsize="medium")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, axis="x")
