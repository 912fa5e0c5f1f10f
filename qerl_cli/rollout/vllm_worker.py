"""Functions that run inside vLLM's worker through ``LLM.apply_model``: AQN noise on vLLM's own
RMSNorm weights, and the LoRA merged into its linear weights (``fp8-merged``). Module level so they
pickle; part of the vLLM rollout engine (``rollout.vllm_engine``).

vLLM's Gemma models use ``GemmaRMSNorm`` (weight initialised to 0, scale ``1 + w`` computed in float32
at every forward): it is found by name like ``RMSNorm``, and noise added to its stored weight is noise
on the channel scale it applies (see :mod:`qerl_cli.modeling.aqn`).
"""

from __future__ import annotations

import torch
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.modeling.aqn import find_norm_modules, is_rms_norm, perturb_norm_weights
from qerl_cli.rollout.fp8_merge import (
    DEFAULT_CHUNK_ROWS,
    BaseWeights,
    CheckpointBases,
    LoraDelta,
    write_merged,
)

# Attribute on vLLM's model (worker side) holding the clean norm weights, on CPU: CPU copies are
# unaffected by sleep-mode offloading and cost ~0.4 MB for a 7B model.
CLEAN_NORMS_ATTR = "_qerl_clean_norm_weights"
# Attribute on vLLM's model (worker side) holding the index of the trainer's base checkpoint the merge
# reads (file of each tensor, shapes learnt): built on the first merge, reused by every later one.
MERGE_BASES_ATTR = "_qerl_merge_bases"


def is_vllm_norm(name: str, module: nn.Module) -> bool:
    """RMSNorm modules with a real weight (vLLM builds some with ``has_weight=False``)."""
    return is_rms_norm(name, module) and bool(getattr(module, "has_weight", True))


def worker_count_norms(model: nn.Module) -> int:
    return len(find_norm_modules(model, is_vllm_norm))


def worker_set_norm_noise(model: nn.Module, sigma: float, seed: int) -> tuple[int, float]:
    """Set each norm weight to clean + N(0, sigma^2) (sigma 0: clean). Returns (modules perturbed,
    fraction of elements that changed after casting to the weight dtype).

    The clean copies are taken on the first call and kept on the model object, so every later
    call (after any number of sleep/wake cycles) starts from them: noise never accumulates. The
    noise is drawn on CPU from ``seed``, so a call is a pure function of (clean, sigma, seed).
    """
    modules = find_norm_modules(model, is_vllm_norm)
    clean: dict[str, torch.Tensor] | None = getattr(model, CLEAN_NORMS_ATTR, None)
    if clean is None:
        if sigma == 0:
            return 0, 0.0  # never perturbed: the weights are clean already
        clean = {name: m.weight.detach().to("cpu", copy=True) for name, m in modules.items()}
        setattr(model, CLEAN_NORMS_ATTR, clean)
    if sigma == 0:
        values = clean
    else:
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
        values = perturb_norm_weights(clean, sigma, generator)
    changed = total = 0
    with torch.no_grad():
        for name, module in modules.items():
            module.weight.copy_(values[name])
            if sigma > 0:
                changed += int((values[name] != clean[name]).sum())
                total += values[name].numel()
    count = len(modules) if sigma > 0 else 0
    return count, (changed / total if total else 0.0)


def no_norms_error(model_path: str) -> QerlError:
    return QerlError(
        f"AQN is on but vLLM's model for {model_path} has no RMSNorm module with a weight to perturb; "
        "turn AQN off (aqn.enabled=false) or use rollout.engine=hf for this architecture"
    )


def worker_merge_lora(
    model: nn.Module,
    base_path: str,
    deltas: dict[str, LoraDelta],
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    bases: BaseWeights | None = None,
) -> int:
    """Rewrite every linear the adapter targets as base + LoRA (``qerl_cli.rollout.fp8_merge``), in
    place in vLLM's parameters; the base is ``bases`` (the trainer's layers, vLLM in its process) or read
    from the trainer's checkpoint at ``base_path``, so repeated merges never compound roundings. Returns
    the number of linears written. Call it awake: sleep mode has the weights offloaded."""
    if bases is None:
        bases = getattr(model, MERGE_BASES_ATTR, None)
        if bases is None or str(bases.folder) != str(base_path):
            bases = CheckpointBases(base_path)
            setattr(model, MERGE_BASES_ATTR, bases)
    return write_merged(model, bases, deltas, chunk_rows=chunk_rows)
