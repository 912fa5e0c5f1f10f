"""What `qerl quantize` checks before it loads anything: the questions whose answer would otherwise come
after the model load or minutes of rounding (a model folder that is not there, an output folder that
is taken or cannot be written, a calibration file missing, llm-compressor not installed). ``qerl
quantize --dry-run`` runs exactly these and says what each found; a run makes them first.

Each check raises the QerlError that names what is wrong and what to do; :func:`preflight` returns
what it settled (the format, the method, where the model comes from and the output goes) with the
checks, in order. Nothing is loaded, converted or written here.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from qerl_cli.config import QuantizeConfig
from qerl_cli.config import validate as validate_config
from qerl_cli.data.calib_text import BUILTIN_NAME
from qerl_cli.errors import Checked, QerlError, closest, install_hint
from qerl_cli.files import check_writable_folder, folder_given_for_file
from qerl_cli.modeling import source_checks
from qerl_cli.modeling.loading import read_config
from qerl_cli.modeling.sources import gguf_source, model_name
from qerl_cli.quantize import pipeline
from qerl_cli.quantize.calibration import LOCAL_SUFFIXES
from qerl_cli.quantize.validate import (
    ModelSource,
    check_format,
    check_method,
    check_method_for_format,
    check_output,
    default_output,
    resolve_model,
)
from qerl_cli.torch_utils import resolve_device

TRUST_HINT = "--set trust_remote_code=true"


@dataclass(frozen=True)
class QuantizePlan:
    """What the checks settled, and what each found (for ``--dry-run`` to print)."""

    fmt: str
    method: str
    # Where the BF16 model comes from; for a GGUF file (or an alias's) ``ref`` is that file, converted
    # to a BF16 folder once the work starts (``sources.resolve_model_source``).
    source: ModelSource
    output: Path
    device: torch.device
    calibrate: bool  # calibration samples are taken (a calibrated method, or a --lora-init start)
    calibration: str | None  # where the calibration (or held-out perplexity) rows come from; None: unused
    checks: list[Checked]


def preflight(cfg: QuantizeConfig) -> QuantizePlan:
    """Every cheap check of ``qerl quantize``, the instant ones first; loads and writes nothing."""

    validate_config(cfg)  # the shared walk: any list setting, then QuantizeConfig's own checks
    fmt = check_format(cfg.format)
    method = check_method(cfg.method)
    check_method_for_format(method, fmt)
    check_lora_init(cfg.lora_init, method)
    start = (
        ""
        if cfg.lora_init == "zeros"
        else f", then the {cfg.lora_init} LoRA start (rank {cfg.lora_init_rank})"
    )
    checks = [Checked("--format / --method", f"{fmt} by {method}{start}")]
    # A missing model folder or a taken output answers in well under a second: before the Hub probes.
    source, found = model_source(cfg)
    checks.append(Checked("MODEL", found))
    output, said = output_folder(cfg, source, fmt)
    checks.append(Checked("--output", said))
    calibrate = cfg.calibrates
    calibration = None
    if calibrate or cfg.eval_ppl:
        calibration = calibration_source(cfg.calib, cfg.calib_split, cfg.num_samples if calibrate else 0)
        checks.append(Checked("--calib", calibration))
    else:
        checks.append(Checked("--calib", f"not used ({method} takes no calibration samples)"))
    checks.append(Checked("packages", packages(fmt, method, cfg.eval_ppl)))
    device = resolve_device(cfg.device)
    checks.append(Checked("--device", f"{cfg.device} -> {device}"))
    return QuantizePlan(fmt, method, source, output, device, calibrate, calibration, checks)


def model_source(cfg: QuantizeConfig) -> tuple[ModelSource, str]:
    """The BF16 model's source and what was found, without converting a GGUF file (its folder name, the
    default output's, is the file's model name: ``sources.converted_folder``)."""

    found = source_checks.model_source_found(
        cfg.model, what="MODEL", trust_remote_code=cfg.trust_remote_code, trust_hint=TRUST_HINT
    )
    gguf = gguf_source(cfg.model)
    if gguf is not None:  # the output may not hold the file either: --overwrite would delete it
        return ModelSource(ref=str(gguf), name=model_name(gguf), is_local=True), found
    source = resolve_model(cfg.model, trust_remote_code=cfg.trust_remote_code)
    # A 4-bit folder (a base qerl quantize wrote, say) is refused here, not once it has loaded.
    folder = Path(source.ref)
    local_config = source.is_local and (folder / "config.json").is_file()
    if local_config and read_config(folder).get("quantization_config"):
        raise QerlError(
            f"MODEL {cfg.model} is already quantized: give the BF16 model it was made from (a base qerl "
            'quantize wrote names it as "model" in its qerl_quant.json)'
        )
    return source, found


def output_folder(cfg: QuantizeConfig, source: ModelSource, fmt: str) -> tuple[Path, str]:
    """The output folder: not the model's or the working folder, free unless ``--overwrite``, writable."""

    output = check_output(
        Path(cfg.output) if cfg.output else default_output(source, fmt), source, cfg.overwrite
    )
    if not check_writable_folder(output, "--output", "choose another with --output DIR"):
        return output, f"{output}: a new folder (written beside it, renamed when complete)"
    return output, f"{output}: exists, replaced by --overwrite once the new checkpoint is complete"


def calibration_source(calib: str, split: str, samples: int) -> str:
    """Where the calibration rows come from, said before they are fetched: the shipped set, a local file
    that exists, or a Hub set (refused at once while the Hub is offline or unreachable, naming the
    shipped set to use instead)."""

    what = f"{samples} calibration samples" if samples else "held-out perplexity rows"
    if calib == BUILTIN_NAME:
        return f"{what} from {BUILTIN_NAME} (shipped with qerl, offline)"
    path = Path(calib).expanduser()
    if path.exists() or path.suffix.lower() in LOCAL_SUFFIXES:
        if path.is_dir():
            raise folder_given_for_file(
                path, "--calib", tuple(LOCAL_SUFFIXES), f"--calib {BUILTIN_NAME} (shipped with qerl, offline)"
            )
        if not path.is_file():
            raise QerlError(
                f"--calib {calib}: no such file; give a .jsonl or .parquet file that exists, or --calib "
                f"{BUILTIN_NAME} (shipped with qerl, offline)"
            )
        if path.suffix.lower() not in LOCAL_SUFFIXES:
            raise QerlError(
                f"--calib {calib}: a calibration file is .jsonl or .parquet (got '{path.suffix}')"
            )
        return f"{what} from the file {calib}"
    if "/" not in calib and closest(calib, [BUILTIN_NAME], cutoff=0.75):
        raise QerlError(
            f"--calib {calib}: no such file, and not the shipped set: did you mean --calib {BUILTIN_NAME}?"
        )
    offline = source_checks.hub_offline_by_env() or os.environ.get("HF_DATASETS_OFFLINE", "").lower() in (
        "1",
        "true",
        "yes",
    )
    if offline or not source_checks.hub_reachable():
        why = (
            "the Hub is offline here (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
            if offline
            else "the Hub cannot be reached"
        )
        raise QerlError(
            f"--calib {calib} is a Hugging Face Hub dataset and {why}: calibrate offline with "
            f"--calib {BUILTIN_NAME} (shipped with qerl) or a local .jsonl/.parquet file"
        )
    return (
        f"{what} from {calib} (split {split}), streamed from the Hugging Face Hub; offline, use --calib "
        f"{BUILTIN_NAME} (shipped) or a local .jsonl/.parquet"
    )


def needs_llmcompressor(fmt: str, method: str) -> bool:
    """NVFP4 and MXFP4 are rounded by llm-compressor, and AWQ's smoothing is its own for every format."""
    return fmt != "nf4" or method == "awq"


def packages(fmt: str, method: str, eval_ppl: bool) -> str:
    """The optional packages this job needs are installed (found, not imported: llm-compressor takes
    seconds to import, which the run pays when it rounds)."""

    needed = []
    if needs_llmcompressor(fmt, method):
        if importlib.util.find_spec("llmcompressor") is None:
            raise QerlError(pipeline.LLMCOMPRESSOR_MISSING)
        needed.append("llm-compressor")
    if fmt == "nf4" and eval_ppl:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise QerlError(
                f"--eval-ppl on NF4 loads the result with bitsandbytes: {install_hint('nf4')} "
                "(quantizing to NF4 itself does not need it)"
            )
        needed.append("bitsandbytes")
    if not needed:
        return f"none beyond qerl's own ({fmt} by {method})"
    return ", ".join(needed) + " installed"


def check_lora_init(lora_init: str, method: str) -> None:
    """``--lora-init`` factors ``W - deq(Q(W))``; with AWQ that is not the rounding error: its smoothing
    divides the linear inputs by per-channel scales folded into the preceding norm weights, so the 4-bit
    linears see other inputs than the BF16 ones and ``W`` itself was replaced."""
    if lora_init != "zeros" and method == "awq":
        raise QerlError(
            f"--lora-init {lora_init} cannot follow --method awq: AWQ's smoothing also rescales the norm "
            "weights (the linear layers' inputs), so the error of the rounded weights is not W - deq(Q(W)) "
            "and a correction of it would not restore the BF16 model. Use --method gptq or rtn"
        )
