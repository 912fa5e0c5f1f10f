"""Tiny offline Qwen2 models: everything the tests and ``qerl demo`` need, built in code.

No download is involved: the tokenizer is a character-level vocabulary over printable ASCII with
Qwen's ChatML special tokens, and the weights are a seeded random initialisation. The folder holds
what transformers and vLLM read (``config.json``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` with a chat template, ``model.safetensors``).

Every linear width is a multiple of 64 so NVFP4 (blocks of 16), MXFP4 (32) and NF4 (64) all apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qerl_cli.errors import QerlError
from qerl_cli.files import check_writable_folder, honour_umask, model_files, remove_path
from qerl_cli.modeling.error_init import INIT_DIR
from qerl_cli.modeling.loading import DEQUANTIZED_RECORD, QUANT_RECORD
from qerl_cli.modeling.sources import SOURCE_RECORD
from qerl_cli.modeling.work_folders import check_not_other_work

# What describes a model folder's weights beside them: qerl's records (a 4-bit base's qerl_quant.json and
# its lora_init/ start, a dense copy's or a converted GGUF's source record) and, beside qerl_quant.json,
# llm-compressor's recipe.yaml. New weights written over the old leave none of them true.
WEIGHT_RECORDS = (QUANT_RECORD, INIT_DIR, DEQUANTIZED_RECORD, SOURCE_RECORD)
QUANTIZE_RECIPE = "recipe.yaml"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split: the tokenizer below has Qwen2's exact structure (byte-level BPE), so
# transformers' ``Qwen2Tokenizer`` and vLLM rebuild the same tokenizer from the saved files.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5's ChatML template, minus tool calling: the same prompt shape as the real models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model. Defaults give about half a million parameters: fast to RL-train on a CPU."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # The tokenizer uses 259 ids (256 bytes + 3 specials); padded to a multiple of 64 like Qwen's.
    vocab_size: int = 320
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        head_dim, rest = divmod(self.hidden_size, self.num_attention_heads)
        widths = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "kv width": head_dim * self.num_key_value_heads,
        }
        bad = {k: v for k, v in widths.items() if v % 64}
        if rest or bad:
            raise ValueError(f"tiny model widths must be multiples of 64 (got {bad or widths})")


def _byte_alphabet() -> list[str]:
    """GPT-2 / Qwen byte-level BPE alphabet: byte b is the character at index b."""
    visible = (range(ord("!"), ord("~") + 1), range(ord("¡"), ord("¬") + 1), range(ord("®"), ord("ÿ") + 1))
    printable = {b for span in visible for b in span}
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:  # bytes without a visible character are shifted above 255
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tokenizer_vocab() -> dict[str, int]:
    """The 256 byte tokens (ids 0-255), then the ChatML special tokens (256-258)."""
    return {tok: i for i, tok in enumerate([*_byte_alphabet(), *SPECIAL_TOKENS])}


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """Byte-level BPE without merges: one token per byte, so ASCII text is one token per character.

    It is any Qwen2 tokenizer minus its merges, which keeps prompts short for a tiny model while
    staying exactly what ``Qwen2Tokenizer`` and vLLM reconstruct from ``tokenizer.json``.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab=tokenizer_vocab(), merges=[], fuse_unk=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"  # decoder-only generation pads on the left
    return tokenizer


def build_tiny_config(spec: TinyModelSpec | None = None):  # -> transformers.Qwen2Config
    from transformers import Qwen2Config

    spec = spec or TinyModelSpec()
    vocab = tokenizer_vocab()
    return Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|endoftext|>"],
        torch_dtype="bfloat16",
    )


def build_tiny_model(seed: int = 0, spec: TinyModelSpec | None = None):  # -> Qwen2ForCausalLM
    """A seeded random Qwen2ForCausalLM in bfloat16 (same seed, same weights)."""
    from transformers import Qwen2ForCausalLM

    config = build_tiny_config(spec)
    devices = []  # fork the RNG so building a model never disturbs the caller's random stream
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def save_model_folder(model, tokenizer, out_dir: str | Path) -> Path:
    """Save weights (safetensors), tokenizer and a generation config that stops at ``<|im_end|>``."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer_vocab()
    model.generation_config = GenerationConfig(
        eos_token_id=[vocab["<|im_end|>"], vocab["<|endoftext|>"]],
        pad_token_id=vocab["<|endoftext|>"],
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return honour_umask(out)


def write_tiny_model(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a tiny Qwen2 model folder that transformers and vLLM load; returns the folder. Over a model
    (``--overwrite``), the records of the old weights go first (:func:`remove_weight_records`)."""
    model, tokenizer = build_tiny_model(seed, spec), build_tokenizer()
    remove_weight_records(out_dir)
    return save_model_folder(model, tokenizer, out_dir)


def remove_weight_records(folder: str | Path) -> list[str]:
    """Remove what describes the weights of the model in ``folder`` besides them (WEIGHT_RECORDS): left
    beside new weights, a 4-bit base's qerl_quant.json would have a BF16 model read as that base, and its
    lora_init/ start one made for other weights. Returns the names removed."""
    out = Path(folder)
    names = [*WEIGHT_RECORDS, *([QUANTIZE_RECIPE] if (out / QUANT_RECORD).is_file() else [])]
    removed = []
    for name in names:
        if remove_path(out / name):
            removed.append(name)
    return removed


def check_output_folder(out: str | Path, what: str, overwrite: bool) -> None:
    """Refuse, before the model is built, an output folder ``out`` (named ``what``: ``--output``, ``OUT``)
    the tiny model must not be written into: a file in the way, a folder holding a model (config.json
    or .safetensors: a real model would lose them without a word) unless ``overwrite``, and a folder of
    other files or trained work (an adapter, a checkpoint) even then, as ``qerl quantize -o`` refuses one
    (the model's files would be mixed in, or the work deleted)."""
    out = Path(out)
    check_writable_folder(out, what, "give another folder")
    if not out.is_dir():
        return
    check_not_other_work(out, what)  # first: --overwrite is no remedy for an adapter or a checkpoint
    held = model_files(out)
    if held and not overwrite:
        raise QerlError(
            f"{what} {out} already holds a model ({', '.join(held)}); nothing was written. Choose another "
            "folder, or add --overwrite to replace its model files"
        )
