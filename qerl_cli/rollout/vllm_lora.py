"""LoRA sync of the colocated vLLM engine: the trainer's adapter served under a new LoRA id every step,
or (``rollout.linear_backend: fp8-merged``) merged into vLLM's linear weights, vLLM running without LoRA.

Part of the vLLM rollout engine: :class:`qerl_cli.rollout.vllm_engine.VLLMEngine` holds one
:class:`AdapterSync` and hands itself to each call (what the sync reads of it: :class:`ServingEngine`).

Why a new LoRA id every step: vLLM caches adapters by id, so re-adding an id it already holds is a
silent no-op and rollouts keep sampling the *old* adapter (or the base model). A fresh id plus
``remove_lora`` of the previous one and a prefix-cache reset (cached KV blocks were computed with the
old weights) makes each sync observable, and the staleness check proves it worked.

Adapters are served from copies on tmpfs (``vllm_setup.tmpfs_dir``), never from the trainer's output
folder, which the next checkpoint may overwrite while vLLM still reads it.

Merge mode (``merge_base`` set: the trainer's base checkpoint): a sync takes the adapter's factors
(:func:`~qerl_cli.rollout.fp8_merge.lora_deltas` of the live PEFT model, or
:func:`~qerl_cli.rollout.fp8_merge.deltas_from_tensors` of a saved adapter) and has vLLM's worker
rewrite each targeted linear as base + B A (:func:`~qerl_cli.rollout.vllm_worker.worker_merge_lora`),
then resets the prefix cache. Like an adapter load it writes GPU weights, so while vLLM sleeps it is
only recorded and done at ``wake_up``. A linear an earlier sync merged and this one does not target is
written back to its base.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Protocol

import torch

from qerl_cli.errors import QerlError
from qerl_cli.modeling import adapter as adapter_folder
from qerl_cli.rollout.fp8_merge import BaseWeights, LoraDelta, PolicyBases, deltas_from_tensors, lora_deltas
from qerl_cli.rollout.vllm_setup import tmpfs_dir, vllm_in_process
from qerl_cli.rollout.vllm_worker import worker_merge_lora


class ServingEngine(Protocol):
    """What the adapter sync reads of the vLLM engine it loads adapters into."""

    llm: Any  # the vllm.LLM
    vllm: Any  # the vLLM names rollout.vllm_setup._import_vllm returns
    enable_lora: bool
    max_lora_rank: int
    merge_base: str | None  # the trainer's base checkpoint the merge reads; None: LoRA served by vLLM

    @property
    def is_sleeping(self) -> bool: ...


class AdapterSync:
    """The engine's one LoRA slot: stage an adapter, load it under a new id, drop the previous one (or,
    with ``merge_base``, merge it into vLLM's weights).

    While vLLM sleeps its LoRA slots (and weights) are offloaded, so a sync then only records the
    adapter; the engine's ``wake_up`` activates it (:meth:`activate_pending`). The engine is passed to
    every call rather than held, so the two never reference each other.
    """

    def __init__(self) -> None:
        self.lora: Any = None  # the active LoRARequest (None: the base model)
        self._pending_lora: Any = None  # loaded by sync while asleep; activated at wake_up
        self._pending_merge: dict[str, LoraDelta] | None = None  # merge mode: the same
        self._merge_bases: BaseWeights | None = None  # merge mode: the trainer's layers (None: checkpoint)
        self._has_pending = False
        self._next_lora_id = 1
        self.num_syncs = 0
        self.last_sync_seconds: float | None = None  # the last sync, its deferred activation included
        self.merged_linears = 0  # merge mode: linears the last merge wrote
        self.adapter_merged = False  # merge mode: vLLM's weights hold an adapter (not the base alone)
        self._merged_shapes: dict[str, tuple[int, int]] = {}  # merge mode: (out, in) of merged linears
        self.stage_root = Path(tempfile.mkdtemp(prefix="qerl-lora-", dir=tmpfs_dir()))
        # The staged copies go with this object, closed or not.
        self.cleanup = weakref.finalize(self, shutil.rmtree, self.stage_root, True)

    @property
    def lora_id(self) -> int:
        """The vLLM LoRA id generate serves (0: the base model), for the figures and logs."""
        return self.lora.lora_int_id if self.lora is not None else 0

    def check_base_scorable(self, engine: ServingEngine) -> None:
        """QerlError where the base alone cannot be scored: merge mode with an adapter in the weights."""
        if engine.merge_base is not None and self.adapter_merged:
            raise QerlError(
                "this engine merged the adapter into vLLM's weights (rollout.linear_backend fp8-merged or "
                "merged), so the base alone cannot be scored: sync_adapter(None) first to restore the "
                "base weights, or score the base with a LoRA-serving backend (fp8, marlin, qerl-triton)"
            )

    def sync_adapter(self, engine: ServingEngine, adapter_dir: str | Path | None) -> None:
        """Copy the PEFT adapter in ``adapter_dir`` to tmpfs and serve it from the next generate on,
        under a new LoRA id (merge mode: merge it); ``None`` serves the base model."""
        started = time.perf_counter()
        if engine.merge_base is not None:
            self._merge(engine, None if adapter_dir is None else saved_deltas(Path(adapter_dir)))
        elif adapter_dir is None:
            self._load(engine, None)
        else:
            source = Path(adapter_dir)
            self._validate_adapter(engine, source)
            self._load(engine, adapter_folder.copy_folder(source, self._next_stage_dir()))
        self.last_sync_seconds = time.perf_counter() - started

    def sync_policy(self, engine: ServingEngine, peft_model: Any) -> None:
        """Save the trainer's PEFT model's adapter straight to tmpfs (no round trip through the output
        folder) and serve it like :meth:`sync_adapter` (merge mode: merge its factors, no file)."""
        started = time.perf_counter()
        if engine.merge_base is not None:
            check_mergeable_policy(peft_model)
            # vLLM in this process (qerl's default): merge onto the trainer's layers, read nowhere else.
            bases = PolicyBases(peft_model) if vllm_in_process() else None
            self._merge(engine, lora_deltas(peft_model), bases)
        else:
            staged = adapter_folder.save_peft_model(peft_model, self._next_stage_dir())
            self._validate_adapter(engine, staged)
            self._load(engine, staged)
        self.last_sync_seconds = time.perf_counter() - started

    def _next_stage_dir(self) -> Path:
        path = self.stage_root / f"adapter-{self._next_lora_id}"
        if path.exists():
            shutil.rmtree(path)
        return path

    @staticmethod
    def _validate_adapter(engine: ServingEngine, folder: Path) -> None:
        adapter_folder.check_servable(
            folder, enable_lora=engine.enable_lora, max_lora_rank=engine.max_lora_rank
        )

    def _load(self, engine: ServingEngine, staged: Path | None) -> None:
        request = None
        if staged is not None:
            lora_id = self._next_lora_id
            self._next_lora_id += 1
            request = engine.vllm.LoRARequest(
                lora_name=f"qerl-adapter-{lora_id}", lora_int_id=lora_id, lora_path=str(staged)
            )
        self.num_syncs += 1
        if engine.is_sleeping:
            # Loading writes into the LoRA slots, which sleep mode has offloaded: defer to wake_up.
            if self._has_pending and self._pending_lora is not None:
                self._drop_stage(self._pending_lora)
            self._pending_lora, self._has_pending = request, True
            return
        self._activate(engine, request)

    def activate_pending(self, engine: ServingEngine) -> None:
        """Serve the adapter synced while vLLM slept (the engine calls this once awake)."""
        if not self._has_pending:
            return
        started = time.perf_counter()
        if self._pending_merge is not None:
            self._write_merge(engine, self._pending_merge)
        else:
            self._activate(engine, self._pending_lora)
        self._pending_lora, self._pending_merge, self._has_pending = None, None, False
        self.last_sync_seconds = (self.last_sync_seconds or 0.0) + time.perf_counter() - started

    # ---- merge mode ---------------------------------------------------------------------------
    def _merge(
        self, engine: ServingEngine, deltas: dict[str, LoraDelta] | None, bases: BaseWeights | None = None
    ) -> None:
        """Merge ``deltas`` (None: none, the base model) onto ``bases`` (None: the checkpoint at
        ``merge_base``) now, or at ``wake_up`` while vLLM sleeps."""
        self.num_syncs += 1
        deltas = dict(deltas or {})
        self._merge_bases = bases
        self.adapter_merged = bool(deltas)
        if engine.is_sleeping:
            # The merge writes vLLM's weights, which sleep mode has offloaded: defer to wake_up.
            self._pending_merge, self._has_pending = deltas, True
            return
        self._write_merge(engine, deltas)

    def _write_merge(self, engine: ServingEngine, deltas: dict[str, LoraDelta]) -> None:
        for name, (out, inp) in self._merged_shapes.items():
            # Merged before, not targeted now: back to its base (a zero update, rounded like the rest).
            deltas.setdefault(name, LoraDelta(torch.zeros(1, inp), torch.zeros(out, 1), 0.0))
        fn = functools.partial(worker_merge_lora, base_path=engine.merge_base, deltas=deltas,
                               bases=self._merge_bases)  # fmt: skip
        self.merged_linears = int(min(engine.llm.apply_model(fn))) if deltas else 0
        self._merged_shapes = {n: (int(d.b.shape[0]), int(d.a.shape[1])) for n, d in deltas.items()}
        # Cached KV blocks were computed with the previous weights.
        engine.llm.reset_prefix_cache()

    def _activate(self, engine: ServingEngine, request: Any) -> None:
        llm_engine = engine.llm.llm_engine
        previous = self.lora
        if previous is not None:
            # Removed first: with max_loras=1 the new adapter takes its slot.
            llm_engine.remove_lora(previous.lora_int_id)
            self._drop_stage(previous)
        self.lora = None
        if request is not None:
            try:
                added = llm_engine.add_lora(request)
            except (ValueError, RuntimeError) as exc:
                raise QerlError(
                    f"vLLM could not load the adapter {request.lora_path}: {exc}. Check that "
                    "lora.target_modules are linear layers vLLM supports for this model and that "
                    "rollout.max_lora_rank >= lora.rank"
                ) from exc
            if not added:
                raise QerlError(f"vLLM refused the adapter {request.lora_path} (add_lora returned False)")
            self.lora = request
        # Cached KV blocks were computed with the previous adapter.
        engine.llm.reset_prefix_cache()

    def _drop_stage(self, request: Any) -> None:
        path = Path(request.lora_path)
        if path.parent == self.stage_root:
            shutil.rmtree(path, ignore_errors=True)


def check_mergeable_policy(peft_model: Any) -> None:
    """Refuse a policy that trains more than LoRA factors (``lora.train_norms``: PEFT's modules_to_save):
    the merge writes B A into the linears only, so the rollouts would use stale copies of the rest."""
    extra = [n for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n]
    if extra:
        raise QerlError(
            f"rollout.linear_backend=fp8-merged merges LoRA factors only, but the policy also trains "
            f"{extra[:3]}{' ...' if len(extra) > 3 else ''}: set lora.train_norms=false, or use "
            "rollout.engine=hf (with rollout.linear_backend=auto) for trained norms"
        )


def saved_deltas(folder: Path) -> dict[str, LoraDelta]:
    """The factors of the PEFT adapter saved in ``folder``, refusing one with full modules (trained norms)
    or DoRA, which a merge of B A cannot serve."""
    adapter_folder.check_folder(folder)
    config = adapter_folder.read_config(folder)
    tensors = adapter_folder.read_weights(folder)
    extra = [k for k in tensors if ".lora_A." not in k and ".lora_B." not in k]
    full = config.get("modules_to_save") or extra[:3]
    if full:
        raise QerlError(
            f"the adapter in {folder} also trains full modules ({full}); "
            "the merge serves LoRA factors only (as vLLM's LoRA does on every backend): retrain with "
            "lora.train_norms=false, or use rollout.engine=hf"
        )
    return deltas_from_tensors(tensors, config)
