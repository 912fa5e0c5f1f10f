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
``qerl-fewshot``: three worked word problems ("Question: ... / Answer: ... The answer is N."), then
    the question and "Answer:", for base models without a chat template (the ``gemma3-270m`` alias): a base
    model continues a document, so it needs to be shown what an answer looks like. Generation stops
    at the next "Question:" the model starts on its own.

Each template names the answer format it asks for (:mod:`qerl_cli.rewards.format`): the format
reward and ``format_rate`` check that one. ``plain`` asks for none, so a ``system_prompt`` given
with it decides (:func:`expected_answer_format`).

An explicit ``system_prompt`` becomes the system message; a ``qerl`` instruction then moves to the
end of the user message, so it is never silently dropped.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from qerl_cli.errors import QerlError, closest
from qerl_cli.modeling.prompt_tokens import encode_prompt, has_chat_template

if TYPE_CHECKING:
    from qerl_cli.config import DataSection
    from qerl_cli.rewards.format import AnswerFormat

Placement = Literal["system", "user_suffix", "fewshot", "none"]

QERL_INSTRUCTION = (
    "Solve the following math problem step by step. The reasoning process and direct answer are "
    "enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>: \n"
    "<think>\n...\n</think>\n<answer>\n...\n</answer>"
)
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# Worked examples in the shape of GSM8K and the synthetic word problems, one operation each, so a
# base model sees the arithmetic written out and the closing sentence the grader reads.
FEWSHOT_EXAMPLES = (
    "Question: Tom has 12 marbles and finds 7 more. How many marbles does Tom have now?\n"
    "Answer: 12 + 7 = 19. The answer is 19.\n\n"
    "Question: A baker made 45 rolls and sold 18 of them. How many rolls are left?\n"
    "Answer: 45 - 18 = 27. The answer is 27.\n\n"
    "Question: Each box holds 6 pens. How many pens are in 4 boxes?\n"
    "Answer: 6 * 4 = 24. The answer is 24."
)
FEWSHOT_STOP = ("\nQuestion:",)


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    instruction: str | None
    placement: Placement
    source: str
    # The answer shape the prompt asks for, checked by the format reward and format_rate.
    answer_format: AnswerFormat = "any"
    # Where generation ends besides EOS: a base model goes on to write the next example.
    stop: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        record = {"name": self.name, "instruction": self.instruction, "placement": self.placement}
        if self.stop:  # only when set, so the hashes of the templates that have none stay as they were
            record["stop"] = list(self.stop)
        return record


TEMPLATES: dict[str, PromptTemplate] = {
    "qerl": PromptTemplate(
        "qerl",
        QERL_INSTRUCTION,
        "system",
        "NVlabs/QeRL utils/data.py and eval/gsm8k.py (system message)",
        answer_format="think_answer",
    ),
    "boxed": PromptTemplate(
        "boxed", BOXED_INSTRUCTION, "user_suffix", "DeepSeek-R1 / Qwen math eval", answer_format="boxed"
    ),
    "plain": PromptTemplate("plain", None, "none", "question only, for synthetic tasks"),
    "qerl-fewshot": PromptTemplate(
        "qerl-fewshot",
        FEWSHOT_EXAMPLES,
        "fewshot",
        "three worked examples, for base models (no chat template)",
        answer_format="answer_is",
        stop=FEWSHOT_STOP,
    ),
}


def get_template(name: str, key: str = "template") -> PromptTemplate:
    """The template ``name``; an unknown one is refused naming ``key`` (the setting that gave it), the
    name meant where one is close, and the templates."""
    try:
        return TEMPLATES[name]
    except KeyError:
        close = closest(name, TEMPLATES)
        meant = f" (did you mean {close}?)" if close else ""
        raise QerlError(
            f"{key}={name} is not a prompt template{meant}: choose one of {', '.join(TEMPLATES)}"
        ) from None


def template_found(name: str, key: str) -> str:
    """What the checks before a run say of the template setting ``key``, refused now when unknown (the
    run would find it only once the model had loaded)."""
    template = get_template(name, key)
    return f"{name}: {template.source} (answers as {template.answer_format})"


def build_messages(question: str, template: str = "qerl", system_prompt: str | None = None) -> list[dict]:
    """Chat messages for ``question`` (system message first when there is one)."""
    tpl = get_template(template)
    user = question.strip()
    system = system_prompt
    if tpl.placement == "fewshot":
        user = f"{tpl.instruction}\n\nQuestion: {user}\nAnswer:"
    elif tpl.instruction is not None:
        if tpl.placement == "system" and system is None:
            system = tpl.instruction
        else:
            user = f"{user}\n\n{tpl.instruction}"
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return messages


# What a system prompt asks the answer to look like, for templates that ask nothing themselves.
_ASKS_FOR = (
    ("think_answer", re.compile(r"<answer>")),
    ("boxed", re.compile(r"\\boxed")),
    ("answer_is", re.compile(r"\banswer\s+is\b", re.IGNORECASE)),
)


def expected_answer_format(template: str = "qerl", system_prompt: str | None = None) -> AnswerFormat:
    """The answer shape the prompt asks for: the template's own, or, for a template that asks for
    none (``plain``), what the system prompt asks for ("... end with: The answer is N." ->
    ``answer_is``); ``any`` when nothing asks."""
    tpl = get_template(template)
    if tpl.answer_format != "any" or not system_prompt:
        return tpl.answer_format
    for name, pattern in _ASKS_FOR:
        if pattern.search(system_prompt):
            return name  # type: ignore[return-value]
    return "any"


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
        "answer_format": expected_answer_format(template, system_prompt),
        "system_prompt": system_prompt,
        "template_hash": template_hash(template, system_prompt),
        "chat_template_hash": chat_template_hash(tokenizer) if tokenizer is not None else None,
    }


def reward_settings(data: DataSection) -> dict[str, Any]:
    """What the reward needs of the run's prompt, for
    ``build_reward_fn(cfg.reward, **reward_settings(cfg.data))``: the answer format it asks for and the
    template's stop strings."""
    return {
        "answer_format": expected_answer_format(data.template, data.system_prompt),
        "stop": get_template(data.template).stop,
    }
