"""Arms of an ablation: named config overrides applied on top of one recipe.

Built in (the three settings the QeRL paper compares):

- ``bf16-lora``: BF16 base + LoRA, no AQN (the baseline);
- ``nvfp4-lora``: NVFP4 base + LoRA, no AQN (quantization noise alone);
- ``nvfp4-aqn``: NVFP4 base + LoRA + Adaptive Quantization Noise (QeRL).

A recipe may add its own (or replace these) under a top-level ``compare:`` section, which ``qerl
train`` never sees::

    compare:
      threshold: 0.5             # reward for "steps to threshold" (default: see summary.py)
      heldout_problems: 64       # held-out split, greedy, pass@1 with its standard error
      base_method: awq           # (default) or rtn: how 4-bit bases are made from the recipe's BF16 model
      arms:
        mxfp4-aqn: {model.format: mxfp4, aqn.enabled: true}

``model.format`` names the base an arm needs; when the recipe's model is another format, its 4-bit
counterpart is made once and shared by all runs: AWQ by ``qerl quantize`` on the shipped qerl-text
calibration set (the default, as the paper calibrates its bases; needs llm-compressor), or round to
nearest by ``qerl_cli.quantize.native`` (``base_method: rtn``: seconds, no extra package). The report
names the method of every base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from qerl_cli.config import from_dict
from qerl_cli.errors import QerlError

BUILTIN_ARMS: dict[str, dict[str, Any]] = {
    "bf16-lora": {"model.format": "bf16", "aqn.enabled": False},
    "nvfp4-lora": {"model.format": "nvfp4", "aqn.enabled": False},
    "nvfp4-aqn": {"model.format": "nvfp4", "aqn.enabled": True},
}
BASE_METHODS = ("awq", "rtn")
DEFAULT_BASE_METHOD = "awq"
RESERVED_NAMES = ("bases", "base-heldout")  # folders of the output next to the arms' own


@dataclass
class CompareSettings:
    threshold: float | None = None
    heldout_problems: int = 64
    heldout_samples: int = 1
    heldout_temperature: float = 0.0  # greedy: the model's own answer, no sampling noise
    # How a BF16 recipe model's 4-bit counterparts are made: AWQ through llm-compressor on the shipped
    # qerl-text calibration set (the quantization `qerl quantize` uses by default and the paper's bases
    # have, offline) or round to nearest (qerl's own packing, seconds, no extra package). AWQ by default:
    # RTN bases of small models can start with too little reward signal for GRPO (issue 22).
    base_method: str = DEFAULT_BASE_METHOD
    # The least seconds between the starts of runs that share the GPU. None: 10 when vLLM runs go
    # --jobs N > 1 at a time (each also waits until the previous run's vLLM engine is up, at most
    # engine_ready_timeout_s), else 0.
    start_interval_s: float | None = None
    # How long the next vLLM run sharing the GPU waits for the previous one's engine to be up (it writes
    # engine_ready in its folder) before it starts anyway. Runs sharing a GPU size vLLM's KV cache from
    # their share rather than by measuring the device, so their starts may overlap; the wait lets a run's
    # torch.compile cache serve the next run of the same base. 45 s: 22 Gemma 3 270M runs on an H100 and
    # an H200 started so (vLLM's engine initialisation 49-85 s), none failed (2026-11-24); serialised
    # starts had cost 113-178 s a run.
    engine_ready_timeout_s: float = 45.0
    arms: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(BUILTIN_ARMS))


def read_settings(section: Any) -> CompareSettings:
    """The recipe's ``compare:`` section (may be absent) with the built-in arms as defaults."""
    if section is None:
        return CompareSettings()
    if not isinstance(section, dict):
        raise QerlError("the recipe's compare: section must be a mapping (threshold, arms, ...)")
    # Read like every recipe section: an unknown key names the closest one, a wrong type names key, value
    # and expected type. The recipe's arms are added to the built-in ones below.
    given_arms = section.get("arms") or {}
    values = {k: v for k, v in section.items() if k != "arms"}
    settings = from_dict(CompareSettings, values, prefix="compare.")
    if settings.base_method not in BASE_METHODS:
        raise QerlError(
            f"compare.base_method must be one of {', '.join(BASE_METHODS)}, got {settings.base_method!r}"
        )
    if settings.heldout_problems <= 0 or settings.heldout_samples <= 0:
        raise QerlError(
            "compare.heldout_problems and compare.heldout_samples must be > 0, got "
            f"{settings.heldout_problems} and {settings.heldout_samples}"
        )
    if not settings.heldout_temperature >= 0:
        raise QerlError(
            f"compare.heldout_temperature must be >= 0 (0: greedy), got {settings.heldout_temperature}"
        )
    if settings.start_interval_s is not None and not settings.start_interval_s >= 0:
        raise QerlError(f"compare.start_interval_s must be >= 0 seconds, got {settings.start_interval_s}")
    if not settings.engine_ready_timeout_s >= 0:
        raise QerlError(
            f"compare.engine_ready_timeout_s must be >= 0 seconds, got {settings.engine_ready_timeout_s}"
        )
    if settings.threshold is not None and not math.isfinite(settings.threshold):
        raise QerlError(f"compare.threshold must be a finite reward, got {settings.threshold}")
    if not isinstance(given_arms, dict):
        raise QerlError("compare.arms must map arm names to overrides, e.g. {my-arm: {aqn.enabled: true}}")
    for name, overrides in given_arms.items():
        if str(name) in RESERVED_NAMES:
            raise QerlError(
                f"compare.arms.{name}: the output folder uses {name}/ for itself; give the arm another name"
            )
        if not isinstance(overrides, dict):
            raise QerlError(f"compare.arms.{name} must map config keys to values, e.g. {{aqn.enabled: true}}")
        settings.arms[str(name)] = dict(overrides)
    return settings


def select_arms(settings: CompareSettings, names: list[str]) -> dict[str, dict[str, Any]]:
    if not names:
        raise QerlError("--arms is empty: name at least one arm, e.g. bf16-lora,nvfp4-aqn")
    unknown = [n for n in names if n not in settings.arms]
    if unknown:
        raise QerlError(
            f"unknown arm(s) {unknown}: built in are {', '.join(BUILTIN_ARMS)}; a recipe adds its own "
            "under compare.arms"
        )
    if len(set(names)) != len(names):
        raise QerlError(f"--arms names an arm twice: {names}")
    return {n: settings.arms[n] for n in names}


def as_set_strings(overrides: dict[str, Any]) -> list[str]:
    """``{"aqn.enabled": False}`` -> ``["aqn.enabled=false"]`` (the ``--set`` syntax, YAML values)."""
    import yaml

    out = []
    for key, value in overrides.items():
        text = yaml.safe_dump(value, default_flow_style=True).strip()
        out.append(f"{key}={text.removesuffix('...').strip()}")
    return out
