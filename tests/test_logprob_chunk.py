"""The memory plan's logprob chunk (``train.logprob_chunk_tokens: auto``): a smaller chunk before a smaller
micro-batch or checkpointing, on Gemma 3 270M's shape (a 262k vocabulary, where the chunk dominates)."""

from __future__ import annotations

import pytest

from qerl_cli.config import LORA_TARGETS_ALL, TrainConfig, load_config
from qerl_cli.errors import QerlError
from qerl_cli.rl import memory as mem

GIB = 2**30
GEMMA_270M = mem.ModelShape(hidden=640, intermediate=2048, layers=18, heads=4, kv_heads=1, vocab=262144,
                            head_dim=256, tie_embeddings=True)  # fmt: skip
# The measured case (18 runs sharing 4 GPUs, train.gpu_fraction=0.075): about 2.9 GiB left for the
# update's activations, 350-token sequences, at most 32 sequences a micro-batch.
TIGHT = int(2.9 * GIB)
SEQ_LEN = 350
MAX_MICRO = 32


def choose(budget: int, **kw) -> mem.MicroBatchChoice:
    return mem.choose_micro_batch(GEMMA_270M, "nvfp4", SEQ_LEN, budget, max_micro_batch=MAX_MICRO, **kw)


def test_auto_chunks_are_powers_of_two_from_1024_to_the_floor() -> None:
    assert mem.logprob_chunks("auto") == [1024, 512, 256, 128]
    assert mem.logprob_chunks(64) == [64] and mem.logprob_chunks(0) == [0]


def test_a_tight_budget_gets_a_smaller_chunk_instead_of_a_tiny_micro_batch() -> None:
    old = choose(TIGHT, logprob_chunk=1024)  # the rule before auto: the chunk fixed at 1024
    assert (old.micro_batch_size, old.gradient_checkpointing, old.logprob_chunk) == (2, True, 1024)
    new = choose(TIGHT)
    assert new.micro_batch_size >= 16 and new.activation_bytes <= TIGHT
    assert mem.MIN_AUTO_LOGPROB_CHUNK <= new.logprob_chunk < 1024
    # No chunk lets a saturating micro-batch fit without checkpointing here (at the floor, 9 x 350 tokens
    # fit, short of SATURATING_TOKENS): checkpointing, at the largest chunk that fits every sequence.
    assert (new.micro_batch_size, new.gradient_checkpointing, new.logprob_chunk) == (MAX_MICRO, True, 512)


def test_no_checkpointing_at_a_smaller_chunk_comes_before_checkpointing_at_1024() -> None:
    # Room for 12 sequences (4200 tokens, past SATURATING_TOKENS) without checkpointing at chunk 256, not 512.
    budget = mem.update_activation_bytes(
        GEMMA_270M, "nvfp4", 12, SEQ_LEN, checkpointing=False, logprob_chunk=256
    )
    assert 12 * SEQ_LEN >= mem.SATURATING_TOKENS
    got = choose(budget)
    assert (got.micro_batch_size, got.gradient_checkpointing, got.logprob_chunk) == (12, False, 256)
    assert choose(budget, logprob_chunk=1024).gradient_checkpointing  # at 1024 it needed checkpointing


def test_a_plentiful_budget_keeps_1024() -> None:
    roomy = choose(40 * GIB)
    assert (roomy.micro_batch_size, roomy.logprob_chunk) == (MAX_MICRO, 1024)
    assert not roomy.gradient_checkpointing


def test_an_explicit_chunk_is_kept() -> None:
    for chunk in (1024, 64, 0):
        assert choose(TIGHT, logprob_chunk=chunk, checkpointing=True, micro_batch=1).logprob_chunk == chunk
    assert choose(40 * GIB, logprob_chunk=256).logprob_chunk == 256


def test_the_error_names_the_chunk_when_an_explicit_one_does_not_fit() -> None:
    with pytest.raises(QerlError, match=r"set train.logprob_chunk_tokens to auto") as info:
        choose(GIB // 2, logprob_chunk=1024)
    assert "even with gradient checkpointing" in str(info.value)
    with pytest.raises(QerlError) as auto:
        choose(GIB // 8)
    assert "logprob_chunk_tokens" not in str(auto.value)  # auto already went down to the floor


def test_the_plan_carries_the_chunk_and_its_figure() -> None:
    # The HF engine keeps no vLLM reserve: the update's budget is what is free less the margin.
    args = dict(shape=GEMMA_270M, fmt="nvfp4", lora_rank=16, lora_targets=LORA_TARGETS_ALL, seq_len=SEQ_LEN,
                sequences_per_step=MAX_MICRO, micro_batch="auto", checkpointing="auto",
                gpu_memory_utilization=0.05, total_bytes=140 * GIB, free_bytes=TIGHT + mem.DEFAULT_MARGIN,
                engine="hf")  # fmt: skip
    plan = mem.plan_memory(logprob_chunk="auto", **args)
    assert (plan.micro_batch_size, plan.logprob_chunk) == (MAX_MICRO, 512)
    assert plan.figures[mem.CHUNK_FIGURE] == 512
    fixed = mem.plan_memory(logprob_chunk=1024, **args)
    assert (fixed.micro_batch_size, fixed.logprob_chunk, fixed.figures[mem.CHUNK_FIGURE]) == (2, 1024, 1024)
    cpu = mem.plan_memory(logprob_chunk="auto", **{**args, "total_bytes": None, "free_bytes": None})
    assert cpu.logprob_chunk == cpu.figures[mem.CHUNK_FIGURE] == mem.DEFAULT_LOGPROB_CHUNK


def test_the_setting_defaults_to_auto_and_is_checked() -> None:
    base = ["model.path=x"]
    assert load_config(TrainConfig, None, base).train.logprob_chunk_tokens == "auto"
    given = load_config(TrainConfig, None, [*base, "train.logprob_chunk_tokens=256"])
    assert given.train.logprob_chunk_tokens == 256
    with pytest.raises(QerlError, match=r"logprob_chunk_tokens must be >= 0"):
        load_config(TrainConfig, None, [*base, "train.logprob_chunk_tokens=-1"])
    with pytest.raises(QerlError, match="logprob_chunk_tokens"):
        load_config(TrainConfig, None, [*base, "train.logprob_chunk_tokens=big"])
