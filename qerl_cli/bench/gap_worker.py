"""One backend of ``qerl bench gap``: its rollout engine built as training builds it, the adapter synced
through the engine's own path, every sequence scored teacher-forced (``RolloutEngine.score``).

A vLLM backend runs in a fresh child process, ``python -m qerl_cli.bench.gap_worker SPEC.json OUT.json``
(as ``bench.worker`` and e2e's pairs do): an in-process ``vllm.LLM`` does not give its GPU memory back
when deleted, and each backend needs an engine of its own. Its engine is ``rl.setup.make_engine`` of the
recipe with ``rollout.linear_backend`` set to the backend (the factory's mapping, vLLM's share as the
trainer's memory plan resolved it, sleep mode and the recipe's ``vllm_kwargs`` as training has them).
``hf`` is not measured here: the trainer side scores it with training's own transformers engine over the
live policy (:func:`~qerl_cli.bench.gap_trainer.score_hf`). A failure is a
:class:`~qerl_cli.bench.gap_report.BackendResult` with its error, so the other backends go on.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from qerl_cli.bench.child import run_child
from qerl_cli.bench.gap_report import BackendResult
from qerl_cli.bench.gap_trainer import completion_logprobs, read_sequences
from qerl_cli.config import TrainConfig, from_dict
from qerl_cli.errors import QerlError
from qerl_cli.rl import setup
from qerl_cli.rollout.base import RolloutEngine


@dataclass
class BackendSpec:
    """What one backend's measurement needs (JSON between the parent and its child)."""

    backend: str
    config: dict[str, Any]  # the TrainConfig the trainer side ran, as a mapping
    sequences_file: str
    adapter_dir: str | None  # None: the base alone
    gpu_memory_utilization: float  # vLLM's share, as the trainer's memory plan resolved it
    work_dir: str  # the engine's output.dir (training writes its ready marker there)


def engine_config(spec: BackendSpec) -> TrainConfig:
    """The recipe with this backend as its vLLM rollout's linear backend."""
    cfg = from_dict(TrainConfig, spec.config)
    rollout = replace(cfg.rollout, engine="vllm", linear_backend=spec.backend)
    return replace(cfg, rollout=rollout, output=replace(cfg.output, dir=spec.work_dir))


def open_backend_engine(spec: BackendSpec) -> RolloutEngine:
    """The backend's engine: training's vLLM engine for the recipe with this linear backend."""
    cfg = engine_config(spec)
    Path(spec.work_dir).mkdir(parents=True, exist_ok=True)
    # Training's engine: no policy is read for vLLM (it loads its own copy of the base).
    return setup.make_engine(cfg, None, gpu_memory_utilization=spec.gpu_memory_utilization)  # type: ignore[arg-type]


def measure_backend(
    spec: BackendSpec, open_engine: Callable[[BackendSpec], RolloutEngine] = open_backend_engine
) -> BackendResult:
    """The engine's logprob of every completion token of every sequence, in order, with the seconds its
    load (adapter synced) and its scoring took. ``open_engine``: how the engine is had (tests stand the
    transformers engine in for vLLM's)."""
    sequences = read_sequences(spec.sequences_file)
    started = time.perf_counter()
    engine = open_engine(spec)
    try:
        with_adapter = spec.adapter_dir is not None
        if with_adapter:
            engine.sync_adapter(spec.adapter_dir)
        load_seconds = time.perf_counter() - started
        started = time.perf_counter()
        scored = engine.score([s.token_ids for s in sequences], with_adapter=with_adapter)
        score_seconds = time.perf_counter() - started
        linear_backend = engine.linear_backend
    finally:
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - the figures are taken; a failed teardown must not lose them
            logging.getLogger(__name__).warning("bench gap: closing the %s engine failed", spec.backend,
                                                exc_info=True)  # fmt: skip
    return BackendResult(spec.backend, linear_backend, load_seconds, score_seconds,
                         completion_logprobs(scored, sequences))  # fmt: skip


def error_result(spec: BackendSpec, error: str) -> BackendResult:
    return BackendResult(spec.backend, error=error)


def measure_in_process(
    spec: BackendSpec, open_engine: Callable[[BackendSpec], RolloutEngine] = open_backend_engine
) -> BackendResult:
    """:func:`measure_backend` here, a failure as the backend's error row."""
    try:
        return measure_backend(spec, open_engine)
    except Exception as exc:  # noqa: BLE001 - the row says why; the other backends go on
        logging.getLogger(__name__).exception("bench gap: backend %s failed", spec.backend)
        return error_result(spec, f"{type(exc).__name__}: {exc}")


def measure_isolated(spec: BackendSpec) -> BackendResult:
    """:func:`measure_backend` in a fresh ``python -m qerl_cli.bench.gap_worker`` process
    (:func:`~qerl_cli.bench.child.run_child`)."""
    payload, code = run_child("qerl_cli.bench.gap_worker", asdict(spec), "qerl-gap-")
    if payload is None:  # e.g. killed for memory
        return error_result(spec, f"the gap worker exited with code {code} and no result")
    return BackendResult.from_dict(payload)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m qerl_cli.bench.gap_worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = BackendSpec(**json.loads(Path(argv[0]).read_text()))
    # qerl's own decisions (the backend chosen and why) in the console, as `qerl train` prints them.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("qerl_cli").setLevel(logging.INFO)
    try:
        result = measure_backend(spec)
    except QerlError as exc:  # the engine refused (no GPU, vLLM missing, the backend's checks)
        result = error_result(spec, str(exc))
    except Exception as exc:  # noqa: BLE001 - e.g. vLLM cannot serve this backend on this GPU
        traceback.print_exc()
        result = error_result(spec, f"crashed with {type(exc).__name__}: {exc} (traceback above)")
    Path(argv[1]).write_text(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
