"""A base's portable identity: what says that two runs of a comparison trained on one base, wherever
their folders lie.

Runs record their base by it (each run's ``result.json`` ``model``), the untrained base's kept figures are
keyed by it (``DIR/base-heldout``), and the warning of runs trained on another base compares it, so that
a comparison folder copied to another path or machine, or reported under another ``$QERL_CACHE_DIR``,
keeps its bases:

- a base under the comparison's folder (``DIR/bases/...``): ``$COMPARE_DIR/`` and its path relative to it;
- a base under qerl's cache (a converted GGUF, ``gguf/<name>-<fingerprint>/<name>``, whose fingerprint is
  the file's SHA-256, so one file gives one path on every machine): ``$QERL_CACHE_DIR/`` and its path
  relative to the cache (a GGUF an earlier qerl converted, named by the file's path and mtime: by the
  folder its content names now, where its ``qerl_source.json`` or the file says it);
- anything else (a hub id, a folder of the user's): as given, since nothing says where it would be elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from qerl_cli.modeling.sources import CACHE_PLACEHOLDER, cache_root, content_named_folder

COMPARE_PLACEHOLDER = "$COMPARE_DIR"


def _roots(out: Path) -> tuple[tuple[str, Path], ...]:
    # The comparison's folder first: a comparison kept inside the cache is still the comparison's.
    return ((COMPARE_PLACEHOLDER, out), (CACHE_PLACEHOLDER, cache_root()))


def base_identity(model: str, out: Path) -> str:
    """``model`` (a base's path, hub id or a recorded identity) as the identity above, for the comparison
    in ``out``."""
    for placeholder, _root in _roots(out):
        if model.startswith(f"{placeholder}/"):
            return model  # recorded portable already
    path = Path(model).expanduser()
    if not path.is_absolute() and not path.exists():
        return model  # a hub id, or a relative path that is not here: nothing to resolve it against
    resolved = path.resolve()
    for placeholder, root in _roots(out):
        root = root.expanduser().resolve()
        if resolved != root and resolved.is_relative_to(root):
            if placeholder == CACHE_PLACEHOLDER:  # a GGUF converted by an earlier qerl: by its content too
                resolved = (content_named_folder(resolved) or resolved).resolve()
            return f"{placeholder}/{resolved.relative_to(root).as_posix()}"
    return model


def base_path(identity: str, out: Path) -> str:
    """The folder a base's identity names on this machine, for the comparison in ``out`` (what is not a
    portable identity, as it is)."""
    for placeholder, root in _roots(out):
        if identity.startswith(f"{placeholder}/"):
            return str(root / identity.removeprefix(f"{placeholder}/"))
    return identity
