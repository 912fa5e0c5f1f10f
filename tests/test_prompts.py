"""Prompt templates: one source for training and eval, chat template applied, hash recorded."""

from __future__ import annotations

import pytest

from qerl_cli.data.prompts import (
    QERL_INSTRUCTION,
    TEMPLATES,
    build_messages,
    chat_template_hash,
    prompt_record,
    render_prompt,
    template_hash,
)
from qerl_cli.errors import QerlError
from qerl_cli.modeling.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_qerl_template_matches_the_qerl_repo_system_prompt() -> None:
    # NVlabs/QeRL puts the instruction in the system message and the bare question as the user turn.
    messages = build_messages("What is 2+3?", "qerl")
    assert messages == [
        {"role": "system", "content": QERL_INSTRUCTION},
        {"role": "user", "content": "What is 2+3?"},
    ]
    assert QERL_INSTRUCTION.startswith("Solve the following math problem step by step.")
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert tag in QERL_INSTRUCTION


def test_render_applies_the_chat_template_with_a_generation_prompt(tokenizer) -> None:
    text = render_prompt("What is 2+3?", tokenizer, "qerl")
    assert text.startswith("<|im_start|>system\nSolve the following math problem step by step.")
    assert "<|im_start|>user\nWhat is 2+3?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert render_prompt("What is 2+3?", tokenizer, "plain") == (
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_boxed_template_asks_for_a_box_in_the_user_turn(tokenizer) -> None:
    text = render_prompt("Find x.", tokenizer, "boxed")
    assert "Find x.\n\nPlease reason step by step, and put your final answer within \\boxed{}." in text
    assert "<|im_start|>system" not in text


def test_explicit_system_prompt_keeps_the_qerl_instruction(tokenizer) -> None:
    messages = build_messages("Q?", "qerl", system_prompt="You are terse.")
    assert messages[0] == {"role": "system", "content": "You are terse."}
    assert messages[1]["content"] == f"Q?\n\n{QERL_INSTRUCTION}"


def test_no_chat_template_falls_back_to_raw_text(tokenizer) -> None:
    class NoTemplate:
        chat_template = None

    assert render_prompt("Q?", NoTemplate(), "plain") == "Q?"
    assert render_prompt("Q?", None, "qerl") == f"{QERL_INSTRUCTION}\n\nQ?"


def test_system_role_refused_by_the_template_is_folded_into_the_user_turn() -> None:
    class UserOnly:
        chat_template = "user only"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            if any(m["role"] == "system" for m in messages):
                raise ValueError("System role not supported")
            return "|".join(m["content"] for m in messages) + "|gen"

    assert render_prompt("Q?", UserOnly(), "qerl") == f"{QERL_INSTRUCTION}\n\nQ?|gen"


def test_hashes_are_stable_and_sensitive(tokenizer) -> None:
    assert template_hash("qerl") == template_hash("qerl")
    assert len({template_hash(name) for name in TEMPLATES}) == len(TEMPLATES)
    assert template_hash("qerl", "sys") != template_hash("qerl")
    record = prompt_record("qerl", None, tokenizer)
    assert record["template_hash"] == template_hash("qerl")
    assert record["chat_template_hash"] == chat_template_hash(tokenizer) is not None
    assert record["instruction"] == QERL_INSTRUCTION and record["placement"] == "system"


def test_unknown_template_is_a_user_error(tokenizer) -> None:
    with pytest.raises(QerlError, match="choose one of"):
        render_prompt("Q?", tokenizer, "fancy")


# -- a template for base models, and the answer format each template asks for --------------------
def test_fewshot_template_shows_worked_examples_and_ends_at_answer(tokenizer) -> None:
    from qerl_cli.data.prompts import FEWSHOT_EXAMPLES, FEWSHOT_STOP

    class BaseModelTokenizer:  # no chat template: the text goes to the model as it is
        chat_template = None

    text = render_prompt(
        "Mia has 23 apples and picks 45 more. How many apples?", BaseModelTokenizer(), "qerl-fewshot"
    )
    assert text.startswith("Question: Tom has 12 marbles")
    assert text.count("The answer is ") == 3 and text.count("Question: ") == 4
    assert text.endswith("\n\nQuestion: Mia has 23 apples and picks 45 more. How many apples?\nAnswer:")
    # the examples' answers are right: a base model copies what it is shown
    assert "12 + 7 = 19" in FEWSHOT_EXAMPLES and "45 - 18 = 27" in FEWSHOT_EXAMPLES
    assert "6 * 4 = 24" in FEWSHOT_EXAMPLES
    # a chat model gets the same text as its user turn
    chat = render_prompt("Q?", tokenizer, "qerl-fewshot")
    assert (
        "<|im_start|>user\nQuestion: Tom has 12 marbles" in chat and "Question: Q?\nAnswer:<|im_end|>" in chat
    )
    tpl = TEMPLATES["qerl-fewshot"]
    assert tpl.stop == FEWSHOT_STOP and tpl.answer_format == "answer_is"
    assert prompt_record("qerl-fewshot")["stop"] == ["\nQuestion:"]


def test_existing_template_hashes_are_unchanged() -> None:
    # Runs recorded before answer formats and stop strings existed still compare as the same prompt.
    assert template_hash("qerl") == "d9097b431ec33dc3"
    assert template_hash("plain") == "e6862193f7bab6d7"


def test_fewshot_is_a_template_train_and_eval_accept(tmp_path) -> None:
    from qerl_cli.config import EvalConfig, TrainConfig
    from qerl_cli.rl.rollouts import sampling_spec

    cfg = TrainConfig()
    cfg.data.template = "qerl-fewshot"
    assert sampling_spec(cfg, step=1, round_index=0).stop == ("\nQuestion:",)
    cfg.data.template = "qerl"
    assert sampling_spec(cfg, step=1, round_index=0).stop == ()
    EvalConfig(model="m", template="qerl-fewshot").validate()


@pytest.mark.parametrize(
    ("template", "system_prompt", "expected"),
    [
        ("qerl", None, "think_answer"),
        ("qerl", "You are terse.", "think_answer"),  # the instruction moves to the user turn: still asked
        ("boxed", None, "boxed"),
        ("qerl-fewshot", None, "answer_is"),
        ("plain", None, "any"),
        # the SmolLM2 recipe: template plain, the format asked in the system prompt
        ("plain", "Solve the math word problem. Show the sum, then end with: The answer is N.", "answer_is"),
        ("plain", "Put the final answer within \\boxed{}.", "boxed"),
        ("plain", "Answer in <think></think><answer></answer> tags.", "think_answer"),
        ("plain", "Be brief.", "any"),
    ],
)
def test_expected_answer_format(template: str, system_prompt: str | None, expected: str) -> None:
    from qerl_cli.data.prompts import expected_answer_format

    assert expected_answer_format(template, system_prompt) == expected
    assert prompt_record(template, system_prompt)["answer_format"] == expected
