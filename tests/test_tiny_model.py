from __future__ import annotations

from pathlib import Path

import torch

from qerl_cli.modeling.tiny import build_tokenizer, tokenizer_vocab, write_tiny_model


def test_tiny_model_loads_with_transformers_and_generates(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > inputs.input_ids.shape[1]
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            assert module.in_features % 64 == 0 and module.out_features % 64 == 0


def test_saved_tokenizer_matches_the_built_one(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    text = "<|im_start|>user\nWhat is 12*7? café\t\n<|im_end|>\n"
    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = loaded(text).input_ids
    assert ids == build_tokenizer()(text).input_ids
    assert loaded.decode(ids) == text
    assert ids[0] == tokenizer_vocab()["<|im_start|>"]
    assert loaded.eos_token == "<|im_end|>"


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = load_file(write_tiny_model(tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(write_tiny_model(tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(write_tiny_model(tmp_path / "c", seed=2) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"]
    )
