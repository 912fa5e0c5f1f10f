"""qerl's own RTN writer (no llm-compressor) packs exactly what `qerl quantize --method rtn` packs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_cli.quantize.native import write_rtn_checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_native_rtn_is_bit_exact_with_llmcompressor(fmt: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("llmcompressor")
    from safetensors.torch import load_file

    from qerl_cli.config import QuantizeConfig
    from qerl_cli.modeling.loading import load_policy_model
    from qerl_cli.quantize import run_quantize

    ours = write_rtn_checkpoint(tiny_model_dir, tmp_path / "ours", fmt)
    assert write_rtn_checkpoint(tiny_model_dir, tmp_path / "ours", fmt) == ours  # complete: reused
    theirs = tmp_path / "theirs"
    run_quantize(QuantizeConfig(model=str(tiny_model_dir), format=fmt, method="rtn", output=str(theirs)))
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key
    model, found = load_policy_model(ours)
    assert found == fmt and model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()
