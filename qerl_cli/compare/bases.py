"""The bases of an ablation: the 4-bit counterparts of the recipe's BF16 model, and what each arm's is.

``compare.base_method`` says how they are made (AWQ by default, or RTN); each is made once under
``DIR/bases/`` and shared by every run, and :func:`base_labels` names format and method for the report.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

from qerl_cli import config as cfg
from qerl_cli.compare.arms import DEFAULT_BASE_METHOD
from qerl_cli.errors import QerlError
from qerl_cli.torch_utils import free_accelerator_memory

log = logging.getLogger(__name__)


def prepare_bases(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], sets: list[str], out: Path,
    method: str = DEFAULT_BASE_METHOD,
) -> dict[str, str]:  # fmt: skip
    """{format: model folder} for every base format an arm asks for (quantized once with ``method``)."""
    from qerl_cli.modeling.loading import detect_format, read_config
    from qerl_cli.modeling.sources import resolve_model_source

    probe = cfg.from_dict(cfg.TrainConfig, cfg.apply_overrides(copy.deepcopy(data), list(sets), None))
    source = probe.model.path
    if not source:
        raise QerlError("the recipe has no model.path: set it or pass --set model.path=...")
    folder = resolve_model_source(source)
    own = detect_format(read_config(Path(folder)))
    bases = {own: folder}
    for overrides in arms.values():
        fmt = str(overrides.get("model.format", "auto"))
        if fmt in ("auto", *bases) or "model.path" in overrides:
            continue
        if own != "bf16":
            raise QerlError(
                f"an arm needs a {fmt} base but the recipe's model {source} is {own}; point model.path at "
                "the BF16 model (its 4-bit counterparts are made here), or give the arm its own model.path"
            )
        target = out / "bases" / (fmt if method == "rtn" else f"{fmt}-{method}")
        if method == "rtn":
            from qerl_cli.quantize.native import write_rtn_checkpoint

            log.info("quantizing %s to %s (round to nearest) into %s", source, fmt, target)
            bases[fmt] = str(write_rtn_checkpoint(folder, target, fmt))
        else:
            _check_awq_available(target, fmt)
            log.info("quantizing %s to %s (AWQ on qerl-text) into %s", source, fmt, target)
            bases[fmt] = str(_awq_base(folder, target, fmt, probe.train.device))
            free_accelerator_memory()  # before any run (or vLLM) measures what is free
    return bases


def _check_awq_available(target: Path, fmt: str) -> None:
    """AWQ bases need llm-compressor, which lives apart from vLLM: say so before anything starts."""
    import importlib.util

    from qerl_cli.files import is_complete_folder

    if is_complete_folder(target) or importlib.util.find_spec("llmcompressor") is not None:
        return
    raise QerlError(
        f"compare.base_method is awq (the default) and making the {fmt} base needs llm-compressor, which is "
        "not installed here (pip install 'qerl[quantize]'; it cannot share an environment with vLLM). Make "
        f"the base where it is installed (qerl quantize MODEL --format {fmt} --calib qerl-text) and copy it "
        f"to {target}, or give the arms its path (compare.arms.<arm>.model.path), or use round to nearest: "
        "--set compare.base_method=rtn"
    )


def base_labels(paths: dict[str, str], bases: dict[str, str], out: Path, method: str) -> dict[str, str]:
    """{arm: "nvfp4 AWQ" / "nvfp4 RTN" / "bf16" / ...}: the format and quantization method of the base at
    each arm's model path (``paths``); ``bases`` made here under ``out`` were made with ``method``."""
    from qerl_cli.modeling.loading import detect_format, read_config

    made = {path for path in bases.values() if Path(path).is_relative_to(out / "bases")}
    labels = {}
    for arm, text in paths.items():
        path = Path(text)
        record = path / "qerl_quant.json"
        fmt = detect_format(read_config(path)) if (path / "config.json").is_file() else "?"
        if str(path) in made:
            labels[arm] = f"{fmt} {method.upper()}"
        elif record.is_file():
            saved = json.loads(record.read_text())
            labels[arm] = f"{saved.get('format', fmt)} {str(saved.get('method', '?')).upper()}"
        else:
            labels[arm] = fmt if fmt == "bf16" else f"{fmt} (method not recorded)"
    return labels


def _awq_base(folder: str, target: Path, fmt: str, device: str) -> Path:
    """``qerl quantize --method awq --calib qerl-text`` of ``folder`` into ``target``, once."""
    from qerl_cli.data.calib_text import BUILTIN_NAME, SMALL_CALIB_SAMPLES, SMALL_CALIB_SEQ_LEN
    from qerl_cli.files import write_folder_once
    from qerl_cli.quantize import run_quantize

    def write(staging: Path) -> None:
        run_quantize(
            cfg.QuantizeConfig(
                model=folder, format=fmt, method="awq", calib=BUILTIN_NAME, calib_field="text",
                num_samples=SMALL_CALIB_SAMPLES, seq_len=SMALL_CALIB_SEQ_LEN, output=str(staging),
                overwrite=True, device=device,
            )
        )  # fmt: skip

    return write_folder_once(target, write)
