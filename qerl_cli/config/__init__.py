"""Typed configuration for every stage: recipe YAML + ``--set a.b=value`` overrides, validated.

A recipe is a YAML mapping of sections (``model:``, ``train:``, ...) onto the dataclasses below.
Loading is strict: an unknown key fails with the closest valid name, a wrong type names the key,
the value and the expected type. Values are converted to the field's type where that is lossless
and unsurprising (``"2e-5"`` -> 2e-5 for a float field, since YAML 1.1 reads ``2e-5`` as a string).
"""

from qerl_cli.config.choices import (
    BENCHMARKS_ALL,
    LORA_TARGETS_ALL,
    RESOLVED_CONFIG_NAME,
    EngineName,
    ModelFormat,
    QuantFormat,
    QuantMethod,
)
from qerl_cli.config.loading import (
    SHIPPED_RECIPES,
    apply_overrides,
    changed_keys,
    dump_yaml,
    from_dict,
    load_config,
    read_yaml,
    resolve_recipe,
    save_resolved_config,
    shipped_recipe_named,
    shipped_recipes,
    to_dict,
    validate,
)
from qerl_cli.config.rl_sections import AlgorithmSection, AQNSection, RolloutSection, TrainSection
from qerl_cli.config.sections import (
    DataSection,
    LoraSection,
    ModelSection,
    OutputSection,
    RewardSection,
    TrainConfig,
)
from qerl_cli.config.stages import BenchConfig, EvalConfig, QuantizeConfig

__all__ = [
    "BENCHMARKS_ALL", "LORA_TARGETS_ALL", "RESOLVED_CONFIG_NAME", "SHIPPED_RECIPES", "AQNSection",
    "AlgorithmSection", "BenchConfig", "DataSection", "EngineName", "EvalConfig", "LoraSection",
    "ModelFormat", "ModelSection", "OutputSection", "QuantFormat", "QuantMethod", "QuantizeConfig",
    "RewardSection", "RolloutSection", "TrainConfig", "TrainSection", "apply_overrides", "changed_keys",
    "dump_yaml", "from_dict", "load_config", "read_yaml", "resolve_recipe", "save_resolved_config",
    "shipped_recipe_named", "shipped_recipes", "to_dict", "validate",
]  # fmt: skip
