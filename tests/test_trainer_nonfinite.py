"""A step whose loss or gradient norm is NaN/inf is skipped, not the end of the run
(``train.max_nonfinite_steps``): gradients zeroed, no optimizer step, the record marked; only more
such steps in a row than the setting allows end the run with the divergence error."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer import FakeReward, tiny_cfg

from qerl_cli.config import TrainConfig, load_config
from qerl_cli.errors import QerlError
from qerl_cli.rl.distributed import Distributed


class Poison:
    """Make one LoRA gradient NaN after the all-reduce of the given (1-based) update calls, as a finite
    loss with NaN gradients did on an H200. Keeps the trainable tensors and each poisoned name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
        self.steps, self.calls = steps, 0
        self.params: list[tuple[str, Any]] = []
        self.poisoned: list[str] = []
        self.original = Distributed.all_reduce_gradients
        # A plain function on the class, so that it is bound to each Distributed as the method was.
        monkeypatch.setattr(
            Distributed, "all_reduce_gradients", lambda dist, params: self.reduce(dist, params)
        )

    def reduce(self, dist: Distributed, params: list[tuple[str, Any]]) -> None:
        self.original(dist, params)
        self.params, self.calls = params, self.calls + 1
        if self.calls in self.steps:
            name, param = params[3]
            param.grad.view(-1)[0] = float("nan")
            self.poisoned.append(name)


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_nan_gradient_step_is_skipped_and_the_run_goes_on(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from qerl_cli.rl.trainer import train

    poison = Poison(monkeypatch, {2})
    weights: dict[int, dict[str, torch.Tensor]] = {}
    grads_left: dict[int, bool] = {}

    def snapshot(step: int, record: dict[str, Any]) -> None:
        weights[step] = {n: p.detach().clone() for n, p in poison.params}
        grads_left[step] = any(p.grad is not None for _, p in poison.params)

    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="qerl_cli.rl.trainer"):
        result = train(
            tiny_cfg(tiny_model_dir, out), progress=False, on_step=snapshot, reward_fn=FakeReward()
        )

    assert result.steps == 4 and result.nonfinite_steps == 1
    rows = _records(out)
    assert [r["skipped_update"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert rows[1]["nonfinite_grad"] == 1.0 and "grad_norm" not in rows[1]
    assert all("nonfinite_grad" not in r for r in rows[:1] + rows[2:])
    # The skipped step left the adapter as step 1 made it, and no gradient behind; the others moved it.
    assert all(torch.equal(weights[1][n], weights[2][n]) for n in weights[1])
    assert not grads_left[2]
    assert any(not torch.equal(weights[2][n], weights[3][n]) for n in weights[2])
    # The learning-rate schedule still stepped (it is a function of the step).
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    warnings = [r.getMessage() for r in caplog.records if "is skipped" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("step 2: the gradient norm is nan")
    assert (
        f"tensors: {poison.poisoned[0]})" in warnings[0]
        and "1 in a row of train.max_nonfinite_steps=3" in warnings[0]
    )


def test_more_nonfinite_steps_in_a_row_than_allowed_end_the_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.rl.trainer import train

    Poison(monkeypatch, {1, 2, 3})
    out = tmp_path / "run"
    cfg = tiny_cfg(tiny_model_dir, out, "train.max_nonfinite_steps=2", "output.save_steps=1")
    with pytest.raises(QerlError) as caught:
        train(cfg, progress=False, reward_fn=FakeReward())
    message = str(caught.value)
    assert message.startswith("training diverged at step 3: the gradient norm is nan")
    assert "(3 steps in a row, train.max_nonfinite_steps=2)" in message
    # Steps 1-3 skipped: checkpoints 1 and 2 hold the untrained weights that gave them; none is earlier.
    assert (
        f"every checkpoint (newest {out / 'checkpoint-2'}) hold" in message
        and "no checkpoint comes before them" in message
    )
    assert "Lower train.learning_rate" in message
    assert [r["nonfinite_grad"] for r in _records(out)] == [1.0, 1.0]


def test_a_finite_step_ends_the_streak(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.rl.trainer import train

    Poison(monkeypatch, {1, 3})
    out = tmp_path / "run"
    result = train(
        tiny_cfg(tiny_model_dir, out, "train.max_nonfinite_steps=1"), progress=False, reward_fn=FakeReward()
    )
    assert result.steps == 4 and result.nonfinite_steps == 2
    assert [r["skipped_update"] for r in _records(out)] == [1.0, 0.0, 1.0, 0.0]


def test_zero_stops_at_the_first_nonfinite_gradient(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.rl.trainer import train

    Poison(monkeypatch, {2})
    out = tmp_path / "run"
    with pytest.raises(QerlError) as caught:
        train(
            tiny_cfg(tiny_model_dir, out, "train.max_nonfinite_steps=0"),
            progress=False,
            reward_fn=FakeReward(),
        )
    message = str(caught.value)
    assert message.startswith(
        "training diverged at step 2: the gradient norm is nan (non-finite gradients in 1 of"
    )
    assert "in a row" not in message
    assert [r["step"] for r in _records(out)] == [1]


def test_a_resumed_run_counts_on_from_the_checkpoints_streak(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stopped for divergence and resumed got a fresh train.max_nonfinite_steps allowance: the
    streak restarted from 0. It is kept in the checkpoint, so the resumed run stops where the
    uninterrupted one would have."""
    from qerl_cli.rl.trainer import train

    Poison(monkeypatch, {2, 3, 4})  # calls 2 and 3: the first run's steps 2 and 3; 4: the resumed step 3
    out = tmp_path / "run"
    cfg = tiny_cfg(tiny_model_dir, out, "train.max_nonfinite_steps=1", "output.save_steps=1")
    with pytest.raises(QerlError, match=r"diverged at step 3: .*\(2 steps in a row"):
        train(cfg, progress=False, reward_fn=FakeReward())
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["nonfinite_streak"] == 1
    with pytest.raises(QerlError, match=r"diverged at step 3: .*\(2 steps in a row"):
        train(cfg, resume=str(out), progress=False, reward_fn=FakeReward())


class NanRewardAt(FakeReward):
    """NaN rewards (so a NaN loss, caught before backward) on the given 1-based steps."""

    def __init__(self, steps: set[int]) -> None:
        super().__init__()
        self.steps = steps

    def __call__(self, completions: list[str], problems: list[Any]) -> tuple[list[float], dict[str, float]]:
        rewards, stats = super().__call__(completions, problems)
        if len(self.batches) in self.steps:
            rewards = [float("nan")] * len(rewards)
        return rewards, stats


def test_a_nonfinite_loss_follows_the_same_rule(tiny_model_dir: Path, tmp_path: Path) -> None:
    from qerl_cli.rl.trainer import train

    out = tmp_path / "run"
    result = train(tiny_cfg(tiny_model_dir, out), progress=False, reward_fn=NanRewardAt({3}))
    assert result.steps == 4 and result.nonfinite_steps == 1
    rows = _records(out)
    assert rows[2]["skipped_update"] == 1.0 and rows[2]["nonfinite_loss"] == 1.0 and "loss" not in rows[2]
    assert all(r["skipped_update"] == 0.0 for r in rows[:2] + rows[3:])

    with pytest.raises(QerlError, match=r"diverged at step 4: the policy-gradient term .*\(4 steps in a row"):
        train(
            tiny_cfg(tiny_model_dir, tmp_path / "nan"),
            progress=False,
            reward_fn=FakeReward(value=float("nan")),
        )


def test_max_nonfinite_steps_is_checked_and_documented() -> None:
    from qerl_cli.config.keydocs import key_docs

    assert TrainConfig().train.max_nonfinite_steps == 3
    with pytest.raises(
        QerlError, match=r"train.max_nonfinite_steps must be >= 0, got -1: .*set 0 to stop at the first"
    ):
        load_config(TrainConfig, None, ["train.max_nonfinite_steps=-1"])
    docs = {doc.key: doc for doc in key_docs(TrainConfig)}
    assert docs["train.max_nonfinite_steps"].default == "3"
    assert "0: the first such step ends it" in docs["train.max_nonfinite_steps"].help


# -- two ranks (gloo, CPU processes) ----------------------------------------------------------------
def _nan_on_rank_1_worker(rank: int, port: int, model_dir: str, out_dir: str, record_dir: str) -> None:
    from test_distributed import FakeReward as RuleReward
    from test_distributed import _join
    from test_distributed import tiny_cfg as two_rank_cfg

    _join(rank, port)
    from qerl_cli.rl.trainer import train

    original = Distributed.all_reduce_gradients
    calls: list[int] = []

    def nan_on_rank_1(dist: Distributed, params: list[tuple[str, Any]]) -> None:
        calls.append(1)
        if len(calls) == 2 and dist.rank == 1:  # before the sum: rank 1's own gradient alone is NaN
            next(p for _, p in params if p.grad is not None).grad.view(-1)[0] = float("nan")
        original(dist, params)
        # Both ranks now hold the same (summed) gradients: the same norm, the same verdict.
        (Path(record_dir) / f"rank{rank}-call{len(calls)}.txt").write_text(
            str(float(torch.nn.utils.get_total_norm([p.grad for _, p in params if p.grad is not None])))
        )

    Distributed.all_reduce_gradients = nan_on_rank_1  # this process only
    result = train(two_rank_cfg(Path(model_dir), Path(out_dir)), progress=False, reward_fn=RuleReward())
    (Path(record_dir) / f"rank{rank}.json").write_text(json.dumps([result.steps, result.nonfinite_steps]))


@pytest.mark.slow
def test_ranks_skip_a_nonfinite_step_together(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A NaN in one rank's gradient reaches every rank through the all-reduce; the norm is taken after
    it, so every rank skips that step and the next collectives stay paired (else the job would hang)."""
    from test_distributed import _spawn

    out = tmp_path / "run"
    _spawn(_nan_on_rank_1_worker, str(tiny_model_dir), str(out), str(tmp_path))
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [[3, 1], [3, 1]]
    norms = {r: [(tmp_path / f"rank{r}-call{c}.txt").read_text() for c in (1, 2, 3)] for r in (0, 1)}
    assert norms[0] == norms[1] and norms[0][1] == "nan"
    assert [r["skipped_update"] for r in _records(out)] == [0.0, 1.0, 0.0]


def test_the_summary_says_how_many_steps_were_skipped() -> None:
    from rich.console import Console

    from qerl_cli.cli.render import train_summary
    from qerl_cli.rl.result import TrainResult

    def rendered(skipped: int) -> str:
        result = TrainResult(
            output_dir="runs/x", adapter="runs/x/adapter", steps=30, world_size=1, resumed_from=None,
            reward_first10=0.1, reward_last10=0.4, plot=None, nonfinite_steps=skipped,
        )  # fmt: skip
        console = Console(width=120, record=True)
        console.print(train_summary(result))
        return console.export_text()

    assert "steps skipped (NaN/inf loss or gradients) │ 2" in rendered(2)
    assert "skipped" not in rendered(0)
    # A summary written before the field existed still reads.
    older = TrainResult("o", "a", 1, 1, None, 0.0, 0.0, None).to_dict()
    del older["nonfinite_steps"]
    assert TrainResult.from_dict(older).nonfinite_steps == 0
