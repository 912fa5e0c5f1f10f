"""Written files honour the umask: reports, checkpoints, tiny models, cached folders, adapters."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
from test_checkpoint_recovery import _checkpoints


# -- files honour the umask --------------------------------------------------------------------
def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_honour_the_umask(tmp_path: Path) -> None:
    from qerl_cli.files import write_json
    from qerl_cli.modeling.tiny import write_tiny_model

    old = os.umask(0o022)
    try:
        assert _mode(write_json(tmp_path / "r.json", {"a": 1})) == 0o644
        saved = _checkpoints(tmp_path / "run", steps=(1,))
        for file in saved[1].rglob("*"):
            assert _mode(file) == (0o755 if file.is_dir() else 0o644), file
        model = write_tiny_model(tmp_path / "tiny")
        assert _mode(model / "model.safetensors") == 0o644
        # Cached folders (GGUF conversions, RTN bases, bench checkpoints) go through write_folder_once.
        from safetensors.torch import save_file

        from qerl_cli.files import write_folder_once

        cached = write_folder_once(tmp_path / "c", lambda d: save_file({"w": torch.zeros(1)}, d / "w.st"))
        assert _mode(cached / "w.st") == 0o644 and _mode(cached) == 0o755
        os.umask(0o077)
        assert _mode(write_json(tmp_path / "private.json", {})) == 0o600
    finally:
        os.umask(old)


def test_policy_adapter_files_are_readable_by_others(tiny_model_dir: Path, tmp_path: Path) -> None:
    from test_trainer import tiny_cfg

    from qerl_cli.rl.policy import build_policy

    policy = build_policy(tiny_cfg(tiny_model_dir, tmp_path / "run"))
    old = os.umask(0o022)
    try:
        out = policy.save_adapter(tmp_path / "adapter")
    finally:
        os.umask(old)
    assert _mode(out / "adapter_model.safetensors") == 0o644
