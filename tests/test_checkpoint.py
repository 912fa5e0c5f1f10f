"""Checkpoints: exact optimizer/scheduler/RNG round trips, atomic layout, pruning, no pickle."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qerl_cli.errors import QerlError
from qerl_cli.rl import checkpoint as ckpt


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(5, 4)).pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def _save_adapter_of(model):
    def save(folder: Path) -> None:
        folder.mkdir(parents=True)
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()},
            str(folder / "adapter_model.safetensors"),
        )

    return save


def _load_adapter_into(model):
    def load(folder: Path) -> None:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(folder / "adapter_model.safetensors")))

    return load


NAMES = ["0.weight", "0.bias", "1.weight", "1.bias"]


def _save(out: Path, model, optimizer, scheduler, step: int, limit: int | None = None) -> Path:
    return ckpt.save_checkpoint(
        out,
        ckpt.TrainingState(step=step, data_position=7 * step, aqn={"sigma_start": 0.01}),
        save_adapter=_save_adapter_of(model),
        optimizer=optimizer,
        param_names=NAMES,
        scheduler=scheduler,
        save_total_limit=limit,
    )


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """Train 3 steps, save, train 2 more; a fresh run loading the checkpoint ends bit-identical."""
    model, optimizer, scheduler = _model_and_optimizer()
    _train(model, optimizer, scheduler, 3)
    random.seed(4)
    np.random.seed(4)
    saved = _save(tmp_path, model, optimizer, scheduler, step=3)
    _train(model, optimizer, scheduler, 2)  # draws its batches from the torch RNG
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_draws = (random.random(), float(np.random.rand()))

    fresh, fresh_opt, fresh_sched = _model_and_optimizer(seed=99)  # other weights, overwritten
    random.seed(0)
    np.random.seed(0)
    state = ckpt.load_checkpoint(
        saved,
        optimizer=fresh_opt,
        param_names=NAMES,
        scheduler=fresh_sched,
        load_adapter=_load_adapter_into(fresh),
    )
    assert (state.step, state.data_position, state.aqn) == (3, 21, {"sigma_start": 0.01})
    assert fresh_sched.last_epoch == 3
    assert (random.random(), float(np.random.rand())) == expected_draws
    _train(fresh, fresh_opt, fresh_sched, 2)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr()


def test_python_and_numpy_rng_round_trip() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    tensors, meta = ckpt.capture_rng()
    json.dumps(meta)  # JSON-able: no pickle anywhere
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    ckpt.restore_rng(tensors, meta)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws


def test_layout_is_safetensors_and_json_only(tmp_path: Path) -> None:
    model, optimizer, scheduler = _model_and_optimizer()
    _train(model, optimizer, scheduler, 1)
    path = _save(tmp_path, model, optimizer, scheduler, step=5)
    assert path.name == "checkpoint-5"
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert files == [
        "adapter/adapter_model.safetensors",
        "manifest.json",
        "optimizer.json",
        "optimizer.safetensors",
        "rng.safetensors",
        "scheduler.json",
        "trainer_state.json",
    ]
    assert not list(tmp_path.glob(".checkpoint-*"))  # the temp dir was renamed


def test_find_last_checkpoint_skips_incomplete_ones(tmp_path: Path) -> None:
    model, optimizer, scheduler = _model_and_optimizer()
    _save(tmp_path, model, optimizer, scheduler, step=2)
    _save(tmp_path, model, optimizer, scheduler, step=4)
    (tmp_path / "checkpoint-6").mkdir()  # a run killed before the rename never leaves this, but
    (tmp_path / ".checkpoint-8.tmp").mkdir()  # be robust to hand-made or foreign folders
    assert ckpt.find_last_checkpoint(tmp_path).name == "checkpoint-4"
    assert ckpt.find_last_checkpoint(tmp_path / "checkpoint-2").name == "checkpoint-2"
    with pytest.raises(QerlError, match="manifest.json is missing.*newest good checkpoint is .*checkpoint-4"):
        ckpt.find_last_checkpoint(tmp_path / "checkpoint-6")
    with pytest.raises(QerlError, match="no such directory"):
        ckpt.find_last_checkpoint(tmp_path / "missing")


def test_save_total_limit_prunes_the_oldest(tmp_path: Path) -> None:
    model, optimizer, scheduler = _model_and_optimizer()
    for step in (1, 2, 3, 4):
        _save(tmp_path, model, optimizer, scheduler, step=step, limit=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]


def test_a_stale_temp_dir_is_replaced(tmp_path: Path) -> None:
    model, optimizer, scheduler = _model_and_optimizer()
    stale = tmp_path / ".checkpoint-3.tmp"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("half-written")
    path = _save(tmp_path, model, optimizer, scheduler, step=3)
    assert not (path / "junk").exists() and not stale.exists()


def test_mismatched_parameters_refuse_to_load(tmp_path: Path) -> None:
    model, optimizer, scheduler = _model_and_optimizer()
    path = _save(tmp_path, model, optimizer, scheduler, step=1)
    with pytest.raises(QerlError, match="other trainable parameters"):
        ckpt.load_checkpoint(
            path,
            optimizer=optimizer,
            param_names=NAMES[:2],
            scheduler=scheduler,
            load_adapter=_load_adapter_into(model),
        )


def test_the_nonfinite_streak_round_trips_and_defaults_for_older_checkpoints(tmp_path: Path) -> None:
    """The count of non-finite steps in a row is kept, so that a resumed run counts on from it; a
    checkpoint written before the field existed resumes from 0 instead of failing."""
    model, optimizer, scheduler = _model_and_optimizer()
    state = ckpt.TrainingState(step=2, data_position=14, nonfinite_streak=2)
    saved = ckpt.save_checkpoint(
        tmp_path, state, save_adapter=_save_adapter_of(model), optimizer=optimizer, param_names=NAMES,
        scheduler=scheduler,
    )  # fmt: skip

    def loaded() -> ckpt.TrainingState:
        fresh, fresh_opt, fresh_sched = _model_and_optimizer(seed=1)
        return ckpt.load_checkpoint(
            saved, optimizer=fresh_opt, param_names=NAMES, scheduler=fresh_sched,
            load_adapter=_load_adapter_into(fresh),
        )  # fmt: skip

    assert json.loads((saved / ckpt.STATE_FILE).read_text())["nonfinite_streak"] == 2
    assert loaded().nonfinite_streak == 2
    # An older checkpoint: its state file without the field (and a manifest that matches it).
    meta = json.loads((saved / ckpt.STATE_FILE).read_text())
    del meta["nonfinite_streak"]
    (saved / ckpt.STATE_FILE).write_text(json.dumps(meta))
    ckpt.write_manifest(saved)
    assert ckpt.checkpoint_problem(saved) is None
    assert loaded().nonfinite_streak == 0
