"""``qerl bench gap`` on real vLLM and a GPU: ``VLLMEngine.score`` against its one-sequence
``prompt_logprobs``, and the benchmark end to end on a random NVFP4 model (the model of
``tests/test_vllm_real.py``: hidden 256, widths Marlin's FP4 kernels accept), Marlin against qerl's Triton
kernel, each in its child process. Skipped without a GPU or vLLM; CI's GPU job runs them
(``pytest -m "gpu or vllm" -n 0``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_trainer import tiny_cfg
from test_vllm_real import folders, start, stop  # noqa: F401 - the module's fixture, reused

from qerl_cli.bench.gap_settings import GapSettings

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


@pytest.fixture(scope="module")
def nvfp4_engine(folders: dict[str, Path]) -> Iterator[Any]:  # noqa: F811 - the fixture above
    engine = start(folders["nvfp4"], linear_backend="marlin", enable_lora=True)
    try:
        yield engine
    finally:
        stop(engine)


def test_score_is_prompt_logprobs_batched(nvfp4_engine: Any, folders: dict[str, Path]) -> None:  # noqa: F811
    nvfp4_engine.sync_adapter(str(folders["lora"]))
    sequences = [list(range(40, 60)), list(range(70, 75)), list(range(100, 140))]
    batched = nvfp4_engine.score(sequences)
    for ids, scored in zip(sequences, batched, strict=True):
        one = nvfp4_engine.prompt_logprobs(ids)
        assert len(scored) == len(ids) - 1
        assert max(abs(a - b) for a, b in zip(scored, one, strict=True)) < 1e-2  # batching's own rounding
    base = nvfp4_engine.score(sequences[:1], with_adapter=False)[0]
    assert max(abs(a - b) for a, b in zip(base, batched[0], strict=True)) > 0.05  # the adapter is served


def test_the_benchmark_runs_marlin_and_qerl_triton_side_by_side(
    folders: dict[str, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    from qerl_cli.bench.gap import run_gap

    cfg = tiny_cfg(folders["nvfp4"], tmp_path / "run", "model.dtype=bfloat16", "train.device=cuda",
                   "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.2")  # fmt: skip
    cfg.rollout.vllm_kwargs = {"enforce_eager": True}  # faster starts
    settings = GapSettings(recipe="test", backends=["marlin", "qerl-triton"], sequences=8, max_tokens=16,
                           output=str(tmp_path / "out"))  # fmt: skip
    report = run_gap(settings, cfg, command="qerl bench gap test")
    assert [row.error for row in report.rows] == [None, None], [row.error for row in report.rows]
    assert [row.linear_backend for row in report.rows] == ["marlin", "qerl-triton"]
    for row in report.rows:  # the 4-bit kernels' numerics: small, never zero
        assert 0 < row.mean_gap < 0.2 and row.sequences == 8
    (ratio,) = report.ratios
    assert ratio.low is not None and ratio.low <= ratio.ratio <= ratio.high
    assert (tmp_path / "out" / "gap.md").is_file()
