"""The HF rollout engine: layout, logprobs that match a plain forward, seeding, AQN, factory."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import replace

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.rollout.base import RolloutEngine, SamplingSpec
from qerl_cli.rollout.factory import EngineRequest, make_engine
from qerl_cli.rollout.hf import HFEngine

PROMPTS = ["<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n", "Hi"]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, load_tokenizer(str(tiny_model_dir))


@pytest.fixture()
def engine(model_and_tokenizer) -> HFEngine:
    model, tokenizer = model_and_tokenizer
    return HFEngine(model, tokenizer, generation_batch_size=4)


def _forward_logprobs(
    model, prompt_ids: list[int], completion_ids: list[int], temperature: float
) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion_ids)[:, None])[:, 0]


def test_engine_satisfies_the_protocol(engine: HFEngine) -> None:
    assert isinstance(engine, RolloutEngine)


def test_generate_layout_and_logprobs_match_an_unpadded_forward(
    engine: HFEngine, model_and_tokenizer
) -> None:
    model, _ = model_and_tokenizer
    spec = SamplingSpec(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=3)
    result = engine.generate(PROMPTS, 3, spec)
    assert len(result.completions) == 2 and all(len(g) == 3 for g in result.completions)
    assert [i for i, _ in result.flat()] == [0, 0, 0, 1, 1, 1]
    # Prompts of different lengths share a left-padded batch (chunks of 4 rows): padding must not
    # change the logprobs, and they are log_softmax(logits / T) untruncated by top-p.
    for i, completion in result.flat():
        assert len(completion.token_ids) == len(completion.logprobs) >= 1
        expected = _forward_logprobs(model, result.prompt_token_ids[i], completion.token_ids, 0.7)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
    assert result.stats["rollout/generated_tokens"] == result.num_generated_tokens > 0
    assert result.stats["rollout/completions"] == 6


def test_finish_reason_length_without_eos(engine: HFEngine) -> None:
    result = engine.generate(PROMPTS, 4, SamplingSpec(max_new_tokens=6, temperature=1.0, top_p=1.0, seed=0))
    for _, c in result.flat():
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in engine.eos_ids
        else:
            assert len(c.token_ids) == 6 and not set(c.token_ids) & set(engine.eos_ids)


def test_finish_reason_stop_keeps_the_eos_token(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    # Every token ends the sequence: each completion is exactly one token, finished by "EOS".
    engine.eos_ids = list(range(model.config.vocab_size))
    result = engine.generate(["abc"], 3, SamplingSpec(max_new_tokens=5, temperature=1.0, top_p=1.0, seed=0))
    for _, c in result.flat():
        assert c.finish_reason == "stop" and len(c.token_ids) == 1 and len(c.logprobs) == 1
    # Benchmarks ignore EOS: the same engine then runs every completion to the limit.
    forced = engine.generate(["abc"], 2, SamplingSpec(max_new_tokens=5, seed=0, ignore_eos=True))
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for _, c in forced.flat())


def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone(engine: HFEngine) -> None:
    spec = SamplingSpec(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=11)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = engine.generate(PROMPTS, 2, spec)
    assert torch.equal(torch.get_rng_state(), before)
    b = engine.generate(PROMPTS, 2, spec)
    c = engine.generate(PROMPTS, 2, SamplingSpec(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=12))
    ids = [[x.token_ids for _, x in r.flat()] for r in (a, b, c)]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_greedy_and_ignore_eos(engine: HFEngine) -> None:
    greedy = SamplingSpec(max_new_tokens=7, temperature=0.0, ignore_eos=True)
    a = engine.generate(PROMPTS, 2, greedy)
    assert all(len(c.token_ids) == 7 and c.finish_reason == "length" for _, c in a.flat())
    # Greedy: both samples of a prompt are identical.
    assert a.completions[0][0].token_ids == a.completions[0][1].token_ids


def test_aqn_noise_only_during_generation(engine: HFEngine, model_and_tokenizer) -> None:
    model, _ = model_and_tokenizer
    clean = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    spec = SamplingSpec(max_new_tokens=6, temperature=1.0, top_p=1.0, seed=5)
    plain = engine.generate(PROMPTS, 2, spec)
    assert engine.set_norm_noise(0.5, seed=1) == 5  # 2 layers x 2 norms + the final norm
    noised = engine.generate(PROMPTS, 2, spec)
    again = engine.generate(PROMPTS, 2, spec)
    # Same (sigma, seed): the same noise every call; the trainer's weights are clean in between.
    for name, param in model.named_parameters():
        if name in clean:
            assert torch.equal(param, clean[name]), name
    lp = [[c.logprobs for _, c in r.flat()] for r in (plain, noised, again)]
    assert lp[1] == lp[2] and lp[0] != lp[1]
    assert noised.stats["rollout/noise_sigma"] == 0.5 and noised.stats["rollout/noise_changed_fraction"] > 0.9
    assert engine.set_norm_noise(0.0, seed=1) == 0
    assert [c.logprobs for _, c in engine.generate(PROMPTS, 2, spec).flat()] == lp[0]
    for bad in (-0.5, math.nan, math.inf):  # the rule every engine's noise follows (config.checks)
        with pytest.raises(QerlError, match="AQN sigma must be a finite number >= 0"):
            engine.set_norm_noise(bad, seed=1)


def test_aqn_without_norms_fails_loudly(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    engine.noiser.modules = {}
    with pytest.raises(QerlError, match="no RMSNorm"):
        engine.set_norm_noise(1e-2, seed=0)
    assert engine.set_norm_noise(0.0, seed=0) == 0


def test_engine_always_uses_the_current_adapter(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_tokenizer
    from qerl_cli.modeling.lora import attach_lora

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = attach_lora(base, r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    engine = HFEngine(model, load_tokenizer(str(tiny_model_dir)))
    spec = SamplingSpec(max_new_tokens=5, temperature=1.0, top_p=1.0, seed=0)
    before = [c.logprobs for _, c in engine.generate(["abc"], 2, spec).flat()]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    after = [c.logprobs for _, c in engine.generate(["abc"], 2, spec).flat()]
    assert before != after
    engine.sync_adapter(None)  # the base model: adapters off
    base_lp = [c.logprobs for _, c in engine.generate(["abc"], 2, spec).flat()]
    assert base_lp == before
    engine.sleep()
    engine.wake_up()


def test_score_honours_an_adapter_disabled_by_sync_adapter_none(tiny_model_dir) -> None:
    """``sync_adapter(None)`` scores the base alone, as vLLM does with no LoRA request (``with_adapter``
    True or not); a folder synced after it turns the adapter back on."""
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_tokenizer
    from qerl_cli.modeling.lora import attach_lora

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = attach_lora(base, r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    engine = HFEngine(model, load_tokenizer(str(tiny_model_dir)))
    ids = [[5, 9, 13, 2, 7], [1, 2, 3]]
    adapted, bare = engine.score(ids), engine.score(ids, with_adapter=False)
    assert adapted != bare
    engine.sync_adapter(None)
    assert engine.score(ids) == bare and engine.score(ids, with_adapter=False) == bare
    engine.sync_policy(model)  # the live adapter again
    assert engine.score(ids) == adapted


def test_make_engine_hf_loads_a_folder(tiny_model_dir) -> None:
    engine = make_engine(EngineRequest("hf", tiny_model_dir, dtype="float32", device="cpu"))
    result = engine.generate(["abc"], 2, SamplingSpec(max_new_tokens=3, seed=0))
    assert len(result.flat()) == 2


def test_make_engine_errors() -> None:
    with pytest.raises(QerlError, match="unknown rollout engine"):
        make_engine(EngineRequest("tgi", "x"))
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(QerlError, match=r'pip install -e "\.\[vllm\]"'):
            make_engine(EngineRequest("vllm", "x"))
    with pytest.raises(QerlError, match="only apply to the vllm engine"):
        make_engine(EngineRequest("hf", "x", gpu_memory_utilization=0.5))


def test_a_4bit_base_is_dequantized_once_per_call_with_the_same_samples(
    tiny_model_dir, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.modeling.loading import load_policy_model, load_tokenizer
    from qerl_cli.modeling.quant_linear import QuantLinear, dense_weights
    from qerl_cli.rl.warmstart import quantize_folder
    from qerl_cli.rollout import hf

    model, _ = load_policy_model(
        quantize_folder(tiny_model_dir, tmp_path / "nvfp4", "nvfp4"), dtype=torch.float32
    )
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    engine = HFEngine(model, load_tokenizer(str(tiny_model_dir)), generation_batch_size=4)
    calls = []
    dequantize = QuantLinear.dequantized_weight
    monkeypatch.setattr(
        QuantLinear, "dequantized_weight", lambda self, *a: calls.append(self) or dequantize(self, *a)
    )
    spec = SamplingSpec(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=5, ignore_eos=True)
    cached = engine.generate(PROMPTS, 3, spec)
    assert len(calls) == len(layers) and set(calls) == set(layers)  # once each, for 2 chunks x 8 tokens
    assert all(layer._dense is None for layer in layers)  # dropped when the call ends
    monkeypatch.setattr(hf, "DENSE_BASE_MAX_BYTES", 0)  # a base too large for dense copies
    packed = engine.generate(PROMPTS, 3, spec)
    assert [c.token_ids for _, c in cached.flat()] == [c.token_ids for _, c in packed.flat()]
    assert [c.logprobs for _, c in cached.flat()] == [c.logprobs for _, c in packed.flat()]
    # A forward that needs gradients (the update's) keeps rebuilding the weight from the packed buffers.
    with dense_weights(model, 2**30) as on:
        assert on
        x = torch.randn(2, layers[0].in_features, requires_grad=True)
        layers[0](x).sum().backward()
        assert x.grad is not None and layers[0]._dense == {}


def test_a_stop_string_ends_the_completion_without_the_pad_tokens_after_it(model_and_tokenizer) -> None:
    """transformers pads a row a stop string ended up to the batch's longest row; where the pad token is
    no EOS (Gemma's tokenizer pads with id 0, its EOS is another) the completion must still end at the
    token completing the stop string, as vLLM's does: the pads are no sampled tokens (a real run scored
    and would have trained 12817 of them among 15735 completion tokens)."""
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer, generation_batch_size=4)
    pad = int(tokenizer.pad_token_id)
    engine.eos_ids = [i for i in engine.eos_ids if i != pad]  # the pad is no EOS here, as with Gemma
    spec = SamplingSpec(max_new_tokens=16, temperature=1.0, top_p=1.0, seed=5)
    free = engine.generate(PROMPTS, 2, spec)
    # A stop string that the first completion reaches early (its third token's text): that row ends
    # there while the batch goes on, so transformers pads it.
    first = free.completions[0][0]
    assert len(first.token_ids) > 4, "the seed must give a completion longer than its stop"
    stop = tokenizer.decode(first.token_ids[2:3], skip_special_tokens=True)
    assert stop.strip(), "the stop string must be visible text"
    stopped = engine.generate(PROMPTS, 2, replace(spec, stop=(stop,)))
    for _, completion in stopped.flat():
        assert len(completion.token_ids) == len(completion.logprobs)
        if completion.finish_reason == "stop" and stop in completion.text:
            # ends with the token completing the stop string: no prefix shorter holds it
            shorter = tokenizer.decode(completion.token_ids[:-1], skip_special_tokens=True)
            assert stop not in shorter
        assert pad not in completion.token_ids[-1:], completion.token_ids
    head = stopped.completions[0][0]
    assert head.finish_reason == "stop" and len(head.token_ids) <= 3
    assert head.token_ids == first.token_ids[: len(head.token_ids)]


def test_cut_ends_each_completion_as_vllm_does(model_and_tokenizer) -> None:
    """The cut of one generated row, on ids made by hand: at the first EOS (kept) or at the token that
    completes the first stop string, whichever comes first; never on the pads transformers fills a row
    with after a stopping criterion ended it, whether the pad is an EOS or not."""
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    pad = int(tokenizer.pad_token_id)
    eos = next(i for i in engine.eos_ids if i != pad)
    engine.eos_ids = [eos]  # the pad is no EOS (Gemma's tokenizer)
    text = tokenizer("abc STOP def", add_special_tokens=False).input_ids
    stop_end = next(n for n in range(1, len(text) + 1) if "STOP" in tokenizer.decode(text[:n]))
    assert stop_end < len(text)
    head = tokenizer("abc", add_special_tokens=False).input_ids
    stop = SamplingSpec(max_new_tokens=64, stop=("STOP",))
    cut = engine._cut
    assert cut([*text, pad, pad], stop) == (text[:stop_end], "stop")  # stopped early, then padded
    assert cut([*text, eos], stop) == (text[:stop_end], "stop")  # the stop string before the EOS
    assert cut([*head, eos, *text], stop) == ([*head, eos], "stop")  # the EOS before the stop string
    assert cut([*text, eos], replace(stop, ignore_eos=True)) == (text[:stop_end], "stop")
    assert cut([*head, pad, pad], stop) == (head, "stop")  # ended by a match the text does not show
    assert cut(head, stop) == (head, "length")
    assert cut([*head, eos, pad], SamplingSpec(max_new_tokens=64)) == ([*head, eos], "stop")
    # No stop string, so nothing but an EOS ends a row early: a pad at its end was sampled, and kept
    # (bench rollout runs with ignore_eos and checks every completion's length).
    assert cut([*head, pad], SamplingSpec(max_new_tokens=64)) == ([*head, pad], "length")
    assert cut([pad], SamplingSpec(max_new_tokens=64, ignore_eos=True)) == ([pad], "length")
    engine.eos_ids = [eos, pad]  # the pad is an EOS (SmolLM2's): the stop still ends it, not the pad
    assert cut([*text, pad, pad], stop) == (text[:stop_end], "stop")
    assert cut([*head, pad, pad], SamplingSpec(max_new_tokens=64)) == ([*head, pad], "stop")
