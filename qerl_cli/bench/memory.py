"""Memory figures: weight bytes from the tensors, peak allocated/reserved, KV-cache budget.

Three ways to see GPU memory, and the report always says which one produced a figure:

* ``torch.cuda``: the caching allocator's peaks in *this* process. Right for the HF engine and for
  vLLM run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the bench sets for its workers);
* ``nvml``: device-wide used memory through pynvml (imported lazily), for a vLLM engine core living
  in another process where ``torch.cuda`` sees nothing; it includes every process on the GPU, so
  the figure is the increase over what was used before the engine started;
* ``cpu-rss``: on a machine without a GPU, the process's peak resident set, reset before each
  case where Linux allows it (``/proc/self/clear_refs``); it includes the Python runtime.
"""

from __future__ import annotations

import json
import resource
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TORCH_CUDA = "torch.cuda (in-process)"
NVML = "nvml (device-wide, minus the memory used before the engine started)"
CPU_RSS = "cpu-rss (process peak)"
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def module_tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage counted once (tied embeddings share one)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def checkpoint_tensor_bytes(folder: str | Path) -> int:
    """Bytes of all tensors in a folder's ``*.safetensors`` files, read from their headers only.

    The header lists every tensor's byte range, so this is exact for packed 4-bit checkpoints
    (uint8 nibbles + scales) without loading a byte of weight data.
    """
    total = 0
    files = sorted(Path(folder).glob("*.safetensors"))
    for file in files:
        with open(file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        total += sum(
            end - start
            for name, entry in header.items()
            if name != "__metadata__"
            for start, end in [entry["data_offsets"]]
        )
    return total


def kv_bytes_per_token(model_config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """K and V for one token across all layers: 2 x layers x kv heads x head dim x dtype bytes."""
    heads = model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    kv_heads = model_config.get("num_key_value_heads") or heads
    return 2 * model_config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def read_model_config(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text())


def vllm_kv_cache(llm: Any, model_config: dict[str, Any]) -> tuple[int | None, int | None]:
    """(bytes, tokens) of the KV cache a ``vllm.LLM`` allocated; (None, None) when it is not known.

    vLLM records the block count on its config once the engine core sized the cache; with the
    engine core in another process the parent's copy never learns it.
    """
    try:
        cache_config = llm.llm_engine.vllm_config.cache_config
    except AttributeError:
        return None, None
    blocks, block_size = cache_config.num_gpu_blocks, cache_config.block_size
    if not blocks or not block_size:
        return None, None
    tokens = int(blocks) * int(block_size)
    dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    dtype_bytes = _DTYPE_BYTES.get(dtype, 2)  # "auto" follows the model dtype: BF16 here
    return tokens * kv_bytes_per_token(model_config, dtype_bytes), tokens


def _reset_rss_peak() -> bool:
    """Linux lets a process reset its own peak RSS (VmHWM) by writing 5 to clear_refs."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _rss_peak_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def _nvml_used_bytes(device_index: int) -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    finally:
        pynvml.nvmlShutdown()


def _device_used_bytes(device_index: int) -> int | None:
    """Device-wide used memory: NVML when installed, else the CUDA driver's free/total."""
    used = _nvml_used_bytes(device_index)
    if used is not None:
        return used
    free, total = torch.cuda.mem_get_info(device_index)
    return total - free


@dataclass
class MemoryProbe:
    """Measures one case: ``start()`` before the engine is built, ``sample()`` while it runs, ``result()``.

    ``in_process`` says whether the engine's allocations happen in this process (HF engine, or
    vLLM with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); if not, only NVML can see them.
    """

    in_process: bool = True
    device_index: int = 0
    _used_before: int | None = None
    _used_peak: int | None = None
    _rss_reset: bool = False

    @property
    def on_gpu(self) -> bool:
        return torch.cuda.is_available()

    @property
    def method(self) -> str:
        if not self.on_gpu:
            return CPU_RSS if self._rss_reset else CPU_RSS + ", since process start"
        return TORCH_CUDA if self.in_process else NVML

    def start(self) -> None:
        if not self.on_gpu:
            self._rss_reset = _reset_rss_peak()
            return
        torch.cuda.synchronize(self.device_index)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device_index)
        self._used_before = _device_used_bytes(self.device_index)
        self._used_peak = self._used_before

    def sample(self) -> None:
        """Record device-wide use now (call after loading and after each generation)."""
        if self.on_gpu:
            used = _device_used_bytes(self.device_index)
            if used is not None:
                self._used_peak = max(self._used_peak or 0, used)

    def result(self) -> dict[str, Any]:
        if not self.on_gpu:
            peak = _rss_peak_bytes()
            return {"peak_allocated_bytes": peak, "peak_reserved_bytes": None, "method": self.method}
        self.sample()
        device_delta = (
            self._used_peak - self._used_before
            if self._used_peak is not None and self._used_before is not None
            else None
        )
        if self.in_process:
            return {
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device_index),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device_index),
                "device_used_delta_bytes": device_delta,
                "method": self.method,
            }
        return {
            "peak_allocated_bytes": device_delta,
            "peak_reserved_bytes": device_delta,
            "device_used_delta_bytes": device_delta,
            "method": self.method,
        }
