"""``qerl bench e2e``: seconds of one GRPO step per phase, BF16 LoRA against each 4-bit format, on one
rollout linear backend or several side by side (the pairs: :mod:`qerl_cli.bench.e2e_backends`).

Each (format, backend) pair runs the same GRPO job through the real trainer (``qerl_cli.rl.trainer.Trainer``):
the same synthetic prompts padded to about ``--prompt-len`` tokens (a filler system prompt; exact
for the byte-level tokenizer of shape checkpoints), ``--generations`` completions per prompt,
``--prompts-per-step`` prompts a step (default: the largest ``batch``, 8), ``--gen-len`` completion
tokens at most, LoRA of ``--lora-rank`` (16 when 0), and the same vLLM memory share
(``gpu_memory_utilization``). Only the base format and the rollout's linear backend differ.
``--recipe`` takes the step's shape from a training recipe
(:func:`~qerl_cli.bench.settings.recipe_shape`, flags given explicitly win) and its memory settings
(micro-batch, checkpointing, logprob chunk, KV-cache dtype, vLLM share).

Rewards are seeded random numbers instead of math grading: grading costs the same for every
format, and random rewards give every group nonzero advantages, so each step does a real update.
AQN is off and TIS on for every format, so every format runs the same algorithm.

Phases of a step, each counted once (the trainer's ``time_*_s``, ``rl.tracking.STEP_PARTS``):
``aqn`` (the noise and, at a noisy stage's first step, its probe; AQN is off here), ``generation``
(rollout), ``reward``, ``sleep`` (vLLM gives its memory to the update), ``logprobs`` (the no-grad
old-policy / reference pass; the trainer runs one only when ``num_iterations > 1`` or ``beta > 0``, so
0 with the paper's settings, where the policy's logprobs are part of the update), ``update`` (forward +
backward + optimizer), ``wake`` (vLLM's weights and KV cache back), ``sync`` (the adapter loaded into
the engine, or merged into its weights, and the staleness probe), and ``other`` (the step's bookkeeping:
advantages, the scheduler, memory release, its figures), which add up to ``step`` exactly. The figures
are those of the median step (by step time; the lower one of an even count) among the timed steps, so
they add up; every step's are kept in the row's ``steps``.

Before, ``sync`` was the wall time of the engine's sleep, its wake-ups and noise and the trainer's
adapter sync together, and the wake-up inside the sync's staleness check was counted twice.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from qerl_cli.bench.child import run_child
from qerl_cli.bench.e2e_backends import E2EPair
from qerl_cli.bench.e2e_notes import step_rate_fields
from qerl_cli.bench.gpusampler import READINGS_KEY, keep_case_clocks, take_case_clocks
from qerl_cli.bench.header import case_clock_sampler
from qerl_cli.bench.hostload import HostLoad
from qerl_cli.bench.progress import Progress
from qerl_cli.bench.settings import E2EConfig, prompts_per_step, recipe_config
from qerl_cli.config import (
    AlgorithmSection,
    AQNSection,
    DataSection,
    LoraSection,
    ModelSection,
    OutputSection,
    RolloutSection,
    TrainConfig,
    TrainSection,
    from_dict,
)
from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import load_tokenizer
from qerl_cli.rl import trainer as trainer_mod
from qerl_cli.rl.tracking import step_other_s
from qerl_cli.torch_utils import GIB, free_accelerator_memory

log = logging.getLogger(__name__)


E2E_DATASET = "synthetic-addition"
DEFAULT_E2E_RANK = 16
# (report field, trainer metric) of each part of a step (rl.tracking.STEP_PARTS, in its order); with
# "other_s" they add up to "step_s".
PHASE_METRICS = (
    ("aqn_s", "time_aqn_s"),
    ("generation_s", "time_rollout_s"),
    ("reward_s", "time_reward_s"),
    ("sleep_s", "time_sleep_s"),
    ("logprobs_s", "time_logprobs_s"),
    ("update_s", "time_update_s"),
    ("wake_s", "time_wake_s"),
    ("sync_s", "time_sync_s"),
)
# The per-step figures each row keeps: timings, memory, rollout figures (the engine's, the logprob gap).
STEP_FIELDS = ("time_", "memory/", "rollout_tokens", "rollout/", "rollout_logprob_gap")


class RandomReward:
    """Seeded uniform rewards: the trainer's ``reward_fn(texts, problems) -> (rewards, stats)``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, texts: list[str], problems: list[Any]) -> tuple[list[float], dict[str, float]]:
        return [self.rng.random() for _ in texts], {}


# Characters of a synthetic-addition question with the plain template, rounded up.
QUESTION_ALLOWANCE = 48
# Tokens added to rollout.max_prompt_length, a bound: the padded prompts (chat template included) fit.
PROMPT_SLACK = 64
FILLER = "Add the two numbers and give only the sum. "


def filler_system_prompt(prompt_len: int, tokenizer: Any = None) -> str | None:
    """A system prompt that brings a synthetic question to about ``prompt_len`` tokens; None when the
    question alone is that long. Characters are tokens for the shapes' byte-level tokenizer; with
    another ``tokenizer`` the filler is stretched by its characters per token."""
    room = prompt_len - QUESTION_ALLOWANCE
    if room <= 0:
        return None
    if tokenizer is not None:
        sample = FILLER * 8
        tokens = len(tokenizer(sample, add_special_tokens=False)["input_ids"])
        room = round(room * len(sample) / max(1, tokens))
    return (FILLER * (room // len(FILLER) + 1))[:room]


def folder_tokenizer(model_dir: str) -> Any:
    """The tokenizer saved with ``model_dir``, or None when it has none (e.g. a name in a test)."""
    if not (Path(model_dir) / "tokenizer_config.json").is_file():
        return None

    return load_tokenizer(model_dir)


def e2e_train_config(
    cfg: E2EConfig, model_dir: str, engine: str, out_dir: str, linear_backend: str | None = None
) -> TrainConfig:
    """The same GRPO job for every pair; only ``model_dir`` and ``linear_backend`` (None: the recipe's,
    else auto; the hf engine has none) change between pairs."""
    steps = cfg.warmup + cfg.repeats
    filler = filler_system_prompt(cfg.prompt_len, folder_tokenizer(model_dir))
    rank = cfg.lora_rank or DEFAULT_E2E_RANK
    prompts = prompts_per_step(cfg)
    recipe = recipe_config(cfg.recipe, model_dir) if cfg.recipe else None
    share = cfg.gpu_memory_utilization
    if share is None:
        share = recipe.rollout.gpu_memory_utilization if recipe else 0.3
    train = TrainSection(max_steps=steps, prompts_per_step=prompts, micro_batch_size=cfg.generations,
                         seed=cfg.seed, device=cfg.device)  # fmt: skip
    kv_cache_dtype, backend, table, auto_fp8 = "auto", "auto", None, False
    if recipe is not None:  # the recipe's memory and kernel settings, so the step runs as training would
        train.micro_batch_size = recipe.train.micro_batch_size
        train.gradient_checkpointing = recipe.train.gradient_checkpointing
        train.logprob_chunk_tokens = recipe.train.logprob_chunk_tokens
        train.fused_kernels = recipe.train.fused_kernels
        train.pack_sequences = recipe.train.pack_sequences
        train.base_compute = recipe.train.base_compute
        kv_cache_dtype = recipe.rollout.kv_cache_dtype
        backend, table = recipe.rollout.linear_backend, recipe.rollout.crossover_table
        auto_fp8 = recipe.rollout.auto_fp8
    backend = linear_backend or backend
    train.base_compute = cfg.base_compute or train.base_compute
    return TrainConfig(
        model=ModelSection(path=model_dir),
        lora=LoraSection(rank=rank, alpha=2 * rank),
        rollout=RolloutSection(
            engine=engine,  # type: ignore[arg-type]
            num_generations=cfg.generations,
            max_prompt_length=cfg.prompt_len + PROMPT_SLACK,
            max_completion_length=cfg.gen_len,
            temperature=1.0,
            top_p=1.0,
            generation_batch_size=prompts * cfg.generations,
            gpu_memory_utilization=share,
            kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
            max_lora_rank=rank,
            linear_backend=backend if engine == "vllm" else "auto",  # type: ignore[arg-type]
            crossover_table=table,
            auto_fp8=auto_fp8,
            vllm_kwargs=dict(cfg.vllm_kwargs),
        ),
        algorithm=AlgorithmSection(tis="on"),
        aqn=AQNSection(enabled=False),
        data=DataSection(
            dataset=E2E_DATASET,
            max_samples=prompts * steps,
            shuffle=False,
            template="plain",
            system_prompt=filler,
        ),  # fmt: skip
        train=train,
        output=OutputSection(dir=out_dir, save_steps=0, save_total_limit=None),
    )


def step_phases(record: dict[str, Any]) -> dict[str, float]:
    """The parts of one step's record under the report's names, ``other_s`` and ``step_s``: the parts and
    ``other_s`` add up to ``step_s``."""

    phases = {field: float(record.get(metric, 0.0)) for field, metric in PHASE_METRICS}
    phases["other_s"] = step_other_s(record) or 0.0
    phases["step_s"] = float(record.get("time_step_s", 0.0))
    return phases


def median_step(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The record of the median step by ``time_step_s`` (the lower of the two middle ones)."""
    ordered = sorted(records, key=lambda r: float(r.get("time_step_s", 0.0)))
    return ordered[(len(ordered) - 1) // 2]


def measure_pair(cfg: E2EConfig, pair: E2EPair, model_dir: str, engine: str, out_dir: str) -> dict[str, Any]:
    """Run warm-up + timed GRPO steps in this process; one e2e row for ``pair``."""

    fmt = pair.format
    train_config = e2e_train_config(cfg, model_dir, engine, out_dir, pair.requested)
    trainer = trainer_mod.Trainer(train_config, reward_fn=RandomReward(cfg.seed))
    if trainer.policy.base_format != fmt:
        raise QerlError(f"{model_dir} loaded as {trainer.policy.base_format}, expected {fmt}")
    records: list[dict[str, Any]] = []
    steps = cfg.warmup + cfg.repeats
    progress = Progress(f"bench e2e {pair.label}", steps)

    def step(index: int) -> None:
        label = f"step {index + 1}{' (warm-up)' if index < cfg.warmup else ''}"
        progress.start(label)
        records.append(trainer.train_step())
        progress.finish(label, f"{records[-1].get('time_step_s', 0.0):.2f} s")

    for index in range(cfg.warmup):
        step(index)
    with case_clock_sampler() as sampler:  # the GPU's clocks under load, over the timed steps
        for index in range(cfg.warmup, steps):
            step(index)
    timed = records[cfg.warmup :]

    def median(key: str) -> float:
        return statistics.median(float(r.get(key, 0.0)) for r in timed)

    # The pair's backend (the key of the ratios and the gate), then below what the engine ran.
    row: dict[str, Any] = {
        "format": fmt,
        "backend": pair.backend,
        "lora_rank": cfg.lora_rank or DEFAULT_E2E_RANK,
    }
    row.update(step_phases(median_step(timed)))  # one step's parts: they add up to its step_s
    row["steps_timed"] = len(timed)
    row["sequences_per_step"] = prompts_per_step(cfg) * cfg.generations
    row["micro_batch_size"] = trainer.memory.micro_batch_size
    row["gradient_checkpointing"] = trainer.memory.gradient_checkpointing
    row["gpu_memory_utilization"] = trainer.memory.gpu_memory_utilization
    row["memory_plan"] = trainer.memory.figures
    # What the engine ran (auto resolved: the run log says why) beside what was asked for.
    row["linear_backend"] = trainer.engine.linear_backend
    row["linear_backend_requested"] = trainer.cfg.rollout.linear_backend
    row["base_compute_requested"] = trainer.cfg.train.base_compute  # the run log says what it resolved to
    for key in ("memory/peak_allocated_gib", "memory/peak_reserved_gib", "memory/device_peak_used_gib"):
        values = [r[key] for r in timed if key in r]
        row[key.split("/")[1]] = max(values) if values else None
    row["steps"] = [{k: v for k, v in r.items() if k.startswith(STEP_FIELDS)} for r in records]
    row["completion_tokens_per_step"] = median("rollout_tokens")
    # Every timed step's rollout speed beside the median step's: their spread says how far a ratio
    # between rows can be trusted.
    row.update(step_rate_fields(timed))
    peak = row["peak_allocated_gib"]
    row["peak_allocated_bytes"] = int(peak * GIB) if peak is not None else None
    kept: list[dict[str, Any]] = []
    keep_case_clocks(row, sampler.record(), kept)
    if kept:  # the readings, for the parent's host load (run_e2e takes them out of the row)
        row[READINGS_KEY] = kept
    return row


def _failed(pair: E2EPair, error: str) -> dict[str, Any]:
    return {"format": pair.format, "backend": pair.backend, "error": error}


def _measure_isolated(
    cfg: E2EConfig, pair: E2EPair, model_dir: str, engine: str, out_dir: str
) -> dict[str, Any]:
    """vLLM: one child process per pair (:mod:`qerl_cli.bench.child`)."""
    spec = {"cfg": asdict(cfg), "pair": asdict(pair), "model_dir": model_dir, "engine": engine,
            "out_dir": out_dir}  # fmt: skip
    row, code = run_child("qerl_cli.bench.e2e", spec, "qerl-e2e-")
    if row is None:  # e.g. killed for memory: the report says so and qerl bench exits 1
        return _failed(pair, f"the e2e worker exited with code {code}, no result")
    return row


def run_e2e(
    cfg: E2EConfig,
    pairs: list[E2EPair],
    checkpoints: dict[str, Path],
    engine: str,
    out: Path,
    after_pair: Callable[[], None] | None = None,
    host: HostLoad | None = None,
) -> list[dict[str, Any]]:
    """One row per (format, backend) pair, in the pairs' order (BF16 first: the reference of the ratios);
    the GPU clock readings each pair took under load go to ``host`` (the report's host load), then
    ``after_pair`` is called (the host load and GPU clocks are sampled there, so a GPU that heats as the
    pairs follow one another shows it pair by pair)."""

    rows = []
    per_format = Counter(pair.format for pair in pairs)
    for pair in pairs:
        # The trainer's run folder: the format's name, with the backend where the format has several.
        name = pair.format if per_format[pair.format] == 1 else f"{pair.format}-{pair.backend}"
        run_dir = str(out / "e2e" / name)
        model_dir = str(checkpoints[pair.format])
        if engine == "vllm":
            rows.append(_measure_isolated(cfg, pair, model_dir, engine, run_dir))
        else:
            try:
                rows.append(measure_pair(cfg, pair, model_dir, engine, run_dir))
            except QerlError:
                raise
            except Exception as exc:  # noqa: BLE001 - shown in the report; the other pairs still run
                log.exception("e2e step for %s failed", pair.label)
                rows.append(_failed(pair, f"{type(exc).__name__}: {exc}"))
            free_accelerator_memory()  # this pair's trainer (model, optimizer) before the next one loads
        take_case_clocks(rows[-1], host)
        if after_pair is not None:
            after_pair()
    return rows


def _worker(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())

    cfg = from_dict(E2EConfig, spec["cfg"])
    pair = E2EPair(**spec["pair"])
    out = Path(argv[1])
    # qerl's own decisions (which rollout backend auto chose and why, the memory plan) in the console,
    # as `qerl train` prints them; other libraries stay at warnings.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("qerl_cli").setLevel(logging.INFO)
    try:
        row = measure_pair(cfg, pair, spec["model_dir"], spec["engine"], spec["out_dir"])
    except Exception as exc:  # noqa: BLE001 - recorded in the row; the parent goes on with other pairs
        traceback.print_exc()
        row = _failed(pair, f"{type(exc).__name__}: {exc}")
    out.write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
