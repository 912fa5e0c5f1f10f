"""A completion's text: vLLM's per-token detokenizer runs only for stop strings, and otherwise the text
is decoded from the token ids after generation, by the very function the HF engine decodes with.

vLLM is the recording stand-in of tests/test_vllm_engine.py, which leaves a completion's text empty when
asked for ``detokenize=False`` as real vLLM does (and refuses stop strings without it). The decoding runs
on the tiny model's real byte-level tokenizer (``qerl_cli.modeling.tiny.build_tokenizer``), not a mock.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from test_vllm_engine import (  # noqa: F401 (fake_vllm is a fixture)
    CompletionOutput,
    FakeLLM,
    Logprob,
    RequestOutput,
    fake_vllm,
    make_engine,
)

from qerl_cli.modeling.tiny import build_tokenizer
from qerl_cli.rollout.base import SamplingSpec, completion_texts
from qerl_cli.rollout.hf import HFEngine
from qerl_cli.rollout.vllm_outputs import to_result

NO_STOP = SamplingSpec(max_new_tokens=8, temperature=0.7, top_p=1.0, top_k=-1, seed=3)
WITH_STOP = SamplingSpec(
    max_new_tokens=8, temperature=0.7, top_p=1.0, top_k=-1, seed=3, stop=("\nQuestion:",)
)


def _answer_ids(tokenizer) -> list[int]:
    """A completion ending in EOS (kept in the ids: it is learned), with a multi-byte character."""
    ids = tokenizer("The answer is <answer>5 €</answer>", add_special_tokens=False)["input_ids"]
    return [*ids, tokenizer.eos_token_id]


def _last_params(n_prompts: int) -> list:
    call = FakeLLM.instances[-1].calls[-1]
    assert call[0] == "generate" and len(call[3]) == n_prompts
    return call[3]


def test_without_stop_strings_vllm_does_not_detokenize_and_the_text_is_decoded_from_the_ids(
    tmp_path: Path,
    fake_vllm: types.ModuleType,  # noqa: F811
) -> None:
    tokenizer = build_tokenizer()
    ids = _answer_ids(tokenizer)
    fake_vllm.options.tokenizer = tokenizer
    fake_vllm.options.completion_ids = ids
    engine = make_engine(tmp_path)
    result = engine.generate(["What is 2+3?", "And 1+1?"], n=2, sampling=NO_STOP)

    # Re-enabling vLLM's per-token detokenizer without stop strings fails here (and below, where the
    # stand-in's text would then be vLLM's, not the decode of the ids).
    assert all(p.detokenize is False for p in _last_params(2))
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected == "The answer is <answer>5 €</answer>"  # EOS skipped, the multi-byte sign whole
    for _, completion in result.flat():
        assert completion.token_ids == ids and completion.token_ids[-1] == tokenizer.eos_token_id
        assert completion.text == expected


def test_with_stop_strings_vllm_detokenizes_and_its_text_is_kept(
    tmp_path: Path,
    fake_vllm: types.ModuleType,  # noqa: F811
) -> None:
    tokenizer = build_tokenizer()
    fake_vllm.options.tokenizer = tokenizer
    fake_vllm.options.completion_ids = _answer_ids(tokenizer)
    engine = make_engine(tmp_path)
    result = engine.generate(["What is 2+3?"], n=2, sampling=WITH_STOP)

    params = _last_params(1)
    assert params[0].detokenize is True and params[0].stop == ["\nQuestion:"]  # vLLM matches them in text
    assert [c.text for c in result.completions[0]] == ["c00", "c01"]  # vLLM's own, not decoded again


def test_to_result_decodes_only_when_vllm_did_not() -> None:
    class CountingTokenizer:
        def __init__(self) -> None:
            self.calls = 0

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            # vLLM's tokenizer interface promises decode, not batch_decode (a mistral tokenizer has none)
            self.calls += 1
            assert skip_special_tokens
            return f"decoded {ids}"

    def outputs(text: str) -> list[RequestOutput]:
        completions = [
            CompletionOutput(
                index=j,
                text=text,
                token_ids=[5 + j],
                logprobs=[{5 + j: Logprob(logprob=-0.5)}],
                finish_reason="stop",
            )
            for j in (1, 0)  # vLLM does not promise index order
        ]
        return [RequestOutput(prompt_token_ids=[1], outputs=completions)]

    kept = to_result(outputs("vllm's"), 2)
    assert [c.text for c in kept.completions[0]] == ["vllm's", "vllm's"]
    tokenizer = CountingTokenizer()
    decoded = to_result(outputs("") * 3, 2, tokenizer=tokenizer)
    assert tokenizer.calls == 6  # every completion of every prompt, once
    assert [c.text for c in decoded.completions[0]] == ["decoded [5]", "decoded [6]"]  # in index order


def test_hf_and_vllm_engines_give_the_same_text_for_the_same_tokens(
    tmp_path: Path,
    tiny_model_dir: Path,
    fake_vllm: types.ModuleType,  # noqa: F811
) -> None:
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    hf = HFEngine(model, tokenizer, generation_batch_size=2).generate(["Hi"], n=3, sampling=NO_STOP)
    fake_vllm.options.tokenizer = tokenizer
    engine = make_engine(tmp_path)
    for _, completion in hf.flat():
        fake_vllm.options.completion_ids = completion.token_ids  # vLLM samples what HF did
        vllm_text = engine.generate(["Hi"], n=1, sampling=NO_STOP).completions[0][0].text
        assert vllm_text == completion.text == completion_texts(tokenizer, [completion.token_ids])[0]


def test_the_detokenizer_runs_exactly_where_stop_strings_need_it(
    tmp_path: Path,
    fake_vllm: types.ModuleType,  # noqa: F811
) -> None:
    engine = make_engine(tmp_path)
    assert engine.sampling_params(1, SamplingSpec(max_new_tokens=4)).detokenize is False
    assert engine.sampling_params(1, SamplingSpec(max_new_tokens=4, stop=("x",))).detokenize is True
    with pytest.raises(ValueError, match="detokenize is True"):  # the stand-in holds vLLM's rule
        fake_vllm.SamplingParams(stop=["x"], detokenize=False)
