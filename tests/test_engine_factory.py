"""One home for building rollout engines: every stage describes its engine in a
``rollout.factory.EngineRequest`` and gets it from ``rollout.factory.make_engine``; no module outside
``qerl_cli/rollout`` names an engine class."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_trainer import tiny_cfg
from torch import nn

from qerl_cli.config import EvalConfig
from qerl_cli.rollout import factory
from qerl_cli.rollout.factory import EngineRequest

PACKAGE = Path(__file__).resolve().parents[1] / "qerl_cli"


class Requested(Exception):
    """Raised by the stand-in factory: the request is all a test needs, no engine is built."""

    def __init__(self, request: Any) -> None:
        super().__init__("engine requested")
        self.request = request


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []

    def stand_in(request: Any) -> Any:
        seen.append(request)
        raise Requested(request)

    monkeypatch.setattr(factory, "make_engine", stand_in)
    return seen


def _request_of(call: Any) -> EngineRequest:
    with pytest.raises(Requested) as info:
        call()
    assert isinstance(info.value.request, EngineRequest)
    return info.value.request


# --------------------------------------------------------------------------------------------
# Every stage asks the factory
# --------------------------------------------------------------------------------------------
def test_training_asks_the_factory(tmp_path: Path, requests: list[Any]) -> None:
    from qerl_cli.rl import setup

    policy = SimpleNamespace(model=nn.Linear(2, 2), tokenizer=object(), device="cpu")
    hf = _request_of(lambda: setup.make_engine(tiny_cfg(tmp_path, tmp_path / "a"), policy,  # type: ignore[arg-type]
                                               gpu_memory_utilization=0.3))  # fmt: skip
    assert (hf.kind, hf.model, hf.tokenizer) == ("hf", policy.model, policy.tokenizer)
    assert factory.vllm_only_settings(hf) == []
    cfg = tiny_cfg(tmp_path, tmp_path / "b", "rollout.engine=vllm", "rollout.enable_sleep_mode=false")
    vllm = _request_of(lambda: setup.make_engine(cfg, policy, gpu_memory_utilization=0.4,  # type: ignore[arg-type]
                                                 distributed=True, world_size=2))  # fmt: skip
    assert vllm.kind == "vllm" and vllm.model_path == cfg.model.path
    assert vllm.gpu_memory_utilization == 0.4 and vllm.enable_sleep_mode is False
    assert vllm.max_model_len == cfg.rollout.max_prompt_length + cfg.rollout.max_completion_length
    assert vllm.concurrency == vllm.max_num_seqs == 1 * cfg.rollout.num_generations  # 2 prompts on 2 ranks
    assert vllm.external_launcher and vllm.seed == cfg.train.seed
    assert vllm.kv_cache_from_share is False  # the whole GPU: vLLM profiles its memory as usual
    shared = tiny_cfg(tmp_path, tmp_path / "c", "rollout.engine=vllm", "rollout.enable_sleep_mode=false",
                      "train.gpu_fraction=0.46")  # fmt: skip
    sliced = _request_of(lambda: setup.make_engine(shared, policy, gpu_memory_utilization=0.23))  # type: ignore[arg-type]
    assert sliced.kv_cache_from_share is True  # a slice: its KV cache is sized from its share
    assert len(requests) == 3
    assert not (tmp_path / "b" / setup.ENGINE_READY_FILE).exists()  # no engine came: nothing to report


def test_training_reports_its_vllm_engine_ready_in_its_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `qerl compare --jobs N` waits for before it starts the next run on the GPU."""
    from qerl_cli.rl import setup

    built = object()
    monkeypatch.setattr(factory, "make_engine", lambda request: built)
    policy = SimpleNamespace(model=nn.Linear(2, 2), tokenizer=object(), device="cpu")
    cfg = tiny_cfg(tmp_path, tmp_path / "run", "rollout.engine=vllm")
    (tmp_path / "run").mkdir()
    assert setup.make_engine(cfg, policy, gpu_memory_utilization=0.3) is built  # type: ignore[arg-type]
    assert (tmp_path / "run" / setup.ENGINE_READY_FILE).is_file()
    setup.mark_engine_ready(tmp_path / "missing-folder")  # never fails the run


def test_evaluation_asks_the_factory(requests: list[Any]) -> None:
    from qerl_cli.evaluation import run

    tokenizer = object()
    vllm = _request_of(lambda: run.build_engine(EvalConfig(model="m", engine="vllm", seed=5), tokenizer))
    assert vllm.kind == "vllm" and vllm.linear_backend == "marlin"  # eval's default: the trained numerics
    assert vllm.enable_sleep_mode is False and vllm.seed == 5 and vllm.gpu_memory_utilization == 0.85
    hf = _request_of(lambda: run.build_engine(EvalConfig(model="m", engine="hf", device="cpu"), tokenizer))
    assert (hf.kind, hf.tokenizer, hf.device) == ("hf", tokenizer, "cpu")
    assert factory.vllm_only_settings(hf) == []


def test_the_bench_asks_the_factory(monkeypatch: pytest.MonkeyPatch, requests: list[Any]) -> None:
    from qerl_cli.bench import engines

    def opened(case: engines.Case) -> EngineRequest:
        def enter() -> None:
            with engines.open_engine(case):
                pytest.fail("the stand-in factory builds no engine")

        return _request_of(enter)

    settings = {"prompt_len": 8, "gen_len": 4}
    shared = engines.Case(
        engine="vllm",
        format="nvfp4",
        model_dir="m",
        lora_rank=16,
        lora_dir="a",
        batches=[4, 32],
        settings=settings,
        lora_phases=[0, 16],
        linear_backend="default",
        vllm_kwargs={"enforce_eager": True},
    )
    vllm = opened(shared)
    assert vllm.kind == "vllm" and vllm.adapter is None  # the first phase runs without the adapter
    assert vllm.max_num_seqs == vllm.concurrency == 32 and vllm.linear_backend == "auto"
    assert vllm.enable_sleep_mode is False and vllm.max_model_len == 12 and vllm.max_lora_rank == 16
    assert factory.requested_vllm_kwargs(vllm) == {"max_num_seqs": 32, "enforce_eager": True}
    monkeypatch.setattr(engines, "_hf_model", lambda case: nn.Linear(2, 2))
    hf = opened(engines.Case(engine="hf", format="bf16", model_dir="m", batches=[4, 32], settings=settings))
    assert hf.kind == "hf" and hf.generation_batch_size == 32 and isinstance(hf.model, nn.Linear)


def test_the_other_callers_ask_the_factory(requests: list[Any]) -> None:
    from qerl_cli.compare.entropy import rollout_entropy
    from qerl_cli.rl.warmstart import sampled_accuracy

    entropy = _request_of(lambda: rollout_entropy("m", ["q"], 2, 4, seed=0, device="cpu", batch=7))
    assert (entropy.kind, entropy.generation_batch_size) == ("hf", 7)
    model = nn.Linear(2, 2)
    probe = _request_of(lambda: sampled_accuracy(model, object(), [], "plain"))
    assert probe.model is model and str(probe.device) == "cpu"


def test_vllm_settings_in_an_hf_request_are_refused() -> None:
    from qerl_cli.errors import QerlError

    with pytest.raises(QerlError, match=r"\['enable_sleep_mode', 'max_num_seqs'\] only apply to the vllm"):
        factory.make_engine(EngineRequest("hf", "x", enable_sleep_mode=False, max_num_seqs=8))


def test_the_recipes_vllm_kwargs_win_over_the_requests() -> None:
    request = EngineRequest("vllm", "m", max_num_seqs=8, external_launcher=True,
                            vllm_kwargs={"max_num_seqs": 2, "enforce_eager": True})  # fmt: skip
    assert factory.requested_vllm_kwargs(request) == {
        "distributed_executor_backend": "external_launcher",
        "max_num_seqs": 2,
        "enforce_eager": True,
    }
    assert factory.requested_vllm_kwargs(EngineRequest("vllm", "m")) == {}


# --------------------------------------------------------------------------------------------
# No engine class outside rollout/
# --------------------------------------------------------------------------------------------
ENGINE_CLASSES = {"HFEngine", "VLLMEngine"}
ENGINE_MODULES = {"qerl_cli.rollout.hf", "qerl_cli.rollout.vllm_engine"}


def _engine_class_uses(file: Path) -> list[str]:
    """Imports of an engine module or class, and any name or attribute spelled like an engine class."""
    found = []
    for node in ast.walk(ast.parse(file.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name in ENGINE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            classes = [a.name for a in node.names if a.name in ENGINE_CLASSES]
            names = sorted(modules & ENGINE_MODULES) + classes
        elif isinstance(node, ast.Name) and node.id in ENGINE_CLASSES:
            names = [node.id]
        elif isinstance(node, ast.Attribute) and node.attr in ENGINE_CLASSES:
            names = [node.attr]
        found += [f"{file.name}:{node.lineno} {name}" for name in names]
    return found


def test_no_module_outside_rollout_names_an_engine_class() -> None:
    outside = [f for f in sorted(PACKAGE.rglob("*.py")) if "rollout" not in f.relative_to(PACKAGE).parts[:1]]
    assert len(outside) > 50  # the walk sees the package
    assert [use for file in outside for use in _engine_class_uses(file)] == []


def test_the_engine_class_check_sees_every_spelling(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from qerl_cli.rollout.hf import HFEngine\n"
        "from qerl_cli.rollout import vllm_engine\n"
        "import qerl_cli.rollout.hf\n"
        "engine = vllm_engine.VLLMEngine('m')\n"
        "from qerl_cli.rollout.base import RolloutEngine\n"  # the protocol is fine
    )
    uses = _engine_class_uses(source)
    assert len(uses) == 5 and not any("RolloutEngine" in use for use in uses)
