"""Prompt templates: the one place where a question becomes a prompt, for training and eval alike.

Every run records :func:`prompt_record` (template name, instruction, placement, system prompt and
a hash of them) so that a training run and its evaluation can be checked to have used the same
prompt.

Templates
---------
``qerl`` (default): the instruction NVlabs/QeRL uses for BigMath training and for its GSM8K/AMC
    evaluation (``utils/data.py`` ``get_bigmath_questions`` and ``eval/gsm8k.py``), given as the
    *system* message with the question as the user message, as there. The original text is a
    triple-quoted, indented Python string; here it is the same words with the indentation removed.
``boxed``: the question followed by "Please reason step by step, and put your final answer within
    \\boxed{}." in the user message (the DeepSeek-R1 / Qwen math evaluation convention).
``plain``: the question alone (synthetic tasks for tiny models).

An explicit ``system_prompt`` becomes the system message; a ``qerl`` instruction then moves to the
end of the user message, so it is never silently dropped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from qerl_cli.errors import QerlError
from qerl_cli.modeling.prompt_tokens import encode_prompt, has_chat_template

Placement = Literal["system", "user_suffix", "none"]

QERL_INSTRUCTION = (
    "Solve the following math problem step by step. The reasoning process and direct answer are "
    "enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>: \n"
    "<think>\n...\n</think>\n<answer>\n...\n</answer>"
)
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    instruction: str | None
    placement: Placement
    source: str

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "instruction": self.instruction, "placement": self.placement}


TEMPLATES: dict[str, PromptTemplate] = {
    "qerl": PromptTemplate(
        "qerl", QERL_INSTRUCTION, "system", "NVlabs/QeRL utils/data.py and eval/gsm8k.py (system message)"
    ),
    "boxed": PromptTemplate("boxed", BOXED_INSTRUCTION, "user_suffix", "DeepSeek-R1 / Qwen math eval"),
    "plain": PromptTemplate("plain", None, "none", "question only, for synthetic tasks"),
}


def get_template(name: str) -> PromptTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise QerlError(f"unknown prompt template '{name}': choose one of {', '.join(TEMPLATES)}") from None


def build_messages(question: str, template: str = "qerl", system_prompt: str | None = None) -> list[dict]:
    """Chat messages for ``question`` (system message first when there is one)."""
    tpl = get_template(template)
    user = question.strip()
    system = system_prompt
    if tpl.instruction is not None:
        if tpl.placement == "system" and system is None:
            system = tpl.instruction
        else:
            user = f"{user}\n\n{tpl.instruction}"
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return messages


def render_prompt(
    question: str, tokenizer: Any, template: str = "qerl", system_prompt: str | None = None
) -> str:
    """The prompt string an engine generates from (chat template applied, generation prompt added).

    A tokenizer without a chat template (a base model) gets the raw text instead: the system text,
    a blank line, then the user text. Templates that refuse a system role get it folded into the
    user message.
    """
    messages = build_messages(question, template, system_prompt)
    if tokenizer is None or not has_chat_template(tokenizer):
        return "\n\n".join(m["content"] for m in messages)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        if messages[0]["role"] != "system":
            raise QerlError(f"the tokenizer's chat template failed on a prompt: {exc}") from exc
        merged = [{"role": "user", "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"}]
        return tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(
    question: str, tokenizer: Any, template: str = "qerl", system_prompt: str | None = None
) -> list[int]:
    """The prompt's token ids as the model expects them: :func:`render_prompt`, then BOS exactly once
    (:func:`qerl_cli.modeling.prompt_tokens.encode_prompt`, which the engines use on the same text)."""
    return encode_prompt(render_prompt(question, tokenizer, template, system_prompt), tokenizer)


def template_hash(template: str = "qerl", system_prompt: str | None = None) -> str:
    """A short, stable hash of what decides the prompt text besides the tokenizer."""
    payload = {**get_template(template).record(), "system_prompt": system_prompt}
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def chat_template_hash(tokenizer: Any) -> str | None:
    """Hash of the tokenizer's chat template (None when it has none): prompts depend on it too."""
    text = getattr(tokenizer, "chat_template", None)
    if not text:
        return None
    if not isinstance(text, str):  # some tokenizers hold a dict of named templates
        text = json.dumps(text, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prompt_record(template: str = "qerl", system_prompt: str | None = None, tokenizer: Any = None) -> dict:
    """What a run stores about its prompts (results.json, the training run's metadata)."""
    tpl = get_template(template)
    return {
        **tpl.record(),
        "source": tpl.source,
        "system_prompt": system_prompt,
        "template_hash": template_hash(template, system_prompt),
        "chat_template_hash": chat_template_hash(tokenizer) if tokenizer is not None else None,
    }
