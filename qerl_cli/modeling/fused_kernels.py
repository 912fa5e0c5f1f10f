"""Fused training kernels for the trainer's model (``train.fused_kernels``): Liger's RMSNorm, SwiGLU
and RoPE (the ``liger`` extra, the kernels TRL uses).

Why: the update runs a forward and a backward over every rollout token; between the projections
(which QuantLinear and LoRA keep) HF's RMSNorm, SiLU x up and rotary embedding are chains of small
elementwise kernels that each read and write the whole activation, and they keep float32 copies for
the backward. Liger's Triton kernels do each in one pass and keep less. The projections and the
logprob head (``rl.logprobs``, chunked, never [rows, length, vocab]) are untouched.

What Liger changes, and what qerl lets it keep:

- the trainer's model instance: its RMSNorm and MLP modules get Liger's ``forward`` (the module
  classes stay, so AQN and the norm lookups still find ``*RMSNorm`` modules). Only this instance.
- process-wide: Liger's ``apply_liger_kernel_to_<family>`` also rebinds names in the family's
  transformers module (liger-kernel 0.8.5 for gemma3_text: ``Gemma3RMSNorm`` ->
  ``LigerRMSNormForGemma3``, ``Gemma3MLP`` -> ``LigerGEGLUMLP``, ``apply_rotary_pos_emb`` ->
  ``liger_rotary_pos_emb``), so every model of that family built later in the process (an evaluation
  right after training, a rollout engine's model) would run Liger's modules too. qerl snapshots those
  modules around the call and puts every rebound name back at once, except the RoPE function, which
  the trainer's model looks up at each forward: that one becomes :func:`guarded_rope` until
  :meth:`AppliedKernels.restore` (the trainer calls it when training ends) puts transformers' back.

Why the guard: Liger's RoPE kernel walks the [batch x seq] rows of q and k with ``stride(1)`` of
``q.transpose(1, 2).contiguous()``. In a one-token step with batch > 1 (every decoding step of a
batched ``generate``), a q that Liger's RMSNorm produced (Gemma 3's q_norm: a fresh [B * H, D]
buffer viewed as [B, H, 1, D]) already counts as contiguous after the transpose, with
``stride(1) = D`` instead of ``H * D``; the rows overlap and q is rotated with other rows' positions
(reproduced on the CPU with Triton's interpreter). transformers' norm keeps the projection's layout
(``stride(1) = H * D``), and training forwards (sequence length > 1) are exact. An evaluation in the
process of a Liger-trained run then decodes with Liger's leaked norm class and RoPE and scores near
zero (the run that showed it: ``benchmarks/README.md``). The guard hands Liger only the calls it
computes right (sequence length > 1, or a single row) and the others to transformers' function.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, get_args

import torch.nn.functional
from torch import nn

from qerl_cli.config.choices import FusedKernels
from qerl_cli.errors import QerlError, install_hint

log = logging.getLogger(__name__)

INSTALL_HINT = install_hint("liger")
_MISSING = object()  # an attribute that did not exist before the patch


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def check_liger(mode: str) -> None:
    """``train.fused_kernels=liger`` without liger-kernel installed is a QerlError with the install
    command; asked by ``qerl train``'s checks before the model loads (``rl.preflight.fused_kernels``)."""
    if mode == "liger" and not liger_installed():
        raise QerlError("train.fused_kernels=liger needs liger-kernel, which is not installed: "
                        f"{INSTALL_HINT} (or set train.fused_kernels=auto)")  # fmt: skip


def _supported_types() -> set[str]:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return set(MODEL_TYPE_TO_APPLY_LIGER_FN)


# --------------------------------------------------------------------------------------------
# Module attributes rebound by a patch, and putting them back
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rebinding:
    """``namespace.name`` was ``old`` (``_MISSING``: absent) and a patch made it ``new``."""

    namespace: Any
    name: str
    old: Any
    new: Any

    @property
    def label(self) -> str:
        ns = self.namespace
        owner = f"{ns.__module__}.{ns.__qualname__}" if isinstance(ns, type) else getattr(ns, "__name__", "?")
        return f"{owner}.{self.name}"


def _set(namespace: Any, name: str, value: Any) -> None:
    if value is _MISSING:
        if name in vars(namespace):
            delattr(namespace, name)
    else:
        setattr(namespace, name, value)


def snapshot(namespaces: Iterable[Any]) -> list[tuple[Any, dict[str, Any]]]:
    """Each namespace (a module or a class) with a copy of its attributes."""
    seen: set[int] = set()
    out = []
    for ns in namespaces:
        if ns is None or id(ns) in seen:
            continue
        seen.add(id(ns))
        out.append((ns, dict(vars(ns))))
    return out


def rebindings(before: list[tuple[Any, dict[str, Any]]]) -> list[Rebinding]:
    """What changed in the snapshotted namespaces since :func:`snapshot` (by identity)."""
    changes = []
    for ns, old in before:
        now = vars(ns)
        for name in old.keys() | now.keys():
            was, value = old.get(name, _MISSING), now.get(name, _MISSING)
            if was is not value:
                changes.append(Rebinding(ns, name, was, value))
    return changes


@dataclass
class _Held:
    """One process-wide attribute qerl keeps patched: its original value and how many handles hold it."""

    namespace: Any
    name: str
    original: Any
    holders: int = 0


# (id(namespace), name) -> what it was before the first handle patched it. Handles restore it when
# the last one holding it lets go, in whatever order they are restored.
_HELD: dict[tuple[int, str], _Held] = {}


@dataclass
class AppliedKernels:
    """What :func:`apply_fused_kernels` did: ``kind`` (``liger`` or ``off``) for the run's records,
    ``kept`` the process-wide attributes left patched (guarded) until :meth:`restore`, ``restored``
    those Liger rebound that were put back at once."""

    kind: str
    kept: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    _keys: list[tuple[int, str]] = field(default_factory=list, repr=False)

    def restore(self) -> None:
        """Put transformers' own functions back in their modules (idempotent). The patched model's
        own modules keep Liger's forwards; it stays correct, with transformers' RoPE."""
        keys, self._keys = self._keys, []
        for key in reversed(keys):
            held = _HELD.get(key)
            if held is None:
                continue
            held.holders -= 1
            if held.holders <= 0:
                _set(held.namespace, held.name, held.original)
                del _HELD[key]

    def __enter__(self) -> AppliedKernels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def settle_rebindings(
    changes: Iterable[Rebinding], keep: Callable[[Rebinding, Any], Any | None]
) -> AppliedKernels:
    """After a patch: every rebinding is undone, except those for which ``keep(change, original)``
    returns a value to install instead (the original being what the name held before any handle);
    those are held until the returned handle's :meth:`~AppliedKernels.restore`."""
    applied = AppliedKernels(kind="liger")
    for change in changes:
        key = (id(change.namespace), change.name)
        held = _HELD.get(key)
        original = held.original if held is not None else change.old
        replacement = keep(change, original)
        if replacement is None:
            _set(change.namespace, change.name, change.old)
            applied.restored.append(change.label)
            continue
        if held is None:
            held = _HELD[key] = _Held(change.namespace, change.name, original)
        held.holders += 1
        _set(change.namespace, change.name, replacement)
        applied._keys.append(key)
        applied.kept.append(change.label)
    return applied


@contextmanager
def watching(namespaces: Iterable[Any]) -> Iterator[list[Rebinding]]:
    """Collect the attributes a block rebinds in ``namespaces`` (the list is filled on exit)."""
    before = snapshot(namespaces)
    found: list[Rebinding] = []
    try:
        yield found
    finally:
        found.extend(rebindings(before))


def _patchable_namespaces(model: nn.Module) -> list[Any]:
    """Where Liger's apply functions rebind names: the loaded transformers modules (the model's
    family module among them), the classes of the model's own module, and torch.nn.functional (its
    cross-entropy patch)."""

    modules = [
        m
        for name, m in list(sys.modules.items())
        if isinstance(m, types.ModuleType) and name.split(".", 1)[0] == "transformers"
    ]
    family = sys.modules.get(type(model).__module__)
    classes = []
    if family is not None:
        modules.append(family)
        own = family.__name__
        classes = [v for v in vars(family).values() if isinstance(v, type) and v.__module__ == own]
    return [*modules, *classes, torch.nn.functional]


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------
def liger_rope_is_exact(q: Any, k: Any) -> bool:
    """Whether Liger's RoPE kernel computes this call right: q and k [B, heads, seq, D] with more than
    one token per row, or a single row (see the module docstring for the one-token case)."""
    if getattr(q, "ndim", 0) != 4 or getattr(k, "ndim", 0) != 4:
        return False
    batch, seq = q.shape[0], q.shape[2]
    return seq > 1 or batch == 1


def guarded_rope(fused: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (transformers' ``apply_rotary_pos_emb``) that lets ``fused`` (Liger's) compute the
    calls it computes right (:func:`liger_rope_is_exact`)."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if liger_rope_is_exact(q, k):
            return fused(q, k, cos, sin, *args, **kwargs)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__qerl_fused__ = fused  # type: ignore[attr-defined]
    apply_rotary_pos_emb.__qerl_original__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _liger_rope_functions() -> set[int]:
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return set()
    return {id(liger_rotary_pos_emb)}


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------
def apply_fused_kernels(model: nn.Module, mode: str, *, on_gpu: bool) -> AppliedKernels:
    """Patch ``model`` (the base, before LoRA is attached) per ``mode``; returns what now runs
    (``.kind``: ``liger`` or ``off``, for the run's records) and the handle whose ``restore()`` puts
    transformers' RoPE back in its module when the model is done with (the trainer calls it).

    ``auto``: Liger when it is installed, the model runs on a GPU and Liger knows its family;
    ``liger``: the same, but a missing package or an unknown family is an error saying what to do;
    ``off``: transformers' own modules.
    """
    off = AppliedKernels(kind="off")
    if mode == "off":
        return off
    kinds = get_args(FusedKernels)  # the config's values, their one home
    if mode not in kinds:
        raise QerlError(f"train.fused_kernels={mode!r} is unknown; choose one of {', '.join(sorted(kinds))}")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not liger_installed():
        check_liger(mode)
        return off
    if model_type not in _supported_types():
        if mode == "liger":
            raise QerlError(f"train.fused_kernels=liger: Liger has no kernels for model type {model_type!r}; "
                            "set train.fused_kernels=auto or off")  # fmt: skip
        return off
    if mode == "auto" and not on_gpu:
        return off  # Liger's Triton kernels need a GPU; the CPU keeps transformers' modules
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    ropes = _liger_rope_functions()

    def keep(change: Rebinding, original: Any) -> Any | None:
        if id(change.new) in ropes and callable(original):
            return guarded_rope(change.new, original)
        return None  # a module class or anything else: models built later keep transformers'

    # The logprob head stays qerl's (temperature-scaled, chunked): no Liger cross-entropy.
    with watching(_patchable_namespaces(model)) as changes:
        _apply_liger_kernel_to_instance(
            model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
            fused_linear_cross_entropy=False,
        )  # fmt: skip
    applied = settle_rebindings(changes, keep)
    log.info("fused kernels: Liger RMSNorm, SwiGLU and RoPE on %s", model_type)
    if applied.restored:
        log.info("fused kernels: put back %s (Liger had rebound them for every later model)",
                 ", ".join(sorted(applied.restored)))  # fmt: skip
    if applied.kept:
        log.info("fused kernels: %s runs Liger's RoPE where it is exact until training ends",
                 ", ".join(sorted(applied.kept)))  # fmt: skip
    return applied
