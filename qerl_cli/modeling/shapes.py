"""Which quantized layers vLLM's Marlin 4-bit kernels refuse, found before vLLM is started.

On a GPU without native FP4 (compute capability < 10.0, e.g. Hopper) vLLM runs NVFP4 / MXFP4 weights
through its Marlin kernels, which need every quantized layer's input width (per tensor-parallel
partition) divisible by 128 and its output width by 64 (``check_marlin_supports_shape`` in vLLM).
vLLM merges q/k/v into one ``qkv_proj`` and gate/up into ``gate_up_proj``, so the output width checked
for those is the sum of the members'. A small model (hidden 576, e.g. ``smollm2-135m-instruct``) fails
this for most layers; vLLM would say so only after minutes of engine start-up, deep in a stack trace.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from qerl_cli import formats
from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import detect_format, read_config, safetensors_files

MARLIN_IN_MULTIPLE = 128
MARLIN_OUT_MULTIPLE = 64
NATIVE_FP4_CAPABILITY = (10, 0)
MARLIN_FORMATS = formats.fp4_names()  # NF4 goes through bitsandbytes' own kernels in vLLM
# vLLM's fused projections: (merged name, members). Input widths are shared, output widths add up.
MERGED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def marlin_refusals(shapes: dict[str, tuple[int, int]]) -> list[str]:
    """Human-readable refusals for quantized layers ``{name: (in_features, out_features)}``."""
    groups: dict[str, tuple[list[str], int, int]] = {}
    for name, (fan_in, fan_out) in shapes.items():
        parent, _, leaf = name.rpartition(".")
        merged = next((m for m, members in MERGED if leaf in members), None)
        key = f"{parent}.{merged}" if merged else name
        names, _, out = groups.get(key, ([], fan_in, 0))
        groups[key] = ([*names, name], fan_in, out + fan_out)
    problems = []
    for key, (names, fan_in, fan_out) in groups.items():
        bad = []
        if fan_in % MARLIN_IN_MULTIPLE:
            bad.append(f"input width {fan_in} is not a multiple of {MARLIN_IN_MULTIPLE}")
        if fan_out % MARLIN_OUT_MULTIPLE:
            bad.append(f"output width {fan_out} is not a multiple of {MARLIN_OUT_MULTIPLE}")
        if bad:
            members = f" ({', '.join(n.rpartition('.')[2] for n in names)})" if len(names) > 1 else ""
            problems.append(f"{key}{members}: {' and '.join(bad)}")
    return problems


def module_shapes(model: torch.nn.Module, names: list[str]) -> dict[str, tuple[int, int]]:
    modules = dict(model.named_modules())
    return {n: (modules[n].in_features, modules[n].out_features) for n in names}


def checkpoint_shapes(folder: Path) -> tuple[str, dict[str, tuple[int, int]]]:
    """(format, quantized layer shapes) read from a checkpoint's safetensors headers (no weights read)."""
    fmt = detect_format(read_config(folder))
    if fmt not in MARLIN_FORMATS:
        return fmt, {}
    shapes: dict[str, tuple[int, int]] = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not dicts
                if key.endswith(".weight_packed"):
                    out, packed_in = handle.get_slice(key).get_shape()
                    shapes[key[: -len(".weight_packed")]] = (int(packed_in) * 2, int(out))  # 2 codes/byte
    return fmt, shapes


def summary(problems: list[str], fmt: str, shown: int = 6) -> str:
    listed = "; ".join(problems[:shown]) + (
        f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    )
    return (
        f"vLLM's Marlin {fmt.upper()} kernels (GPUs without native FP4, compute capability < 10.0) refuse "
        f"{len(problems)} fused layer(s): {listed}. Serve a BF16 copy of the dequantized base instead "
        "(rollout.linear_backend=merged: the LoRA merged into it after every update), use the hf rollout "
        "engine or a Blackwell GPU (native FP4), or leave those layers in BF16"
    )


def _capability() -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


def check_vllm_shapes(model_path: str | Path, capability: tuple[int, int] | None = None) -> None:
    """Raise a QerlError naming the layers vLLM's Marlin FP4 path would refuse.

    Checked only where Marlin would be used: a local NVFP4/MXFP4 folder and a GPU of compute capability
    below 10.0 (``capability``; default the current CUDA device, no check without one).
    """
    folder = Path(model_path)
    fmt, problems = marlin_problems(folder, capability)
    if problems:
        raise QerlError(f"{folder}: " + summary(problems, fmt))


def marlin_problems(
    model_path: str | Path, capability: tuple[int, int] | None = None
) -> tuple[str, list[str]]:
    """(format, the layers vLLM's Marlin FP4 path would refuse) for a local checkpoint on a GPU of compute
    capability below 10.0 (``capability``; default the current CUDA device); no layers where Marlin
    would not run: a hub id, no GPU, a Blackwell GPU (native FP4) or a checkpoint without FP4 weights."""
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        return "other", []  # a hub id: vLLM reads it itself
    capability = capability if capability is not None else _capability()
    if capability is None or tuple(capability) >= NATIVE_FP4_CAPABILITY:
        return "other", []
    fmt, shapes = checkpoint_shapes(folder)
    return fmt, marlin_refusals(shapes)
