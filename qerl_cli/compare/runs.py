"""Where an ablation's runs live and how each run's config is made (recipe, --set, arm, seed, base)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from qerl_cli.compare.arms import as_set_strings, config_overrides, read_settings
from qerl_cli.compare.settings import CompareSettings
from qerl_cli.config import TrainConfig, apply_overrides, from_dict, read_yaml, validate

RESULT_NAME = "result.json"
# What a user whose comparison stopped (Ctrl-C, a full disk) is told: how it goes on.
STOP_HINT = (
    "run the same command again to resume: finished runs (ARM/seed-S/result.json) are skipped and a stopped "
    "one continues from its last checkpoint"
)


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / arm / f"seed-{seed}"


def load_recipe(recipe: str | Path, sets: list[str] | None = None) -> tuple[dict[str, Any], CompareSettings]:
    """The recipe without its compare: section, and that section (``--set compare.X=...`` applied)."""
    data = read_yaml(recipe)
    data = apply_overrides(data, [s for s in sets or [] if s.startswith("compare.")], None)
    settings = read_settings(data.pop("compare", None))
    return data, settings


def train_sets(sets: list[str]) -> list[str]:
    """The ``--set`` items for training: all but the ``compare.*`` ones."""
    return [s for s in sets if not s.startswith("compare.")]


def arm_config(
    data: dict[str, Any], arm_overrides: dict[str, Any], sets: list[str], seed: int, out: Path, arm: str,
    bases: dict[str, str],
) -> TrainConfig:  # fmt: skip
    """recipe < --set < arm overrides < this run's seed, output dir and base path.

    ``bases`` is :func:`~qerl_cli.compare.bases.prepare_bases`'s {arm: folder}; an arm's own model.path
    wins. The config's model.format is the format of the folder its model.path names, so that it passes
    the checks a `qerl train` of it would (``rl.preflight``, which refuses a mismatch): a
    ``base.dequantized`` arm trains its dense copy as the BF16 model it is, and before the bases are made
    (``arm`` not in ``bases``) an arm whose model.format names a base compare makes is checked on the
    recipe's model, which its format does not describe: auto, what that folder holds."""
    merged = apply_overrides(
        copy.deepcopy(data), [*sets, *as_set_strings(config_overrides(arm_overrides))], TrainConfig
    )
    merged = apply_overrides(merged, [f"train.seed={seed}", f"output.dir={run_dir(out, arm, seed)}"], None)
    if "model.path" not in arm_overrides:
        model = merged.setdefault("model", {})
        if arm in bases:
            model["path"] = bases[arm]
            if arm_overrides.get("base.dequantized"):
                model["format"] = "bf16"
        elif "model.format" in arm_overrides:
            model["format"] = "auto"
    conf = from_dict(TrainConfig, merged)
    validate(conf)
    return conf
