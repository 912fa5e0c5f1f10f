"""Prompt token ids start with BOS exactly once, whichever way the prompt was rendered.

Gemma's tokenizer (a base model: no chat template) adds BOS, and every prompt path used to tokenise
with ``add_special_tokens=False``, which dropped it. Templates that write BOS themselves must not
get a second one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qerl_cli.data.prompts import prompt_token_ids, render_prompt
from qerl_cli.modeling.prompt_tokens import encode_prompt, encode_prompts, leading_special_ids
from qerl_cli.modeling.tiny import build_tokenizer

BOS = "<|endoftext|>"


def bos_tokenizer(*, chat_template: str | None = None, add_eos: bool = False):
    """The tiny byte tokenizer turned into a Gemma-like one: it adds BOS (and EOS if asked) itself."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = build_tokenizer().backend_tokenizer
    bos_id, eos_id = backend.token_to_id(BOS), backend.token_to_id("<|im_end|>")
    suffix = " <|im_end|>" if add_eos else ""
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A{suffix}",
        pair=f"{BOS} $A {BOS} $B{suffix}",
        special_tokens=[(BOS, bos_id), ("<|im_end|>", eos_id)],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def _count(ids: list[int], token: int) -> int:
    return sum(1 for i in ids if i == token)


def test_no_chat_template_gets_the_tokenizers_bos_exactly_once() -> None:
    tokenizer = bos_tokenizer()
    bos = tokenizer.bos_token_id
    assert tokenizer("Q?", add_special_tokens=False)["input_ids"][0] != bos  # the old path lost it
    ids = prompt_token_ids("What is 2+3?", tokenizer, "plain")
    assert ids[0] == bos and _count(ids, bos) == 1
    assert ids[1:] == tokenizer("What is 2+3?", add_special_tokens=False)["input_ids"]
    # a prompt that already spells BOS out is not given a second one
    assert encode_prompt(f"{BOS}Q?", tokenizer) == encode_prompt("Q?", tokenizer)


def test_a_chat_template_that_writes_bos_is_not_doubled() -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}A:"
    tokenizer = bos_tokenizer(chat_template=template)
    text = render_prompt("What is 2+3?", tokenizer, "plain")
    assert text.startswith(BOS)
    ids = prompt_token_ids("What is 2+3?", tokenizer, "plain")
    assert ids[0] == tokenizer.bos_token_id and _count(ids, tokenizer.bos_token_id) == 1


def test_only_leading_special_tokens_are_added() -> None:
    # A tokenizer that appends EOS must not end the prompt with it: the model would stop or restart.
    tokenizer = bos_tokenizer(add_eos=True)
    assert leading_special_ids(tokenizer) == [tokenizer.bos_token_id]
    ids = encode_prompt("Q?", tokenizer)
    assert ids[0] == tokenizer.bos_token_id and ids[-1] != tokenizer.eos_token_id


def test_tokenizers_without_bos_are_unchanged() -> None:
    tokenizer = build_tokenizer()  # ChatML, no BOS (Qwen, SmolLM2)
    assert leading_special_ids(tokenizer) == []
    texts = [render_prompt("Q?", tokenizer, "qerl"), "plain text"]
    assert encode_prompts(texts, tokenizer) == tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert encode_prompts([], tokenizer) == []


def test_text_not_rendered_by_the_template_gets_bos_even_when_there_is_one() -> None:
    tokenizer = bos_tokenizer(chat_template="{{ bos_token }}{{ messages[0]['content'] }}")
    assert encode_prompt("doc", tokenizer)[0] != tokenizer.bos_token_id  # taken as template output
    assert encode_prompt("doc", tokenizer, from_chat_template=False)[0] == tokenizer.bos_token_id


def test_awq_calibration_text_starts_with_bos(tmp_path: Path) -> None:
    from qerl_cli.quantize.calibration import load_calibration

    path = tmp_path / "calib.jsonl"
    rows = [{"text": f"Document number {i} about sums."} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = bos_tokenizer()
    calib = load_calibration(str(path), tokenizer, num_samples=3, seq_len=8, seed=0)
    bos = tokenizer.bos_token_id
    assert all(s[0] == bos and _count(s, bos) == 1 and len(s) == 8 for s in calib.samples)


@pytest.mark.parametrize("template", [None, "{{ bos_token }}{{ messages[-1]['content'] }}"])
def test_the_hf_engine_generates_from_the_same_ids(template: str | None) -> None:
    import torch

    from qerl_cli.modeling.tiny import build_tiny_model
    from qerl_cli.rollout.base import SamplingSpec
    from qerl_cli.rollout.hf import HFEngine

    tokenizer = bos_tokenizer(chat_template=template)
    engine = HFEngine(build_tiny_model(0), tokenizer, device=torch.device("cpu"))
    prompt = render_prompt("Q?", tokenizer, "plain")
    result = engine.generate([prompt], n=1, sampling=SamplingSpec(max_new_tokens=2, temperature=0.0))
    assert result.prompt_token_ids == [prompt_token_ids("Q?", tokenizer, "plain")]
    assert _count(result.prompt_token_ids[0], tokenizer.bos_token_id) == 1
