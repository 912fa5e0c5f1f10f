"""`compare.heldout_engine`: the held-out evaluations on hf (the default, its qerl eval settings as they
always were) or on vLLM (the run's kernels and share), the kept base figures keyed apart by engine, the
refusals before anything trains, and the verdict's note when runs were evaluated on different engines."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_compare import TINY_SETS, _recipe, _score

from qerl_cli import evaluation
from qerl_cli.compare import heldout as heldout_mod
from qerl_cli.compare import runner
from qerl_cli.compare import runs as runs_mod
from qerl_cli.compare.arms import read_settings
from qerl_cli.compare.results import HeldoutScore, RunResult
from qerl_cli.compare.verdict import arm_verdicts, engine_notes, verdict_line
from qerl_cli.config import EvalConfig
from qerl_cli.errors import QerlError, install_hint

VLLM_SETS = [*TINY_SETS, "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.23"]


def _capture_eval(monkeypatch: pytest.MonkeyPatch) -> list[EvalConfig]:
    """qerl eval replaced by a recorder of the EvalConfig it is given (no model runs)."""
    asked: list[EvalConfig] = []

    def fake_eval(eval_cfg: EvalConfig, log: Any) -> Any:
        asked.append(eval_cfg)
        metrics = SimpleNamespace(pass_at_1=0.5, pass_at_1_se=0.1, num_problems=4)
        return SimpleNamespace(benchmarks={"synthetic-addition": SimpleNamespace(metrics=metrics)})

    monkeypatch.setattr(evaluation, "run_eval", fake_eval)
    return asked


def _conf(tmp_path: Path, model: Path, sets: list[str], compare: dict[str, Any] | None = None):
    data, settings = runs_mod.load_recipe(_recipe(tmp_path, model, compare))
    return runs_mod.arm_config(data, {}, sets, 0, tmp_path, "a", {}), settings


def test_the_default_engine_asks_qerl_eval_for_what_it_always_did(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _capture_eval(monkeypatch)
    conf, settings = _conf(tmp_path, tiny_model_dir, VLLM_SETS)  # a vLLM recipe, evaluated on hf still
    assert settings.heldout_engine == "hf"
    score = heldout_mod.evaluate_heldout(conf, settings, None, tmp_path / "heldout", "marlin")
    (eval_cfg,) = asked
    before = EvalConfig(
        model=conf.model.path, adapter=None, benchmarks=["synthetic-addition"], samples=1, engine="hf",
        output=str(tmp_path / "heldout"), temperature=0.0, top_p=1.0,
        max_new_tokens=conf.rollout.max_completion_length, max_problems=4, seed=0, template="plain",
        system_prompt=None, grader_workers=1, device="cpu", dtype="float32",
        generation_batch_size=conf.rollout.generation_batch_size,
    )  # fmt: skip
    assert eval_cfg == before
    assert score.engine == "hf" and score.pass_at_1 == 0.5


def test_vllm_serves_the_runs_kernels_at_its_share(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _capture_eval(monkeypatch)
    sets = [*VLLM_SETS, "rollout.linear_backend=fp8-merged", "rollout.vllm_kwargs={enforce_eager: true}"]
    conf, settings = _conf(tmp_path, tiny_model_dir, sets, {"heldout_engine": "vllm"})
    hf = dataclasses.replace(settings, heldout_engine="hf")
    score = heldout_mod.evaluate_heldout(conf, settings, "ADAPTER", tmp_path / "heldout", None)
    (eval_cfg,) = asked
    assert score.engine == "vllm"
    assert (eval_cfg.engine, eval_cfg.linear_backend, eval_cfg.gpu_memory_utilization) == (
        "vllm", "fp8-merged", 0.23,
    )  # fmt: skip
    assert eval_cfg.vllm_kwargs == {"enforce_eager": True}
    # Nothing else of the evaluation changes: the problems, samples, sampling and prompt are hf's.
    on_hf = heldout_mod.heldout_eval_config(conf, hf, "ADAPTER", tmp_path / "heldout")
    changed = {
        f.name for f in dataclasses.fields(EvalConfig) if getattr(on_hf, f.name) != getattr(eval_cfg, f.name)
    }
    assert changed == {"engine", "linear_backend", "gpu_memory_utilization", "vllm_kwargs"}

    # The backend the run's engine resolved (auto's choice) wins; a name that is no setting does not.
    run = heldout_mod.heldout_eval_config(conf, settings, "ADAPTER", tmp_path, "marlin")
    assert run.linear_backend == "marlin"
    assert (
        heldout_mod.heldout_eval_config(conf, settings, None, tmp_path, "default").linear_backend
        == "fp8-merged"
    )
    # A share of "auto" is sized around the trainer: the evaluation, alone on the GPU, takes its own.
    auto, _ = _conf(tmp_path, tiny_model_dir, [*VLLM_SETS, "rollout.gpu_memory_utilization=auto"])
    alone = heldout_mod.heldout_eval_config(auto, settings, None, tmp_path)
    assert alone.gpu_memory_utilization == EvalConfig().gpu_memory_utilization
    assert not alone.kv_cache_from_share  # the whole GPU (train.gpu_fraction 1): vLLM may profile it
    # A run that shares the GPU (compare's train.gpu_fraction < 1) sizes the eval's KV cache from its share,
    # as its training engine did: profiling would count the neighbours' memory as its own.
    shared, _ = _conf(tmp_path, tiny_model_dir, [*VLLM_SETS, "train.gpu_fraction=0.46"])
    assert heldout_mod.heldout_eval_config(shared, settings, None, tmp_path).kv_cache_from_share


def test_kept_base_figures_are_keyed_by_engine_only_off_hf(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf, hf = _conf(tmp_path, tiny_model_dir, VLLM_SETS)
    vllm = dataclasses.replace(hf, heldout_engine="vllm")
    key = heldout_mod._base_eval_key(conf, hf, tmp_path)
    # The keys of every base evaluation kept before the setting: the same, so their figures are found.
    assert set(key) == {
        "model", "dtype", "dataset", "template", "system_prompt", "max_completion_length", "seed",
        "heldout_problems", "heldout_samples", "heldout_temperature", "entropy_prompts", "entropy_samples",
        "lora_init",
    }  # fmt: skip
    other = heldout_mod._base_eval_key(conf, vllm, tmp_path)
    assert other == {**key, "heldout_engine": "vllm", "linear_backend": "auto"}
    assert heldout_mod._digest(other) != heldout_mod._digest(key)

    # Figures kept on one engine are not reported for the other (a report of runs made elsewhere).
    recipe = _recipe(tmp_path, tiny_model_dir)
    data, _ = runs_mod.load_recipe(recipe)
    out = tmp_path / "cmp"
    monkeypatch.setattr(heldout_mod, "evaluate_heldout", lambda *a: _score(0.25, 0.05))
    monkeypatch.setattr(heldout_mod, "base_entropy", lambda *a: {"exact_entropy": 1.5})
    arms = {"a": {}}
    kept, _ = heldout_mod.evaluate_bases(data, arms, VLLM_SETS, 0, out, {}, hf)
    assert kept["a"] is not None
    found, _ = heldout_mod.evaluate_bases(data, arms, VLLM_SETS, 0, out, {}, hf, evaluate=False)
    assert found["a"] == kept["a"]
    missing, _ = heldout_mod.evaluate_bases(data, arms, VLLM_SETS, 0, out, {}, vllm, evaluate=False)
    assert missing["a"] is None


def _stop_before_bases(monkeypatch: pytest.MonkeyPatch) -> None:
    def made(*a: Any, **k: Any) -> Any:
        raise AssertionError("bases made")

    monkeypatch.setattr(runner, "prepare_bases", made)


def test_vllm_evaluation_of_hf_rollouts_is_refused_before_anything_is_made(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stop_before_bases(monkeypatch)
    recipe = _recipe(tmp_path, tiny_model_dir, {"heldout_engine": "vllm"})
    with pytest.raises(QerlError, match=r"arm\(s\) bf16-lora, nvfp4-aqn train with rollout.engine=hf") as err:
        runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 2, tmp_path / "cmp", sets=TINY_SETS)
    assert "Set rollout.engine=vllm" in str(err.value) and "leave compare.heldout_engine at hf" in str(
        err.value
    )
    # One arm on hf among vLLM ones is named alone.
    sets = [*VLLM_SETS, "compare.arms={mine: {rollout.engine: hf}}"]
    with pytest.raises(QerlError, match=r"arm\(s\) mine train with rollout.engine=hf"):
        runner.run_compare(recipe, ["bf16-lora", "mine"], 2, tmp_path / "cmp", sets=sets)


def test_a_machine_without_vllm_is_refused_in_the_parent_before_training(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stop_before_bases(monkeypatch)
    recipe = _recipe(tmp_path, tiny_model_dir, {"heldout_engine": "vllm"})

    def no_vllm(name: str) -> str:
        raise QerlError(f"--engine vllm: vLLM is not installed ({install_hint('vllm')})")

    monkeypatch.setattr(heldout_mod, "resolve_engine", no_vllm)
    with pytest.raises(
        QerlError, match=r"cannot evaluate on this machine \(qerl eval's check: --engine vllm: vLLM is not"
    ) as err:
        runner.run_compare(recipe, ["bf16-lora"], 1, tmp_path / "cmp", sets=VLLM_SETS)
    assert str(err.value).endswith("with vLLM installed, or leave compare.heldout_engine at hf")
    # With vLLM present the comparison goes on (here: to making its bases).
    monkeypatch.setattr(heldout_mod, "resolve_engine", lambda name: name)
    with pytest.raises(AssertionError, match="bases made"):
        runner.run_compare(recipe, ["bf16-lora"], 1, tmp_path / "cmp", sets=VLLM_SETS)
    # The default engine asks nothing of the machine.
    monkeypatch.setattr(heldout_mod, "resolve_engine", no_vllm)
    with pytest.raises(AssertionError, match="bases made"):
        runner.run_compare(
            _recipe(tmp_path, tiny_model_dir), ["bf16-lora"], 1, tmp_path / "x", sets=VLLM_SETS
        )


def test_an_unknown_heldout_engine_is_refused() -> None:
    with pytest.raises(QerlError, match="compare.heldout_engine"):
        read_settings({"heldout_engine": "tgi"})


def _run(arm: str, seed: int, pass_at_1: float, engine: str | None) -> RunResult:
    score = HeldoutScore("synthetic-addition", pass_at_1, 0.05, 4, 1, engine)
    return RunResult(arm, seed, [0.1], [1.0], score, device="CPU (test)", invocation="i")


def test_the_verdict_notes_runs_evaluated_on_different_engines() -> None:
    mixed = {
        "bf16-lora": [_run("bf16-lora", s, 0.3 + s / 100, e) for s, e in enumerate((None, "hf", "vllm"))],
        "nvfp4-aqn": [_run("nvfp4-aqn", s, 0.31 + s / 100, "vllm") for s in range(2)],
    }
    (verdict,) = arm_verdicts(mixed, "bf16-lora", 5.0)
    assert verdict.notes == ["held-out evaluated on hf (2 runs) and vllm (3 runs)"]
    assert verdict_line(verdict).endswith("(held-out evaluated on hf (2 runs) and vllm (3 runs))")
    # Unrecorded engines were hf: with recorded hf ones they agree, and no note is made.
    agree = {arm: [_run(arm, s, 0.3 + s / 100, e) for s, e in enumerate((None, "hf"))] for arm in mixed}
    assert arm_verdicts(agree, "bf16-lora", 5.0)[0].notes == []
    assert engine_notes([_run("a", 0, 0.3, "vllm")]) == []


def test_a_heldout_score_keeps_an_older_files_layout() -> None:
    old = {"benchmark": "synthetic-addition", "pass@1": 0.5, "pass@1_se": 0.1, "problems": 4, "samples": 1}
    score = HeldoutScore.from_dict(old)
    assert score.engine is None and score.engine_used == "hf"
    assert json.dumps(score.to_dict()) == json.dumps(old)
    recorded = dataclasses.replace(score, engine="vllm")
    assert recorded.to_dict() == {**old, "engine": "vllm"}
    assert HeldoutScore.from_dict(recorded.to_dict()) == recorded
