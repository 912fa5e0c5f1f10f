"""``rl.update.update_policy`` on a fixed batch: its stats describe one pass over the batch whatever
``algorithm.num_iterations``, and the policy ratio compares logprobs taken in one dropout state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_cli.config import TrainConfig, load_config
from qerl_cli.data.problem import Problem
from qerl_cli.rl.policy import build_policy
from qerl_cli.rl.rollouts import Rollouts
from qerl_cli.rl.update import update_policy
from qerl_cli.rollout.base import Completion

GROUP = 4


def _cfg(model_dir: Path, *overrides: str) -> TrainConfig:
    return load_config(
        TrainConfig,
        None,
        [
            f"model.path={model_dir}",
            "model.dtype=float32",
            "rollout.num_generations=4",
            "rollout.max_completion_length=8",
            "train.device=cpu",
            "train.gradient_checkpointing=false",
            "lora.rank=4",
            "lora.alpha=8",
            *overrides,
        ],
    )


def _batch(vocab: int, completion_len: int = 6) -> Rollouts:
    """Two groups of four fixed completions (``completion_len`` tokens each; 6: 48 completion tokens),
    rewards varying."""
    generator = torch.Generator().manual_seed(0)
    batch = Rollouts(group_size=GROUP)
    for row in range(2 * GROUP):
        tokens = torch.randint(3, vocab, (completion_len,), generator=generator).tolist()
        batch.problems.append(Problem(id=str(row // GROUP), question="q", answer="1"))
        batch.prompt_ids.append(torch.randint(3, vocab, (5,), generator=generator).tolist())
        batch.completions.append(Completion(tokens, "x", [-1.0] * len(tokens), "stop"))
        batch.rewards.append(float(row % 2))
    return batch


def _update(model_dir: Path, *overrides: str, lr: float = 0.0) -> dict[str, float]:
    cfg = _cfg(model_dir, *overrides)
    torch.manual_seed(0)
    policy = build_policy(cfg, torch.device("cpu"))
    with torch.no_grad():  # PEFT starts B at zero, where LoRA dropout changes nothing
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    params = policy.named_trainable_parameters()
    optimizer = torch.optim.SGD([p for _, p in params], lr=lr)
    batch = _batch(policy.model.config.vocab_size)
    return update_policy(cfg, policy, optimizer, params, batch, tis_on=False, micro_batch_size=3,
                         logprob_chunk=1024)  # fmt: skip


def test_stats_describe_one_pass_whatever_the_iterations(tiny_model_dir: Path) -> None:
    once = _update(tiny_model_dir, "algorithm.num_iterations=1")
    twice = _update(tiny_model_dir, "algorithm.num_iterations=2")
    assert once["num_tokens"] == twice["num_tokens"] == 48  # not 96: the batch is counted once
    # lr 0: both iterations see the same policy, so the mean over iterations is one pass's loss
    assert twice["loss"] == pytest.approx(once["loss"], rel=1e-4, abs=1e-6)
    assert twice["policy_loss"] == pytest.approx(once["policy_loss"], rel=1e-4, abs=1e-6)


def test_the_ratio_compares_logprobs_taken_without_dropout(tiny_model_dir: Path) -> None:
    # With LoRA dropout 0.5 and no parameter change, old and new logprobs differ only if they are
    # taken in different dropout states: the ratio must be 1 and nothing clipped.
    stats = _update(tiny_model_dir, "algorithm.num_iterations=2", "lora.dropout=0.5")
    assert stats["ratio_min"] == pytest.approx(1.0, abs=1e-4)
    assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert stats["clip_fraction"] == 0.0


def test_a_nonfinite_gradient_norm_takes_no_step_and_leaves_no_gradient(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.rl.distributed import Distributed
    from qerl_cli.rl.losses import NonFiniteGradientError

    def nan_after_sum(dist: Distributed, params: list) -> None:  # a finite loss, one NaN gradient entry
        params[0][1].grad.view(-1)[0] = float("nan")

    monkeypatch.setattr(Distributed, "all_reduce_gradients", nan_after_sum)
    cfg = _cfg(tiny_model_dir)
    torch.manual_seed(0)
    policy = build_policy(cfg, torch.device("cpu"))
    params = policy.named_trainable_parameters()
    before = {n: p.detach().clone() for n, p in params}
    optimizer = torch.optim.SGD([p for _, p in params], lr=1.0)
    batch = _batch(policy.model.config.vocab_size)
    with pytest.raises(
        NonFiniteGradientError, match=r"gradient norm is nan \(non-finite gradients in 1 of"
    ) as info:
        update_policy(cfg, policy, optimizer, params, batch, tis_on=False, micro_batch_size=3,
                      logprob_chunk=1024)  # fmt: skip
    assert info.value.metric == "nonfinite_grad"
    assert all(p.grad is None for _, p in params)
    assert all(torch.equal(before[n], p.detach()) for n, p in params)


@pytest.mark.parametrize("chunk", [0, 4])
def test_padding_leaves_bfloat16_gradients_finite(tiny_model_dir: Path, chunk: int) -> None:
    """Paths once suspected of a finite loss with NaN gradients: left-padded prompts (a padding query
    whose every key is masked), an empty completion and one of padding ids only, in bfloat16, with and
    without the chunked LM head. The update raises NonFiniteGradientError if a gradient is NaN/inf."""
    cfg = _cfg(tiny_model_dir, "model.dtype=bfloat16")
    torch.manual_seed(0)
    policy = build_policy(cfg, torch.device("cpu"))
    params = policy.named_trainable_parameters()
    batch = _batch(policy.model.config.vocab_size)
    batch.prompt_ids[0] = batch.prompt_ids[0][:1]  # the widest left padding
    batch.completions[1] = Completion([], "", [], "stop")
    pad = int(policy.tokenizer.pad_token_id)
    batch.completions[2] = Completion([pad, pad], "", [-1.0, -1.0], "length")
    optimizer = torch.optim.SGD([p for _, p in params], lr=0.0)
    stats = update_policy(cfg, policy, optimizer, params, batch, tis_on=False, micro_batch_size=3,
                          logprob_chunk=chunk)  # fmt: skip
    assert stats["grad_norm"] > 0 and torch.isfinite(torch.tensor(stats["grad_norm"]))


def test_the_update_runs_the_plans_chunk_and_chunks_128_and_1024_agree(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk given to the update is the LM head's chunk (the memory plan's ``logprob_chunk``), and a
    128-token chunk gives the 1024-token chunk's loss and gradients on a micro-batch of 320 scored tokens."""
    from qerl_cli.rl import logprobs

    seen: list[tuple[int, int]] = []  # (rows through the head, chunk) of each call
    apply = logprobs.LinearLogprob.apply

    def recording(hidden, weight, targets, temperature, chunk):  # type: ignore[no-untyped-def]
        seen.append((hidden.shape[0], chunk))
        return apply(hidden, weight, targets, temperature, chunk)

    monkeypatch.setattr(logprobs.LinearLogprob, "apply", recording)
    cfg = _cfg(tiny_model_dir, "rollout.max_completion_length=40")
    results = {}
    for chunk in (128, 1024):
        torch.manual_seed(0)
        policy = build_policy(cfg, torch.device("cpu"))
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)
        params = policy.named_trainable_parameters()
        optimizer = torch.optim.SGD([p for _, p in params], lr=0.0)
        batch = _batch(policy.model.config.vocab_size, completion_len=40)
        seen.clear()
        stats = update_policy(cfg, policy, optimizer, params, batch, tis_on=False, micro_batch_size=8,
                              logprob_chunk=chunk)  # fmt: skip
        assert seen == [(8 * 40, chunk)]  # one micro-batch, its 320 tokens in chunks of the given size
        results[chunk] = stats
    for key in ("loss", "grad_norm"):
        assert results[128][key] == pytest.approx(results[1024][key], rel=1e-5, abs=1e-7)
    assert results[128]["grad_norm"] > 0


def test_the_optimizer_steps_run_in_the_update_phase_and_the_fixed_logprobs_outside_it(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The phase a GPU watcher tags its readings with (``rl.phase``) is ``update`` over the span timed as
    ``time_update_s`` only: the no-grad logprob pass before it is ``time_logprobs_s``, and after it the
    step is in no phase."""
    from qerl_cli.rl import update as update_mod
    from qerl_cli.rl.phase import OTHER, UPDATE, phase_state

    seen: list[tuple[str, str]] = []

    def watched(name: str, original):  # -> the original, noting the phase it was called in
        def call(*args, **kwargs):
            seen.append((name, phase_state()[0]))
            return original(*args, **kwargs)

        return call

    for name in ("fixed_inputs", "accumulate_gradients", "clip_and_step"):
        monkeypatch.setattr(update_mod, name, watched(name, getattr(update_mod, name)))
    _update(tiny_model_dir)
    assert seen == [("fixed_inputs", OTHER), ("accumulate_gradients", UPDATE), ("clip_and_step", UPDATE)]
    assert phase_state()[0] == OTHER
