"""Rollouts with ``transformers`` ``generate`` over the live (PEFT) policy model.

The engine holds the trainer's own model object, so every generation uses the current adapter
without any weight sync. What RL needs beyond plain ``generate``:

- per-token log-probabilities of the sampled tokens under ``log_softmax(logits / temperature)``
  (the untruncated distribution, see ``rollout.base.Completion``), for truncated importance
  sampling against the trainer's logprobs. A logits processor placed *first* in the chain reads the
  raw logits, so top-p / top-k truncation does not leak into them;
- seeded sampling that leaves the caller's global RNG streams untouched;
- AQN: norm noise applied only for the duration of ``generate`` and removed afterwards, because the
  trainer's forward runs on the same modules and must never see it.

The model's own ``generation_config`` (Qwen ships repetition_penalty, top_k, ...) is swapped for a
neutral one during the call: any processor we did not ask for would make the sampled distribution
differ from the logprobs we report and from what the trainer recomputes.
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from qerl_cli.config.checks import noise_sigma
from qerl_cli.errors import QerlError
from qerl_cli.modeling import adapter as adapter_folder
from qerl_cli.modeling.aqn import NormNoiser
from qerl_cli.modeling.prompt_tokens import encode_prompts
from qerl_cli.modeling.quant_linear import dense_weights
from qerl_cli.rollout.base import (
    COMPLETIONS,
    GENERATED_TOKENS,
    NOISE_CHANGED_FRACTION,
    NOISE_SIGMA,
    NORM_MODULES,
    PERTURBED_NORMS,
    SECONDS,
    TOKENS_PER_S,
    Completion,
    FinishReason,
    RolloutResult,
    SamplingSpec,
    completion_texts,
)

# The 4-bit base is frozen during a generate call, so its layers are dequantized once per call rather
# than at every generated token, where the dense copies fit in this (counted at 4 bytes a weight): small
# models, whose per-token dequantization is a large share of their decoding time. A larger model keeps
# the 4-bit footprint its memory plan counts on.
DENSE_BASE_MAX_BYTES = 256 * 2**20


class _SampledLogprobRecorder:
    """Logits processor that records ``log p_T(token)`` of each sampled token.

    At generation step t it receives the raw logits for step t and, in ``input_ids``, the token
    sampled at step t-1; it keeps only the previous step's log-softmax ([B, V]) instead of the
    whole history of logits, which would not fit for long completions and large vocabularies.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.prompt_length: int | None = None
        self._previous: torch.Tensor | None = None
        self.columns: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        else:
            self._take(input_ids[:, -1])
        self._previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        assert self._previous is not None
        self.columns.append(self._previous.gather(1, tokens.view(-1, 1)).squeeze(1))

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[B, generated] logprobs, given the full output sequences of ``generate``."""
        assert self.prompt_length is not None
        generated = sequences.shape[1] - self.prompt_length
        if len(self.columns) < generated:
            self._take(sequences[:, -1])
        self._previous = None
        if not self.columns:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack(self.columns[:generated], dim=1).float().cpu()


def _eos_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    config = getattr(_transformers_model(model), "generation_config", None)
    configured = getattr(config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.append(configured)
    elif configured:
        ids.extend(int(i) for i in configured)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise QerlError("the model and tokenizer define no EOS token; set eos_token in the tokenizer config")
    return ids


def _transformers_model(model: nn.Module) -> nn.Module:
    """The ``PreTrainedModel`` under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _warpers(spec: SamplingSpec) -> list[Any]:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers: list[Any] = []
    if spec.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(spec.temperature))
    if spec.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=spec.top_k))
    if spec.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=spec.top_p))
    return warpers


class HFEngine:
    """:class:`~qerl_cli.rollout.base.RolloutEngine` over an in-memory transformers / PEFT model.

    ``generation_batch_size`` bounds the number of sequences (prompt copies) per ``generate``
    call: the KV cache grows with it. ``noiser`` overrides which modules AQN perturbs (default: every
    ``*RMSNorm`` module).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        generation_batch_size: int = 64,
        device: str | torch.device | None = None,
        noiser: NormNoiser | None = None,
    ) -> None:
        if generation_batch_size < 1:
            raise QerlError(f"generation_batch_size must be >= 1, got {generation_batch_size}")
        if tokenizer.pad_token_id is None:
            raise QerlError("the tokenizer has no pad token; batched generation needs one (set pad_token)")
        self.model = model
        self.tokenizer = tokenizer
        self.generation_batch_size = generation_batch_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.noiser = noiser if noiser is not None else NormNoiser(model)
        self.eos_ids = _eos_ids(model, tokenizer)
        self._sigma = 0.0
        self._noise_seed = 0
        self._adapter_disabled = False

    # ----------------------------------------------------------------------------------------
    # RolloutEngine
    # ----------------------------------------------------------------------------------------
    def set_norm_noise(self, sigma: float, seed: int) -> int:
        """Noise the norms for the following ``generate`` calls (drawn once per call from ``seed``, so
        every call until the next ``set_norm_noise`` sees the same noise). The weights stay clean
        between calls."""
        noise_sigma("AQN sigma", sigma)
        if sigma > 0 and self.noiser.num_modules == 0:
            raise QerlError(
                "AQN is on (sigma > 0) but the rollout model has no RMSNorm module to perturb; "
                "use a model with RMSNorm layers or set aqn.enabled=false"
            )
        self._sigma, self._noise_seed = float(sigma), int(seed)
        return self.noiser.num_modules if sigma > 0 else 0

    def sync_adapter(self, adapter_dir: str | None) -> None:
        """No-op for the live adapter the engine shares with the trainer. ``None`` generates with the
        base model (adapters disabled); a folder loads that PEFT adapter's weights into the model."""
        if adapter_dir is None:
            self._adapter_disabled = hasattr(self.model, "disable_adapter")
            return
        self._adapter_disabled = False
        adapter_folder.load_weights(self.model, adapter_dir)

    def sync_policy(self, peft_model: Any) -> None:
        """Nothing to do for the trainer's own model, which this engine generates with; another
        PEFT model's adapter weights are copied into this engine's model."""
        self._adapter_disabled = False
        if peft_model is self.model:
            return
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        set_peft_model_state_dict(self.model, get_peft_model_state_dict(peft_model))

    def check_staleness(
        self,
        probe_ids: Sequence[int],
        trainer_logprobs: Callable[[Sequence[int]], Sequence[float]],
        reference_logprobs: Callable[[Sequence[int]], Sequence[float]] | None = None,
    ) -> float | None:
        """None: the engine's weights are the trainer's (or copied from them), nothing can be stale."""
        return None

    def score(self, sequences: Sequence[Sequence[int]], *, with_adapter: bool = True) -> list[list[float]]:
        """The model's teacher-forced logprobs of every list (``RolloutEngine.score``): one sequence a
        forward (no padding), the float32 log-softmax of its logits, no noise, in eval mode. The base
        alone when ``with_adapter`` is False or ``sync_adapter(None)`` disabled the adapter (as vLLM
        scores with no LoRA request then)."""
        lists = [list(ids) for ids in sequences]
        if any(len(ids) < 2 for ids in lists):
            raise ValueError("score needs 2 token ids a sequence at least")
        was_training = self.model.training
        self.model.eval()
        adapters = (
            self.model.disable_adapter()
            if (not with_adapter or self._adapter_disabled) and hasattr(self.model, "disable_adapter")
            else nullcontext()
        )
        out: list[list[float]] = []
        try:
            with torch.no_grad(), adapters:
                for ids in lists:
                    tokens = torch.tensor([ids], device=self.device)
                    logits = self.model(input_ids=tokens, use_cache=False).logits[0, :-1].float()
                    picked = torch.log_softmax(logits, dim=-1).gather(1, tokens[0, 1:, None])[:, 0]
                    out.append(picked.cpu().tolist())
        finally:
            self.model.train(was_training)
        return out

    @property
    def linear_backend(self) -> str:
        return "trainer"  # generates with the trainer's own modules

    def stats(self) -> dict[str, float]:
        return {
            NORM_MODULES: float(self.noiser.num_modules),
            NOISE_SIGMA: self._sigma,
            PERTURBED_NORMS: float(self.noiser.num_modules if self._sigma > 0 else 0),
        }

    def close(self) -> None:
        """Nothing to release: the model belongs to the caller."""

    def sleep(self) -> None:
        # The HF engine has no persistent KV cache: generate's cache dies with the call. What is
        # left to free is the allocator's cache, so the update phase can use that memory. On a CPU
        # there is no such cache, and a full gc pass cost ~0.5 s a step (a tenth of a tiny run).
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Nothing to restore: weights never left the device."""

    def generate(self, prompts: list[str], n: int, sampling: SamplingSpec) -> RolloutResult:
        if n < 1:
            raise QerlError(f"number of samples per prompt must be >= 1, got {n}")
        if sampling.max_new_tokens < 1:
            raise QerlError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        if sampling.temperature < 0:
            raise QerlError(f"temperature must be >= 0, got {sampling.temperature}")
        start = time.perf_counter()
        prompt_ids = encode_prompts(prompts, self.tokenizer)  # BOS as the model expects it
        if any(len(ids) == 0 for ids in prompt_ids):
            raise QerlError("an empty prompt cannot be generated from; every prompt needs at least one token")
        rows = [i for i in range(len(prompts)) for _ in range(n)]  # prompt-major: groups contiguous
        completions: list[Completion] = []
        with self._generation_mode(sampling), self._seeded(sampling.seed):
            for begin in range(0, len(rows), self.generation_batch_size):
                chunk = rows[begin : begin + self.generation_batch_size]
                completions.extend(self._generate_chunk([prompt_ids[i] for i in chunk], sampling))
        seconds = time.perf_counter() - start
        grouped = [completions[i * n : (i + 1) * n] for i in range(len(prompts))]
        result = RolloutResult(prompt_token_ids=prompt_ids, completions=grouped)
        tokens = result.num_generated_tokens
        result.stats = {
            SECONDS: seconds,
            GENERATED_TOKENS: float(tokens),
            TOKENS_PER_S: tokens / seconds if seconds > 0 else 0.0,
            COMPLETIONS: float(len(rows)),
            NOISE_SIGMA: self._sigma,
            NOISE_CHANGED_FRACTION: self.noiser.last_changed_fraction if self._sigma > 0 else 0.0,
        }
        return result

    # ----------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------
    @contextmanager
    def _generation_mode(self, spec: SamplingSpec) -> Iterator[None]:
        """Eval mode (no dropout), neutral generation config, adapters as requested, AQN noise on;
        everything restored on exit, even when generation fails."""
        from transformers import GenerationConfig

        base = _transformers_model(self.model)
        was_training = self.model.training
        saved_config = base.generation_config
        base.generation_config = GenerationConfig(
            # Benchmarks run to the length limit: no EOS to stop on (its logit is left alone, so the
            # reported logprobs stay those of the model).
            eos_token_id=None if spec.ignore_eos else self.eos_ids,
            pad_token_id=int(self.tokenizer.pad_token_id),
        )
        generator = torch.Generator(device="cpu").manual_seed(self._noise_seed)
        self.model.eval()
        try:
            with (
                self.noiser.noised(self._sigma, generator),
                self._adapters(),
                dense_weights(self.model, DENSE_BASE_MAX_BYTES),
            ):
                yield
        finally:
            base.generation_config = saved_config
            self.model.train(was_training)

    @contextmanager
    def _adapters(self) -> Iterator[None]:
        if self._adapter_disabled:
            with self.model.disable_adapter():
                yield
        else:
            yield

    @contextmanager
    def _seeded(self, seed: int | None) -> Iterator[None]:
        # generate samples with the global RNG; fork it so a seeded rollout neither depends on nor
        # disturbs the trainer's random stream (dropout, data order).
        if seed is None:
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    def _generate_chunk(self, prompts: Sequence[list[int]], spec: SamplingSpec) -> list[Completion]:
        pad = int(self.tokenizer.pad_token_id)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        greedy = spec.temperature == 0
        recorder = _SampledLogprobRecorder(1.0 if greedy else spec.temperature)
        kwargs: dict[str, Any] = {}
        if not greedy:  # neutral built-in warpers: ours run after the recorder
            kwargs.update(temperature=1.0, top_k=0, top_p=1.0)
        if spec.stop:
            kwargs.update(stop_strings=list(spec.stop), tokenizer=self.tokenizer)
        with torch.no_grad():
            sequences = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                max_new_tokens=spec.max_new_tokens,
                do_sample=not greedy,
                use_cache=True,
                logits_processor=[recorder] if greedy else [recorder, *_warpers(spec)],
                **kwargs,
            )
        logprobs = recorder.finish(sequences)
        generated = sequences[:, width:].cpu()
        cut = [self._cut(generated[row].tolist(), spec) for row in range(len(prompts))]
        texts = completion_texts(self.tokenizer, [ids for ids, _ in cut])
        return [
            Completion(ids, text, logprobs[row, : len(ids)].tolist(), finish)
            for row, ((ids, finish), text) in enumerate(zip(cut, texts, strict=True))
        ]

    def _cut(self, ids: list[int], spec: SamplingSpec) -> tuple[list[int], FinishReason]:
        """The completion's ids up to its first EOS (kept: it is learned) or up to the token that
        completes its first stop string, whichever comes first, and why it ended: as vLLM ends its
        completions. transformers fills a row that a stopping criterion ended with the pad token up to
        the batch's longest row; those pads are no sampled tokens, whether the pad is an EOS or not
        (Gemma's tokenizer pads with a token of its own)."""
        eos_end = None
        if not spec.ignore_eos:
            eos_end = next((pos + 1 for pos, token in enumerate(ids) if token in self.eos_ids), None)
        kept = ids if eos_end is None else ids[:eos_end]
        stop_end = self._stop_end(kept, spec.stop) if spec.stop else None
        if stop_end is not None:
            return ids[:stop_end], "stop"
        if eos_end is not None:
            return kept, "stop"
        if not spec.stop:  # no criterion but EOS stops a row early: a pad at the end was sampled
            return ids, "length"
        # Pads with no EOS or stop string before them: transformers ended the row on a stop string that
        # its token-level match found and the decoded text does not show (special tokens skipped): the
        # row stopped there all the same, and the pads after it were never sampled.
        end = len(ids)
        while end and ids[end - 1] == self.tokenizer.pad_token_id:
            end -= 1
        return (ids[:end], "stop") if end < len(ids) else (ids, "length")

    def _stop_end(self, ids: list[int], stop: Sequence[str]) -> int | None:
        """The shortest prefix of ``ids`` whose text holds a stop string, as its length (None: none
        does). A prefix that holds one is followed only by longer ones that do: a binary search, a
        handful of decodes a completion."""

        def holds(length: int) -> bool:
            text = completion_texts(self.tokenizer, [ids[:length]])[0]
            return any(s in text for s in stop)

        if not ids or not holds(len(ids)):
            return None
        return 1 + bisect_left(range(1, len(ids) + 1), True, key=holds)  # holds(len(ids)) is true
