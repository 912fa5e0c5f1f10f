"""Damaged and legacy checkpoints: resume skips a damaged one, a damaged one is a user error, one from
before manifests resumes with a warning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qerl_cli.errors import QerlError
from qerl_cli.rl import checkpoint as ckpt


# -- damaged checkpoints -----------------------------------------------------------------------
def _checkpoints(tmp_path: Path, steps=(2, 4)) -> dict[int, Path]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()

    def save_adapter(folder: Path) -> None:
        folder.mkdir()
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()},
            str(folder / "adapter_model.safetensors"),
        )

    return {
        step: ckpt.save_checkpoint(
            tmp_path,
            ckpt.TrainingState(step=step, data_position=step),
            save_adapter=save_adapter,
            optimizer=optimizer,
            param_names=["weight", "bias"],
            scheduler=scheduler,
        )  # fmt: skip
        for step in steps
    }


def test_resume_auto_skips_a_damaged_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved = _checkpoints(tmp_path)
    adapter = saved[4] / "adapter" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:40])  # truncated
    with caplog.at_level("WARNING"):
        assert ckpt.find_last_checkpoint(tmp_path) == saved[2]
    assert (
        "skipped checkpoint-4" in caplog.text
        and "adapter/adapter_model.safetensors has 40 bytes" in caplog.text
    )
    with pytest.raises(
        QerlError, match=r"adapter/adapter_model.safetensors has 40 bytes.*newest good .*checkpoint-2"
    ):
        ckpt.find_last_checkpoint(saved[4])


def test_a_damaged_legacy_checkpoint_is_a_user_error(tmp_path: Path) -> None:
    saved = _checkpoints(tmp_path, steps=(1,))
    (saved[1] / "rng.safetensors").write_bytes(b"\x00garbage")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with pytest.raises(
        QerlError, match="cannot load the checkpoint"
    ):  # past the manifest, still no raw error
        ckpt.load_checkpoint(
            saved[1], optimizer=optimizer, param_names=["weight", "bias"], scheduler=scheduler,
            load_adapter=lambda folder: None,
        )  # fmt: skip


def test_a_checkpoint_from_before_manifests_resumes_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = _checkpoints(tmp_path, steps=(1, 2))
    for step in (1, 2):  # what qerl 0.1.0 wrote: no manifest, no promise of one in the state file
        (saved[step] / ckpt.MANIFEST_FILE).unlink()
        state_file = saved[step] / ckpt.STATE_FILE
        state = json.loads(state_file.read_text())
        del state["manifest"]
        state_file.write_text(json.dumps(state))
    with caplog.at_level("WARNING"):
        assert ckpt.find_last_checkpoint(tmp_path) == saved[2]
    assert "before checkpoint manifests" in caplog.text
    # A current checkpoint whose manifest is gone is damaged, not legacy.
    newer = _checkpoints(tmp_path / "new", steps=(3,))
    (newer[3] / ckpt.MANIFEST_FILE).unlink()
    with pytest.raises(QerlError, match="manifest.json is missing"):
        ckpt.find_last_checkpoint(newer[3])
