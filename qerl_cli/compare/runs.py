"""Where an ablation's runs live and how each run's config is made (recipe, --set, arm, seed, base)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from qerl_cli.compare.arms import as_set_strings, config_overrides, read_settings
from qerl_cli.compare.settings import CompareSettings
from qerl_cli.config import (
    RESOLVED_CONFIG_NAME,
    TrainConfig,
    apply_overrides,
    changed_keys,
    from_dict,
    read_yaml,
    validate,
)
from qerl_cli.errors import QerlError

RESULT_NAME = "result.json"
# What a user whose comparison stopped (Ctrl-C, a full disk) is told: how it goes on.
STOP_HINT = (
    "run the same command again to resume: finished runs (ARM/seed-S/result.json) are skipped and a stopped "
    "one continues from its last checkpoint"
)


SHARE_KEY = "rollout.gpu_memory_utilization"  # vLLM's share of the whole GPU (compare.gpu_share)
# What a finished run's config.yaml may hold otherwise than this invocation's config of it: where it
# wrote (output), its base (compare's own, made under DIR/bases or recorded by base_identity, with the
# format read from it) and the GPU share compare gives runs that share a GPU (gpu_share).
NOT_SETTINGS = (
    "output", "model.path", "model.format", "train.gpu_fraction", SHARE_KEY, "rollout.enable_sleep_mode",
)  # fmt: skip


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / arm / f"seed-{seed}"


def check_finished_settings(out: Path, finished: dict[tuple[str, int], TrainConfig]) -> None:
    """Refuse finished runs (skipped, never trained again) whose saved config differs from the one this
    invocation gives them: the comparison would report runs of other settings as this one's."""
    changed: dict[str, list[str]] = {}
    for (arm, seed), conf in finished.items():
        saved = run_dir(out, arm, seed) / RESOLVED_CONFIG_NAME
        if saved.is_file():
            for change in changed_keys(read_yaml(saved) or {}, conf, NOT_SETTINGS):
                changed.setdefault(change, []).append(f"{arm}/seed-{seed}")
    if not changed:
        return
    runs = sorted({run for where in changed.values() for run in where})
    raise QerlError(
        f"--output {out} holds finished runs ({', '.join(runs)}) trained with other settings than this "
        f"invocation gives them ({'; '.join(changed)}); finished runs are skipped, not trained again, so "
        "the report would give their figures as this setting's. Nothing was changed. Run again with the "
        "settings they were trained with (each run's config.yaml) to add to them, or give this comparison "
        "its own folder with -o DIR"
    )


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
