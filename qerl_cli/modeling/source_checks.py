"""Check a model location before anything slow happens, and say what is wrong with it.

What a model argument may name (folders, hub ids, GGUF files, aliases) and how it becomes a folder
is :mod:`qerl_cli.modeling.sources`; this module judges the result (adapter folders:
:mod:`qerl_cli.modeling.adapter`).

Every stage takes "a hub id or a local folder". Before minutes of dataset downloads or model
loading, :func:`check_model_source` answers the cheap questions with a QerlError that names the
path and what to do:

- a local path that does not exist, is a file, or lacks ``config.json``;
- weights only in pickle files (``*.bin``, ``*.pt``, ``*.pth``): refused unless the user opts in
  with ``QERL_ALLOW_PICKLE=1`` (unpickling runs code from the file; safetensors cannot);
- a model whose config needs its own Python code (``auto_map``): refused unless the user asks for
  ``trust_remote_code``, naming the key to set;
- a hub id while the Hub is unreachable (``HF_HUB_OFFLINE=1`` or no network) and the model is not
  in the local cache: at once, instead of transformers' or datasets' retries.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import try_to_load_from_cache

from qerl_cli.config import RESOLVED_CONFIG_NAME
from qerl_cli.errors import QerlError, closest, qerl_command
from qerl_cli.files import file_given_for_folder
from qerl_cli.modeling import adapter, run_layout, sources
from qerl_cli.modeling.sources import PICKLE_SUFFIXES, resolve_model_source

ALLOW_PICKLE_ENV = "QERL_ALLOW_PICKLE"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUE = ("1", "true", "yes", "on")
# A reachability probe, not a download: long enough for a slow link, far below the retries it replaces.
PROBE_TIMEOUT_S = 3.0


def hub_offline_by_env() -> bool:
    return any(os.environ.get(k, "").lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def pickle_allowed() -> bool:
    return os.environ.get(ALLOW_PICKLE_ENV, "").lower() in _TRUE


def weight_file_kwargs() -> dict[str, bool | None]:
    """``from_pretrained``'s keyword for which weight files it may read, for every load of model weights.

    The folder checks refuse a local pickle-only folder, but not a hub id whose repository holds only
    ``*.bin`` (nor a path they miss): ``use_safetensors=True`` makes transformers itself refuse to unpickle
    one. ``None`` (transformers' own choice, pickle included) only once the user opts in with
    ``QERL_ALLOW_PICKLE=1``.
    """
    return {"use_safetensors": None if pickle_allowed() else True}


def pickle_refusal(what: str, where: str | Path, found: str) -> QerlError:
    """The refusal of a model whose weights are pickle only; ``found`` says what was seen."""
    return QerlError(
        f"{what} {where} holds {found}; loading pickle can run code from the file, so qerl loads "
        "safetensors only. Convert the model to safetensors "
        "(model.save_pretrained(DIR, safe_serialization=True)), or, if you trust the file, "
        f"opt in with {ALLOW_PICKLE_ENV}=1"
    )


def looks_like_hub_id(name: str) -> bool:
    """``owner/name`` and nothing that reads as a path (``./x``, ``/x``, ``a/b/c``, ``~/x``)."""
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "~"))


def hub_reachable(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub endpoint (``HF_ENDPOINT``) opens within ``timeout_s``."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _in_hub_cache(repo_id: str, revision: str | None) -> bool:
    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return isinstance(found, str)


def offline_message(name: str, what: str, hint: str = "") -> str:
    """An owner/name that is neither a folder nor in the Hub cache, offline. It is as often a relative
    folder not written yet (the README's runs/smol-nvfp4 before `qerl quantize -o` made it) as a Hub id:
    the message gives the remedy of each reading (``hint``: how to make the folder)."""
    why = "HF_HUB_OFFLINE=1 is set" if hub_offline_by_env() else "the Hugging Face Hub cannot be reached"
    folder = Path(name).expanduser().absolute()
    return (
        f"{what} {name}: no folder {folder}, and it reads as a Hugging Face Hub id, {why}, and it is not "
        f"in the local cache. A folder: {hint or 'give its path'}. A Hub id: download it where there is "
        f"network (`huggingface-cli download {name} --local-dir DIR`) and pass the folder instead"
    )


# A base named <MODEL>-<FORMAT> (the shipped recipes' ./Qwen2.5-14B-Instruct-NVFP4) is `qerl quantize`'s
# output for <MODEL>; the 4-bit formats' names as they appear in such folder names.
_QUANTIZED_NAME = re.compile(r"^(?P<model>.+?)[-_](?P<fmt>nvfp4|mxfp4|nf4)$", re.IGNORECASE)
# Hub organisations of model families the shipped recipes use, for the example command.
_HUB_ORGS = {"qwen": "Qwen", "llama": "meta-llama", "gemma": "google", "smollm": "HuggingFaceTB"}


def missing_model_hint(path: str | Path, fmt: str = "auto") -> str:
    """What to do about a recipe's model that is not there, fitted to what it names: the offline tiny
    base (``qerl tiny-base``), a ``qerl quantize`` output (the command that writes it), or any folder."""
    text = str(path)
    point = "or point the recipe to your copy with --set model.path=DIR"
    if Path(text).parent.name == "tiny-base":
        return f"build it with `qerl tiny-base` (run from the folder that holds runs/), {point}"
    match = _QUANTIZED_NAME.match(Path(text).name)
    if match:
        model, name_fmt = match["model"], match["fmt"].lower()
        org = next((o for key, o in _HUB_ORGS.items() if model.lower().startswith(key)), None)
        if org is None:  # a folder name of the user's (runs/smol-nvfp4): no Hub id to guess from it
            quantize = f"qerl quantize MODEL --format {name_fmt} -o {text}"
            return f"write it with `{quantize}` (see docs/quantize.md), {point}"
        return (
            f"it is what `qerl quantize {org}/{model} --format {name_fmt} -o {text}` writes (a GPU "
            f"machine; see docs/quantize.md), {point}"
        )
    fmt_flag = f" --format {fmt}" if fmt not in ("auto", "bf16") else ""
    return f"write a 4-bit base with `qerl quantize MODEL{fmt_flag} -o {text}`, {point}"


def _alias_meant(text: str) -> str | None:
    """The alias a name not found half-remembers: its start (``smollm2``) or a close spelling."""
    aliases, name = list(sources.ALIASES), text.lower()
    starts = [a for a in aliases if len(name) >= 4 and a.startswith(name)]
    return starts[0] if starts else closest(name, aliases)


def check_model_source(
    name: str | Path,
    *,
    what: str = "model",
    trust_remote_code: bool = False,
    trust_hint: str = "--set model.trust_remote_code=true",
    revision: str | None = None,
    hint: str = "",
) -> None:
    """Raise a QerlError when ``name`` cannot be a loadable model (see the module docstring).

    ``what`` names the thing in messages ("model", "model.path"); ``trust_hint`` is how this stage
    turns on ``trust_remote_code``; ``hint`` is appended to the not-found message (e.g. the command
    that builds a recipe's base model).
    """
    text = resolve_model_source(name)  # a .gguf file, a folder holding one, or an alias: its folder
    path = Path(text).expanduser()
    if path.exists():
        _check_local_folder(path, what, trust_remote_code, trust_hint)
        return
    if not looks_like_hub_id(text):
        meant = _alias_meant(text)
        suffix = f"; did you mean the alias {meant}?" if meant else ""
        suffix += f"; {hint}" if hint else ""
        raise QerlError(
            f"{what} {text}: no such folder, and not a Hugging Face Hub id (owner/name) or a model alias "
            f"(qerl models lists them){suffix}"
        )
    if _in_hub_cache(text, revision):
        return
    if hub_offline_by_env() or not hub_reachable():
        raise QerlError(offline_message(text, what, hint))


def model_source_found(
    name: str | Path,
    *,
    what: str = "model",
    trust_remote_code: bool = False,
    trust_hint: str = "--set model.trust_remote_code=true",
    hint: str = "",
) -> str:
    """:func:`check_model_source`'s checks, saying what was found, without converting a GGUF file: a
    stage's checks before work (and ``--dry-run``) load no model, and converting one loads it. An alias
    must be on this machine (found offline); its file, or a ``.gguf`` given, is converted when the work
    starts, once (``sources.resolve_model_source``)."""

    text = str(name)
    gguf = sources.gguf_source(text)  # an alias not on this machine, or a .gguf not there, is refused
    if gguf is not None:
        return f"{text}: the GGUF file {gguf}, converted to a BF16 folder at the start, once"
    check_model_source(text, what=what, trust_remote_code=trust_remote_code, trust_hint=trust_hint, hint=hint)
    if Path(text).expanduser().exists():
        return f"{text}: a model folder (config.json, safetensors weights)"
    if _in_hub_cache(text, None):
        return f"{text}: a Hugging Face Hub id, in the local cache"
    return f"{text}: a Hugging Face Hub id, the Hub reachable (downloaded at the start)"


# What a model argument takes, as the "no config.json" message ends: a stage's own list where it takes
# more (the bench's shape names).
MODEL_FOLDER = "a Hugging Face model folder"


def check_model_config(path: Path, what: str, choices: str = MODEL_FOLDER) -> None:
    """A local folder given for a model has a config.json; else the error naming what the folder is
    (:func:`no_model_config`). The bench's ``--model`` checks asks this too."""
    if not (path / "config.json").is_file():
        raise no_model_config(path, what, choices)


def no_model_config(path: Path, what: str, choices: str = MODEL_FOLDER) -> QerlError:
    """A folder without config.json. A `qerl train` run's folder (or its adapter) given for a model is
    common, and its bare "no config.json" said nothing of what the folder is or how to use it: name it,
    with the adapter and the base it was trained on, and the commands that take them. A run stopped
    before its final adapter is one too (its layout: :mod:`qerl_cli.modeling.run_layout`): its newest
    checkpoint's adapter is what it has trained."""
    if adapter.is_adapter_folder(path):
        return _trained_folder(path, what, path, "a PEFT adapter folder", "the trained adapter", "")
    # A final adapter (its config read by adapter.py, so an empty adapter/ is none), or the run's layout.
    if adapter.run_adapter(path) is None and not run_layout.is_run_folder(path):
        return QerlError(f"{what} {path} has no config.json; give {choices}")
    kind = "a `qerl train` run's folder (its output.dir)"
    resume_run = qerl_command("train", path / RESOLVED_CONFIG_NAME, "--resume", "auto")
    resume = (f"; to train on, continue the run: `{resume_run}` (a finished run with --set train.max_steps "
              "raised)")  # fmt: skip
    if (final := adapter.run_adapter(path)) is not None:
        return _trained_folder(path, what, final, kind, "the trained adapter", resume)
    if (newest := adapter.checkpoint_adapter(path)) is not None:
        which = "the adapter of its newest checkpoint (the run stopped before its final adapter)"
        return _trained_folder(path, what, newest, kind, which, resume)
    return QerlError(
        f"{what} {path} is {kind}, not a model (no config.json): {what} takes the base model it trains "
        f"(its {RESOLVED_CONFIG_NAME}'s model.path). The run stopped before its first checkpoint, so it "
        "holds no adapter to evaluate or resume from"
    )


def _trained_folder(path: Path, what: str, trained: Path, kind: str, which: str, resume: str) -> QerlError:
    base = adapter.base_model(trained)
    on = f"the base model it was trained on ({base})" if base else "the base model it was trained on"
    return QerlError(
        f"{what} {path} is {kind}, not a model (no config.json): {what} takes {on}. To evaluate {which}: "
        f"`{qerl_command('eval', base or 'BASE', '--adapter', trained)}`{resume}"
    )


def _check_local_folder(path: Path, what: str, trust_remote_code: bool, trust_hint: str) -> None:
    if not path.is_dir():
        raise file_given_for_folder(
            path,
            what,
            "a model folder (config.json and *.safetensors), a Hugging Face Hub id (owner/name), a .gguf "
            "file or a model alias (qerl models)",
            kind="model folder",
        )
    check_model_config(path, what)
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise QerlError(f"{what} {config_file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise QerlError(f"{what} {config_file} holds no JSON object")
    if config.get("auto_map") and not trust_remote_code:
        raise QerlError(
            f"{what} {path} needs its own Python code (config.json has auto_map: "
            f"{sorted(config['auto_map'])}); qerl runs no code from a model folder unless asked. "
            f"Read that code, then opt in with {trust_hint}"
        )
    weights = [p for p in path.iterdir() if p.is_file()]
    if any(p.name.endswith((".safetensors", ".safetensors.index.json")) for p in weights):
        return
    pickles = sorted(p.name for p in weights if p.name.endswith((*PICKLE_SUFFIXES, ".bin.index.json")))
    if not pickles:
        raise QerlError(f"{what} {path} holds no weights (no *.safetensors file)")
    if not pickle_allowed():
        raise pickle_refusal(what, path, f"only pickle weights ({', '.join(pickles[:3])})")
