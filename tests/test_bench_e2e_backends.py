"""``qerl bench e2e --linear-backend a,b,c``: every (format, backend) pair that means something, timed once
in a fixed order, side by side in one run; rows keyed by format and backend in bench.json, the report's
backend column and step-time ratios to BF16 + vLLM-LoRA, the gate matching rows by both, the single-backend
form as before, and the HF engine's refusal.

The vLLM engine is replaced by a stand-in of the per-pair worker (``bench.e2e._measure_isolated``, the
child process that runs the trainer with vLLM): it records the pair and the trainer config the pair
would run with, and returns a row with made-up step times, so the whole command runs on the CPU.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from qerl_cli.bench import preflight
from qerl_cli.bench.e2e_backends import E2EPair, e2e_pairs
from qerl_cli.bench.gate import check_regressions
from qerl_cli.bench.labels import row_backend
from qerl_cli.bench.report import e2e_reference, e2e_rows, to_markdown
from qerl_cli.bench.result import BenchResult, read_report
from qerl_cli.bench.settings import E2EConfig
from qerl_cli.cli import main
from qerl_cli.errors import QerlError
from qerl_cli.rollout.backends import served_backend

REPO = Path(__file__).resolve().parents[1]
# Made-up step seconds of each (format, backend) pair the stand-in worker returns.
STEP_S = {
    ("bf16", "default"): 10.0,
    ("bf16", "merged"): 8.0,
    ("nvfp4", "marlin"): 12.5,
    ("nvfp4", "fp8-merged"): 5.0,
    ("nvfp4", "merged"): 7.5,
    ("bf16", "fp8"): 9.0,
    ("nvfp4", "fp8"): 6.0,
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("qerl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QERL_CACHE_DIR", str(path))
        yield path


@pytest.fixture
def vllm_stand_in(cache_dir, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """A GPU with vLLM, as far as the plan can tell, and the per-pair worker replaced: each call is
    recorded (the pair, the backend its trainer config asks vLLM for, its run folder)."""
    from qerl_cli.bench import e2e

    monkeypatch.setattr(preflight, "gpu_available", lambda: True)
    monkeypatch.setattr(preflight, "vllm_available", lambda: True)
    calls: list[dict[str, Any]] = []

    def measure(cfg: E2EConfig, pair: E2EPair, model_dir: str, engine: str, out_dir: str) -> dict[str, Any]:
        train = e2e.e2e_train_config(cfg, model_dir, engine, out_dir, pair.requested)
        calls.append({"pair": pair, "asked": train.rollout.linear_backend, "out_dir": out_dir})
        step = STEP_S.get((pair.format, pair.backend), 1.0)
        # vLLM runs the requested backend as the format serves it (rollout.backends.choose_backend).
        return {"format": pair.format, "backend": pair.backend, "step_s": step, "generation_s": step / 2,
                "linear_backend": pair.backend, "linear_backend_requested": pair.requested}  # fmt: skip

    monkeypatch.setattr(e2e, "_measure_isolated", measure)
    return calls


def run_e2e_command(capsys: pytest.CaptureFixture[str], out: Path, *flags: str) -> tuple[int, str, str]:
    argv = ["bench", "e2e", "--model", "tiny", "--formats", "nvfp4,bf16", "--set", "repeats=1",
            "--set", "warmup=0", "-o", str(out), *flags]  # fmt: skip
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_a_backend_list_times_each_meaningful_pair_once_in_a_fixed_order(
    vllm_stand_in: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bf16,nvfp4 x marlin,fp8-merged,merged: BF16 has no FP4 kernel (marlin keeps vLLM's default) and no
    4-bit base to copy to FP8 (fp8-merged is its merged), so it runs twice, not three times; NVFP4 runs
    all three. BF16 first, then each format's backends in the order asked."""
    rc, out, err = run_e2e_command(capsys, tmp_path, "--linear-backend", "marlin,fp8-merged,merged")
    assert rc == 0, err
    ran = [(c["pair"].format, c["pair"].backend, c["asked"]) for c in vllm_stand_in]
    assert ran == [
        ("bf16", "default", "marlin"),
        ("bf16", "merged", "fp8-merged"),  # the first name asked that runs it; `merged` not run again
        ("nvfp4", "marlin", "marlin"),
        ("nvfp4", "fp8-merged", "fp8-merged"),
        ("nvfp4", "merged", "merged"),
    ]
    # Each pair its own trainer run folder (a format with several pairs: its backend in the name).
    assert [Path(c["out_dir"]).name for c in vllm_stand_in] == [
        "bf16-default", "bf16-merged", "nvfp4-marlin", "nvfp4-fp8-merged", "nvfp4-merged",
    ]  # fmt: skip
    # The plan names the pairs and what was folded into what, before any work.
    plain = " ".join(err.split())
    assert (
        "cases: 5 (bf16 / default; bf16 / merged; nvfp4 / marlin; nvfp4 / fp8-merged; nvfp4 / merged)"
        in plain
    )
    assert "bf16 marlin -> default; bf16 fp8-merged -> merged" in plain

    # bench.json: a row per pair with its format and backend, read back key for key.
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["format"], r["backend"]) for r in on_disk["e2e"]] == [p[:2] for p in ran]
    report = read_report(tmp_path / "bench.json")
    assert report.to_dict() == on_disk
    assert on_disk["settings"]["e2e_backends"] == ["marlin", "fp8-merged", "merged"]
    assert on_disk["settings"]["e2e_folded"] == [
        {"format": "bf16", "requested": "marlin", "backend": "default"},
        {"format": "bf16", "requested": "fp8-merged", "backend": "merged"},
    ]
    # Each row's step time against BF16 + vLLM-LoRA's (the default backend on bf16: 10 s).
    ratios = {(r["format"], r["backend"]): r["step_vs_bf16"] for r in on_disk["e2e"]}
    assert ratios == {("bf16", "default"): 1.0, ("bf16", "merged"): 0.8, ("nvfp4", "marlin"): 1.25,
                      ("nvfp4", "fp8-merged"): 0.5, ("nvfp4", "merged"): 0.75}  # fmt: skip
    assert on_disk["e2e"][3]["speedup_vs_bf16"] == 2.0  # the same reference, as a speed-up
    # Were generation free (half of each stand-in step): BF16 + vLLM-LoRA's 10 s step over the rest.
    ceilings = {(r["format"], r["backend"]): r["rollout_ceiling_vs_bf16"] for r in on_disk["e2e"]}
    assert ceilings[("bf16", "default")] == 2.0 and ceilings[("nvfp4", "fp8-merged")] == 4.0

    # The report: a backend column, the ratio column, the folded backends.
    markdown = (tmp_path / "bench.md").read_text()
    assert "| format | backend | AQN s |" in markdown and "| step s | step / BF16 |" in markdown
    assert "| nvfp4 | fp8-merged | - | 2.50 |" in markdown and "| 5.00 | 0.50 |" in markdown
    assert (
        "Were generation free (the ceiling of any rollout speed-up): bf16 / default 5.0 s (2.00x BF16 + "
        "LoRA's step);" in markdown
    )
    assert "nvfp4 / fp8-merged 2.5 s (4.00x BF16 + LoRA's step)" in markdown
    assert (
        "Backends folded (each run once, under the name its format serves it): bf16 marlin -> default"
        in markdown
    )
    # The console: the folded backends (its table's columns are the markdown's, cut to the terminal's width).
    console = " ".join(out.split())
    assert "fp8-merged" in console and "bf16 fp8-merged -> merged" in console


def test_the_single_backend_form_runs_each_format_once_as_before(
    vllm_stand_in: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One --linear-backend value (or none): one pair per format, run in the format's own folder, the
    value reaching the trainer as rollout.linear_backend; no backend folded."""
    rc, _, err = run_e2e_command(capsys, tmp_path / "fp8", "--linear-backend", "fp8")
    assert rc == 0, err
    assert [(c["pair"].format, c["asked"], Path(c["out_dir"]).name) for c in vllm_stand_in] == [
        ("bf16", "fp8", "bf16"), ("nvfp4", "fp8", "nvfp4"),
    ]  # fmt: skip
    report = json.loads((tmp_path / "fp8" / "bench.json").read_text())
    assert [r["format"] for r in report["e2e"]] == ["bf16", "nvfp4"]
    assert report["settings"]["e2e_folded"] == [] and "folded" not in err
    # No BF16 + vLLM-LoRA row (BF16 ran on vLLM's online FP8): no ratio rather than a wrong one.
    assert [r["step_vs_bf16"] for r in report["e2e"]] == [None, None]
    vllm_stand_in.clear()
    rc, _, err = run_e2e_command(capsys, tmp_path / "none")
    assert rc == 0, err
    assert [(c["pair"].format, c["pair"].backend, c["asked"]) for c in vllm_stand_in] == [
        ("bf16", "auto", "auto"), ("nvfp4", "auto", "auto"),
    ]  # fmt: skip


def test_the_dry_run_lists_the_pairs_and_the_folded_backends(
    vllm_stand_in: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["bench", "e2e", "--formats", "bf16,nvfp4", "--linear-backend", "marlin,fp8", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and yaml.safe_load(out)["linear_backend"] == ["marlin", "fp8"]
    plan = " ".join(out.split())
    assert "cases: 4 (bf16 / default; bf16 / fp8; nvfp4 / marlin; nvfp4 / fp8)" in plan
    assert "bf16 marlin -> default" in plan and vllm_stand_in == []  # nothing run


@pytest.mark.parametrize("backends", ["marlin,fp8", "fp8", "auto,humming"])
def test_the_hf_engine_refuses_linear_backends(backends: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "e2e", "--engine", "hf", "--linear-backend", backends, "--dry-run"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2
    assert f"--linear-backend {backends}: the hf engine has no linear backends" in err
    assert "leave --linear-backend out (or give auto)" in err and "--engine vllm" in err
    assert main(["bench", "e2e", "--engine", "hf", "--linear-backend", "auto", "--dry-run"]) == 0


def test_pairs_fold_by_the_rollout_backends_rule() -> None:
    """The names each format serves a backend under: what rollout.backends.choose_backend keeps for a
    pinned backend (a BF16 or NF4 base keeps vLLM's default for the FP4 kernels)."""
    every = ("marlin", "humming", "qerl-triton", "fp8", "fp8-merged", "merged", "auto")
    assert [served_backend(b, "bf16") for b in every] == [
        "default", "default", "default", "fp8", "merged", "merged", "auto",
    ]  # fmt: skip
    assert [served_backend(b, "nf4") for b in ("marlin", "humming", "fp8-merged")] == [
        "default", "default", "fp8-merged",
    ]  # fmt: skip
    assert [served_backend(b, "mxfp4") for b in ("marlin", "humming", "fp8-merged")] == [
        "marlin", "humming", "fp8-merged",
    ]  # fmt: skip
    cfg = E2EConfig(linear_backend=["humming", "marlin", "fp8", "marlin"])
    plan = e2e_pairs(cfg, "vllm", ["nf4", "nvfp4"])
    assert [(p.format, p.backend) for p in plan.pairs] == [
        ("nf4", "default"), ("nf4", "fp8"), ("nvfp4", "humming"), ("nvfp4", "marlin"), ("nvfp4", "fp8"),
    ]  # fmt: skip
    assert [f.line() for f in plan.folded] == ["nf4 humming -> default", "nf4 marlin -> default"]
    with pytest.raises(QerlError, match="hf engine has no linear backends"):
        e2e_pairs(cfg, "hf", ["nf4"])


def _report(rows: list[dict[str, Any]]) -> BenchResult:
    return BenchResult(schema="qerl-bench/1", created="", device="gpu", figures_label="", machine={},
                       gpu=None, versions={}, settings={"model": "m"}, e2e=rows)  # fmt: skip


def test_the_gate_matches_e2e_rows_by_format_and_backend() -> None:
    now = _report([
        {"format": "nvfp4", "backend": "marlin", "step_s": 10.0},
        {"format": "nvfp4", "backend": "fp8", "step_s": 10.0},
        {"format": "nvfp4", "backend": "merged", "error": "out of memory"},
    ])  # fmt: skip
    baseline = copy.deepcopy(now)
    baseline.e2e = [
        {"format": "nvfp4", "backend": "marlin", "step_s": 10.0},
        {"format": "nvfp4", "backend": "fp8", "step_s": 5.0},  # twice as fast then
        {"format": "nvfp4", "backend": "merged", "step_s": 8.0},
    ]
    outcome = check_regressions(now, baseline, tolerance=0.1)
    assert outcome.compared == 3
    (slower, lost) = outcome.failures
    assert "e2e format=nvfp4 backend=fp8: step_s rose 100.0%" in slower
    assert lost == "e2e nvfp4 / merged: measured in the baseline, failed now (out of memory)"
    # A baseline from before rows recorded their backend: the one backend that run asked for, as its
    # format serves it, matches this run's row of that backend.
    old = _report([{"format": "bf16", "step_s": 1.0, "linear_backend_requested": "marlin"}])
    fresh = _report([{"format": "bf16", "backend": "default", "step_s": 2.0},
                     {"format": "bf16", "backend": "fp8", "step_s": 0.5}])  # fmt: skip
    (failure,) = check_regressions(fresh, old, tolerance=0.1).failures
    assert "backend=default: step_s rose 100.0%" in failure
    assert row_backend({"format": "nvfp4"}) == "auto"  # the bench's default before any was given


def test_the_reference_row_is_bf16_with_the_lora_served_by_the_engine() -> None:
    rows = [
        {"format": "bf16", "backend": "fp8", "linear_backend": "fp8", "step_s": 1.0},
        {"format": "bf16", "backend": "auto", "linear_backend": "default", "step_s": 2.0},
        {"format": "bf16", "backend": "default", "linear_backend": "default", "step_s": 3.0},
    ]
    assert e2e_reference(rows) is rows[2]  # asked for as default, before auto's choice of it
    assert e2e_reference(rows[:2]) is rows[1]  # auto chose vLLM's default
    assert e2e_reference(rows[:1]) is None
    hf = [{"format": "bf16", "backend": "auto", "linear_backend": "trainer", "step_s": 1.0}]
    assert e2e_reference(hf) is hf[0]
    report = _report([{**rows[1], "generation_s": 1.0}, {**rows[0], "generation_s": 0.5}])
    assert [row[:2] for row in e2e_rows(report)] == [("bf16", "default (auto)"), ("bf16", "fp8")]


def test_committed_e2e_reports_render_and_gate_against_themselves() -> None:
    """Reports from before the backend column: each row's backend is the one its run asked for."""
    reports = [read_report(p) for p in sorted((REPO / "benchmarks").glob("*/**/bench.json"))]
    with_e2e = [r for r in reports if r.e2e]
    assert with_e2e, "no committed e2e report to read"
    for report in with_e2e:
        assert "### End-to-end GRPO step" in to_markdown(report)
        assert all(row_backend(r) for r in report.e2e or [])
        assert check_regressions(report, copy.deepcopy(report), tolerance=0.0).passed


def test_the_worker_reads_its_pair_and_a_failure_keeps_the_pairs_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vLLM pairs run in `python -m qerl_cli.bench.e2e SPEC OUT`: the spec carries the settings and
    the pair; a pair that fails is a row with its format and backend (the report names it, the gate
    matches it)."""
    from dataclasses import asdict

    from qerl_cli.bench import e2e

    cfg = E2EConfig(formats=["bf16"], linear_backend=["fp8-merged", "fp8"])
    pair = E2EPair("bf16", "merged", "fp8-merged")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cfg": asdict(cfg), "pair": asdict(pair), "model_dir": "m", "engine": "vllm",
                                "out_dir": str(tmp_path / "run")}))  # fmt: skip
    seen = []

    def measure(cfg: E2EConfig, pair: E2EPair, model_dir: str, engine: str, out_dir: str) -> dict[str, Any]:
        seen.append((cfg.linear_backend, pair))
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(e2e, "measure_pair", measure)
    assert e2e._worker([str(spec), str(tmp_path / "row.json")]) == 0
    assert seen == [(["fp8-merged", "fp8"], pair)]
    row = json.loads((tmp_path / "row.json").read_text())
    assert row == {"format": "bf16", "backend": "merged", "error": "RuntimeError: CUDA error: out of memory"}


def test_a_single_backend_still_reads_from_a_config_file_and_set(tmp_path: Path) -> None:
    """`linear_backend: fp8` in a --config file (the single value before the list) and --set forms."""
    from qerl_cli.config import load_config
    from qerl_cli.config.checks import ConfigValueError

    conf = tmp_path / "e2e.yaml"
    conf.write_text("linear_backend: fp8\n")
    assert load_config(E2EConfig, conf, []).linear_backend == ["fp8"]
    assert load_config(E2EConfig, None, ["linear_backend=marlin,fp8"]).linear_backend == ["marlin", "fp8"]
    with pytest.raises(ConfigValueError, match="linear_backend needs at least one backend"):
        load_config(E2EConfig, None, ["linear_backend=[]"])
