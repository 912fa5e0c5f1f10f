"""vLLM outputs -> qerl's: completions, sampled-token and prompt logprobs, and the staleness
check's figures and message. Part of the vLLM rollout engine (``rollout.vllm_engine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qerl_cli.rollout.backends import FP8_MERGED
from qerl_cli.rollout.base import Completion, FinishReason, RolloutResult, SamplingSpec, completion_texts


def finish_reason(reason: str | None) -> FinishReason:
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop"
    # "abort" (or None) means vLLM dropped the request, e.g. it was put to sleep mid-generation.
    raise RuntimeError(f"vLLM returned an unfinished completion (finish_reason={reason!r})")


def sampled_token_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """Logprob of each sampled token from a CompletionOutput's ``logprobs``.

    With ``logprobs=0`` vLLM returns exactly the sampled token per position, either as
    ``FlatLogprobs`` (flat lists; read directly, no per-token dict is built) or as a list of
    ``{token_id: Logprob}`` dicts.
    """
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although SamplingParams(logprobs=0) asked for them")
    flat_ids = getattr(logprobs, "token_ids", None)
    flat_values = getattr(logprobs, "logprobs", None)
    if (
        isinstance(flat_values, list)
        and flat_ids is not None
        and len(flat_values) == len(token_ids)
        and list(flat_ids) == list(token_ids)
    ):
        return [float(v) for v in flat_values]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprob positions for {len(token_ids)} tokens")
    return [float(position[token].logprob) for token, position in zip(token_ids, logprobs, strict=True)]


def prompt_token_logprobs(token_ids: Sequence[int], prompt_logprobs: Any) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1 from a RequestOutput's ``prompt_logprobs``
    (position 0 is None: the first token has no context)."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no prompt logprobs for a scored sequence")
    return [float(prompt_logprobs[i][token_ids[i]].logprob) for i in range(1, len(token_ids))]


def score_prompts(
    llm: Any, vllm: Any, token_id_lists: Sequence[Sequence[int]], lora_request: Any
) -> list[list[float]]:
    """log p(ids[i] | ids[:i]), i >= 1, of every token-id list, from one ``llm.generate`` call that asks
    for the prompts' logprobs and generates one token each (``lora_request`` None: the base model)."""
    lists = [list(ids) for ids in token_id_lists]
    if any(len(ids) < 2 for ids in lists):
        raise ValueError("scoring needs 2 token ids a sequence at least")
    if not lists:
        return []
    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids in lists]
    outputs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
    return [prompt_token_logprobs(ids, out.prompt_logprobs) for ids, out in zip(lists, outputs, strict=True)]


def mean_abs_gap(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(len(a), 1)


# Rollout weights on other numerics (an FP8 copy, merged or not) may put vLLM's base model this many
# staleness tolerances away from the trainer's.
BASE_TOLERANCE_FACTOR = 2.0


@dataclass(frozen=True)
class NumericsCheck:
    """Whether a staleness gap is the rollout weights' numerics: ``base_gap``, vLLM's base model vs the
    trainer's (adapter off on both); ``effect_gap``, how far the adapter's effect in vLLM is from its
    effect in the trainer."""

    base_gap: float
    effect_gap: float
    tolerance: float

    @property
    def ok(self) -> bool:
        # Twice the tolerance for the bases: TIS corrects rollouts a little off the policy, not far off.
        return self.effect_gap <= self.tolerance and self.base_gap <= BASE_TOLERANCE_FACTOR * self.tolerance


def numerics_explain(
    engine_lp: Sequence[float],
    engine_base_lp: Sequence[float],
    trainer_lp: Sequence[float],
    trainer_base_lp: Sequence[float],
    tolerance: float,
) -> NumericsCheck:
    """Compare the adapter's effect (with minus without) in vLLM and in the trainer: a served adapter
    moves both alike even when the rollout weights (an FP8 copy) shift every logprob."""
    effect = [(e - b) - (t - r) for e, b, t, r in zip(engine_lp, engine_base_lp, trainer_lp, trainer_base_lp,
                                                      strict=True)]  # fmt: skip
    return NumericsCheck(
        base_gap=mean_abs_gap(engine_base_lp, trainer_base_lp),
        effect_gap=sum(abs(x) for x in effect) / max(1, len(effect)),
        tolerance=tolerance,
    )


def staleness_message(
    gap: float,
    tolerance: float,
    lora_id: int | None,
    engine_lp: list[float],
    base_lp: list[float] | None,
    trainer_lp: Sequence[float],
    numerics: NumericsCheck | None = None,
) -> str:
    """Why vLLM's logprobs are ``gap`` away from the trainer's, from the figures at hand: no adapter,
    an adapter that changes nothing (the base model is sampled), or another adapter than the trainer's."""
    head = (
        f"vLLM's logprobs differ from the trainer's by {gap:.3f} nats/token on the probe prompt "
        f"(rollout.staleness_tolerance={tolerance}): rollouts are not sampled from the policy being trained."
    )
    if lora_id is None:
        return (
            head + " No adapter is loaded in vLLM: call sync_adapter with the trainer's adapter after each "
            "update."
        )
    adapter_effect = mean_abs_gap(engine_lp, base_lp or engine_lp)
    base_gap = mean_abs_gap(base_lp or engine_lp, trainer_lp)
    if numerics is not None and numerics.effect_gap <= numerics.tolerance:
        return (
            f"{head} The adapter acts alike in vLLM and the trainer, but vLLM's base model is "
            f"{numerics.base_gap:.3f} nats/token from the trainer's, past twice the tolerance: the rollout "
            "model's numerics (rollout.linear_backend, KV-cache dtype) are too far off for truncated "
            "importance sampling. Use rollout.linear_backend=marlin (the 4-bit weights as they are)"
        )
    if adapter_effect < 1e-4:
        cause = (
            f"vLLM gives identical logprobs with and without adapter id {lora_id}: "
            "rollouts are sampling the base model (the adapter's target modules are not applied)."
        )
    else:
        cause = (
            f"The adapter changes vLLM's logprobs by {adapter_effect:.3f} and the base model is "
            f"{base_gap:.3f} from the trainer: the adapter vLLM loaded is not the one the trainer uses "
            "(stale file, wrong folder or mismatched lora.alpha/rank)."
        )
    return (
        f"{head} {cause} Check that the adapter saved after each update is the trained one; raise "
        "rollout.staleness_tolerance only if the gap is explained by quantization numerics."
    )


def merged_staleness_message(gap: float, tolerance: float, factor: float, backend: str) -> str:
    """Why vLLM's logprobs are ``gap`` away from the trainer's when the adapter is merged into its
    weights (``backend``: fp8-merged or merged), allowed ``factor`` x ``tolerance``: there is no
    adapter-free vLLM model to tell a stale merge from the weights' rounding."""
    fp8 = backend == FP8_MERGED
    alternative = (
        "rollout.linear_backend=fp8, which serves the LoRA in vLLM and tells the FP8 copy's numerics from a "
        "stale adapter"
        if fp8
        else "the default rollout.linear_backend, which serves the LoRA in vLLM"
    )
    return (
        f"vLLM's logprobs differ from the trainer's by {gap:.3f} nats/token on the probe prompt (allowed: "
        f"{factor:g} x rollout.staleness_tolerance={tolerance}) with the adapter merged into its weights "
        f"(rollout.linear_backend={backend}): the merge is not the trainer's policy (another base than "
        f"model.path{', or FP8 rounding past the allowance' if fp8 else ''}). Use {alternative}"
    )


def vllm_detokenizes(sampling: SamplingSpec) -> bool:
    """Whether vLLM's own detokenizer runs during generation: only for stop strings, which vLLM matches
    in the text it detokenizes (it refuses stop strings with ``detokenize=False``).

    Otherwise it is off: it takes one DecodeStream step per token per request on the engine's loop, and
    with the engine core in qerl's process that loop also feeds the GPU (vLLM 0.26, 7B, 128 x 2048 tokens:
    38% of the engine loop in a rollout, 48% in a GRPO step, the GPU busy about half the time).
    EOS, ``max_tokens`` and stop token ids need no text; the rewards' text is decoded once afterwards.
    """
    return bool(sampling.stop)


def to_result(outputs: Sequence[Any], n: int, tokenizer: Any = None) -> RolloutResult:
    """Group vLLM RequestOutputs (n completions each, sorted by index) into a RolloutResult.

    ``tokenizer``: given when vLLM ran without its detokenizer (``detokenize=False``: its texts are
    empty), and then every completion's text is decoded here, as the HF engine decodes
    (:func:`~qerl_cli.rollout.base.completion_texts`). Without it vLLM's own texts are kept.
    """
    prompt_ids: list[list[int]] = []
    ordered: list[list[Any]] = []
    for output in outputs:
        if len(output.outputs) != n:
            raise RuntimeError(f"vLLM returned {len(output.outputs)} completions for a prompt, expected {n}")
        prompt_ids.append(list(output.prompt_token_ids))
        ordered.append(sorted(output.outputs, key=lambda c: c.index))
    flat = [c for group in ordered for c in group]
    token_ids = [list(c.token_ids) for c in flat]
    # Never a second decode of what vLLM already detokenized.
    texts = [c.text for c in flat] if tokenizer is None else completion_texts(tokenizer, token_ids)
    completions = [
        Completion(
            token_ids=ids,
            text=text,
            logprobs=sampled_token_logprobs(ids, c.logprobs),
            finish_reason=finish_reason(c.finish_reason),
        )
        for c, ids, text in zip(flat, token_ids, texts, strict=True)
    ]
    groups = [completions[i * n : (i + 1) * n] for i in range(len(ordered))]
    return RolloutResult(prompt_token_ids=prompt_ids, completions=groups)
