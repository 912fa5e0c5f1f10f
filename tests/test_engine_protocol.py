"""The trainer talks to its rollout engine through ``rollout.base.RolloutEngine`` alone: a fake engine
with only the protocol's methods trains, every figure it reports reaches the step's metrics, and
``rl/`` never asks an engine what it is."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from test_trainer import FakeReward, tiny_cfg

from qerl_cli.rollout import base
from qerl_cli.rollout.base import RolloutEngine, RolloutResult, SamplingSpec

PACKAGE = Path(__file__).resolve().parents[1] / "qerl_cli"


def _public_methods(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


PROTOCOL_METHODS = _public_methods(RolloutEngine)


class ProtocolOnlyEngine:
    """Exactly the protocol's methods: samples through the trainer's HF engine (``inner``), reports
    figures of its own and records what the trainer asked of it."""

    def __init__(self, inner: RolloutEngine) -> None:
        self._inner = inner
        self._calls: list[str] = []
        self._probes: list[tuple[list[int], list[float]]] = []
        self._synced: list[Any] = []

    def generate(self, prompts: list[str], n: int, sampling: SamplingSpec) -> RolloutResult:
        self._calls.append("generate")
        result = self._inner.generate(prompts, n, sampling)
        result.stats = {**result.stats, base.NOISE_CHANGED_FRACTION: 0.25, "rollout/fake_figure": 7.0}
        return result

    def sync_adapter(self, adapter_dir: str | None) -> None:
        raise AssertionError("the trainer syncs its live model through sync_policy")

    def set_norm_noise(self, sigma: float, seed: int) -> int:
        self._calls.append("set_norm_noise")
        return self._inner.set_norm_noise(sigma, seed)

    def sleep(self) -> None:
        self._calls.append("sleep")

    def wake_up(self) -> None:
        self._calls.append("wake_up")

    def sync_policy(self, peft_model: Any) -> None:
        self._calls.append("sync_policy")
        self._synced.append(peft_model)

    def check_staleness(
        self,
        probe_ids: Sequence[int],
        trainer_logprobs: Callable[[Sequence[int]], Sequence[float]],
        reference_logprobs: Callable[[Sequence[int]], Sequence[float]] | None = None,
    ) -> float | None:
        self._calls.append("check_staleness")
        self._probes.append((list(probe_ids), list(trainer_logprobs(probe_ids))))
        return 0.01

    def score(self, sequences: Sequence[Sequence[int]], *, with_adapter: bool = True) -> list[list[float]]:
        self._calls.append("score")
        return self._inner.score(sequences, with_adapter=with_adapter)

    def stats(self) -> dict[str, float]:
        return {base.STALENESS_GAP: 0.01, "rollout/syncs": float(len(self._synced))}

    @property
    def linear_backend(self) -> str:
        return "default"

    def close(self) -> None:
        self._calls.append("close")


def test_the_fake_has_exactly_the_protocols_methods() -> None:
    assert _public_methods(ProtocolOnlyEngine) == PROTOCOL_METHODS
    assert {"sync_policy", "check_staleness", "stats", "close"} <= PROTOCOL_METHODS
    assert isinstance(ProtocolOnlyEngine(None), RolloutEngine)  # type: ignore[arg-type]


def test_a_protocol_only_engine_trains_and_its_figures_reach_the_metrics(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from qerl_cli.rl.trainer import Trainer

    trainer = Trainer(tiny_cfg(tiny_model_dir, tmp_path / "run"), reward_fn=FakeReward())
    fake = ProtocolOnlyEngine(trainer.engine)
    trainer.engine = fake
    record = trainer.train_step()
    # awake again (timed on its own: time_wake_s) before the adapter sync and its staleness probe
    assert fake._calls == [
        "wake_up",
        "set_norm_noise",
        "generate",
        "sleep",
        "wake_up",
        "sync_policy",
        "check_staleness",
    ]
    assert fake._synced == [trainer.policy.model]
    probe, logprobs = fake._probes[0]
    assert len(logprobs) == len(probe) - 1 and all(lp <= 0 for lp in logprobs)
    # Per-rollout figures (the AQN changed fraction included) and the engine's state are all logged.
    assert record[base.NOISE_CHANGED_FRACTION] == 0.25 and record["rollout/fake_figure"] == 7.0
    assert record[base.STALENESS_GAP] == 0.01 and record["rollout/syncs"] == 1.0
    assert record[base.GENERATED_TOKENS] == record["rollout_tokens"] > 0
    assert record[base.COMPLETIONS] == 8.0  # 2 prompts x 4 generations


def test_engine_figures_merge_over_rounds_and_ranks() -> None:
    from qerl_cli.rl.rollouts import engine_stats

    rounds = [
        {base.SECONDS: 2.0, base.GENERATED_TOKENS: 100.0, base.TOKENS_PER_S: 50.0, base.NOISE_SIGMA: 0.1},
        {base.SECONDS: 3.0, base.GENERATED_TOKENS: 50.0, base.TOKENS_PER_S: 16.7, base.NOISE_SIGMA: 0.1},
    ]
    merged = engine_stats(rounds, add=sum)
    assert merged == {base.SECONDS: 5.0, base.GENERATED_TOKENS: 150.0, base.TOKENS_PER_S: 30.0,
                      base.NOISE_SIGMA: 0.1}  # fmt: skip
    ranks = engine_stats(rounds, add=sum, seconds=max)  # ranks run at once: the slowest one's time
    assert ranks[base.SECONDS] == 3.0 and ranks[base.TOKENS_PER_S] == 50.0


def _engine_probes(file: Path) -> list[str]:
    """isinstance / getattr / hasattr calls whose arguments name an engine."""
    found = []
    for node in ast.walk(ast.parse(file.read_text())):
        probe = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args
        asks = probe and node.func.id in ("isinstance", "getattr", "hasattr")
        if asks and "engine" in ast.unparse(node).lower():
            found.append(f"{file.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_rl_never_asks_an_engine_what_it_is() -> None:
    probes = [p for file in sorted((PACKAGE / "rl").glob("*.py")) for p in _engine_probes(file)]
    assert probes == []


def test_the_probe_check_sees_isinstance_and_getattr(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "def f(engine, HFEngine):\n"
        "    return isinstance(engine, HFEngine), getattr(engine, 'close', None), hasattr(x, 'y')\n"
    )
    assert len(_engine_probes(source)) == 2


def test_the_hf_engine_copies_another_models_adapter_and_has_nothing_to_check(tiny_model_dir: Path) -> None:
    import torch
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_tokenizer
    from qerl_cli.modeling.lora import attach_lora
    from qerl_cli.rollout.hf import HFEngine

    def lora_model():
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        return attach_lora(base, r=4, alpha=8, target_modules=["q_proj", "v_proj"])

    trained, served = lora_model(), lora_model()
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_()
    engine = HFEngine(served, load_tokenizer(str(tiny_model_dir)))
    engine.sync_policy(trained)
    want, got = get_peft_model_state_dict(trained), get_peft_model_state_dict(served)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert engine.check_staleness([1, 2, 3], lambda ids: pytest.fail("no trainer forward needed")) is None
    assert set(engine.stats()) == {base.NORM_MODULES, base.NOISE_SIGMA, base.PERTURBED_NORMS}
    engine.close()
