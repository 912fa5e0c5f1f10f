"""The paper's entropy claim measured directly: rollout entropy of a BF16 vs a 4-bit model before training.

Same prompts, same seeds, same sampling (temperature 1). Two figures per model:

- ``sampled_entropy``: -mean log p of the sampled tokens (the Monte-Carlo estimate ``qerl train`` logs);
- ``exact_entropy``: the mean over generated positions of the full next-token distribution's entropy,
  from one teacher-forced forward over each model's own completions.
"""

from __future__ import annotations

from typing import Any

import torch

from qerl_cli.rollout import factory
from qerl_cli.rollout.base import SamplingSpec


@torch.no_grad()
def exact_token_entropy(
    model: Any, prompt_ids: list[list[int]], completions: list[list[int]], device: Any
) -> float:
    total, count = 0.0, 0
    for prompt, completion in zip(prompt_ids, completions, strict=True):
        if not completion:
            continue
        ids = torch.tensor([prompt + completion], device=device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        total += float(-(logp.exp() * logp).sum(dim=-1).sum())
        count += len(completion)
    return total / max(count, 1)


def rollout_entropy(
    model_path: str, prompts: list[str], n: int, max_new_tokens: int, seed: int, device: str = "auto",
    dtype: str = "bfloat16", batch: int = 128, trust_remote_code: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Sample ``n`` completions per prompt from ``model_path`` (no adapter, no noise) and measure entropy.

    ``batch``: completions per generate call (the recipe's ``rollout.generation_batch_size``).
    """

    engine = factory.make_engine(factory.EngineRequest(
        "hf", model_path, dtype=dtype, device=device, generation_batch_size=batch,
        trust_remote_code=trust_remote_code,
    ))  # fmt: skip
    spec = SamplingSpec(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, seed=seed)
    result = engine.generate(prompts, n, spec)
    pairs = result.flat()
    tokens = sum(len(c.token_ids) for _, c in pairs)
    sampled = -sum(sum(c.logprobs) for _, c in pairs) / max(tokens, 1)
    exact = exact_token_entropy(
        engine.model, [result.prompt_token_ids[i] for i, _ in pairs], [c.token_ids for _, c in pairs],
        engine.device,
    )  # fmt: skip
    return {
        "model": model_path,
        "completions": len(pairs),
        "tokens": tokens,
        "mean_length": tokens / max(len(pairs), 1),
        "sampled_entropy": sampled,
        "exact_entropy": exact,
        "texts": [c.text for _, c in pairs[:4]],
    }
