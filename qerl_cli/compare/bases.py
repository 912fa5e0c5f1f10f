"""The bases of an ablation: the 4-bit counterparts of the recipe's BF16 model, and what each arm's is.

``compare.base_method`` (or an arm's ``base.method``) says how they are made (AWQ by default, GPTQ or RTN),
``base.dequantized`` asks for a dense BF16 copy of one; each is made once under ``DIR/bases/`` and shared
by every run, and :func:`base_labels` names format and method for the report.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from qerl_cli.compare.arms import BaseChoice, base_choice
from qerl_cli.compare.base_identity import base_path
from qerl_cli.compare.base_record import check_made_base
from qerl_cli.compare.results import RunResult
from qerl_cli.compare.runs import RESULT_NAME, run_dir
from qerl_cli.compare.settings import DEFAULT_BASE_METHOD
from qerl_cli.config import QuantizeConfig, TrainConfig, apply_overrides, from_dict
from qerl_cli.data import calib_text
from qerl_cli.errors import QerlError, install_hint
from qerl_cli.files import is_complete_folder, write_folder_once
from qerl_cli.modeling.adapter import check_folder
from qerl_cli.modeling.error_init import init_folder
from qerl_cli.modeling.loading import detect_format, read_config
from qerl_cli.modeling.sources import converted_folder, gguf_source, resolve_model_source
from qerl_cli.quantize import run_quantize
from qerl_cli.quantize.native import DEQUANTIZED_RECORD, write_dequantized_checkpoint, write_rtn_checkpoint
from qerl_cli.quantize.report import REPORT_NAME
from qerl_cli.rl.preflight import model_source as check_model_path
from qerl_cli.torch_utils import free_accelerator_memory

log = logging.getLogger(__name__)
INIT_NAMES = {"eora": "EoRA", "svd": "SVD"}  # lora.init values as the report names them


def prepare_bases(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], sets: list[str], out: Path,
    method: str = DEFAULT_BASE_METHOD,
) -> dict[str, str]:  # fmt: skip
    """{arm: base folder} for every arm without its own model.path: the recipe's model where the arm asks
    for its format (or ``auto``), else its 4-bit counterpart (quantized once with the arm's
    ``base.method`` or ``method``), or that base's dense BF16 copy for a ``base.dequantized`` arm."""

    # The recipe's model as it is (model.format auto): the arms' model.format name the bases made from it.
    probe = from_dict(TrainConfig, apply_overrides(copy.deepcopy(data), [*sets, "model.format=auto"], None))
    source = probe.model.path
    if not source:
        raise QerlError("the recipe has no model.path: set it or pass --set model.path=...")
    check_model_path(probe)  # a folder not there is named as one, with how to make it
    folder = resolve_model_source(source)
    own = detect_format(read_config(Path(folder)))
    bases: dict[str, str] = {}
    checked: set[Path] = set()
    for arm, overrides in arms.items():
        if "model.path" in overrides:
            continue
        choice = _arm_base(arm, overrides, method, source, own)
        if choice.format in ("auto", own):
            base, made_with = folder, None  # the recipe's own model
            if "base.method" in overrides and own != "bf16":
                log.warning("arm %s: base.method is unused: the recipe's model %s is %s already", arm, source,
                            own)  # fmt: skip
        else:  # made from the BF16 recipe model (_arm_base refused it from a 4-bit one)
            init = _lora_init_of(arms, choice, method)
            if (target := _base_folder(out, choice, init)) not in checked:  # once per base, not per arm
                checked.add(target)
                on = _arms_on(arms, choice, method)
                check_made_base(target, folder, choice, init, probe.lora.rank, out, on)
            base = _quantized_base(folder, out, choice, probe.train.device, init, probe.lora.rank)
            made_with = choice.method
        if choice.dequantized:
            name = Path(base).name if made_with else f"{own}-recipe"
            target = out / "bases" / f"{name}-dequantized"
            if not is_complete_folder(target):
                log.info("%s: a dense BF16 copy of %s's dequantized weights into %s", arm, base, target)
            bases[arm] = str(write_dequantized_checkpoint(base, target, made_with))
        else:
            bases[arm] = base
    return bases


def check_base_formats(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], sets: list[str], method: str = DEFAULT_BASE_METHOD,
    out: Path | None = None,
) -> tuple[dict[str, str], bool]:  # fmt: skip
    """What :func:`prepare_bases` refuses, before any work and without loading or converting anything: an
    arm asking for a format the recipe's model folder is not, while that model is not BF16 (4-bit bases
    are made from a BF16 one), and a base made before under ``out/bases`` from another model or with other
    settings (:func:`~qerl_cli.compare.base_record.check_made_base`). A hub id, a GGUF file or an alias is
    BF16 once converted. Returns what each arm will train on, in words (``--dry-run`` says it), and whether
    any base is made from the recipe's model."""
    conf = from_dict(TrainConfig, apply_overrides(copy.deepcopy(data), list(sets), None))
    source = conf.model.path
    folder = Path(source).expanduser()
    own = detect_format(read_config(folder)) if (folder / "config.json").is_file() else "bf16"
    plan = {}
    checked: set[Path] = set()
    any_made = False
    for arm, overrides in arms.items():
        if "model.path" in overrides:
            base_choice(overrides, method, where=f"arm {arm}")  # its base settings are still read
            plan[arm] = f"its own model.path {overrides['model.path']}"
            continue
        choice = _arm_base(arm, overrides, method, source, own)
        made = choice.format not in ("auto", own)
        any_made = any_made or made
        if made and out is not None:
            init = _lora_init_of(arms, choice, method)
            if (target := _base_folder(out, choice, init)) not in checked:  # once per base, not per arm
                checked.add(target)
                check_made_base(target, _source_folder(source), choice, init, conf.lora.rank, out,
                                _arms_on(arms, choice, method))  # fmt: skip
        plan[arm] = f"{choice.label()}, made once from model.path" if made else "the recipe's model"
        if choice.dequantized:
            plan[arm] = f"a dense BF16 copy of {plan[arm]}"
    return plan, any_made


def _arm_base(arm: str, overrides: dict[str, Any], method: str, source: str, own: str) -> BaseChoice:
    """The base an arm without its own model.path asks for, refused where it cannot be had: a format the
    recipe's model (``own``) is not, while that model is not BF16 (4-bit bases are made from a BF16 one).
    The one rule :func:`prepare_bases` and :func:`check_base_formats` (the dry run's) both apply."""
    choice = base_choice(overrides, method, where=f"arm {arm}")
    if choice.format not in ("auto", own) and own != "bf16":
        raise QerlError(
            f"arm {arm} needs a {choice.format} base but the recipe's model {source} is {own}; point "
            "model.path at the BF16 model (its 4-bit counterparts are made here), or give the arm its own "
            "model.path"
        )
    return choice


def recorded_bases(out: Path, finished: list[tuple[str, int]]) -> dict[str, str]:
    """{arm: the base its finished runs recorded}, from the newest invocation's run where seed ranges were
    added at different times (their base held-out figures were kept for that base); a base recorded by its
    portable identity, as the folder it names here (which may not exist: the runs were made elsewhere)."""
    newest: dict[str, tuple[str, int, str]] = {}
    for arm, seed in finished:
        run = RunResult.from_dict(json.loads((run_dir(out, arm, seed) / RESULT_NAME).read_text()))
        if run.model is None:
            raise QerlError(
                f"{run_dir(out, arm, seed) / RESULT_NAME} records no base (written by an older qerl): the "
                "report of such runs needs their bases, so run without --report-only where they are"
            )
        order = (run.invocation or "", seed, run.model)
        newest[arm] = max(newest.get(arm, order), order)
    return {arm: base_path(model, out) for arm, (_, _, model) in newest.items()}


def _lora_init_of(arms: dict[str, dict[str, Any]], choice: BaseChoice, method: str) -> str:
    """The LoRA start ("zeros", "eora", "svd") the arms sharing ``choice``'s base need written beside it."""
    inits = {
        str(o.get("lora.init", "zeros"))
        for a, o in arms.items()
        if "model.path" not in o and _same_base(base_choice(o, method, where=f"arm {a}"), choice)
    } - {"zeros"}
    if len(inits) > 1:
        raise QerlError(
            f"arms on the {choice.label()} base ask for different LoRA starts ({', '.join(sorted(inits))}); "
            "one base holds one (BASE/lora_init): give the others their own model.path"
        )
    return inits.pop() if inits else "zeros"


def _same_base(a: BaseChoice, b: BaseChoice) -> bool:
    return (a.format, a.method) == (b.format, b.method)


def _arms_on(arms: dict[str, dict[str, Any]], choice: BaseChoice, method: str) -> list[str]:
    """The arms that train on ``choice``'s base (or a dense copy of it)."""
    return [
        a for a, o in arms.items() if "model.path" not in o and _same_base(base_choice(o, method), choice)
    ]


def _base_folder(out: Path, choice: BaseChoice, lora_init: str) -> Path:
    """Where compare makes ``choice``'s base: ``<fmt>`` for qerl's own RTN, else ``<fmt>-<method>``."""
    native_rtn = choice.method == "rtn" and lora_init == "zeros"
    return out / "bases" / (choice.format if native_rtn else f"{choice.format}-{choice.method}")


def _source_folder(source: str) -> str:
    """The folder a base is made from for the recipe's ``model.path``, found without converting anything:
    a GGUF's converted folder (where it is, or will be), else ``source`` as given (a folder, a hub id)."""
    gguf = gguf_source(source)
    return str(converted_folder(gguf)) if gguf is not None else source


def made_by_quantize(target: Path, fmt: str, method: str, lora_init: str = "zeros") -> bool:
    """A folder ``qerl quantize`` finished (it writes staged, so a folder there is whole) with this format
    and method, and the LoRA start asked for: a base made elsewhere (e.g. where llm-compressor is
    installed) and copied to ``target`` serves as one compare made."""

    report = target / REPORT_NAME
    if not report.is_file():
        return False
    saved = json.loads(report.read_text())
    if (saved.get("format"), saved.get("method")) != (fmt, method):
        return False
    if lora_init == "zeros":
        return True
    try:
        check_folder(init_folder(target), "LoRA init")
    except QerlError:
        return False
    return True


def _quantized_base(
    folder: str, out: Path, choice: BaseChoice, device: str, lora_init: str = "zeros", rank: int = 16
) -> str:
    """The ``choice.format`` counterpart of the BF16 model ``folder``, made under ``out/bases`` once (with
    the LoRA start ``lora_init`` beside it, of rank ``rank``)."""
    fmt, method = choice.format, choice.method
    native_rtn = method == "rtn" and lora_init == "zeros"
    target = _base_folder(out, choice, lora_init)
    if native_rtn:  # qerl's own RTN: no llm-compressor needed
        if not is_complete_folder(target):
            log.info("quantizing %s to %s (round to nearest) into %s", folder, fmt, target)
        return str(write_rtn_checkpoint(folder, target, fmt))
    if made_by_quantize(target, fmt, method, lora_init):
        return str(target)
    if lora_init != "zeros" and target.exists():
        raise QerlError(
            f"{target} was made without the LoRA start an arm asks for (lora.init: {lora_init}): remove it "
            f"to have it made again, or make it with qerl quantize --method {method} --lora-init {lora_init}"
        )
    _check_llmcompressor_available(target, fmt, method)
    if not is_complete_folder(target):
        log.info("quantizing %s to %s (%s on qerl-text) into %s", folder, fmt, method.upper(), target)
    made = str(_calibrated_base(folder, target, fmt, method, device, lora_init, rank))
    free_accelerator_memory()  # before any run (or vLLM) measures what is free
    return made


def _check_llmcompressor_available(target: Path, fmt: str, method: str) -> None:
    """AWQ and GPTQ bases need llm-compressor, which lives apart from vLLM: say so before anything starts."""

    if is_complete_folder(target) or importlib.util.find_spec("llmcompressor") is not None:
        return
    raise QerlError(
        f"making the {fmt} {method.upper()} base needs llm-compressor, which is not installed here "
        f"({install_hint('quantize')}; it cannot share an environment with vLLM). Make the base where it is "
        f"installed (qerl quantize MODEL --format {fmt} --method {method} --calib qerl-text --calib-field "
        f"text) and copy it to {target}, or give the arms its path (compare.arms.<arm>.model.path), or use "
        "round to nearest: --set compare.base_method=rtn"
    )


def base_labels(
    paths: dict[str, str], arms: dict[str, dict[str, Any]], bases: dict[str, str], out: Path, method: str
) -> dict[str, str]:
    """{arm: "nvfp4 AWQ" / "nvfp4 RTN dequantized to BF16" / "bf16" / ...}: the format and quantization
    method of the base at each arm's model path (``paths``). A dense copy says what it was made from; a
    4-bit base made here (``bases``, under ``out/bases``) is named by the arm's choice, any other by its
    ``qerl_quant.json``."""

    labels = {}
    for arm, text in paths.items():
        path = Path(text)
        fmt = detect_format(read_config(path)) if (path / "config.json").is_file() else "?"
        if (path / DEQUANTIZED_RECORD).is_file():
            saved = json.loads((path / DEQUANTIZED_RECORD).read_text())
            made = saved.get("method")
            source = f"{saved.get('format', '?')} {made.upper() if made else '(method not recorded)'}"
            labels[arm] = f"{source} dequantized to BF16"
        elif bases.get(arm) == text and (path.is_relative_to(out / "bases") or not path.exists()):
            # Made here, or recorded by runs made elsewhere (compare --report-only): the arm's own choice.
            choice = base_choice(arms[arm], method)
            labels[arm] = choice.label() + (" dequantized to BF16" if choice.dequantized else "")
        elif (path / REPORT_NAME).is_file():
            saved = json.loads((path / REPORT_NAME).read_text())
            labels[arm] = f"{saved.get('format', fmt)} {str(saved.get('method', '?')).upper()}"
        else:
            labels[arm] = fmt if fmt == "bf16" else f"{fmt} (method not recorded)"
        init = arms[arm].get("lora.init", "zeros")
        if init != "zeros":  # the LoRA's start is part of where the arm begins
            labels[arm] += f" + {INIT_NAMES.get(init, init)} start"
    return labels


def _calibrated_base(
    folder: str, target: Path, fmt: str, method: str, device: str, lora_init: str, rank: int
) -> Path:
    """``qerl quantize --method METHOD --calib qerl-text [--lora-init INIT]`` of ``folder`` into
    ``target``, once."""

    def write(staging: Path) -> None:
        run_quantize(
            QuantizeConfig(
                model=folder, format=fmt, method=method, calib=calib_text.BUILTIN_NAME, calib_field="text",
                num_samples=calib_text.SMALL_CALIB_SAMPLES, seq_len=calib_text.SMALL_CALIB_SEQ_LEN,
                output=str(staging),
                overwrite=True, device=device, lora_init=lora_init, lora_init_rank=rank,
            )
        )  # fmt: skip

    return write_folder_once(target, write)
