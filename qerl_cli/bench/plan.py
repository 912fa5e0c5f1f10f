"""What ``qerl bench rollout`` / ``concurrency`` / ``e2e`` will measure, checked before any work, and
roughly how long it will take: :func:`bench_plan`.

The plan resolves the engine (a GPU without vLLM is refused unless ``--engine hf``), the model, the
formats and their packages (:mod:`qerl_cli.bench.preflight`) and the output folder, and counts the
cases. ``--dry-run`` prints it; a run prints it at its start.

The estimate is rough and says so: per-token costs from the recorded runs (their figures:
``docs/bench.md``), not a measurement of this machine.

On a CPU the default model is the tiny shape on the transformers engine, whose decode steps cost as
much at 512 tokens as a GPU's: there the lengths the user did not give are ``CPU_LENGTHS``, so the
default ``qerl bench`` takes about ten seconds of an idle 2-core CPU, not minutes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qerl_cli.bench import preflight
from qerl_cli.bench.concurrency import backends_for
from qerl_cli.bench.e2e_backends import E2EPlan, e2e_pairs, refuse_named_backends
from qerl_cli.bench.gate import check_comparable
from qerl_cli.bench.models import default_model, normalize_formats
from qerl_cli.bench.progress import clock
from qerl_cli.bench.report_settings import report_settings
from qerl_cli.bench.result import REPORT_NAME, BenchResult, read_report, report_device
from qerl_cli.bench.rollout import GEN_LEN_RULE, MIN_GEN_LEN, MIN_REPEATS, WARMUP_TOKENS
from qerl_cli.bench.settings import CPU_LENGTHS, E2EConfig
from qerl_cli.config import BenchConfig, validate
from qerl_cli.errors import Checked, QerlError, install_hint
from qerl_cli.files import check_input_not_replaced

# Rough costs behind the estimate (see the module docstring).
VLLM_START_S = 90.0  # one vLLM engine start (7B shape, CUDA graphs for the measured sizes)
VLLM_STEP_S = 0.012  # one decode step of a 7B shape at small batch on a datacenter GPU (docs/bench.md)
# One decode step of the tiny shape on an idle 2-core CPU, at batch 2 and 8 on average, per format: the
# default `qerl bench --batch 2,8` (528 steps per format) took 2.85 s of bf16 and nvfp4 cases and 2.97 s
# of nf4 (decode 2-4 ms/token), plus CPU_FIXED_S for the adapter and the report (10.0 s of work, 16 s end
# to end). MXFP4 runs NVFP4's path. Beside another CPU-bound process the same run took 75 s: the estimate
# is of an idle machine, and the plan says it is not a measurement of this one.
CPU_STEP_S = {"bf16": 0.0054, "nvfp4": 0.0054, "mxfp4": 0.0054, "nf4": 0.0056}
CPU_FIXED_S = 1.4  # once a run, whatever its lengths: the random adapter, the report and its charts
CPU_MEAN_BATCH = 5.0  # the mean batch those figures are of (the default --batch 2,8)


@dataclass
class BenchPlan:
    """What a bench.json benchmark will do, resolved and checked."""

    engine: str
    model: str
    model_source: str
    formats: list[str]
    # One per engine start (vLLM) or per case (HF); e2e: one per (format, backend) pair.
    cases: list[str] = field(default_factory=list)
    measurements: int = 0  # (case, LoRA phase, batch) figures
    e2e_steps: int = 0  # GRPO steps over all (format, backend) pairs (warm-up included)
    e2e: E2EPlan | None = None  # e2e: the pairs timed, and the backends folded
    estimate_s: float | None = None
    notes: list[str] = field(default_factory=list)
    checks: list[Checked] = field(default_factory=list)  # what was checked and found, for --dry-run
    settings: dict[str, Any] = field(default_factory=dict)  # the report's (report_settings)
    baseline: BenchResult | None = None  # --baseline, read and checked to gate this run

    def lines(self) -> list[str]:
        """The plan as the run's first lines (and --dry-run's)."""
        estimate = (
            f"~{clock(self.estimate_s)} (an estimate from recorded runs, not a measurement of this machine)"
            if self.estimate_s is not None
            else "no estimate (a GRPO step's time depends on the trainer's whole setup)"
            if self.e2e_steps
            else "no estimate for this model on this engine"
        )
        items: dict[str, Any] = {
            "engine": self.engine,
            "model": self.model_source,
            "formats": ", ".join(self.formats),
            "cases": f"{len(self.cases)} ({'; '.join(self.cases)})" if self.cases else None,
            "rollout figures": self.measurements or None,
            "GRPO steps": self.e2e_steps or None,
            "time": estimate,
        }
        return ["plan:", *(f"  {line}" for line in preflight.summary(items)), *(f"  {n}" for n in self.notes)]


def apply_cpu_lengths(cfg: BenchConfig, engine: str, given: set[str]) -> list[str]:
    """The CPU's lengths for the default model on the transformers engine, where the user gave none;
    the notes that say so."""
    if engine != "hf" or cfg.model or isinstance(cfg, E2EConfig) and cfg.recipe:
        return []
    changed = {k: v for k, v in CPU_LENGTHS.items() if k not in given and getattr(cfg, k) != v}
    for key, value in changed.items():
        setattr(cfg, key, value)
    if not changed:
        return []
    said = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in changed.items())
    why = "the GPU's 256 + 512 are ten times the decode steps; give them to override"
    return [f"CPU lengths: {said} ({why})"]


def _rollout_cases(
    cfg: BenchConfig, engine: str, formats: list[str]
) -> tuple[list[str], int, dict[str, int]]:
    """(case labels, figures, decode steps per format) of the rollout cases, as bench.run builds them."""
    ranks = [0, cfg.lora_rank] if cfg.lora_rank else [0]
    batches = list(cfg.concurrency or cfg.batch)
    per_batch = cfg.warmup * (min(cfg.gen_len, WARMUP_TOKENS) + 1) + cfg.repeats * (cfg.gen_len + 1)
    labels: list[str] = []
    steps: dict[str, int] = {}
    for fmt in formats:
        if engine == "vllm":
            backends = backends_for(fmt, cfg.backends) if cfg.concurrency else ["default"]
            mine = [fmt if b in ("default", "marlin") else f"{fmt}/{b}" for b in backends]
            figures = len(mine) * len(ranks) * len(batches)  # one engine serves every LoRA rank
        else:
            mine = [f"{fmt} LoRA {rank}" if rank else fmt for rank in ranks]
            figures = len(mine) * len(batches)
        labels += mine
        steps[fmt] = figures * per_batch
    figures_total = sum(steps.values()) // per_batch
    return labels, figures_total, steps


def _estimate(
    cfg: BenchConfig, engine: str, model: str, labels: list[str], steps: dict[str, int]
) -> float | None:
    if engine == "vllm":
        return len(labels) * VLLM_START_S + sum(steps.values()) * VLLM_STEP_S
    if model.lower() != "tiny":
        return None  # a real-size model on the CPU: no recorded figure to scale
    batches = list(cfg.concurrency or cfg.batch)
    scale = 0.5 + 0.5 * (sum(batches) / len(batches)) / CPU_MEAN_BATCH  # half the cost is per sequence
    return CPU_FIXED_S + sum(n * CPU_STEP_S.get(fmt, CPU_STEP_S["nf4"]) * scale for fmt, n in steps.items())


def check_settings(cfg: BenchConfig) -> int:
    """Refuse settings that cannot give a meaningful figure; returns the fewest timed repeats allowed."""

    validate(cfg, "bench.")  # the shared walk: its list settings, then the class's own checks
    # A sweep and whole GRPO steps are long enough for one timed run each; a rollout case is not.
    min_repeats = 1 if cfg.concurrency or isinstance(cfg, E2EConfig) else MIN_REPEATS
    if cfg.repeats < min_repeats:
        allowed = "" if min_repeats == 1 else " (`qerl bench concurrency` and `e2e` allow 1)"
        raise QerlError(f"repeats (--set repeats=N) must be at least {min_repeats} so the median means "
                        f"something{allowed}")  # fmt: skip
    if cfg.lora_rank < 0:
        raise QerlError(f"--lora-rank must be >= 0 (0 skips the LoRA cases), got {cfg.lora_rank}")
    if cfg.gen_len < MIN_GEN_LEN and not isinstance(cfg, E2EConfig):  # rollout cases time the decode
        raise QerlError(f"{GEN_LEN_RULE}, got {cfg.gen_len}")
    return min_repeats


def bench_plan(
    cfg: BenchConfig, *, given: set[str] | None = None, backends_given: bool | None = None
) -> BenchPlan:
    """Resolve and check ``cfg`` (engine, packages, model, output) and count its work; with ``given``
    (the keys the user set: the CLI), the CPU's lengths fill the others on the transformers engine.
    ``backends_given``: whether the sweep's ``backends`` were named (the CLI knows; None: a library
    call, whose backends are held to their packages but not refused on the HF engine, which the CLI
    has done where the user named them).

    Raises QerlError (exit 2) for what would fail later: a GPU without vLLM (``--engine auto``), a
    format or linear backend whose package is missing, an e2e linear backend asked of the HF engine
    (which has none), an output folder that cannot be written or holds the ``--baseline`` its report
    would replace, a ``--baseline`` that cannot gate this run (other settings, another kind of machine:
    the run's and the dry run's one check), a negative ``--tolerance``."""

    check_settings(cfg)
    preflight.check_tolerance(cfg.tolerance)
    baseline = read_report(cfg.baseline) if cfg.baseline else None  # a folder, a file of another kind
    if cfg.baseline:  # a baseline in the output folder would be gated against, then written over
        check_input_not_replaced(cfg.baseline, "--baseline", REPORT_NAME, cfg.output)
    engine = preflight.resolve_engine(cfg.engine, cfg.device)
    notes = apply_cpu_lengths(cfg, engine, given) if given is not None else []
    model = cfg.model or default_model(engine)
    formats = normalize_formats(cfg.formats)
    requirements = preflight.format_requirements(engine, formats)
    e2e = e2e_pairs(cfg, engine, formats) if isinstance(cfg, E2EConfig) else None
    backends, backend_needs = (e2e.backends if e2e else cfg.backends if cfg.concurrency else []), []
    if e2e is not None:  # whole GRPO steps, no rollout cases; a backend asked for by name must run
        backend_needs = preflight.backend_requirements(engine, formats, e2e.backends)
    elif cfg.concurrency:
        if backends_given:  # a backend named must run, as e2e's --linear-backend must
            refuse_named_backends("--backends", cfg.backends, engine, "leave --backends out")
        backend_needs = preflight.backend_requirements(engine, formats, cfg.backends)
        if backend_needs and backends_given is False and any(r.missing() for r in backend_needs):
            # The default sweep measures what is installed; a backend asked for by name must run.
            cfg.backends = backends = [b for b in cfg.backends if b != "humming"]
            notes.append(f"backends: humming left out (not installed: {install_hint('humming')})")
            backend_needs = []
    preflight.check_requirements([*requirements, *backend_needs])
    preflight.check_output(cfg.output)
    found = preflight.describe_model(model, formats)
    plan = BenchPlan(engine, model, found, formats, notes=notes)
    plan.settings = report_settings(cfg, model, engine, formats, e2e)
    if baseline is not None:  # one of other settings, or of another kind of machine, cannot gate this run
        check_comparable(plan.settings, report_device(), baseline)
        plan.baseline = baseline
    plan.checks = _checks(cfg, engine, found, (formats, requirements), (backends, backend_needs))
    if e2e is None:
        plan.cases, plan.measurements, steps = _rollout_cases(cfg, engine, formats)
        plan.estimate_s = _estimate(cfg, engine, model, plan.cases, steps)
    else:
        plan.e2e, plan.cases = e2e, [pair.label for pair in e2e.pairs]
        plan.e2e_steps = len(e2e.pairs) * (cfg.warmup + cfg.repeats)
        plan.notes += e2e.notes()
        plan.estimate_s = None  # a GRPO step's time depends on the trainer's whole setup
    return plan


def _checks(
    cfg: BenchConfig, engine: str, model_found: str, *needs: tuple[list[str], list[preflight.Requirement]]
) -> list[Checked]:
    """What :func:`bench_plan` checked and found, listed by ``--dry-run`` as every stage's dry run lists
    its checks: ``needs`` are the formats and the backends with the packages each needs."""
    (formats, format_needs), (backends, backend_needs) = needs
    checks = [
        Checked("--output", f"{cfg.output}: a folder that can be written"),
        Checked("--device", preflight.device_found(cfg.device)),
        Checked("--engine", preflight.engine_found(cfg.engine, engine, cfg.device)),
        Checked("--model", model_found),
        Checked("--formats", preflight.requirements_found(formats, format_needs)),
    ]
    if backends and engine == "vllm":
        checks.append(Checked("--backends", preflight.requirements_found(backends, backend_needs)))
    if cfg.baseline:
        checks.append(Checked("--baseline", f"{cfg.baseline}: a bench.json of these settings, not the one "
                              "this run writes"))  # fmt: skip
    return checks
