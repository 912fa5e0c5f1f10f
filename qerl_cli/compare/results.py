"""What ``qerl compare`` keeps and returns, typed: each run's ``result.json``, each base's
``heldout.json``, the report (``compare.json``) and :class:`CompareResult`.

The files are read by other tools and kept in committed benchmarks, so ``to_dict`` writes exactly
their keys, in their order; ``from_dict`` also reads the files of earlier qerl versions (and the
smaller ones tests write), which lack some keys.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from qerl_cli.evaluation.results import RESULTS_NAME, read_results

log = logging.getLogger(__name__)

# The held-out engine of every evaluation made before runs recorded it (compare always evaluated on hf).
HELDOUT_ENGINE_BEFORE = "hf"


@dataclass
class HeldoutScore:
    """pass@1 (with its standard error) on the held-out split, from ``qerl eval``."""

    benchmark: str | None
    pass_at_1: float
    pass_at_1_se: float | None
    problems: int | None
    samples: int | None
    # The engine that generated its answers (compare.heldout_engine). None: written before it was recorded,
    # when the held-out evaluation always ran on hf (HELDOUT_ENGINE_BEFORE).
    engine: str | None = None

    def to_dict(self) -> dict[str, Any]:
        engine = {} if self.engine is None else {"engine": self.engine}  # an older file's layout, as it was
        return {"benchmark": self.benchmark, "pass@1": self.pass_at_1, "pass@1_se": self.pass_at_1_se,
                "problems": self.problems, "samples": self.samples, **engine}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeldoutScore:
        return cls(data.get("benchmark"), data["pass@1"], data.get("pass@1_se"), data.get("problems"),
                   data.get("samples"), data.get("engine"))  # fmt: skip

    @property
    def engine_used(self) -> str:
        """The engine of its answers, an unrecorded one being the hf engine of its time."""
        return self.engine or HELDOUT_ENGINE_BEFORE

    def rescored(self, eval_folder: Path) -> HeldoutScore:
        """This score, or the one ``qerl eval --rescore`` wrote since into the evaluation's folder (its
        ``results.json`` with ``rescored`` set): a report shows the grades of the newest grading."""

        path = eval_folder / RESULTS_NAME
        results = read_results(path) if path.is_file() else None
        if results is None or not results.rescored:
            return self
        score = results.benchmarks.get(self.benchmark or "")
        if score is None:
            log.warning("%s was re-graded but holds no %s: the run's own figures are reported", path,
                        self.benchmark)  # fmt: skip
            return self
        return replace(self, pass_at_1=score.metrics.pass_at_1, pass_at_1_se=score.metrics.pass_at_1_se)


@dataclass
class RunResult:
    """One finished (arm, seed) run: ``DIR/<arm>/seed-<s>/result.json``, written last."""

    arm: str
    seed: int
    reward: list[float]  # per step, the mean training reward
    entropy: list[float]  # per step, the rollout entropy
    heldout: HeldoutScore
    model: str | None = None  # the base it trained on
    aqn: bool | None = None
    device: str | None = None  # None: written before result.json recorded it
    gpus: int | None = None  # GPUs the run's process saw (0: CPU); None: not recorded
    # The `qerl compare` invocation that trained it ("20261128T103000Z-1a2b3c"): runs of one folder made
    # at different times (a seed range added later) tell apart. None: not recorded.
    invocation: str | None = None
    steps: int | None = None
    resumed_from: str | None = None
    # Per step, the share of groups whose rewards were all equal (no GRPO signal from them).
    zero_std_group_fraction: list[float] = field(default_factory=list)
    seconds: float | None = None
    # Per step, the mean |trainer - rollout| logprob of the trained tokens (rollout_logprob_gap, nats/token):
    # how far the rollout kernels' numerics sit from the trainer's. Empty: an older result.
    logprob_gap: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "seed": self.seed,
            "model": self.model,
            "aqn": self.aqn,
            "device": self.device,
            "gpus": self.gpus,
            "invocation": self.invocation,
            "steps": self.steps,
            "resumed_from": self.resumed_from,
            "reward": list(self.reward),
            "entropy": list(self.entropy),
            "zero_std_group_fraction": list(self.zero_std_group_fraction),
            "heldout": self.heldout.to_dict(),
            "seconds": self.seconds,
            "logprob_gap": list(self.logprob_gap),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunResult:
        return cls(
            arm=data["arm"],
            seed=data["seed"],
            reward=list(data["reward"]),
            entropy=list(data["entropy"]),
            heldout=HeldoutScore.from_dict(data["heldout"]),
            model=data.get("model"),
            aqn=data.get("aqn"),
            device=data.get("device"),
            gpus=data.get("gpus"),
            invocation=data.get("invocation"),
            steps=data.get("steps"),
            resumed_from=data.get("resumed_from"),
            zero_std_group_fraction=list(data.get("zero_std_group_fraction") or []),  # older results lack it
            seconds=data.get("seconds"),
            logprob_gap=list(data.get("logprob_gap") or []),  # older results lack it
        )


@dataclass
class BaseHeldout:
    """An untrained base's held-out figures and entropy (``DIR/base-heldout/<base>/heldout.json``)."""

    model: str
    device: str | None
    heldout: HeldoutScore
    # base_entropy's figures (compare.entropy.rollout_entropy, with the prompts and samples used)
    entropy: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # what the figures depend on

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "device": self.device, **self.heldout.to_dict(), "entropy": self.entropy,
                "settings": self.settings}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BaseHeldout:
        return cls(data["model"], data.get("device"), HeldoutScore.from_dict(data),
                   dict(data.get("entropy") or {}), dict(data.get("settings") or {}))  # fmt: skip


@dataclass
class ArmRow:
    """One arm of the table, over its seeds (see ``compare.summary`` for how each figure is made)."""

    arm: str
    base: str | None  # the base's format and method, e.g. "nvfp4 AWQ"
    seeds: int
    steps: int
    final_reward: float | None
    final_reward_sd: float | None
    base_heldout_accuracy: float | None
    base_heldout_se: float | None
    base_entropy: float | None
    heldout_accuracy: float | None
    heldout_se: float | None
    heldout_per_seed: list[float]
    heldout_seeds: list[int] | None  # the seeds of heldout_per_seed, in its order; None in older reports
    steps_to_threshold: float | None
    reached_threshold: str  # "k/n": seeds that reached it
    early_entropy: float | None
    early_entropy_sd: float | None
    start_reward: float | None
    start_no_spread_fraction: float | None
    # The mean rollout/trainer logprob gap of the arm's runs (nats/token) and its sd over seeds; None in
    # older reports and for runs without the figure.
    logprob_gap: float | None = None
    logprob_gap_sd: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _ARM_KEYS}  # the field names are the file's keys

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ArmRow:
        # Columns added since (base, base_entropy, start_*) are None in older reports.
        return cls(**{name: data.get(name) for name in _ARM_KEYS})


_ARM_KEYS = tuple(f.name for f in fields(ArmRow))


@dataclass
class SeedCurve:
    seed: int
    reward: list[float]
    entropy: list[float]


@dataclass
class ArmVerdict:
    """One arm against the reference (``compare.json``'s ``verdicts``). Figures are in points."""

    arm: str
    reference: str
    margin: float
    verdict: str  # one of VERDICTS, or NEEDS_SEEDS (compare.verdict says how each is decided)
    seeds: list[int]  # the arm's seeds compared
    reference_seeds: list[int]
    difference: float | None = None  # mean(arm) - mean(reference)
    low: float | None = None  # its 95% interval (Welch); None also when no arm's seeds scattered
    high: float | None = None
    df: float | None = None  # Welch-Satterthwaite
    p_value: float | None = None  # two-sided permutation test
    p_exact: bool | None = None  # every relabeling enumerated, else Monte Carlo
    p_relabelings: int | None = None  # relabelings enumerated or drawn
    seeds_needed: int | None = None  # unresolved: seeds per arm for an interval of ± the margin
    # unresolved: the same, with the scatter at its one-sided 80% upper bound (its SDs are estimates)
    seeds_needed_assured: int | None = None
    # unresolved: seeds per arm at which an interval at this scatter would resolve it were the difference to
    # stay where it is (compare.verdict.resolving_half_width); None: more than the search's limit, or a
    # report written before it was recorded
    seeds_to_resolve: int | None = None
    devices: list[str] = field(default_factory=list)  # of the arm's and the reference's runs
    invocations: list[str] = field(default_factory=list)  # the compare invocations that made them
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ArmVerdict:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


VERDICTS = ("better", "not worse", "worse", "unresolved")
NEEDS_SEEDS = "needs ≥2 seeds"  # the verdict of an arm or reference of fewer seeds


@dataclass
class CompareReport:
    """The ablation's report (``compare.json``; ``compare.md`` and the table render it)."""

    recipe: str
    output: str
    threshold: float  # the reward 'steps to threshold' counts to
    arms: list[ArmRow]
    base_method: str | None  # how the 4-bit bases made here were quantized
    warnings: list[str]
    overrides: dict[str, dict[str, Any]]  # each arm's config overrides
    skipped_finished_runs: int
    devices: list[str]
    curves: dict[str, list[SeedCurve]]
    plot: str | None = None
    reference: str | None = None  # the arm the verdicts compare with; None: no verdicts
    margin: float | None = None  # the verdicts' margin, in points of held-out pass@1
    verdicts: list[ArmVerdict] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "output": self.output,
            "threshold": self.threshold,
            "arms": [row.to_dict() for row in self.arms],
            "base_method": self.base_method,
            "warnings": list(self.warnings),
            "overrides": self.overrides,
            "skipped_finished_runs": self.skipped_finished_runs,
            "devices": list(self.devices),
            "curves": {
                arm: [{"seed": c.seed, "reward": c.reward, "entropy": c.entropy} for c in curves]
                for arm, curves in self.curves.items()
            },  # fmt: skip
            "plot": self.plot,
            "reference": self.reference,
            "margin": self.margin,
            "verdicts": [v.to_dict() for v in self.verdicts],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompareReport:
        return cls(
            recipe=data["recipe"],
            output=data["output"],
            threshold=data["threshold"],
            arms=[ArmRow.from_dict(row) for row in data["arms"]],
            base_method=data.get("base_method"),
            warnings=list(data.get("warnings") or []),
            overrides=dict(data.get("overrides") or {}),
            skipped_finished_runs=data.get("skipped_finished_runs", 0),
            devices=list(data.get("devices") or []),
            curves={
                arm: [SeedCurve(c["seed"], c["reward"], c["entropy"]) for c in curves]
                for arm, curves in (data.get("curves") or {}).items()
            },  # fmt: skip
            plot=data.get("plot"),
            reference=data.get("reference"),
            margin=data.get("margin"),
            verdicts=[ArmVerdict.from_dict(v) for v in data.get("verdicts") or []],
        )


@dataclass
class CompareResult:
    """What :func:`~qerl_cli.compare.runner.run_compare` did: the runs planned and trained, and the
    report (None with ``summarize`` off)."""

    output: str
    runs: int  # runs of the plan (arms x seeds, or --only's)
    ran: int  # those not finished before this invocation
    report: CompareReport | None = None
