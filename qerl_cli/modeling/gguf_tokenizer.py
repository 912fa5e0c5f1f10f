"""The tokenizer of a GGUF file: check transformers' conversion, rebuild it from the file's vocabulary.

transformers converts a GGUF tokenizer from the file's metadata. For SentencePiece-style vocabularies
(``tokenizer.ggml.model == "llama"``: Llama 2, Mistral, Gemma) the file holds pieces, scores and token
types but no merges. Gemma's GGUF converter (transformers 5.17) reads those scores as a *Unigram*
model's log-probabilities; they are BPE merge ranks (``-rank``), so Viterbi prefers the many short,
early pieces and the tokenizer becomes nearly character-level (``gemma3-270m``: "Mia has 23 apples" ->
``Mia ▁h as ▁ 2 3 ▁a pp les``). The model then sees text it was never trained on and prints "is is is".

This module rebuilds what SentencePiece's BPE does from the same vocabulary: a merge for every piece
that splits into two pieces of the vocabulary, ranked by the merged piece's score (the order
SentencePiece applies them), byte fallback for unknown characters, spaces as ``▁``, BOS added when the
file says so. :func:`checked_gguf_tokenizer` compares transformers' tokenizer with the rebuild on probe
sentences and returns the rebuild (saying why) when they differ; where no rebuild exists (BPE files with
merges, e.g. GPT-2-style) it refuses a tokenizer that does not round-trip or splits English into more
than :data:`MAX_TOKENS_PER_WORD` tokens a word.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

from qerl_cli.errors import QerlError

SPACE_PIECE = "\u2581"  # SentencePiece's visible space
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type
# Plain English sentences a working subword tokenizer splits into ~1.3 tokens a word.
PROBE_TEXTS = (
    "Mia has 23 apples and picks 45 more. How many apples does Mia have now?",
    "The train leaves the station at noon and arrives three hours later.",
)
# A character-level tokenizer gives ~4-5 tokens a word; any real subword vocabulary well under 2.
MAX_TOKENS_PER_WORD = 2.5
MIN_VOCAB_FOR_LENGTH_CHECK = 16_000  # a tiny test vocabulary may legitimately split words finely


@dataclass
class GGUFVocabulary:
    """The ``tokenizer.ggml.*`` metadata of one GGUF file."""

    model: str
    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    merges: list[str] = field(default_factory=list)
    special_ids: dict[str, int] = field(default_factory=dict)  # bos / eos / unknown / padding -> id
    add_bos: bool = True
    add_eos: bool = False
    add_space_prefix: bool = False

    def token(self, kind: str) -> str | None:
        index = self.special_ids.get(kind)
        return self.tokens[index] if index is not None and 0 <= index < len(self.tokens) else None


def read_gguf_vocabulary(gguf: Path) -> GGUFVocabulary:
    """The vocabulary and its settings, read with the gguf package (no weights are read)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields

    def value(key: str, default=None):
        item = fields.get(f"tokenizer.ggml.{key}")
        return item.contents() if item is not None else default

    tokens = value("tokens")
    if not tokens:
        raise QerlError(f"{gguf} has no tokenizer.ggml.tokens: it carries no tokenizer to load")
    special_ids = {
        kind: int(found)
        for kind in ("bos", "eos", "unknown", "padding")
        if (found := value(f"{kind}_token_id")) is not None
    }
    return GGUFVocabulary(
        model=str(value("model", "")),
        tokens=list(tokens),
        scores=[float(s) for s in value("scores", [0.0] * len(tokens))],
        token_types=[int(t) for t in value("token_type", [NORMAL] * len(tokens))],
        merges=list(value("merges", []) or []),
        special_ids=special_ids,
        add_bos=bool(value("add_bos_token", True)),
        add_eos=bool(value("add_eos_token", False)),
        add_space_prefix=bool(value("add_space_prefix", False)),
    )


def _piece(token: str) -> str:
    # Whitespace-only pieces are written with real spaces in some GGUF files; the text they match has
    # been normalised to ``▁`` by then.
    return SPACE_PIECE * len(token) if token and not token.strip(" ") else token


def sentencepiece_bpe_merges(vocab: GGUFVocabulary) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a normal piece into two normal pieces, best score first.

    SentencePiece merges, at every step, the adjacent pair whose concatenation is the highest-scoring
    piece; ranking the merges by that score gives the same segmentation in a merges-based BPE.
    """
    normal = {
        _piece(token): score
        for token, score, kind in zip(vocab.tokens, vocab.scores, vocab.token_types, strict=True)
        if kind == NORMAL
    }
    ranked: list[tuple[float, int, str, str]] = []
    for piece, score in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, cut, left, right))
    ranked.sort()
    return [(left, right) for _score, _cut, left, right in ranked]


def build_sentencepiece_tokenizer(vocab: GGUFVocabulary):  # -> PreTrainedTokenizerFast
    """A fast tokenizer equal to SentencePiece BPE over ``vocab`` (byte fallback, ``▁`` for spaces)."""
    from transformers import PreTrainedTokenizerFast

    pieces: dict[str, int] = {}
    for index, token in enumerate(vocab.tokens):
        pieces.setdefault(_piece(token), index)
    unk = vocab.token("unknown")
    model = BPE(
        vocab=pieces,
        merges=sentencepiece_bpe_merges(vocab),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=any(kind == BYTE for kind in vocab.token_types),
    )
    backend = Tokenizer(model)
    replace = normalizers.Replace(" ", SPACE_PIECE)
    prepend = [normalizers.Prepend(SPACE_PIECE)] if vocab.add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prepend, replace])
    steps = [decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    # Control tokens are special; user-defined ones (Gemma's "\n\n", "<table>", runs of spaces) are
    # matched whole as in SentencePiece, after normalisation so a run of spaces finds its ``▁▁`` piece.
    backend.add_tokens(
        [
            AddedToken(_piece(token), special=kind == CONTROL, normalized=kind == USER_DEFINED)
            for token, kind in zip(vocab.tokens, vocab.token_types, strict=True)
            if kind in (CONTROL, USER_DEFINED)
        ]
    )
    bos, eos = vocab.token("bos"), vocab.token("eos")
    single, pair, specials = "$A", "$A $B", []
    if vocab.add_bos and bos is not None:
        single, pair = f"{bos} {single}", f"{bos} $A {bos} $B"
        specials.append((bos, pieces[bos]))
    if vocab.add_eos and eos is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}"
        specials.append((eos, pieces[eos]))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=vocab.token("padding"),
        add_bos_token=vocab.add_bos,
        add_eos_token=vocab.add_eos,
    )


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def tokenizer_problem(tokenizer, vocab_size: int) -> str | None:
    """What is wrong with ``tokenizer`` on the probe sentences (round trip, tokens a word), or None."""
    for text in PROBE_TEXTS:
        ids = _encode(tokenizer, text)
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        if decoded.strip() != text:
            return f"it does not round-trip: {text!r} decodes back as {decoded!r}"
        per_word = len(ids) / len(text.split())
        if vocab_size >= MIN_VOCAB_FOR_LENGTH_CHECK and per_word > MAX_TOKENS_PER_WORD:
            pieces = " ".join(tokenizer.convert_ids_to_tokens(ids[:12]))
            return (
                f"it splits plain English into {per_word:.1f} tokens a word (a {vocab_size}-token vocabulary "
                f"gives under {MAX_TOKENS_PER_WORD}): {pieces} ..."
            )
    return None


def checked_gguf_tokenizer(vocab: GGUFVocabulary, converted, name: str) -> tuple[object, str]:
    """(the tokenizer to save, how it was obtained) for the GGUF file ``name`` of vocabulary ``vocab``,
    whose transformers conversion is ``converted``.

    SentencePiece-style files are rebuilt and compared on the probe sentences; a difference means
    transformers' conversion is wrong, and the rebuild is used. Other files are kept when they pass
    :func:`tokenizer_problem` and refused otherwise.
    """
    if vocab.model == "llama" and not vocab.merges:
        rebuilt = build_sentencepiece_tokenizer(vocab)
        problem = tokenizer_problem(rebuilt, len(vocab.tokens))
        if problem is not None:
            raise QerlError(
                f"the tokenizer rebuilt from {name}'s vocabulary is unusable ({problem}); "
                "use a Hugging Face folder of this model (with its tokenizer.json) instead of the GGUF file"
            )
        differing = [text for text in PROBE_TEXTS if _encode(converted, text) != _encode(rebuilt, text)]
        if not differing:
            return converted, "transformers"
        text = differing[0]
        theirs, ours = len(_encode(converted, text)), len(_encode(rebuilt, text))
        return rebuilt, (
            "rebuilt from the GGUF vocabulary as SentencePiece BPE: transformers' conversion split the "
            f"probe sentence into {theirs} tokens where the file's BPE gives {ours}"
        )
    problem = tokenizer_problem(converted, len(vocab.tokens))
    if problem is not None:
        raise QerlError(
            f"transformers converted {name}'s tokenizer ({vocab.model or 'unknown'} type) wrongly: "
            f"{problem}. Use a Hugging Face folder of this model (with its tokenizer.json), or a GGUF "
            "file of another converter"
        )
    return converted, "transformers"
