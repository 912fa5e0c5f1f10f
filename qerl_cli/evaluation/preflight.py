"""What `qerl eval` checks before it loads anything: the questions whose answer would otherwise come after
the model load or minutes of generating (a model or adapter folder that is not there, a benchmark whose
data cannot be reached offline, a baseline that cannot be read, an output folder that cannot be
written). ``qerl eval --dry-run`` runs exactly these and says what each found; a run makes them first.

Each check raises the QerlError that names what is wrong and what to do; :func:`preflight` returns
the engine it settled on and the checks, in order. Nothing is loaded or written here.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from qerl_cli.config import BENCHMARKS_ALL, EvalConfig, validate
from qerl_cli.data.benchmarks import benchmark_spec
from qerl_cli.data.datasets import SYNTHETIC_PREFIX, check_reachable
from qerl_cli.data.prompts import template_found
from qerl_cli.data.synthetic import make_problems
from qerl_cli.errors import Checked, QerlError, install_hint, qerl_command
from qerl_cli.evaluation.results import RESULTS_NAME, find_sample_files, read_results
from qerl_cli.files import check_input_not_replaced, check_writable_folder
from qerl_cli.modeling.adapter import base_model
from qerl_cli.modeling.adapter import check_folder as check_adapter_folder
from qerl_cli.modeling.run_layout import trained_template
from qerl_cli.modeling.source_checks import model_source_found

TRUST_HINT = "--set trust_remote_code=true"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalPlan:
    """What the checks settled, and what each found (for ``--dry-run`` to print)."""

    engine: str  # the engine ``auto`` resolved to; the caller's engine's name when one is given
    checks: list[Checked]


def preflight(cfg: EvalConfig, *, engine_given: bool = False, guard_output: bool = False) -> EvalPlan:
    """Every cheap check of ``qerl eval``, the instant ones first; loads and writes nothing.

    ``engine_given``: the caller holds an engine (tests, a stage that has the model loaded), so the
    model, the adapter (the engine syncs it) and the engine choice are its own. ``guard_output`` (the
    command, whose default output folder every evaluation shares; stages that compose evaluations keep
    their own folders): an output folder holding another evaluation is refused."""

    validate(cfg)  # the shared walk: its list settings, then EvalConfig's own checks
    template = Checked("template", template_found(cfg.template, "template") + adapter_template(cfg))
    if cfg.rescore:
        return EvalPlan("none (re-grading)", [rescored(cfg), template, *baseline(cfg), output_folder(cfg)])
    checks = [template]
    engine = cfg.engine
    if not engine_given:
        engine = resolve_engine(cfg.engine)
        checks.append(Checked("--engine", f"{cfg.engine} -> {engine}"))
        if cfg.adapter:
            found = f"{check_adapter_folder(cfg.adapter)}: a PEFT adapter folder{adapter_base(cfg)}"
            checks.append(Checked("--adapter", found))
    # The local inputs before anything that may ask the Hub (a model id, a benchmark's data set): offline,
    # a mistyped --baseline must not hide behind the Hub's error, nor a typo wait for a network probe.
    checks += [*baseline(cfg), output_folder(cfg, guard=guard_output)]
    if not engine_given:
        found = model_source_found(
            cfg.model, what="model", trust_remote_code=cfg.trust_remote_code, trust_hint=TRUST_HINT
        )
        checks.append(Checked("MODEL", found))
    checks += [
        Checked(f"benchmark {name}", benchmark(name, cfg.data_files.get(name))) for name in cfg.benchmarks
    ]
    return EvalPlan(engine, checks)


def adapter_template(cfg: EvalConfig) -> str:
    """Whether ``--adapter`` was trained with the template this evaluation prompts with: the text its check
    adds, with a warning where it was not (a model asked in another form than it learned may answer in
    none the grader reads: a tiny model trained on ``plain`` scored 0% under ``qerl``, silently)."""
    trained = trained_template(cfg.adapter) if cfg.adapter and not cfg.rescore else None
    if trained is None:
        return ""
    name, record = trained
    if name == cfg.template:
        return ", as the adapter was trained"
    log.warning(
        "the adapter %s was trained with the prompt template %s (%s) and this evaluation prompts with %s: "
        "its answers may not come in the form it learned; evaluate it as trained with --set template=%s",
        cfg.adapter, name, record, cfg.template, name,
    )  # fmt: skip
    return f"; the adapter was trained with {name} (--set template={name} evaluates it as trained)"


def adapter_base(cfg: EvalConfig) -> str:
    """Whether ``--adapter`` was trained on ``MODEL`` (the base its adapter_config.json records): the text
    its check adds, with a warning where both are folders here and differ (an adapter trained on the
    4-bit base and evaluated on its BF16 model, say, gives figures of a base it did not learn on)."""
    recorded = base_model(cfg.adapter) if cfg.adapter and cfg.model else None
    if recorded is None:
        return ""
    if not (Path(recorded).expanduser().is_dir() and Path(cfg.model).expanduser().is_dir()):
        return ""  # a hub id, an alias, or a path of another machine's folder
    if _same_model(cfg.model, recorded):
        return f", trained on {cfg.model}"
    log.warning(
        "the adapter %s was trained on %s and this evaluation loads %s: its figures are of another base than "
        "the one it learned on; evaluate it on its own with %s",
        cfg.adapter, recorded, cfg.model, qerl_command("eval", recorded, "--adapter", cfg.adapter),
    )  # fmt: skip
    return f"; trained on {recorded}, not on MODEL"


def resolve_engine(name: str) -> str:
    """``auto``: vLLM where a CUDA GPU and vLLM are present, else the HF engine (as ``qerl bench``
    chooses). ``vllm`` on a machine without either is refused at once, naming ``--engine hf``."""

    has_vllm = importlib.util.find_spec("vllm") is not None
    gpu = torch.cuda.is_available()
    if name == "auto":
        return "vllm" if has_vllm and gpu else "hf"
    if name == "vllm" and not (has_vllm and gpu):
        why = (
            "this machine has no CUDA GPU" if has_vllm else f"vLLM is not installed ({install_hint('vllm')})"
        )
        raise QerlError(f"--engine vllm: {why}; evaluate with the HF engine: --engine hf (or --engine auto)")
    return name


def benchmark(name: str, data_file: str | None) -> str:
    """Where a benchmark's problems come from, reachable now: its ``--data-file``, a synthetic task's
    held-out split, or the Hub set (in the local cache, or on a reachable Hub)."""

    if data_file:  # its first record read now: a file of other fields must not wait for the model
        spec = benchmark_spec(name)
        return check_reachable(
            data_file,
            what=f"--data-file {name}:",
            like=spec.name if spec else None,
            fields=None if spec else (None, None),
        )
    if name.startswith(SYNTHETIC_PREFIX):
        make_problems(name, split="test", n=0)  # an unknown task is refused, naming the tasks
        return "a synthetic task's held-out split, generated here"
    if benchmark_spec(name) is None:  # cfg.validate() names the choices; a data file was not given
        raise QerlError(f"benchmark '{name}' is not built in; give its file with --data-file {name}=PATH")
    return check_reachable(name, what="benchmark")


def baseline(cfg: EvalConfig) -> list[Checked]:
    """``--baseline`` read now: a missing or broken one must not wait for minutes of generating."""
    if not cfg.baseline:
        return []
    base = read_results(cfg.baseline)
    check_input_not_replaced(cfg.baseline, "--baseline", RESULTS_NAME, output_dir(cfg))
    names = ", ".join(base.benchmarks) or "none"
    return [Checked("--baseline", f"{cfg.baseline}: a results file (benchmarks: {names})")]


def rescore_selection(cfg: EvalConfig, files: dict[str, Path]) -> dict[str, Path]:
    """The saved samples ``--rescore`` re-grades: every benchmark's by default, else those named."""
    if list(cfg.benchmarks) == list(BENCHMARKS_ALL):  # the default: everything that was saved
        return files
    chosen = {b: p for b, p in files.items() if b in cfg.benchmarks}
    if not chosen:
        saved = ",".join(sorted(files))
        raise QerlError(
            f"--rescore {cfg.rescore}: no saved samples of {', '.join(cfg.benchmarks)}; it holds those of "
            f"{saved.replace(',', ', ')}: rescore them with --benchmarks {saved}, or leave --benchmarks out "
            "for all"
        )
    return chosen


def rescored(cfg: EvalConfig) -> Checked:
    files = rescore_selection(cfg, find_sample_files(str(cfg.rescore)))
    rescore_model(cfg)
    return Checked("--rescore", f"{cfg.rescore}: samples of {', '.join(files)}")


def rescore_model(cfg: EvalConfig) -> None:
    """``--rescore DIR`` re-grades the answers saved in DIR and loads no model, so a MODEL given with it
    was ignored in silence: the scores read as MODEL's were another model's. MODEL may stay only where it
    is the model DIR's results.json records as having generated them."""
    if not cfg.model:
        return
    folder = Path(str(cfg.rescore))
    old = read_results(folder) if (folder / RESULTS_NAME).is_file() else None
    # A record a rescore rebuilt from samples alone names no generating run (no created, no engine).
    recorded = old.model if old is not None and (old.created or old.engine) else None
    if recorded and _same_model(cfg.model, recorded):
        return
    command = f"`{qerl_command('eval', '--rescore', cfg.rescore)}`"
    if recorded:
        raise QerlError(
            f"MODEL {cfg.model}: --rescore re-grades the answers saved in {cfg.rescore}, generated by "
            f"{recorded}, and loads no model; drop MODEL ({command}), or give the one they came from, "
            f"{recorded}"
        )
    raise QerlError(
        f"MODEL {cfg.model}: --rescore re-grades the answers saved in {cfg.rescore}, which record no model "
        f"that generated them, and loads no model; drop MODEL ({command})"
    )


def _same_model(given: str, recorded: str) -> bool:
    """The same model, spelt alike or as the same folder (``./m`` and ``/abs/m``, ``m/``)."""
    return given == recorded or Path(given).expanduser().resolve() == Path(recorded).expanduser().resolve()


def output_dir(cfg: EvalConfig) -> Path:
    """Where the results go: ``--output``; a rescore without one writes back into the rescored folder
    (its samples files get the new grades; the completions are untouched)."""
    if cfg.rescore and cfg.output == EvalConfig().output:
        return Path(cfg.rescore)
    return Path(cfg.output)


def output_folder(cfg: EvalConfig, *, guard: bool = False) -> Checked:
    """The output folder can be written; with ``guard``, it holds no other model's or adapter's
    evaluation (:func:`check_not_another_evaluation`)."""
    out = output_dir(cfg)
    if check_writable_folder(out, "--output", "choose another with --output DIR"):
        if guard:
            check_not_another_evaluation(cfg, out)
        return Checked("--output", f"{out}: writable (results.json and the samples files replaced there)")
    return Checked("--output", f"{out}: a new folder (made when the run starts)")


def check_not_another_evaluation(cfg: EvalConfig, out: Path) -> None:
    """An output folder holding the results of another model's (or another adapter's) evaluation is
    refused: its results.json would be replaced, and its samples files of benchmarks not run again left
    beside the new ones, where a rescore grades them as this model's. Re-running the same evaluation
    replaces it."""
    if not (out / RESULTS_NAME).is_file() or not cfg.model:
        return
    try:
        old = read_results(out)
    except QerlError:
        return  # not a results file qerl reads: replaced, as before
    if old.model is None:  # rebuilt by a rescore from samples alone: no model recorded to tell
        return
    same_adapter = (old.adapter is None) == (cfg.adapter is None) and (
        cfg.adapter is None or _same_model(cfg.adapter, str(old.adapter))
    )
    if _same_model(cfg.model, old.model) and same_adapter:
        return
    other = old.model + (f" + adapter {old.adapter}" if old.adapter else "")
    raise QerlError(
        f"--output {out} holds the results of another evaluation ({other}); nothing was changed. Give "
        f"this one another folder with -o DIR (and --baseline {out / RESULTS_NAME} to compare the two), or "
        f"remove {out} to replace it"
    )
