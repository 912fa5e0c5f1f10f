"""``qerl bench rollout``, ``concurrency`` and ``e2e``: :func:`run_bench` measures every case the
config asks for and writes ``bench.json``, ``bench.md`` and the charts.

Every ratio in a report comes from measurements of one run, side by side, on one machine.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from qerl_cli.bench import models
from qerl_cli.bench.adapter import write_random_lora
from qerl_cli.bench.ballast import memory_cap
from qerl_cli.bench.charts import write_charts
from qerl_cli.bench.concurrency import add_roofline, backends_for, measured_model, write_crossover
from qerl_cli.bench.e2e import run_e2e
from qerl_cli.bench.engines import Case, run_case
from qerl_cli.bench.gate import check_regressions
from qerl_cli.bench.gpusampler import take_case_clocks
from qerl_cli.bench.models import cache_root, model_config
from qerl_cli.bench.plan import bench_plan, check_settings
from qerl_cli.bench.progress import Progress
from qerl_cli.bench.report import add_speedups, write_markdown
from qerl_cli.bench.report_settings import rollout_vllm_kwargs
from qerl_cli.bench.result import BenchFiles, BenchResult, BenchTimings, new_report, write_json
from qerl_cli.bench.settings import E2EConfig
from qerl_cli.config import BenchConfig
from qerl_cli.errors import QerlError

log = logging.getLogger(__name__)


def _cases(cfg: BenchConfig, engine: str, fmt: str, folder: Path, ranks: list[int], lora_dir: Any,
           settings: dict[str, Any]) -> list[Any]:  # fmt: skip
    """vLLM: one engine per format (and linear backend, with --concurrency) serves every rank in turn
    (an engine start is 1-3 minutes); HF: one case per rank (a plain model, then one with LoRA)."""

    def case(rank: int, phases: list[int], backend: str = "marlin") -> Case:
        return Case(
            engine=engine, format=fmt, model_dir=str(folder), lora_rank=rank,
            lora_dir=str(lora_dir) if rank else None, batches=list(cfg.concurrency or cfg.batch),
            settings=settings, gpu_memory_utilization=cfg.gpu_memory_utilization,
            vllm_kwargs=rollout_vllm_kwargs(cfg) if engine == "vllm" else dict(cfg.vllm_kwargs),
            lora_phases=phases, linear_backend=backend, device=cfg.device,
        )  # fmt: skip

    if engine == "vllm":
        backends = backends_for(fmt, cfg.backends) if cfg.concurrency else ["marlin"]
        return [case(max(ranks), ranks, backend) for backend in backends]
    return [case(rank, []) for rank in ranks]


def _case_priority(case: Any) -> int:
    """Each format on its default kernels first, then the 4-bit alternatives, then BF16's (a sweep cut
    short keeps the comparisons that matter most)."""
    if case.linear_backend in ("default", "marlin"):
        return 0
    return 2 if case.format == "bf16" else 1


def _measure_rollouts(cfg: BenchConfig, engine: str, checkpoints: dict[str, Path], report: BenchResult,
                      timings: BenchTimings, settings: dict[str, Any], out: Path,
                      started: float) -> None:  # fmt: skip
    """Every rollout case (format x linear backend, with and without LoRA), default kernels first; the
    report (and the crossover table) is rewritten after each, so a run cut short keeps what it measured."""

    model = _measured_model(report, checkpoints)
    ranks = [0, cfg.lora_rank] if cfg.lora_rank else [0]
    (cache_root() / "bench").mkdir(parents=True, exist_ok=True)
    # The adapter depends on the shape only; it lives beside the cache, not in the uploaded output.
    with tempfile.TemporaryDirectory(prefix="lora-", dir=cache_root() / "bench") as lora_tmp:
        lora_dir = (
            write_random_lora(next(iter(checkpoints.values())), lora_tmp, cfg.lora_rank, seed=cfg.seed)
            if cfg.lora_rank
            else None
        )
        cases = [c for fmt, folder in checkpoints.items()
                 for c in _cases(cfg, engine, fmt, folder, ranks, lora_dir, settings)]  # fmt: skip
        ordered = sorted(cases, key=_case_priority)
        progress = Progress("bench", len(ordered), started=started)
        for case in ordered:
            fmt = case.format
            label = fmt if case.linear_backend in ("default", "marlin") else f"{fmt}/{case.linear_backend}"
            case_label = f"{label}, LoRA {'/'.join(map(str, case.phases()))}, batches {case.batches}"
            case_started = time.perf_counter()
            progress.start(case_label)
            outcome = "done"
            try:
                result = run_case(case, isolate=engine == "vllm")
            except (QerlError, RuntimeError) as exc:
                if engine != "vllm":
                    raise
                # One format vLLM cannot serve here must not hide the others' figures.
                report.errors += [
                    {"format": fmt, "backend": case.linear_backend, "lora_rank": r, "error": str(exc)}
                    for r in case.phases()
                ]
                outcome = f"failed ({str(exc)[:200]})"
            else:
                take_case_clocks(result, report.host_load)  # the case's clocks under load
                report.rollout.extend(result["rollout"])
                report.memory.extend(result["memory"])
            spent = time.perf_counter() - case_started
            timings.formats_s[label] = timings.formats_s.get(label, 0.0) + spent
            progress.finish(case_label, outcome)
            write_json(dataclasses.replace(report, complete=False), out)
            if cfg.concurrency and engine == "vllm":
                write_crossover(report, out, model)


def _measured_model(report: BenchResult, checkpoints: dict[str, Path]) -> Any:
    """The model the crossover table's entries name (its label and size), None without a readable config."""

    if not checkpoints:
        return None
    try:
        config = model_config(next(iter(checkpoints.values())))
    except (OSError, ValueError):
        return None
    return measured_model(report.settings.get("model"), config)


def _write_outputs(
    cfg: BenchConfig, engine: str, report: BenchResult, out: Path, checkpoints: dict[str, Path]
) -> None:
    written = BenchFiles(json=str(write_json(report, out)))
    written.markdown = str(write_markdown(report, out))
    written.charts = [str(p) for p in write_charts(report, out)]
    if cfg.concurrency and engine == "vllm":  # the table is of vLLM's linear backends
        written.crossover = str(write_crossover(report, out, _measured_model(report, checkpoints)))
    report.files = written
    write_json(report, out, sample=False)  # again, now listing the files


def run_bench(cfg: BenchConfig, command: str | None = None) -> BenchResult:
    """Measure every format (with and without LoRA; whole GRPO steps per (format, linear backend) pair
    for an ``E2EConfig``), write ``bench.json``, ``bench.md`` and PNG charts to ``cfg.output``, and
    return the report; ``command`` is recorded in it (the command line).

    With ``cfg.baseline`` the report's ``regression`` section says whether throughput dropped or
    memory rose beyond ``cfg.tolerance``; :func:`gate_failures` returns the failures (the CLI
    exits 1 when there are any). Mistakes (unknown format, bad baseline) raise ``QerlError``.
    """

    min_repeats = check_settings(cfg)
    # Every package, the engine, the output folder and the baseline (a bench.json of these settings, on
    # this kind of machine): checked before the first checkpoint is written, as the dry run checks them.
    plan = bench_plan(cfg)
    engine, model, formats, baseline = plan.engine, plan.model, plan.formats, plan.baseline
    started = time.perf_counter()
    report = new_report(plan.settings, command)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    Progress("bench", 0, started=started).say(f"preparing the {', '.join(formats)} checkpoints of {model}")
    checkpoints = models.prepare_checkpoints(model, formats, cfg.seed)
    # Where the time goes, for a CI budget: writing random checkpoints (once per machine), each format
    # (its engine start and cases), the e2e steps.
    timings = BenchTimings(checkpoints_s=time.perf_counter() - started)
    settings = {"prompt_len": cfg.prompt_len, "gen_len": cfg.gen_len, "warmup": cfg.warmup,
                "repeats": cfg.repeats, "seed": cfg.seed, "min_repeats": min_repeats}  # fmt: skip
    with memory_cap(cfg.memory_cap_gib):
        if not isinstance(cfg, E2EConfig):
            _measure_rollouts(cfg, engine, checkpoints, report, timings, settings, out, started)
        else:
            assert plan.e2e is not None  # bench_plan plans the pairs of an E2EConfig
            e2e_started = time.perf_counter()
            after_pair = report.host_load.sample if report.host_load else None
            report.e2e = run_e2e(cfg, plan.e2e.pairs, checkpoints, engine, out, after_pair, report.host_load)
            timings.e2e_s = time.perf_counter() - e2e_started
    timings.total_s = time.perf_counter() - started
    report.timings = timings
    add_speedups(report)
    add_roofline(report, {fmt: model_config(folder) for fmt, folder in checkpoints.items()})
    if baseline is not None:
        try:
            report.regression = check_regressions(report, baseline, cfg.tolerance)
        except QerlError as exc:  # the figures measured are kept, whatever the gate makes of them
            _write_outputs(cfg, engine, report, out, checkpoints)
            raise QerlError(f"{exc} (this run's figures are in {out / 'bench.json'})") from None
    _write_outputs(cfg, engine, report, out, checkpoints)
    return report
