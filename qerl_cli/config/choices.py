"""The values a setting may take (``Literal`` aliases) and the named defaults of the config: their one home.

A check of a value tests membership in ``get_args(alias)``; ``tests/test_one_home.py`` refuses a second
definition or a literal copy of their values. Apart from the sections so that modules below the config
(modeling, rollout) read them without the recipe's dataclasses.
"""

from __future__ import annotations

from typing import Literal

# The format registry's names (qerl_cli.formats, which this layer sits below: a test holds the two
# equal). The config's checks and the CLI's help read them from here.
QuantFormat = Literal["nvfp4", "mxfp4", "nf4"]
QuantMethod = Literal["gptq", "awq", "rtn"]  # how `qerl quantize` rounds
CALIBRATED_METHODS = ("gptq", "awq")  # the methods that read calibration samples (rtn reads none)
ModelFormat = Literal["auto", "bf16", QuantFormat]
EngineName = Literal["hf", "vllm"]
# rollout.linear_backend's values (qerl_cli.rollout.backends chooses and checks them).
LinearBackend = Literal["auto", "marlin", "humming", "qerl-triton", "fp8", "fp8-merged", "merged"]
# The backends that merge the adapter into the rollout weights: a 4-bit base's FP8 copy; BF16 weights (a
# BF16 base's own, a 4-bit base's BF16 copy).
MERGED_LINEAR_BACKENDS = ("fp8-merged", "merged")
# The backends only the vLLM engine serves (the hf engine runs the trainer's own layers; marlin and auto
# are vLLM's default there, which the hf engine ignores).
VLLM_ONLY_LINEAR_BACKENDS = ("humming", "qerl-triton", "fp8", *MERGED_LINEAR_BACKENDS)
# train.base_compute's values (qerl_cli.modeling.base_compute).
BaseCompute = Literal["auto", "bf16", "fp8"]
# train.fused_kernels' values (qerl_cli.modeling.fused_kernels).
FusedKernels = Literal["off", "liger", "auto"]
# lora.init's values, and `qerl quantize --lora-init`'s: zeros is no error-compensating start.
LoraInit = Literal["zeros", "eora", "svd"]
# The old spelling of lora_init: zeros (`qerl quantize --lora-init none`), still accepted for scripts.
LORA_INIT_ALIASES = {"none": "zeros"}
LORA_TARGETS_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BENCHMARKS_ALL = ["gsm8k", "math500", "aime24", "aime25", "amc23"]
RESOLVED_CONFIG_NAME = "config.yaml"
