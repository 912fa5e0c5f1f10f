"""Data-parallel training over torch.distributed (gloo, 2 CPU processes, the tiny model):

- the update of a batch split across 2 ranks equals the single-process update of the whole batch
  (loss, LoRA gradient and the weights after the step, float32);
- a 2-process run writes one metrics row per step (with world_size), rank 0 writes the checkpoint,
  and a 1-process ``--resume`` of it continues with the same next batch;
- the settings a data-parallel job cannot run fail clearly.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from test_trainer import tiny_cfg as trainer_tiny_cfg

from qerl_cli.config import TrainConfig
from qerl_cli.errors import QerlError
from qerl_cli.rl.distributed import Distributed

WORLD = 2


class FakeReward:
    """Rewards by a rule on the text (varies within groups); records the problem ids it graded."""

    def __init__(self, record: Path | None = None) -> None:
        self.record = record

    def __call__(self, completions: list[str], problems: list[Any]) -> tuple[list[float], dict[str, float]]:
        if self.record is not None:
            with self.record.open("a") as fh:
                fh.write(json.dumps([p.id for p in problems]) + "\n")
        rewards = [float(len(c) % 3 == 0) for c in completions]
        return rewards, {"accuracy": sum(rewards) / len(rewards), "format_rate": 0.0, "grader_timeouts": 0.0}


def tiny_cfg(model_dir: Path, out: Path, *overrides: str) -> TrainConfig:
    """test_trainer's tiny run, with 3 groups a step (an uneven split over 2 ranks: 2 + 1) and the
    token-level loss (its normaliser must count every rank's tokens)."""
    return trainer_tiny_cfg(
        model_dir,
        out,
        "train.prompts_per_step=3",
        "train.max_steps=3",
        "algorithm.loss_type=dapo",
        *overrides,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join(rank: int, port: int) -> None:
    """What torchrun sets for each process."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)


def _spawn(fn: Any, *args: Any) -> None:
    mp.spawn(fn, args=(_free_port(), *args), nprocs=WORLD, join=True)


# -- the update of a fixed batch ------------------------------------------------------------------
def _update_recording_grads(trainer: Any, batch: Any) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """``trainer.update(batch)`` and the LoRA gradients of its optimizer step (the update frees them
    after the step)."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def step_recording_grads(*args: Any, **kwargs: Any) -> Any:
        grads.update({n: p.grad.clone() for n, p in trainer.params})
        return step(*args, **kwargs)

    trainer.optimizer.step = step_recording_grads
    return trainer.update(batch), grads


def _update_worker(rank: int, port: int, model_dir: str, batch_file: str, out_dir: str) -> None:
    _join(rank, port)
    from qerl_cli.rl.trainer import Trainer

    trainer = Trainer(tiny_cfg(Path(model_dir), Path(out_dir) / "run"), reward_fn=FakeReward())
    batch = pickle.loads(Path(batch_file).read_bytes())
    groups = len(batch) // batch.group_size
    mine = trainer.dist.shard(groups)
    part = type(batch)(group_size=batch.group_size)
    part.extend(batch, list(range(mine.start * batch.group_size, mine.stop * batch.group_size)))
    stats, grads = _update_recording_grads(trainer, part)
    result = {
        "stats": stats,
        "rows": len(part),
        "grads": grads,
        "weights": {n: p.detach().clone() for n, p in trainer.params},
    }
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    # As train() ends: both ranks done before the group goes. Without it one rank tore gloo down while
    # the other still used it, and that one aborted ("terminate called without an active exception").
    trainer.dist.barrier()
    trainer.dist.close()


@pytest.mark.slow
def test_two_ranks_take_the_single_process_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    from qerl_cli.rl.trainer import Trainer

    single = Trainer(tiny_cfg(tiny_model_dir, tmp_path / "single"), reward_fn=FakeReward())
    _, batch, _ = single.collect()
    assert len(batch) == 12 and len(set(batch.rewards)) > 1
    batch_file = tmp_path / "batch.pkl"
    batch_file.write_bytes(pickle.dumps(batch))
    expected, expected_grads = _update_recording_grads(single, batch)

    _spawn(_update_worker, str(tiny_model_dir), str(batch_file), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert [r["rows"] for r in ranks] == [8, 4]  # whole groups: 2 on rank 0, 1 on rank 1
    for result in ranks:
        stats = result["stats"]
        assert stats["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7)
        assert stats["num_tokens"] == expected["num_tokens"]
        assert stats["num_sequences"] == 12
        assert stats["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
        for name, param in single.params:
            grad = expected_grads[name]
            assert torch.allclose(result["grads"][name], grad, rtol=1e-5, atol=1e-7), name
            # Adam's first step is lr * g / (|g| + 1e-8): for a gradient near Adam's eps (float noise
            # of ~1e-8) the step follows that noise, so compare the weights where |g| >> eps.
            real = grad.abs() > 1e-6
            moved, want = result["weights"][name][real], param.detach()[real]
            assert torch.allclose(moved, want, rtol=1e-5, atol=1e-7), name
    assert any(g.abs().sum() > 0 for g in expected_grads.values())  # the comparison is not of zeros


# -- a whole run, then a resume with another world size -------------------------------------------
def _train_worker(rank: int, port: int, model_dir: str, out_dir: str, record_dir: str) -> None:
    _join(rank, port)
    from qerl_cli.rl.trainer import train

    # 3 steps, a checkpoint after step 2 only: the resume below redoes step 3.
    result = train(
        tiny_cfg(Path(model_dir), Path(out_dir)),
        progress=False,
        reward_fn=FakeReward(Path(record_dir) / f"rank{rank}.jsonl"),
    )
    assert result.world_size == WORLD and not torch.distributed.is_initialized()


@pytest.mark.slow
def test_two_process_run_resumes_on_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    from qerl_cli.rl.checkpoint import list_checkpoints
    from qerl_cli.rl.trainer import train

    out = tmp_path / "run"
    _spawn(_train_worker, str(tiny_model_dir), str(out), str(tmp_path))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and {r["world_size"] for r in rows} == {2}
    assert rows[-1]["data_position"] == 9 and rows[-1]["num_sequences"] == 12
    assert [s for s, _ in list_checkpoints(out)] == [2]
    # Each rank graded its own prompts; together they are the step's 3 prompts, in rank order.
    per_rank = [
        [json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(WORLD)
    ]
    assert [len(batch) for batch in per_rank[0]] == [8] * 3 and [len(b) for b in per_rank[1]] == [4] * 3
    step3 = per_rank[0][2] + per_rank[1][2]

    resumed = FakeReward(tmp_path / "resumed.jsonl")
    result = train(tiny_cfg(tiny_model_dir, out), resume=str(out), progress=False, reward_fn=resumed)
    assert result.resumed_from.endswith("checkpoint-2") and result.world_size == 1
    # One process draws exactly the prompts the two processes drew for step 3.
    assert json.loads((tmp_path / "resumed.jsonl").read_text().splitlines()[0]) == step3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["world_size"] for r in rows] == [2, 2, 1]


# -- settings ---------------------------------------------------------------------------------------
def _failing_write_worker(rank: int, port: int, out_dir: str) -> None:
    _join(rank, port)
    from qerl_cli.rl.distributed import init_distributed

    dist = init_distributed("cpu")

    def write() -> str:
        raise QerlError("could not write checkpoint-1: no space left on device")

    try:
        dist.on_main(write, "write checkpoint-1")
        message = "returned"
    except QerlError as exc:
        message = str(exc)
    (Path(out_dir) / f"rank{rank}.txt").write_text(message)
    dist.close()


def test_a_failed_write_on_rank_0_stops_every_rank_with_its_reason(tmp_path: Path) -> None:
    """Rank 0 writes checkpoints alone; when that fails the others must not wait for it in a collective
    (under NCCL they would hang until the 30-minute timeout)."""
    _spawn(_failing_write_worker, str(tmp_path))
    assert (tmp_path / "rank0.txt").read_text() == "could not write checkpoint-1: no space left on device"
    told = "rank 0 could not write checkpoint-1; its own error says why"
    assert (tmp_path / "rank1.txt").read_text() == told


def test_shards_are_contiguous_whole_and_cover_everything() -> None:
    for world in (1, 2, 3, 4):
        for count in range(world, 11):
            blocks = [Distributed(rank=r, world_size=world).shard(count) for r in range(world)]
            assert [i for b in blocks for i in range(b.start, b.stop)] == list(range(count))
            assert max(b.stop - b.start for b in blocks) - min(b.stop - b.start for b in blocks) <= 1


def test_single_process_is_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from qerl_cli.rl.distributed import init_distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist = init_distributed("cpu")
    assert not dist.enabled and dist.is_main and dist.sum([2.0, 3.0]) == [2.0, 3.0]
    assert dist.all_gather_object({"a": 1}) == [{"a": 1}]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(QerlError, match="torchrun"):
        init_distributed("cpu")


def test_settings_a_data_parallel_job_cannot_run(tmp_path: Path) -> None:
    from qerl_cli.rl.setup import check_parallel_settings

    two = Distributed(rank=0, world_size=2)
    cfg = tiny_cfg(tmp_path, tmp_path / "out", "train.prompts_per_step=1")
    with pytest.raises(QerlError, match="prompts_per_step=1 is smaller than the 2 processes"):
        check_parallel_settings(cfg, two)
    cfg = tiny_cfg(tmp_path, tmp_path / "out", "rollout.engine=vllm", "rollout.tensor_parallel_size=2")
    with pytest.raises(QerlError, match="tensor_parallel_size=2 with 2 torchrun processes"):
        check_parallel_settings(cfg, two)
    check_parallel_settings(cfg, Distributed())  # one process: vLLM spans the GPUs itself
    with pytest.raises(QerlError, match="needs rollout.engine=vllm"):
        tiny_cfg(tmp_path, tmp_path / "out", "rollout.tensor_parallel_size=2")
    with pytest.raises(QerlError, match="tensor_parallel_size must be > 0"):
        tiny_cfg(tmp_path, tmp_path / "out", "rollout.tensor_parallel_size=0")


def test_vllm_engine_joins_the_process_group_and_sizes_max_num_seqs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.rl import setup
    from qerl_cli.rollout import factory

    calls: list[factory.EngineRequest] = []
    monkeypatch.setattr(factory, "make_engine", calls.append)
    cfg = tiny_cfg(
        tmp_path, tmp_path / "out", "rollout.engine=vllm", "rollout.vllm_kwargs={enforce_eager: 1}"
    )
    setup.make_engine(cfg, None, gpu_memory_utilization=0.3, distributed=True, world_size=2)  # type: ignore[arg-type]
    setup.make_engine(cfg, None, gpu_memory_utilization=0.3)  # type: ignore[arg-type]
    launcher = {"distributed_executor_backend": "external_launcher"}
    n = cfg.rollout.num_generations
    # 3 prompts a step: the larger rank share is 2 prompts, a single process rolls out all 3.
    vllm_kwargs = [factory.requested_vllm_kwargs(request) for request in calls]
    assert vllm_kwargs[0] == {**launcher, "max_num_seqs": 2 * n, "enforce_eager": 1}
    assert vllm_kwargs[1] == {"max_num_seqs": 3 * n, "enforce_eager": 1}
    assert calls[1].tensor_parallel_size == 1
    # A recipe's own max_num_seqs wins; a huge step is capped at vLLM's default.
    calls.clear()
    cfg = tiny_cfg(tmp_path, tmp_path / "out", "rollout.engine=vllm", "rollout.vllm_kwargs={max_num_seqs: 5}")
    setup.make_engine(cfg, None, gpu_memory_utilization=0.3)  # type: ignore[arg-type]
    cfg = tiny_cfg(tmp_path, tmp_path / "out", "rollout.engine=vllm", "train.prompts_per_step=2048")
    setup.make_engine(cfg, None, gpu_memory_utilization=0.3)  # type: ignore[arg-type]
    assert [factory.requested_vllm_kwargs(c)["max_num_seqs"] for c in calls] == [
        5,
        setup.VLLM_DEFAULT_MAX_NUM_SEQS,
    ]


_GROUP_OF_ONE = """
import datetime, os, socket, sys
import torch.distributed as dist
from qerl_cli.rl.distributed import init_distributed
if sys.argv[1] == "qerl":
    init_distributed("cpu")  # what qerl train does first, before its rollout engine starts
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
# What vLLM's in-process engine does: a process group of one at a fresh tcp:// address.
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0,
                        timeout=datetime.timedelta(seconds=3))
print("group of one up")
"""


@pytest.mark.parametrize("first", ["qerl", "bare"])
def test_a_torchrun_world_of_one_can_start_its_own_process_group(first: str) -> None:
    """`torchrun --nproc-per-node 1` hung in vLLM's start on an H100: torchrun's
    TORCHELASTIC_USE_AGENT_STORE=True makes a tcp:// rendezvous a client of a store nobody serves. qerl's
    start leaves the agent store, so the engine's group of one comes up; without it, it times out."""
    import subprocess
    import sys

    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _GROUP_OF_ONE, first], env=env, capture_output=True, text=True, timeout=120
    )
    if first == "qerl":
        assert done.returncode == 0 and "group of one up" in done.stdout, done.stderr[-2000:]
    else:  # the failure seen on the GPU, reproduced: the rendezvous never completes
        assert done.returncode != 0 and "group of one up" not in done.stdout
