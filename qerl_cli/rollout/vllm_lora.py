"""LoRA sync of the colocated vLLM engine: the trainer's adapter served under a new LoRA id every step.

Part of the vLLM rollout engine (:class:`qerl_cli.rollout.vllm_engine.VLLMEngine` mixes this in).

Why a new LoRA id every step: vLLM caches adapters by id, so re-adding an id it already holds is a
silent no-op and rollouts keep sampling the *old* adapter (or the base model). A fresh id plus
``remove_lora`` of the previous one and a prefix-cache reset (cached KV blocks were computed with the
old weights) makes each sync observable, and the staleness check proves it worked.

Adapters are served from copies on tmpfs (``vllm_setup.tmpfs_dir``), never from the trainer's output
folder, which the next checkpoint may overwrite while vLLM still reads it.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.modeling import adapter as adapter_folder
from qerl_cli.rollout.vllm_setup import tmpfs_dir


class AdapterSync:
    """The engine's one LoRA slot: stage an adapter, load it under a new id, drop the previous one.

    While vLLM sleeps its LoRA slots are offloaded, so a sync then only records the adapter; the
    engine's ``wake_up`` activates it (:meth:`_activate_pending`).
    """

    # The engine's state this mixin reads (set in VLLMEngine.__init__ before any sync).
    llm: Any
    _vllm: Any  # the vLLM names rollout.vllm_setup._import_vllm returns
    _sleeping: bool
    enable_lora: bool
    max_lora_rank: int

    def _init_adapter_state(self) -> None:
        self._lora: Any = None  # the active LoRARequest
        self._pending_lora: Any = None  # loaded by sync while asleep; activated at wake_up
        self._has_pending = False
        self._next_lora_id = 1
        self.num_syncs = 0
        self._stage_root = Path(tempfile.mkdtemp(prefix="qerl-lora-", dir=tmpfs_dir()))
        # The staged copies go when the engine does, closed or not.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._stage_root, True)

    @property
    def lora_request(self) -> Any:
        """The LoRARequest generate uses now (None: the base model)."""
        return self._lora

    @property
    def _lora_id(self) -> int:
        """The vLLM LoRA id generate serves (0: the base model), for the figures and logs."""
        return self._lora.lora_int_id if self._lora is not None else 0

    def sync_adapter(self, adapter_dir: str | Path | None) -> None:
        """Copy the PEFT adapter in ``adapter_dir`` to tmpfs and serve it from the next generate on,
        under a new LoRA id; ``None`` serves the base model."""
        if adapter_dir is None:
            self._load(None)
            return
        source = Path(adapter_dir)
        self._validate_adapter(source)
        staged = adapter_folder.copy_folder(source, self._next_stage_dir())
        self._load(staged)

    def sync_policy(self, peft_model: Any) -> None:
        """Save the trainer's PEFT model's adapter straight to tmpfs (no round trip through the output
        folder) and serve it like :meth:`sync_adapter`."""
        staged = adapter_folder.save_peft_model(peft_model, self._next_stage_dir())
        self._validate_adapter(staged)
        self._load(staged)

    def _next_stage_dir(self) -> Path:
        path = self._stage_root / f"adapter-{self._next_lora_id}"
        if path.exists():
            shutil.rmtree(path)
        return path

    def _validate_adapter(self, folder: Path) -> None:
        adapter_folder.check_servable(folder, enable_lora=self.enable_lora, max_lora_rank=self.max_lora_rank)

    def _load(self, staged: Path | None) -> None:
        request = None
        if staged is not None:
            lora_id = self._next_lora_id
            self._next_lora_id += 1
            request = self._vllm.LoRARequest(
                lora_name=f"qerl-adapter-{lora_id}", lora_int_id=lora_id, lora_path=str(staged)
            )
        self.num_syncs += 1
        if self._sleeping:
            # Loading writes into the LoRA slots, which sleep mode has offloaded: defer to wake_up.
            if self._has_pending and self._pending_lora is not None:
                self._drop_stage(self._pending_lora)
            self._pending_lora, self._has_pending = request, True
            return
        self._activate(request)

    def _activate_pending(self) -> None:
        """Serve the adapter synced while vLLM slept (the engine calls this once awake)."""
        if self._has_pending:
            self._activate(self._pending_lora)
            self._pending_lora, self._has_pending = None, False

    def _activate(self, request: Any) -> None:
        engine = self.llm.llm_engine
        previous = self._lora
        if previous is not None:
            # Removed first: with max_loras=1 the new adapter takes its slot.
            engine.remove_lora(previous.lora_int_id)
            self._drop_stage(previous)
        self._lora = None
        if request is not None:
            try:
                added = engine.add_lora(request)
            except (ValueError, RuntimeError) as exc:
                raise QerlError(
                    f"vLLM could not load the adapter {request.lora_path}: {exc}. Check that "
                    "lora.target_modules are linear layers vLLM supports for this model and that "
                    "rollout.max_lora_rank >= lora.rank"
                ) from exc
            if not added:
                raise QerlError(f"vLLM refused the adapter {request.lora_path} (add_lora returned False)")
            self._lora = request
        # Cached KV blocks were computed with the previous adapter.
        self.llm.reset_prefix_cache()

    def _drop_stage(self, request: Any) -> None:
        path = Path(request.lora_path)
        if path.parent == self._stage_root:
            shutil.rmtree(path, ignore_errors=True)
