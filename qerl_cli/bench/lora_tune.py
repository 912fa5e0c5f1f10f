"""``qerl bench lora-tune``: Triton configs for vLLM's LoRA kernels, measured on this GPU for one model
shape and LoRA rank, written in vLLM's names and layout (:mod:`qerl_cli.rollout.lora_kernel_configs`).

The plan: every GEMM of a decoder layer as vLLM's punica wrapper calls its LoRA ops -- ``qkv`` with 3
slices, ``gate_up`` with 2, ``o`` and ``down`` with 1 -- at each token count, for ``lora_shrink`` (``x @
A``, k = input features, n = rank) and ``lora_expand`` (``+= xa @ B``, k = rank, n = the largest slice's
output features), one key per distinct (op, slices, m, k, n). For each key the search times vLLM's
default config first, then every candidate of a small grid (:func:`candidates`); a candidate that fails
to compile or run, or whose output differs from the default's, is skipped (and reported), and the
fastest of the rest is written. The timing itself (:mod:`qerl_cli.bench.lora_tune_gpu`, vLLM's ops in CUDA
graphs) is handed in as a function, so the search and the files are tested on the CPU.

Only ``add_inputs=True`` (the LoRA output added onto the base layer's: vLLM's single-stream path, the
one qerl's engines run) is tuned, so ``{GPU}_EXPAND_FALSE.json`` is not written: under
``VLLM_LORA_ENABLE_DUAL_STREAM=1`` vLLM keeps its default expand config.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.table import Table

from qerl_cli.bench.lora_tune_settings import MAX_LORAS, LoraTuneSettings
from qerl_cli.errors import QerlError
from qerl_cli.modeling.model_shape import ModelShape
from qerl_cli.modeling.random_checkpoint import SHAPES
from qerl_cli.rollout import lora_kernel_configs as lkc
from qerl_cli.rollout.vllm_setup import VLLM_LORA_RANKS

REPORT_NAME = "lora_tune.json"
SCHEMA = "qerl.bench.lora_tune/1"
# The grid each op's candidates come from. Shrink: a [m, k] x [k, rank] GEMM, k in the thousands and rank
# small, so it splits k (split_k partial sums, added atomically) and tiles m; expand: [m, rank] x [rank,
# n], n in the thousands, so it tiles m and n. Kept to a few dozen configs per op: Triton compiles each
# once per slice count (and again for a token count that is not a multiple of 16), and the compiles are
# most of a run's time. A block_m above the token count (rounded up to a power of two, at least 16)
# only computes padding, so a key's candidates leave those out (:func:`candidates`).
SHRINK_GRID = {"block_m": (16, 32, 64), "block_k": (64, 128, 256), "split_k": (8, 16, 32, 64)}
EXPAND_GRID = {"block_m": (16, 32, 64, 128), "block_n": (32, 64, 128, 256), "num_warps": (4, 8)}

Op = Literal["shrink", "expand"]
Status = Literal["ok", "failed", "differs"]


@dataclass(frozen=True)
class TuneKey:
    """One (op, slices, m, k, n) the ops look a config up by, the tensors it is timed on (the input
    features and each slice's output features) and the linears that share it."""

    op: Op
    num_slices: int
    m: int
    k: int
    n: int
    in_features: int
    slice_sizes: tuple[int, ...]
    linears: tuple[str, ...]

    def config_key(self, max_loras: int) -> lkc.ConfigKey:
        return lkc.ConfigKey(lkc.lookup_max_loras(max_loras), self.num_slices, self.m, self.k, self.n)

    def label(self) -> str:
        return f"{self.op} {'/'.join(self.linears)} m={self.m} k={self.k} n={self.n} slices={self.num_slices}"


@dataclass(frozen=True)
class Trial:
    """One config timed on one key: ``ok`` with its microseconds, or ``failed`` / ``differs`` and why."""

    config: dict[str, Any]
    status: Status
    us: float | None = None
    detail: str = ""


# (key, config, the reference config whose output it must match) -> its trial.
TrialFn = Callable[[TuneKey, Mapping[str, Any], Mapping[str, Any]], Trial]
DefaultFn = Callable[[TuneKey, int], dict[str, Any]]  # (key, max_loras) -> vLLM's default config


@dataclass(frozen=True)
class KeyResult:
    """A key's search: the default's trial, every candidate's, the fastest valid one and its speed-up
    over the default (None, with ``error``, when the default itself could not be timed)."""

    key: TuneKey
    default: Trial
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None
    speedup: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"key": asdict(self.key), "default": asdict(self.default), "best": None,
               "speedup": self.speedup, "trials": [asdict(t) for t in self.trials]}  # fmt: skip
        if self.best is not None:
            out["best"] = asdict(self.best)
        if self.error:
            out["error"] = self.error
        return out


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------
def model_shape(model: str) -> ModelShape:
    """A shape name of the bench's registry, or a folder holding a ``config.json``."""
    if model.lower() in SHAPES:
        return ModelShape.from_config(SHAPES[model.lower()])
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        raise QerlError(
            f"--model {model}: neither a model shape ({', '.join(SHAPES)}) nor a folder with a config.json"
        )
    try:
        return ModelShape.from_config(json.loads(config.read_text()))
    except json.JSONDecodeError as exc:
        raise QerlError(f"{config} is not valid JSON ({exc}); is the model folder complete?") from None


def check_rank(rank: int) -> int:
    """vLLM runs a LoRA with the kernels of its engine's ``max_lora_rank``, one of its allowed ranks."""
    if rank not in VLLM_LORA_RANKS:
        served = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
        hint = f"vLLM runs a rank-{rank} adapter at rank {served}: give --rank {served}" if served else ""
        ranks = ", ".join(map(str, VLLM_LORA_RANKS))
        raise QerlError(
            f"--rank {rank} is not one of vLLM's LoRA ranks ({ranks})" + (f"; {hint}" if hint else "")
        )
    return rank


def plan_keys(shape: ModelShape, rank: int, rows: list[int]) -> list[TuneKey]:
    """Every key of both ops, linears of the same key merged (the op sees the same shapes)."""
    keys: dict[tuple[Any, ...], TuneKey] = {}
    for op, m, (name, (k_in, outs)) in itertools.product(("shrink", "expand"), rows,
                                                         shape.fused_linears().items()):  # fmt: skip
        k, n = (k_in, rank) if op == "shrink" else (rank, max(outs))
        ident = (op, len(outs), m, k, n)
        if ident in keys:
            keys[ident] = TuneKey(**{**asdict(keys[ident]), "linears": (*keys[ident].linears, name)})
        else:
            keys[ident] = TuneKey(op, len(outs), m, k, n, k_in, outs, (name,))  # type: ignore[arg-type]
    return list(keys.values())


def _pow2_at_least(value: int, floor: int = 16) -> int:
    out = floor
    while out < value:
        out *= 2
    return out


def candidates(op: Op, rank: int, m: int | None = None) -> list[dict[str, Any]]:
    """The configs timed against the default for ``op`` at ``rank`` (the rank is n of shrink, k of
    expand: one tile covers it) and ``m`` tokens (None: the whole grid)."""
    tile = _pow2_at_least(rank)
    base = {"num_ctas": 1, "num_stages": 2, "group_size_m": 8, "max_nreg": None}
    if op == "shrink":
        grid = SHRINK_GRID
        fixed = {"block_n": tile, "num_warps": 4}
    else:
        grid = EXPAND_GRID
        fixed = {"block_k": tile, "split_k": 1}
    names = list(grid)
    configs = [{**base, **fixed, **dict(zip(names, values, strict=True))}
               for values in itertools.product(*(grid[n] for n in names))]  # fmt: skip
    if m is None:
        return configs
    return [c for c in configs if c["block_m"] <= _pow2_at_least(m)]


def plan(settings: LoraTuneSettings) -> dict[str, Any]:
    """What a run would do: the shape's linears (input features, each slice's output features), the keys
    per op, each op's grid and the trials per op (vLLM's default included)."""
    check_rank(settings.rank)
    shape = model_shape(settings.model)
    keys = plan_keys(shape, settings.rank, settings.rows)
    ops = ("shrink", "expand")
    return {
        "linears": shape.fused_linears(),
        "keys": {op: sum(1 for k in keys if k.op == op) for op in ops},
        "grid": {op: len(candidates(op, settings.rank)) for op in ops},  # type: ignore[arg-type]
        "trials": {
            op: sum(len(candidates(op, settings.rank, k.m)) + 1 for k in keys if k.op == op)  # type: ignore[arg-type]
            for op in ops
        },  # fmt: skip
    }


def plan_lines(settings: LoraTuneSettings) -> list[str]:
    """The plan in words, a line each (``--dry-run`` prints them after the settings)."""
    planned = plan(settings)
    linears = ", ".join(
        f"{name} {k} -> {'+'.join(map(str, outs))}" for name, (k, outs) in planned["linears"].items()
    )
    keys, grid, trials = planned["keys"], planned["grid"], planned["trials"]
    return [
        f"plan: {settings.model}, LoRA rank {settings.rank}, max_loras {MAX_LORAS}, token counts "
        f"{','.join(map(str, settings.rows))}",
        f"linears (input features -> each slice's output features): {linears}",
        f"keys: {keys['shrink']} shrink, {keys['expand']} expand",
        f"grid: {grid['shrink']} shrink and {grid['expand']} expand candidates (block_m taller than a key's "
        "tokens left out), after vLLM's default",
        f"trials: {trials['shrink']} shrink, {trials['expand']} expand",
        f"writes: {{GPU}}_SHRINK.json, {{GPU}}_EXPAND_TRUE.json and {REPORT_NAME} into {settings.output}",
    ]


# --------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------
def tune_key(
    key: TuneKey, default: dict[str, Any], configs: list[dict[str, Any]], trial: TrialFn
) -> KeyResult:
    """Time the default, then each candidate (those equal to the default once); the fastest ``ok`` wins."""
    first = trial(key, default, default)
    if first.status != "ok" or first.us is None:
        return KeyResult(key, first, error=f"vLLM's default config could not be timed: {first.detail}")
    trials = [trial(key, config, default) for config in configs if dict(config) != default]
    valid = [t for t in (first, *trials) if t.status == "ok" and t.us is not None]
    best = min(valid, key=lambda t: t.us)  # type: ignore[arg-type, return-value]
    return KeyResult(key, first, trials, best, first.us / best.us)  # type: ignore[operator]


def run_search(
    settings: LoraTuneSettings,
    trial: TrialFn,
    default_config: DefaultFn,
    on_key: Callable[[KeyResult], None] | None = None,
) -> list[KeyResult]:
    """Every key of the plan searched, in order; ``on_key`` after each (progress, partial reports)."""
    check_rank(settings.rank)
    results = []
    for key in plan_keys(model_shape(settings.model), settings.rank, settings.rows):
        result = tune_key(
            key, default_config(key, MAX_LORAS), candidates(key.op, settings.rank, key.m), trial
        )
        results.append(result)
        if on_key is not None:
            on_key(result)
    return results


# --------------------------------------------------------------------------------------------
# The files
# --------------------------------------------------------------------------------------------
def tables(results: list[KeyResult], max_loras: int) -> dict[str, dict[str, Any]]:
    """op -> its table of the best config per key. A key whose search failed gets vLLM's default: vLLM
    looks the slice count up exactly, so a table without a slice count the model has would stop the
    engine, while the default is what vLLM would have run there anyway."""
    out: dict[str, dict[str, Any]] = {}
    for op in ("shrink", "expand"):
        chosen = [
            (r.key.config_key(max_loras), (r.best or r.default).config) for r in results if r.key.op == op
        ]
        if chosen:
            out[op] = lkc.nest(chosen)
    return out


def write_configs(results: list[KeyResult], gpu_name: str, out_dir: Path, max_loras: int) -> list[Path]:
    """The config files of ``results`` in vLLM's names, in ``out_dir``."""
    written = []
    for op, table in tables(results, max_loras).items():
        path = out_dir / lkc.config_file_name(gpu_name, op, add_inputs=True)  # type: ignore[arg-type]
        lkc.write_table(path, table)
        written.append(path)
    return written


def report(header: dict[str, Any], settings: LoraTuneSettings, results: list[KeyResult], started: float,
           written: list[Path]) -> dict[str, Any]:  # fmt: skip
    """``lora_tune.json``: the header (command, GPU, date, versions), the settings, every key's trials, the
    default's time and the speed-up, the files written."""
    speedups = [r.speedup for r in results if r.speedup is not None]
    return {
        **header,
        "settings": settings.to_dict(),
        "tuned": "add_inputs=True (vLLM's single-stream path); add_inputs=False keeps the default",
        "seconds": round(time.perf_counter() - started, 1),
        "files": [p.name for p in written],
        "keys": [r.to_dict() for r in results],
        "errors": [{"key": r.key.label(), "error": r.error} for r in results if r.error],
        "summary": {
            "keys": len(results),
            "tuned": len(speedups),
            "mean_speedup": sum(speedups) / len(speedups) if speedups else None,
        },
    }


def source_tree_folder() -> Path:
    """The shipped folder of the source checkout this qerl runs from; an installed wheel has none."""
    folder = lkc.SHIPPED_FOLDER
    if not (folder.parents[2] / "pyproject.toml").is_file():
        raise QerlError(
            f"--install copies the configs into a source checkout's qerl_cli/rollout/lora_configs/, and this "
            f"qerl is installed at {folder.parents[1]} (no checkout): run it from a clone, or copy the files "
            "by hand"
        )
    return folder


def install(written: list[Path], folder: Path | None = None) -> list[Path]:
    """Copy the config files written into the shipped folder (each read back first: a table or refused)."""
    target = source_tree_folder() if folder is None else folder
    copied = []
    for path in written:
        lkc.read_table(path)
        copied.append(Path(shutil.copy2(path, target / path.name)))
    return copied


def lora_tune_table(data: dict[str, Any]) -> Table:
    """One line per key: the default's and the best config's microseconds and the speed-up."""
    table = Table(title=f"vLLM LoRA kernels on {data.get('device')}: default vs tuned config, us per call")
    for name in ("op", "linears", "slices", "m", "k", "n", "default", "tuned", "speed-up"):
        table.add_column(name)
    for row in data["keys"]:
        key, best = row["key"], row["best"]
        default = row["default"]["us"]
        table.add_row(
            key["op"], "/".join(key["linears"]), str(key["num_slices"]), str(key["m"]), str(key["k"]),
            str(key["n"]), f"{default:.1f}" if default is not None else "-",
            f"{best['us']:.1f}" if best else "-", f"{row['speedup']:.2f}x" if row["speedup"] else "failed",
        )  # fmt: skip
    return table
