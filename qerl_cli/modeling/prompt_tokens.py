"""The one way a rendered prompt becomes token ids: as the model expects it, BOS exactly once.

A prompt rendered through the tokenizer's chat template already holds every special token the
model wants (the template writes BOS itself when the model needs it, as Llama 3's and Gemma's do),
so it is tokenised without adding any. A tokenizer without a chat template (a base model) gets
raw text, and the model then expects what the tokenizer adds on its own, which for Gemma or Llama
is BOS, which it was trained to see first: without it the prompt reads as text it never saw. Only
the *leading* special tokens are added: a tokenizer that also appends EOS would otherwise end the
prompt before the answer starts.
A text that already starts with them (a user's prompt written with a literal ``<bos>``) is left
as it is, so BOS is never doubled either.

Every engine and trainer path tokenises prompts here: the HF engine, the vLLM engine (which is
given the ids, since vLLM would add special tokens to a text prompt on top of the template's),
prompt-length filtering, the staleness probe and AWQ calibration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Any short text: only the ids the tokenizer adds around it matter.
_PROBE_TEXT = "0"


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def leading_special_ids(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before any text of its own accord (BOS for Gemma and Llama,
    nothing for GPT-2, Qwen or Llama-style chat models)."""
    plain = list(tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(_PROBE_TEXT, add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    # The text tokenised differently with special tokens around it: trust BOS alone.
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if full and bos is not None and full[0] == bos else []


def encode_prompts(
    texts: Sequence[str], tokenizer: Any, *, from_chat_template: bool | None = None
) -> list[list[int]]:
    """Token ids of rendered prompts (see the module docstring for which special tokens they get).

    ``from_chat_template``: whether the texts were rendered by the tokenizer's chat template; by
    default, whether it has one (prompts are rendered through it whenever it exists). Text that
    was not (AWQ calibration text, say) gets the tokenizer's leading special tokens.
    """
    if not texts:
        return []
    encoded = [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    if has_chat_template(tokenizer) if from_chat_template is None else from_chat_template:
        return encoded
    prefix = leading_special_ids(tokenizer)
    if not prefix:
        return encoded
    return [ids if ids[: len(prefix)] == prefix else [*prefix, *ids] for ids in encoded]


def encode_prompt(text: str, tokenizer: Any, *, from_chat_template: bool | None = None) -> list[int]:
    return encode_prompts([text], tokenizer, from_chat_template=from_chat_template)[0]
