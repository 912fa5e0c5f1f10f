"""``qerl bench gap``'s trainer side: the policy model as ``qerl train`` builds it from the recipe, the
adapter every side serves, the sequences every backend scores, and the trainer's own logprobs of them.

The policy is :func:`qerl_cli.rl.policy.build_policy` of the recipe (its base loading, quantized linear
layers, dtype and LoRA), its memory plan ``rl.setup.plan_with_base_compute`` (vLLM's share of the GPU,
``auto`` resolved as training resolves it, the update's micro-batch and LM-head chunk). AQN is off.

- **adapter** ``random``: the recipe's LoRA with B drawn N(0, 0.01^2) from the seed (PEFT starts B at
  zero, and a zero adapter would let an engine skip its LoRA path), saved once as a PEFT folder that the
  trainer holds in memory and every engine loads; ``none``: the base alone (adapters off everywhere).
- **sequences**: the first ``sequences`` prompts of the recipe's own seeded order (the prompts its
  training would take from step 1, ``rl.stream.PromptStream``), rendered with its template (chosen before
  the policy is built, so too large a ``--sequences`` fails first), each with ONE completion sampled by
  the policy through training's transformers rollout engine (``rl.setup.make_engine`` with
  ``rollout.engine=hf``) with training's own sampling (``rl.rollouts.sampling_spec``: the recipe's
  temperature, ``top_p`` and its template's stop strings), only ``max_tokens`` and the seed the
  benchmark's. No vLLM backend sampled them, so none is favoured.
- **trainer logprobs**: log p(token | prefix) of each completion token at temperature 1 (raw
  log-softmax, as every engine scores: vLLM's prompt logprobs take no temperature), by the trainer's
  no-grad forward (``rl.policy.batched_logprobs``, the old-policy pass of an update) with the plan's
  micro-batch and LM-head chunk.
- **hf** (when ``--backends`` names it): the same engine's ``score`` of the sequences over the live
  policy (its base-compute settings, fused kernels and adapter: training's own HF rollout), the floor.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from qerl_cli.bench.adapter import RANDOM_B_SD
from qerl_cli.bench.gap_report import SCORE_TEMPERATURE, BackendResult
from qerl_cli.bench.gap_settings import HF_BACKEND, GapSettings
from qerl_cli.config import TrainConfig
from qerl_cli.errors import QerlError
from qerl_cli.files import write_json
from qerl_cli.modeling.loading import load_tokenizer
from qerl_cli.rl import setup
from qerl_cli.rl.policy import Policy, batched_logprobs, build_policy, make_token_batch
from qerl_cli.rl.rollouts import sampling_spec
from qerl_cli.rl.stream import PromptStream, load_training_problems, render_prompts
from qerl_cli.rollout.base import RolloutEngine, SamplingSpec
from qerl_cli.torch_utils import free_accelerator_memory

log = logging.getLogger(__name__)

SEQUENCES_FILE = "sequences.json"
TRAINER_FILE = "trainer_logprobs.json"
ADAPTER_DIR = "adapter"


@dataclass
class GapSequence:
    """One scored sequence: a prompt's token ids and the completion sampled for it."""

    index: int
    problem_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    finish_reason: str

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.completion_ids]


@dataclass
class TrainerSide:
    """What the trainer side hands the backends: the sequences, the trainer's logprobs of each
    completion token, the adapter folder (None: the base alone) and vLLM's share of the GPU."""

    sequences: list[GapSequence]
    trainer_logprobs: list[list[float]]
    adapter_dir: str | None
    gpu_memory_utilization: float
    base_format: str
    seconds: dict[str, float]
    hf: BackendResult | None = None  # the hf backend, scored here (None: not asked for)


def gap_train_config(recipe: TrainConfig, settings: GapSettings) -> TrainConfig:
    """The recipe as the benchmark runs it: AQN off, room in vLLM's context for a prompt and
    ``max_tokens`` completion tokens (plus the one token a scoring request generates), and a vLLM rollout
    engine when a vLLM backend is measured (the memory plan then resolves vLLM's share beside the
    trainer, as that training run would)."""
    vllm = any(b != HF_BACKEND for b in settings.backends)
    rollout = replace(
        recipe.rollout,
        engine="vllm" if vllm else "hf",  # hf alone: no vLLM share for the memory plan to keep
        max_completion_length=max(recipe.rollout.max_completion_length, settings.max_tokens + 1),
    )
    return replace(recipe, rollout=rollout, aqn=replace(recipe.aqn, enabled=False))


def randomize_adapter(policy: Policy, seed: int) -> int:
    """Draw every LoRA B of the policy from N(0, RANDOM_B_SD^2) (seeded, in a fixed order); returns how
    many matrices were drawn."""
    generator = torch.Generator().manual_seed(seed)
    drawn = 0
    with torch.no_grad():
        for name, param in sorted(policy.model.named_parameters(), key=lambda item: item[0]):
            if "lora_B" in name:
                values = torch.randn(param.shape, generator=generator) * RANDOM_B_SD
                param.copy_(values.to(param.dtype))
                drawn += 1
    if not drawn:
        raise QerlError("the policy has no LoRA B matrix to draw; check lora.target_modules")
    return drawn


def chosen_prompts(cfg: TrainConfig, count: int) -> tuple[list[str], list[str]]:
    """(problem ids, rendered prompts) of the first ``count`` prompts of the recipe's seeded order; with
    the tokenizer alone, so that too few prompts fail before the policy is built."""
    tokenizer = load_tokenizer(
        cfg.model.path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
    )
    problems, prompts = render_prompts(cfg, load_training_problems(cfg), tokenizer)
    if len(problems) < count:
        raise QerlError(
            f"--sequences {count}: the recipe's training data has {len(problems)} prompts that fit "
            f"rollout.max_prompt_length; give --sequences {len(problems)} or fewer"
        )
    taken = PromptStream(problems, cfg.train.seed, cfg.data.shuffle).take(count)
    return [p.id for p in taken], [prompts[p.id] for p in taken]


def gap_sampling_spec(cfg: TrainConfig, settings: GapSettings) -> SamplingSpec:
    """Training's sampling of the recipe (its temperature, ``top_p``, stop strings, ...), only the length
    and the seed the benchmark's."""
    return replace(sampling_spec(cfg, 0, 0), max_new_tokens=settings.max_tokens, seed=settings.seed)


def sample_sequences(
    engine: RolloutEngine, ids: list[str], prompts: list[str], spec: SamplingSpec
) -> list[GapSequence]:
    """One completion per chosen prompt, sampled through the rollout engine."""
    result = engine.generate(prompts, 1, spec)
    return [
        GapSequence(i, pid, list(prompt_ids), list(group[0].token_ids), group[0].finish_reason)
        for i, (pid, prompt_ids, group) in enumerate(
            zip(ids, result.prompt_token_ids, result.completions, strict=True)
        )
    ]


def completion_logprobs(scored: Sequence[Sequence[float]], sequences: list[GapSequence]) -> list[list[float]]:
    """Each sequence's scored logprobs (one a token after the first) cut to its completion tokens."""
    return [list(lp[len(lp) - len(s.completion_ids) :]) for lp, s in zip(scored, sequences, strict=True)]


def score_hf(engine: RolloutEngine, sequences: list[GapSequence], with_adapter: bool) -> BackendResult:
    """The hf backend: training's transformers engine over the live policy scores the sequences (its
    failure is the backend's error row)."""
    started = time.perf_counter()
    try:
        scored = engine.score([s.token_ids for s in sequences], with_adapter=with_adapter)
    except Exception as exc:  # noqa: BLE001 - the row says why; the other backends go on
        log.exception("bench gap: backend hf failed")
        return BackendResult(HF_BACKEND, error=f"{type(exc).__name__}: {exc}")
    return BackendResult(HF_BACKEND, engine.linear_backend, 0.0, time.perf_counter() - started,
                         completion_logprobs(scored, sequences))  # fmt: skip


def trainer_logprobs(
    policy: Policy, sequences: list[GapSequence], micro_batch: int, chunk: int, with_adapter: bool
) -> list[list[float]]:
    """The trainer's log p(token | prefix) of every completion token at temperature 1 (no noise)."""
    pad = int(policy.tokenizer.pad_token_id)
    prompts = [s.prompt_ids for s in sequences]
    completions = [s.completion_ids for s in sequences]
    batch = make_token_batch(prompts, completions, [[0.0] * len(c) for c in completions], pad)
    t = SCORE_TEMPERATURE
    if with_adapter:
        values = batched_logprobs(policy.model, batch, t, policy.device, micro_batch, chunk_tokens=chunk)
    else:
        with policy.bare_base():
            values = batched_logprobs(policy.model, batch, t, policy.device, micro_batch, chunk_tokens=chunk)
    return [values[row, : len(c)].tolist() for row, c in enumerate(completions)]


def prepare_trainer_side(
    cfg: TrainConfig, settings: GapSettings, out: Path, chosen: tuple[list[str], list[str]]
) -> TrainerSide:
    """Build the policy, write the adapter (``random``), sample the sequences for the ``chosen`` prompts
    (:func:`chosen_prompts`, taken before the output folder is made: too few fails at once), take the
    trainer's logprobs of them and (``hf`` asked for) the HF engine's; writes ``sequences.json`` and
    ``trainer_logprobs.json`` in ``out`` and frees the policy's memory before returning (the engines that
    follow need the GPU)."""
    seconds: dict[str, float] = {}
    setup.seed_everything(settings.seed)
    ids, prompts = chosen
    started = time.perf_counter()
    policy = build_policy(cfg)
    try:
        plan = setup.plan_with_base_compute(cfg, policy)
        seconds["load"] = time.perf_counter() - started
        with_adapter = settings.adapter == "random"
        adapter_dir = None
        if with_adapter:
            randomize_adapter(policy, settings.seed)
            adapter_dir = str(policy.save_adapter(out / ADAPTER_DIR))
        hf_cfg = replace(cfg, rollout=replace(cfg.rollout, engine="hf"))
        engine = setup.make_engine(hf_cfg, policy, gpu_memory_utilization=0.0)  # the HF engine takes none
        try:
            if not with_adapter:
                engine.sync_adapter(None)  # the base alone
            started = time.perf_counter()
            sequences = sample_sequences(engine, ids, prompts, gap_sampling_spec(cfg, settings))
            seconds["sample"] = time.perf_counter() - started
            started = time.perf_counter()
            trainer = trainer_logprobs(policy, sequences, plan.micro_batch_size, plan.logprob_chunk,
                                       with_adapter)  # fmt: skip
            seconds["trainer_logprobs"] = time.perf_counter() - started
            hf = score_hf(engine, sequences, with_adapter) if HF_BACKEND in settings.backends else None
        finally:
            engine.close()
        side = TrainerSide(sequences, trainer, adapter_dir, plan.gpu_memory_utilization, policy.base_format,
                           seconds, hf)  # fmt: skip
    finally:
        policy.close()
        del policy
        free_accelerator_memory()
    write_sequences(out, side)
    return side


def write_sequences(out: Path, side: TrainerSide) -> None:
    write_json(out / SEQUENCES_FILE, {"sequences": [asdict(s) for s in side.sequences]})
    write_json(out / TRAINER_FILE, {"trainer_logprobs": side.trainer_logprobs})


def read_sequences(path: str | Path) -> list[GapSequence]:
    """The sequences of a ``sequences.json`` (what every backend's worker scores)."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return [GapSequence(**s) for s in data["sequences"]]
