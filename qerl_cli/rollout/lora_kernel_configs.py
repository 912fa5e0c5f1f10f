"""Tuned Triton configs for vLLM's LoRA kernels (``lora_shrink`` / ``lora_expand``): their files, where
qerl ships them, and the one place an engine is pointed at them.

vLLM reads such configs only from the folder named by ``VLLM_TUNED_CONFIG_FOLDER``; without it every
LoRA GEMM runs one default tile config per op, whatever the token count and the layer's shape, and at
RL concurrency those kernels are a large share of a rollout's time. ``qerl bench lora-tune`` measures
the configs on a GPU and writes them here in vLLM's own names and layout; ``qerl_cli/rollout/lora_configs/``
(package data) ships them, one set of files per GPU name.

Files (vLLM's naming rule): ``{GPU}_SHRINK.json`` and ``{GPU}_EXPAND_{TRUE|FALSE}.json``, where GPU is
``torch.cuda.get_device_name()`` with spaces and dashes made underscores and TRUE / FALSE is the expand
op's ``add_inputs``. Layout: ``table[max_loras][num_slices][m][k][n] = {block_m, ...}``, every key a
decimal string; vLLM takes the exact key at each level when there is one, else the numerically nearest,
except ``num_slices``, which it takes exactly: a table must hold every slice count of the model's LoRA
layers (1, 2 and 3 for decoders with fused q/k/v and gate/up), or vLLM stops at the first layer without.
``max_loras`` there is the length of the op's LoRA-id list, the engine's ``max_loras`` plus the slot for
"no LoRA" (:func:`lookup_max_loras`); ``k, n`` are (input features, rank) for shrink and (rank, the
largest slice's output features) for expand.

:func:`use_tuned_lora_configs` is called where the engine's environment is set, before vLLM is imported
(:func:`qerl_cli.rollout.vllm_setup._import_vllm`), so every engine -- training, evaluation and each
benchmark backend, BF16 + LoRA and 4-bit + LoRA alike -- runs the same LoRA kernels. vLLM reads the
variable at the first LoRA kernel call and keeps what it read for the life of the process. In
batch-invariant mode (``VLLM_BATCH_INVARIANT=1``) vLLM ignores tuned configs altogether.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from qerl_cli import files
from qerl_cli.errors import QerlError

log = logging.getLogger(__name__)

ENV_VAR = "VLLM_TUNED_CONFIG_FOLDER"
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
SHIPPED_FOLDER = Path(__file__).resolve().parent / "lora_configs"
# The fields of one config, as vLLM's LoRA ops read them (max_nreg: None leaves the register count to Triton).
CONFIG_FIELDS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_ctas", "num_stages",
                 "group_size_m", "max_nreg")  # fmt: skip

Op = Literal["shrink", "expand"]
Source = Literal["user", "shipped", "none"]


def gpu_file_prefix(gpu_name: str) -> str:
    """The GPU part of a config file's name: vLLM's rule, spaces and dashes made underscores."""
    return gpu_name.replace(" ", "_").replace("-", "_")


def config_file_name(gpu_name: str, op: Op, add_inputs: bool = True) -> str:
    """``{GPU}_SHRINK.json``, or ``{GPU}_EXPAND_TRUE.json`` / ``_FALSE`` by the expand op's ``add_inputs``
    (True where the LoRA output is added onto the base layer's, vLLM's single-stream path)."""
    prefix = gpu_file_prefix(gpu_name)
    if op == "shrink":
        return f"{prefix}_SHRINK.json"
    return f"{prefix}_EXPAND_{str(add_inputs).upper()}.json"


def config_file_names(gpu_name: str) -> tuple[str, ...]:
    """Every file vLLM may look up for this GPU."""
    return (config_file_name(gpu_name, "shrink"), config_file_name(gpu_name, "expand", True),
            config_file_name(gpu_name, "expand", False))  # fmt: skip


def files_for_gpu(gpu_name: str, folder: Path = SHIPPED_FOLDER) -> list[Path]:
    """The config files ``folder`` holds for ``gpu_name`` (none: vLLM's defaults for it)."""
    return [folder / name for name in config_file_names(gpu_name) if (folder / name).is_file()]


def lookup_max_loras(engine_max_loras: int) -> int:
    """The first-level key vLLM's ops look a config up by: the length of their LoRA-id list, one slot per
    adapter plus one for "no LoRA"."""
    return engine_max_loras + 1


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigKey:
    """Where one config sits in a table: ``table[max_loras][num_slices][m][k][n]``."""

    max_loras: int
    num_slices: int
    m: int
    k: int
    n: int

    def path(self) -> tuple[str, ...]:
        return tuple(str(v) for v in (self.max_loras, self.num_slices, self.m, self.k, self.n))


def nest(entries: Iterable[tuple[ConfigKey, Mapping[str, Any]]]) -> dict[str, Any]:
    """The table of ``entries`` (a later entry of the same key replaces an earlier one)."""
    table: dict[str, Any] = {}
    for key, config in entries:
        *outer, last = key.path()
        level: MutableMapping[str, Any] = table
        for part in outer:
            level = level.setdefault(part, {})
        # Only the fields given: vLLM reads an absent optional field as its default, a null one as null.
        level[last] = {name: config[name] for name in CONFIG_FIELDS if name in config}
    return table


def lookup(table: Mapping[str, Any], key: ConfigKey) -> dict[str, Any]:
    """The config vLLM's loader finds for ``key``: at each level the exact key, else the numerically
    nearest (``num_slices`` is exact: a table without it has no config for that layer kind)."""
    level: Any = table
    for depth, part in enumerate(key.path()):
        if part in level:
            level = level[part]
        elif depth == 1:
            raise KeyError(f"no configs for {part} slices")
        else:
            level = level[min(level, key=lambda k, want=int(part): abs(int(k) - want))]
    return dict(level)


def write_table(path: Path, table: Mapping[str, Any]) -> None:
    """One config file, keys in numeric order (what a reader of the file expects)."""
    files.atomic_write_text(path, json.dumps(_numeric_order(table), indent=2) + "\n")


def _numeric_order(value: Any) -> Any:
    if isinstance(value, Mapping) and all(str(k).isdigit() for k in value):
        return {k: _numeric_order(value[k]) for k in sorted(value, key=int)}
    return value


# --------------------------------------------------------------------------------------------
# The engine's environment
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TunedConfigChoice:
    """Which folder vLLM's LoRA kernels read their configs from (None: vLLM's defaults), and why."""

    folder: str | None
    source: Source
    reason: str

    def message(self) -> str:
        where = f"{ENV_VAR}={self.folder}" if self.folder else "vLLM's default LoRA kernel configs"
        return f"LoRA kernel configs: {where} ({self.reason})"


def choose_tuned_config_folder(
    gpu_name: str | None, env: Mapping[str, str], folder: Path = SHIPPED_FOLDER
) -> TunedConfigChoice:
    """The user's ``VLLM_TUNED_CONFIG_FOLDER`` when set (it wins), else ``folder`` when it holds a config
    file for ``gpu_name``, else none."""
    given = env.get(ENV_VAR)
    if given and Path(given).resolve() != folder.resolve():
        return TunedConfigChoice(given, "user", f"{ENV_VAR} is set in the environment, so it is used as is")
    if gpu_name is None:
        return TunedConfigChoice(None, "none", "no CUDA GPU is visible")
    found = files_for_gpu(gpu_name, folder)
    if not found:
        return TunedConfigChoice(
            None, "none", f"qerl ships none for {gpu_name}; `qerl bench lora-tune` makes them on this GPU"
        )
    names = ", ".join(p.name for p in found)
    return TunedConfigChoice(str(folder), "shipped", f"qerl's tuned configs for {gpu_name}: {names}")


def use_tuned_lora_configs(
    gpu_name: str | None, env: MutableMapping[str, str] | None = None, folder: Path | None = None
) -> TunedConfigChoice:
    """Point vLLM's LoRA kernels at qerl's tuned configs for this GPU (``env``: the process environment;
    ``folder``: the shipped one), unless the user set ``VLLM_TUNED_CONFIG_FOLDER``; logs one line saying
    which folder and why. Call it before the engine is built: vLLM keeps the first configs it reads."""
    env = os.environ if env is None else env
    folder = SHIPPED_FOLDER if folder is None else folder
    choice = choose_tuned_config_folder(gpu_name, env, folder)
    if choice.source == "shipped":
        env[ENV_VAR] = str(choice.folder)
    elif choice.source == "none" and Path(env.get(ENV_VAR) or "/").resolve() == folder.resolve():
        env.pop(ENV_VAR)  # set for another GPU's files by an earlier engine of this process
    note = ""
    if choice.folder and env.get(BATCH_INVARIANT_ENV, "0") not in ("", "0"):
        note = f"; {BATCH_INVARIANT_ENV} is set, and vLLM ignores tuned configs in batch-invariant mode"
    log.info("%s%s", choice.message(), note)
    return choice


def read_table(path: Path) -> dict[str, Any]:
    """A config file's table, refused with the remedy when it is not one."""
    try:
        table = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise QerlError(f"{path} is not a readable LoRA kernel config file ({exc}); write it again") from None
    if not isinstance(table, dict):
        raise QerlError(f"{path} holds no config table (a JSON object of max_loras keys); write it again")
    return table
