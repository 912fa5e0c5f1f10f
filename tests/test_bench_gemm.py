"""``qerl bench kernels``' GEMM section (qerl_cli.bench.gemm): the linears it measures, its table, and on
a GPU one small sweep whose every backend agrees with the float32 reference."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from qerl_cli.bench.gemm import empty_sections, gemm_section, gemm_table, model_linears
from qerl_cli.bench.gemm_settings import BACKENDS, GemmSettings
from qerl_cli.kernels.nvfp4_tiles import candidates_for, config_for


def test_linears_are_vllms_fused_projections() -> None:
    assert model_linears("qwen2.5-7b") == {
        "qkv": (3584 + 2 * 512, 3584),
        "o": (3584, 3584),
        "gate_up": (2 * 18944, 3584),
        "down": (3584, 18944),
    }
    assert model_linears("qwen2.5-32b") == {
        "qkv": (5120 + 2 * 1024, 5120),
        "o": (5120, 5120),
        "gate_up": (2 * 27648, 5120),
        "down": (5120, 27648),
    }


def test_candidates_start_with_the_bucket_config() -> None:
    for m in (1, 16, 17, 100, 128, 129, 4096):
        candidates = candidates_for(m)
        assert candidates[0] == config_for(m) and len(set(candidates)) == len(candidates)


def test_table_has_one_line_per_linear_and_rows() -> None:
    def row(backend: str, m: int, lora: bool, us: float) -> dict:
        return {"model": "qwen2.5-7b", "linear": "qkv", "n": 4608, "k": 3584, "m": m, "backend": backend,
                "lora": lora, "us": us, "of_hbm_bound": 0.5, "of_roofline": 0.75}  # fmt: skip

    older = {**row("bf16", 128, False, 20.0), "of_roofline": None}  # a report from before the roofline share
    rows = [row("bf16", 8, False, 10.0), row("bf16", 8, True, 12.5), row("qerl-nvfp4", 8, False, 4.0), older]
    console = Console(width=200, record=True)
    console.print(gemm_table(rows, "NVIDIA H200"))
    text = console.export_text()
    assert "10.0 (75%) / 12.5 (75%)" in text and "4.0 (75%) / -" in text and "20.0 (HBM 50%) / -" in text
    assert "marlin" not in text and "fp8" not in text  # only the backends measured get a column
    assert sum("4608 x 3584" in line for line in text.splitlines()) == 2  # rows 8 and 128


def test_the_roofline_share_is_the_tighter_bounds_share() -> None:
    from qerl_cli.bench.gemm import bound_shares
    from qerl_cli.bench.roofline import GpuSpec

    h200 = GpuSpec("H200", bandwidth=4.8e12, bf16_flops=989e12, fp8_flops=1979e12)
    # The 7B layer's four linears at 128 tokens in NVFP4: 59.7 GFLOP, ~131 MB: the tensor cores bound it
    # (60 us at the peak) well above the HBM bound (27 us), so at 120 us it is at half its roofline.
    flops, read = 2 * 128 * 233_046_016, 131_088_384
    of_hbm, of_peak, of_roofline = bound_shares(flops, read, 120.0, h200, "qerl-nvfp4")
    assert of_hbm == pytest.approx(read / 4.8e12 / 120e-6) and of_hbm < 0.25
    assert of_peak == pytest.approx(flops / 120e-6 / 989e12) and of_roofline == of_peak
    assert 0.49 < of_roofline < 0.51
    # At 8 tokens the bytes bind; FP8 is judged against its own (twice the) peak.
    assert bound_shares(2 * 8 * 233_046_016, read, 60.0, h200, "qerl-nvfp4")[2] == pytest.approx(
        read / 4.8e12 / 60e-6
    )
    assert bound_shares(flops, read, 120.0, h200, "fp8")[1] == pytest.approx(flops / 120e-6 / 1979e12)
    assert bound_shares(flops, read, 120.0, None, "bf16") == (None, None, None)


@pytest.mark.parametrize(
    ("formats", "cuda", "why"),
    [(["bf16", "nf4"], True, "nvfp4 is not among --formats"), (["nvfp4"], False, "on a CUDA GPU only")],
)
def test_section_says_why_it_measured_nothing(formats, cuda, why) -> None:
    report = {"settings": {"formats": formats, **GemmSettings().to_dict()}, "errors": [], **empty_sections()}
    gemm_section(report, lambda: None, cuda)
    assert report["gemm"] == [] and report["errors"] == []
    assert len(report["gemm_skipped"]) == 1 and why in report["gemm_skipped"][0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_small_sweep_on_gpu() -> None:
    from qerl_cli.bench.gemm import run_gemm

    rows: list[dict] = []
    tuning: list[dict] = []
    errors: list[tuple[str, str]] = []
    skipped = run_gemm(["qwen2.5-0.5b"], [8, 128], rows.append, lambda c, e: errors.append((c, e)),
                       tune=tuning.append)  # fmt: skip
    assert errors == []
    measured = {r["backend"] for r in rows}
    assert measured | {s.split(":")[0] for s in skipped} == set(BACKENDS)
    for r in rows:
        assert r["us"] > 0 and 0 < r["of_hbm_bound"] <= r["of_roofline"] < 1.2
        # NVFP4 backends compute on the very weights of the reference; FP8 rounds weights and activations
        assert r["max_rel_err"] < (0.08 if r["backend"] == "fp8" else 0.02), r
    assert {t["m"] for t in tuning} == {8, 128} and any(t["bucket_default"] for t in tuning)


def test_gemm_flags_narrow_the_section() -> None:
    names = ["qwen2.5-7b", "qwen2.5-32b", "tiny"]
    settings = GemmSettings.from_flags(["Qwen2.5-7B"], [8, 128], ["qerl-nvfp4", "BF16"], False, names)
    assert settings == GemmSettings(("qwen2.5-7b",), (8, 128), False, ("bf16", "qerl-nvfp4"))
    assert settings.to_dict()["gemm_backends"] == ["bf16", "qerl-nvfp4"]  # in BACKENDS' order
    assert GemmSettings.from_flags(None, None, None, True, []) == GemmSettings()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gemm-shapes", "qwen9"], "--gemm-shapes: unknown shape qwen9; choose from"),
        (["--gemm-backends", "bf16,cublas"], "--gemm-backends: unknown backend cublas; choose from"),
        (["--gemm-rows", "8,0"], "--gemm-rows takes comma-separated positive integers"),
    ],
)
def test_bench_kernels_refuses_a_wrong_gemm_flag(capsys, argv, message) -> None:
    from qerl_cli.cli import main

    rc = main(["bench", "kernels", "--dry-run", *argv])
    assert rc == 2 and message in capsys.readouterr().err


def test_bench_kernels_dry_run_names_the_gemm_flags_as_comments(capsys) -> None:
    from qerl_cli.cli import main

    argv = ["bench", "kernels", "--formats", "nvfp4", "--gemm-rows", "8,128", "--no-gemm-tune", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "#   --gemm-rows: 8, 128\n" in out and "#   --gemm-tune: off\n" in out
    assert "\ngemm" not in out  # not config keys: the YAML stays a --config file
