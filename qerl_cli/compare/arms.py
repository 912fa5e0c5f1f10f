"""Arms of an ablation: named config overrides applied on top of one recipe.

Built in (the three settings the QeRL paper compares):

- ``bf16-lora``: BF16 base + LoRA, no AQN (the baseline);
- ``nvfp4-lora``: NVFP4 base + LoRA, no AQN (quantization noise alone);
- ``nvfp4-aqn``: NVFP4 base + LoRA + Adaptive Quantization Noise (QeRL);

and one control:

- ``nvfp4-dequant-lora``: BF16 LoRA over a dense BF16 copy of the NVFP4 base's dequantized weights: the
  weights ``nvfp4-lora`` trains on, BF16 kernels (rollouts and update). Beside ``bf16-lora`` and
  ``nvfp4-lora`` it tells a gap made by the 4-bit weights from one made by the 4-bit execution path.

A recipe may add its own (or replace these) under a top-level ``compare:`` section, which ``qerl
train`` never sees::

    compare:
      threshold: 0.5             # reward for "steps to threshold" (default: see summary.py)
      heldout_problems: 64       # held-out split, pass@1 with its standard error
      heldout_samples: 4         # per problem, at the recipe's temperature (1: greedy)
      reference: bf16-lora       # the arm the verdicts compare with (the default)
      margin: 5                  # points: "not worse" is a 95% interval above -5
      base_method: awq           # (default), gptq or rtn: how 4-bit bases are made from the BF16 model
      arms:
        mxfp4-aqn: {model.format: mxfp4, aqn.enabled: true}
        nvfp4-rtn-lora: {model.format: nvfp4, aqn.enabled: false, base.method: rtn}

``model.format`` names the base an arm needs. Two keys that are not ``qerl train`` settings say how
compare makes it: ``base.method`` (gptq, awq or rtn: this arm's, instead of ``compare.base_method``) and
``base.dequantized`` (true: the arm trains in BF16 on a dense copy of that 4-bit base's dequantized
weights, made once under ``DIR/bases/``).

When the recipe's model is another format than an arm's, its 4-bit counterpart is made once and shared
by all runs: AWQ by ``qerl quantize`` on the shipped qerl-text calibration set (the default, as the paper
calibrates its bases; needs llm-compressor), or round to nearest by ``qerl_cli.quantize.native``
(``base_method: rtn``: seconds, no extra package). The report names the method of every base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, get_args

import yaml

from qerl_cli import formats
from qerl_cli.compare.settings import BUILTIN_ARMS, CompareSettings
from qerl_cli.compare.verdict import check_margin
from qerl_cli.config import QuantMethod, from_dict
from qerl_cli.errors import QerlError, closest

BASE_METHODS = get_args(QuantMethod)  # the methods `qerl quantize` makes a base with
# Arm keys that are compare's own (how the arm's base is made), never passed to `qerl train`.
BASE_KEYS = ("base.method", "base.dequantized")
QUANTIZED_FORMATS = tuple(formats.names())  # what an arm's 4-bit base may be
RESERVED_NAMES = ("bases", "base-heldout")  # folders of the output next to the arms' own


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
        close = closest(settings.base_method, BASE_METHODS)
        raise QerlError(
            f"compare.base_method must be one of {', '.join(BASE_METHODS)}, got {settings.base_method!r}"
            + (f"; did you mean {close!r}?" if close else "")
        )
    if settings.heldout_problems <= 0 or settings.heldout_samples <= 0:
        raise QerlError(
            "compare.heldout_problems and compare.heldout_samples must be > 0, got "
            f"{settings.heldout_problems} and {settings.heldout_samples}"
        )
    temperature = settings.heldout_temperature
    if temperature is not None and not temperature >= 0:
        raise QerlError(f"compare.heldout_temperature must be >= 0 (0: greedy), got {temperature}")
    if temperature == 0 and settings.heldout_samples > 1:
        raise QerlError(
            f"compare.heldout_samples={settings.heldout_samples} at compare.heldout_temperature=0 would "
            "grade one greedy answer that many times: leave heldout_temperature unset (the recipe's "
            "rollout.temperature) or set it above 0, or take heldout_samples=1"
        )
    settings.margin = check_margin(settings.margin)
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
        base_choice(overrides, settings.base_method, where=f"compare.arms.{name}")  # checked now
        settings.arms[str(name)] = dict(overrides)
    return settings


@dataclass(frozen=True)
class BaseChoice:
    """The base an arm trains on: ``format`` (its model.format), made with ``method`` when compare makes
    it, and held as a dense BF16 copy of its dequantized weights when ``dequantized``."""

    format: str
    method: str
    dequantized: bool = False

    def label(self) -> str:
        """What the report's base column says of a base compare made: "nvfp4 AWQ", "bf16"."""
        return f"{self.format} {self.method.upper()}" if self.format in QUANTIZED_FORMATS else self.format


def base_choice(overrides: dict[str, Any], default_method: str, where: str = "the arm") -> BaseChoice:
    """The arm's :class:`BaseChoice` from its overrides; a wrong ``base.*`` key or value is refused."""
    unknown = [k for k in overrides if str(k).startswith("base.") and k not in BASE_KEYS]
    if unknown:
        raise QerlError(f"{where}: unknown key(s) {unknown}; an arm's base takes {', '.join(BASE_KEYS)}")
    given = [k for k in BASE_KEYS if k in overrides]
    if given and "model.path" in overrides:
        raise QerlError(
            f"{where}: {', '.join(given)} say(s) how compare makes the arm's base, but the arm brings its "
            "own model.path: remove one (a dense copy of your own 4-bit model: qerl_cli.quantize.native."
            "write_dequantized_checkpoint, then point model.path at it)"
        )
    method = overrides.get("base.method", default_method)
    if method not in BASE_METHODS:
        raise QerlError(f"{where}: base.method must be one of {', '.join(BASE_METHODS)}, got {method!r}")
    dequantized = overrides.get("base.dequantized", False)
    if not isinstance(dequantized, bool):
        raise QerlError(f"{where}: base.dequantized must be true or false, got {dequantized!r}")
    fmt = str(overrides.get("model.format", "auto"))
    if fmt != "auto":  # auto: the checkpoint's own, as in a recipe
        formats.check_names([fmt], "model.format", dense=True, option=where)
    if dequantized and fmt not in QUANTIZED_FORMATS:
        raise QerlError(
            f"{where}: base.dequantized needs the 4-bit base to dequantize: set model.format to one of "
            f"{', '.join(QUANTIZED_FORMATS)} (got {fmt})"
        )
    return BaseChoice(fmt, str(method), dequantized)


def config_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """The arm's ``qerl train`` settings: its overrides less compare's own ``base.*`` keys."""
    return {k: v for k, v in overrides.items() if k not in BASE_KEYS}


def select_arms(settings: CompareSettings, names: list[str]) -> dict[str, dict[str, Any]]:
    if not names:
        raise QerlError("--arms is empty: name at least one arm, e.g. bf16-lora,nvfp4-aqn")
    unknown = [n for n in names if n not in settings.arms]
    if unknown:
        meant = {n: closest(n, settings.arms) for n in unknown}
        named = [f"{n} (did you mean {meant[n]}?)" if meant[n] else n for n in unknown]
        own = [a for a in settings.arms if a not in BUILTIN_ARMS]
        mine = f"; this recipe adds {', '.join(own)}" if own else "; a recipe adds its own under compare.arms"
        raise QerlError(f"unknown arm(s) {', '.join(named)}: built in are {', '.join(BUILTIN_ARMS)}{mine}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # named in words, not as a Python list
        raise QerlError(f"--arms names {', '.join(twice)} twice: give each arm once")
    return {n: settings.arms[n] for n in names}


def as_set_strings(overrides: dict[str, Any]) -> list[str]:
    """``{"aqn.enabled": False}`` -> ``["aqn.enabled=false"]`` (the ``--set`` syntax, YAML values)."""

    out = []
    for key, value in overrides.items():
        text = yaml.safe_dump(value, default_flow_style=True).strip()
        out.append(f"{key}={text.removesuffix('...').strip()}")
    return out
