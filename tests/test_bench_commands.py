"""Every ``qerl bench`` subcommand: its --help, bad input refused with exit 2 before torch is imported,
--dry-run, the bare ``qerl bench`` (the rollout benchmark), and the JSON each writes on the CPU with the
tiny model (the command, the device, the date and the versions first). The library arithmetic of ``scaling``.

Every subcommand runs on the CPU, so none is GPU-only here; the GPU-only parts (``--profile``,
``--memory-cap``) are tested for their refusal on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from qerl_cli.cli import main

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = ["rollout", "concurrency", "e2e", "kernels", "update", "scaling", "quality", "lora-tune", "gap"]
HEADER = ("schema", "command", "created", "device", "gpu", "versions")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("qerl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QERL_CACHE_DIR", str(path))
        mp.setenv("QERL_NUM_THREADS", "1")  # tiny models on shared cores: one thread is fastest
        yield path


# -- help -------------------------------------------------------------------------------------------
def test_bench_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    from typer.main import get_command

    from qerl_cli.cli import app

    assert list(get_command(app).commands["bench"].commands) == BENCHMARKS
    rc, out, err = run(capsys, "bench", "--help")
    assert rc == 0 and err == ""  # the group's help, not the default benchmark
    panel = out.split("Commands", 1)[1]
    assert all(f"│ {name} " in panel for name in BENCHMARKS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_has_help(capsys: pytest.CaptureFixture[str], name: str) -> None:
    rc, out, err = run(capsys, "bench", name, "--help")
    assert rc == 0 and err == ""
    assert f"qerl bench {name}" in out and "--dry-run" in out and "--output" in out


def test_concurrency_help_lists_every_backend_the_sweep_accepts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--backends' help listed marlin,humming,fp8,fp8-merged,merged while the sweep also takes qerl-triton
    (docs/bench.md and the error for a misspelt name list it): the help named fewer than it accepts."""
    from qerl_cli.config.stages import SWEPT_BACKENDS

    monkeypatch.setenv("COLUMNS", "400")  # one line per option, so the list is not wrapped
    rc, out, _ = run(capsys, "bench", "concurrency", "--help")
    line = next(line for line in out.splitlines() if "--backends" in line)
    assert rc == 0 and ", ".join(SWEPT_BACKENDS) in line, line
    # At 80 columns the list wraps between names: joined without spaces it was cut off mid-word ("fp8-me…").
    monkeypatch.setenv("COLUMNS", "80")
    rc, out, _ = run(capsys, "bench", "concurrency", "--help")
    assert rc == 0 and "…" not in out.split("--backends")[1].split("--")[0], out
    assert all(name in out for name in SWEPT_BACKENDS), out


# -- bad input: exit 2, naming the flag, before torch is imported -----------------------------------
def bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    missing = str(tmp / "missing.json")
    return [
        (["rollout", "--formats", "fp3"], "--formats: unknown format(s) fp3; choose from bf16, nvfp4"),
        (["rollout", "--batch", "2,0"], "--batch takes comma-separated positive integers"),
        (["rollout", "--batch", "2,,8"], "positive integers (e.g. --batch 2,8), got '2,,8'"),
        (["rollout", "--tolerance", "-1"], "--tolerance is a fraction >= 0"),
        (["e2e", "--tolerance", "-0.5"], "--tolerance is a fraction >= 0"),
        (["concurrency", "--concurrency", "8,,32"], "--concurrency takes comma-separated positive integers"),
        (["rollout", "--baseline", missing], f"--baseline {missing}: not found"),
        (["concurrency", "--concurrency", "8,x"], "--concurrency takes comma-separated positive integers"),
        (
            ["concurrency", "--backends", "cuda,bf16"],
            "--backends has unknown backend(s) bf16, cuda; choose from",
        ),
        (["e2e", "--recipe", str(tmp / "no.yaml")], "recipe file not found"),
        (["e2e", "--prompts-per-step", "-1"], "--prompts-per-step must be >= 0"),
        (["e2e", "--memory-cap", "0"], "--memory-cap must be > 0 GiB"),
        # The old flag form of e2e inside rollout (and the bare form) names the subcommand that replaced it.
        (
            ["rollout", "--e2e", "--e2e-recipe", "gsm8k_7b"],
            "rollout --e2e --e2e-recipe: whole GRPO steps are timed by `qerl bench e2e`",
        ),  # fmt: skip
        (["--batch", "2", "--generations", "4"], "rollout --generations: whole GRPO steps are timed by"),
        (["kernels", "--formats", "int3"], "--formats: unknown format(s) int3"),
        (["kernels", "--batch", "0"], "--batch must be a positive integer, got 0"),
        (["update", "--fused", "fast"], "--fused takes a comma list of off, liger, auto"),
        (["update", "--base-compute", "fp16"], "--base-compute takes a comma list of bf16, fp8, auto"),
        (["update", "--micro-batch", "x"], "--micro-batch takes a positive integer or auto"),
        (["update", "--checkpointing", "maybe"], "--checkpointing takes auto, on or off"),
        (["update", "--sequences", "5", "--group", "2"], "--sequences (5) must be a multiple of --group (2)"),
        (["scaling", "tiny", "--steps", "0"], "--steps must be a positive integer, got 0"),
        (["scaling", "tiny", "--reference", missing], f"--reference {missing}: not found"),
        (["scaling", "no-such-recipe"], "recipe file not found"),
        (["scaling", "tiny", "--format", "fp3"], "--format: unknown format(s) fp3"),
        (["scaling", "tiny", "--format", "nvfp4"], "--format names the format of a --model SHAPE"),
        (["quality", "m", "--rows", "nvfp4-foo"], "'nvfp4-foo' is not FORMAT-METHOD"),
        (["quality", "m", "--rows", "bf16-rtn"], "'bf16-rtn' is not FORMAT-METHOD"),
        (["quality", "m", "--seq-len", "1"], "--seq-len must be >= 2"),
    ]


DRY_RUNS: list[tuple[list[str], dict[str, Any]]] = [
    (["rollout", "--batch", "1,4"], {"batch": [1, 4], "concurrency": []}),
    (["e2e", "--recipe", "gsm8k_7b"], {"recipe": "gsm8k_7b", "gen_len": 2048}),  # the recipe's shape
    (["concurrency"], {"concurrency": [8, 32, 128, 256]}),
    # A CPU here: --backends is refused on the HF engine (resolved on vLLM: test_bench_preflight.py).
    (["concurrency", "--concurrency", "16"], {"concurrency": [16], "backends": ["marlin", "humming", "fp8"]}),
    (
        # A CPU here: the HF engine, which takes only auto (vLLM's backends: test_bench_e2e_backends.py).
        ["e2e", "--prompts-per-step", "4", "--linear-backend", "auto", "--memory-cap", "79.2"],
        {"prompts_per_step": 4, "linear_backend": ["auto"], "memory_cap_gib": 79.2},
    ),
    (["e2e", "--recipe", "gsm8k_7b", "--gen-len", "64"], {"recipe": "gsm8k_7b", "gen_len": 64}),
    (["kernels", "--formats", "NVFP4,nf4"], {"formats": ["nvfp4", "nf4"], "batch": 8}),
    (["update", "--checkpointing", "on", "--micro-batch", "2"], {"checkpointing": True, "micro_batch": 2}),
    (["update", "--base-compute", "bf16,fp8"], {"base_compute": ["bf16", "fp8"]}),
    (
        # The tiny shape for model.path: the recipe's base is built by `qerl tiny-base`, which the dry run's
        # checks would ask for.
        ["scaling", "tiny", "--model", "tiny", "--steps", "4", "--prompts-per-gpu", "3"]
        + ["--set", "rollout.num_generations=2"],
        {
            "train": lambda t: (t["max_steps"], t["prompts_per_step"]) == (4, 3),
            "rollout": lambda r: r["num_generations"] == 2,
            "output": lambda o: o["save_steps"] == 4,  # the last step: a run to resume
        },
    ),
    # MODEL: the tiny model's folder (the dry run checks the BF16 model is there).
    (
        ["quality", "MODEL", "--rows", "nf4-rtn,NVFP4-awq"],
        {"rows": ["nf4-rtn", "nvfp4-awq"], "model": "MODEL"},
    ),
]


def _with_model(items: list[Any], model: Path) -> list[Any]:
    return [str(model) if item == "MODEL" else item for item in items]


def test_bad_input_imports_no_torch_and_dry_runs_exit_0(tmp_path: Path, tiny_model_dir: Path) -> None:
    """One process: every bad input exits 2 with its message without importing torch (the checks are the
    cheap ones, made first), then every --dry-run exits 0 (those may ask torch for the GPU)."""
    bad_cases = [[*argv] for argv, _ in bad_inputs(tmp_path)]
    cases = [bad_cases, [[*_with_model(argv, tiny_model_dir), "--dry-run"] for argv, _ in DRY_RUNS]]
    code = (
        "import json, sys\nfrom qerl_cli.cli import main\n"
        "bad, dry = json.loads(sys.argv[1])\n"
        "codes = [main(['bench', *argv]) for argv in bad]\n"
        "torch = 'torch' in sys.modules\n"
        "codes += [main(['bench', *argv]) for argv in dry]\n"
        "print(json.dumps({'codes': codes, 'torch': torch}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300", "QERL_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    bad = len(bad_inputs(tmp_path))
    assert result["codes"] == [2] * bad + [0] * len(DRY_RUNS), done.stderr
    assert result["torch"] is False
    err = " ".join(done.stderr.split())
    for argv, message in bad_inputs(tmp_path):
        assert message in err, (argv, message)
    assert "internal error" not in err


@pytest.mark.parametrize(("argv", "expected"), DRY_RUNS)
def test_dry_run_resolves_the_flags(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: dict, tiny_model_dir: Path
) -> None:
    rc, out, err = run(capsys, "bench", *_with_model(argv, tiny_model_dir), "--dry-run")
    assert rc == 0, err
    resolved = yaml.safe_load(out)
    for key, value in expected.items():
        value = str(tiny_model_dir) if value == "MODEL" else value
        ok = value(resolved[key]) if callable(value) else resolved[key] == value
        assert ok, (key, resolved[key])


def test_bare_bench_is_the_default_rollout_benchmark_without_a_warning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl bench --batch 2,8` is the form users' CI runs: the rollout benchmark, not deprecated."""
    rc, out, err = run(capsys, "bench", "--batch", "2", "--dry-run")
    assert rc == 0 and yaml.safe_load(out)["batch"] == [2]
    assert "deprecated" not in err and "warning" not in err
    rc, out, err = run(capsys, "bench", "--concurrency", "16", "--dry-run")
    assert rc == 0 and yaml.safe_load(out)["concurrency"] == [16] and "deprecated" not in err
    import qerl_cli.bench as bench_mod
    from qerl_cli.bench.result import read_report

    report = read_report(REPO / "benchmarks" / "h100-2026-11-24" / "sweep-fp8-humming" / "bench.json")
    seen = []
    monkeypatch.setattr(bench_mod, "run_bench", lambda conf, command=None: seen.append(command) or report)
    rc, out, err = run(capsys, "bench", "--batch", "2,8")  # the command of CI's GPU job
    assert rc == 0 and "Rollout throughput" in out and "deprecated" not in err
    assert seen == ["qerl bench --batch 2,8"]
    rc, _, err = run(capsys, "bench", "rolout")  # a misspelt benchmark is not the default benchmark
    assert rc == 2 and "No such command 'rolout'" in err
    rc, out, err = run(capsys, "bench", "--help")
    assert rc == 0 and "without a benchmark runs `qerl bench rollout" in " ".join(out.split())


# -- each benchmark's JSON, on the CPU --------------------------------------------------------------
def check_header(report: dict[str, Any], command: str, schema: str) -> None:
    assert list(report)[: len(HEADER)] == list(HEADER)
    assert report["schema"] == schema and report["command"].startswith(f"qerl bench {command} ")
    assert report["device"] == "cpu" and report["created"][:2] == "20"
    assert report["versions"]["torch"] and "qerl" in report["versions"]


BENCH_SHAPE = [
    "--model",
    "tiny",
    "--engine",
    "hf",
    "--formats",
    "bf16",
    "--prompt-len",
    "8",
    "--gen-len",
    "2",
]


def test_rollout_writes_bench_json_with_its_command(cache_dir, tmp_path, capsys) -> None:
    rc, out, err = run(
        capsys, "bench", "rollout", *BENCH_SHAPE, "--batch", "1", "--lora-rank", "0", "-o", str(tmp_path)
    )
    assert rc == 0, err
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["command"].startswith("qerl bench rollout --model tiny") and report["device"] == "cpu"
    assert list(report)[:4] == ["schema", "created", "command", "device"]
    assert [r["batch"] for r in report["rollout"]] == [1] and report["e2e"] is None


def test_concurrency_writes_bench_json(cache_dir, tmp_path, capsys) -> None:
    rc, _, err = run(
        capsys,
        "bench",
        "concurrency",
        *BENCH_SHAPE,
        "--concurrency",
        "2",
        "--lora-rank",
        "0",
        "--set",
        "repeats=1",
        "--set",
        "warmup=0",
        "-o",
        str(tmp_path),
    )
    assert rc == 0, err
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["command"].startswith("qerl bench concurrency") and report["settings"]["concurrency"] == [2]
    assert [r["batch"] for r in report["rollout"]] == [2] and report["rollout"][0]["roofline"] is None  # CPU


def test_e2e_writes_step_phases_and_no_rollout_cases(cache_dir, tmp_path, capsys) -> None:
    rc, out, err = run(
        capsys,
        "bench",
        "e2e",
        *BENCH_SHAPE,
        "--prompts-per-step",
        "1",
        "--generations",
        "2",
        "--lora-rank",
        "4",
        "--set",
        "repeats=1",
        "--set",
        "warmup=0",
        "-o",
        str(tmp_path),
    )
    assert rc == 0, err
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (
        report["command"].startswith("qerl bench e2e") and report["rollout"] == [] and report["memory"] == []
    )
    (row,) = report["e2e"]
    assert row["format"] == "bf16" and row["step_s"] > 0 and row["steps_timed"] == 1
    # What the engine ran beside what was asked for (the HF engine generates with the trainer's modules).
    assert (row["linear_backend"], row["linear_backend_requested"]) == ("trainer", "auto")
    assert row["base_compute_requested"] == "auto"
    assert report["settings"]["rollouts"] is False and "End-to-end GRPO step" in out


def test_kernels_writes_its_json(cache_dir, tmp_path, capsys) -> None:
    rc, out, err = run(
        capsys,
        "bench",
        "kernels",
        "--model",
        "tiny",
        "--formats",
        "nvfp4",
        "--batch",
        "1",
        "--seq-len",
        "16",
        "--iters",
        "2",
        "--device",
        "cpu",
        "-o",
        str(tmp_path),
    )
    assert rc == 0, err
    report = json.loads((tmp_path / "kernels.json").read_text())
    check_header(report, "kernels", "qerl-bench-kernels/1")
    assert report["errors"] == [] and report["copy_GBps"] > 0
    (dequant,) = report["dequant"]
    assert dequant["kernel"] == "torch" and dequant["bit_exact"] is True and dequant["GBps"] > 0
    (memory,) = report["memory"]
    assert (
        memory["detected_format"] == "nvfp4" and 0 < memory["packed_linear_bytes"] < memory["weights_bytes"]
    )
    assert memory["weights_bytes"] < memory["bf16_equivalent_bytes"]  # packed 4-bit is smaller than BF16
    (layer,) = report["layer"]
    # the same weights give the same output before the timing means anything
    assert layer["tokens"] == 16 and layer["ms"] > 0 and layer["max_abs_diff"] < 1e-3


def test_update_writes_its_json(cache_dir, tmp_path, capsys) -> None:
    rc, _, err = run(
        capsys,
        "bench",
        "update",
        "--model",
        "tiny",
        "--formats",
        "nvfp4",
        "--fused",
        "off",
        "--sequences",
        "2",
        "--group",
        "2",
        "--prompt-len",
        "4",
        "--gen-len",
        "4",
        "--lora-rank",
        "4",
        "--device",
        "cpu",
        "-o",
        str(tmp_path),
    )
    assert rc == 0, err
    report = json.loads((tmp_path / "update.json").read_text())
    check_header(report, "update", "qerl-bench-update/1")
    (row,) = report["rows"]  # --base-compute's default: the base's GEMMs in BF16
    assert "error" not in row, row
    assert (
        row["format"] == "nvfp4" and row["micro_batch_size"] == 2 and row["gradient_checkpointing"] is False
    )
    assert row["base_compute"] == "bf16" and row["mfu_fp8"] is None
    assert row["logprob_chunk_tokens"] == 1024  # the CPU's plan: auto's largest chunk
    assert row["update_s"] > 0 and row["tokens_per_s"] == pytest.approx(2 * 8 / row["update_s"])
    # no GPU peak on the CPU; 2 x 4 completion tokens in the loss
    assert row["mfu_bf16"] is None and row["loss_tokens"] == 8


def test_update_profile_needs_a_gpu(cache_dir, tmp_path, capsys) -> None:
    rc, _, err = run(
        capsys, "bench", "update", "--model", "tiny", "--profile", "--device", "cpu", "-o", str(tmp_path)
    )
    assert rc == 2 and "--profile" in err and "needs a GPU" in err


def test_quality_makes_and_measures_each_base(cache_dir, tiny_model_dir, tmp_path, capsys) -> None:
    rc, out, err = run(
        capsys,
        "bench",
        "quality",
        str(tiny_model_dir),
        "--rows",
        "nf4-rtn",
        "--calib-samples",
        "2",
        "--seq-len",
        "16",
        "--heldout-rows",
        "2",
        "--device",
        "cpu",
        "-o",
        str(tmp_path),
    )
    assert rc == 0, err
    report = json.loads((tmp_path / "quality.json").read_text())
    check_header(report, "quality", "qerl-bench-quality/1")
    (row,) = report["rows"]
    assert (
        row["row"] == "nf4-rtn"
        and Path(row["folder"]).is_dir()
        and row["via"] == "qerl quantize --method rtn"
    )
    assert row["perplexity"] > 1 and row["kl_to_bf16"] >= 0 and 0 <= row["top1_agreement"] <= 1
    assert 0 < row["mean_layer_error"] <= row["max_layer_error"] < 1
    assert (
        report["quality"]["reference_perplexity"] > 1
        and "| nf4-rtn |" in (tmp_path / "quality.md").read_text()
    )


def test_scaling_writes_its_json_and_the_efficiency_against_a_reference(
    cache_dir, tiny_model_dir, tmp_path, capsys
) -> None:
    shape = [
        "--set",
        f"model.path={tiny_model_dir}",
        "--set",
        "rollout.num_generations=2",
        "--set",
        "rollout.max_completion_length=4",
        "--set",
        "aqn.enabled=false",
    ]
    one = tmp_path / "one"
    rc, out, err = run(
        capsys, "bench", "scaling", "tiny", "--steps", "2", "--prompts-per-gpu", "1", *shape, "-o", str(one)
    )
    assert rc == 0, err
    report = json.loads((one / "scaling.json").read_text())
    check_header(report, "scaling", "qerl-bench-scaling/1")
    run_ = report["run"]
    assert (
        report["world_size"] == 1
        and report["scaling"] == "weak"
        and report["settings"]["prompts_per_step"] == 1
    )
    assert (run_["steps"], run_["steps_timed"]) == (2, 1) and run_["step_tokens_per_s"] > 0
    assert report["scaling_efficiency"] is None and report["reference"] is None
    rc, _, err = run(capsys, "bench", "scaling", "tiny", "--steps", "2", *shape, "-o", str(one))
    assert rc == 2 and "exists" in err  # never mixes two runs' metrics
    again = tmp_path / "again"
    rc, _, err = run(
        capsys,
        "bench",
        "scaling",
        "tiny",
        "--steps",
        "2",
        "--prompts-per-gpu",
        "1",
        *shape,
        "--reference",
        str(one / "scaling.json"),
        "-o",
        str(again),
    )
    assert rc == 0, err
    second = json.loads((again / "scaling.json").read_text())
    assert second["reference"]["gpus"] == 1 and second["scaling_efficiency"] > 0


def test_scaling_synthetic_job_and_its_checkpoint_resumes(
    cache_dir, tiny_model_dir, tmp_path, capsys
) -> None:
    """--synthetic swaps in bench e2e's prompts and random rewards; the last step's checkpoint lets
    `qerl train RUN/config.yaml --resume RUN` go on (under torchrun: on another number of GPUs)."""
    out = tmp_path / "syn"
    shape = ["--set", "rollout.num_generations=2", "--set", "rollout.max_completion_length=4"]
    rc, _, err = run(
        capsys, "bench", "scaling", "tiny", "--model", str(tiny_model_dir), "--synthetic", "--steps", "2",
        "--prompts-per-gpu", "2", *shape, "-o", str(out),
    )  # fmt: skip
    assert rc == 0, err
    report = json.loads((out / "scaling.json").read_text())
    assert report["settings"]["job"] == "synthetic prompts, random rewards"
    # what the engine ran, beside what the recipe asked for (auto's choice is the figure's context)
    assert (report["settings"]["linear_backend"], report["settings"]["linear_backend_requested"]) == (
        "trainer",
        "auto",
    )
    assert report["settings"]["model"] == str(tiny_model_dir)
    saved = yaml.safe_load((out / "run" / "config.yaml").read_text())
    assert saved["data"]["dataset"] == "synthetic-addition" and saved["data"]["template"] == "plain"
    assert saved["algorithm"]["mask_truncated"] is False
    assert saved["rollout"]["max_prompt_length"] == 64 + 64  # the recipe's, and room for the template
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and "time_checkpoint_s" in rows[-1]
    assert (out / "run" / "checkpoint-2").is_dir()
    # Seeded uniform rewards, not grades: a tiny untrained model's completions earn no 0/1 pattern.
    assert all(0.0 < r["reward_mean"] < 1.0 for r in rows)
    rc, _, err = run(
        capsys, "train", str(out / "run" / "config.yaml"), "--resume", str(out / "run"),
        "--set", "train.max_steps=3",
    )  # fmt: skip
    assert rc == 0, err
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_scaling_shape_dry_run_names_the_checkpoint_and_writes_nothing(
    cache_dir, tiny_model_dir, capsys, caplog, monkeypatch
) -> None:
    rc, out, err = run(
        capsys, "bench", "scaling", "tiny", "--model", "qwen2.5-0.5b", "--format", "MXFP4", "--dry-run"
    )
    assert rc == 0, err
    assert yaml.safe_load(out)["model"]["path"] == str(cache_dir / "bench" / "qwen2.5-0.5b" / "mxfp4-seed0")
    assert "Add --synthetic" in caplog.text  # random weights graded on the recipe's data: warned
    rc, _, err = run(capsys, "bench", "scaling", "tiny", "--model", str(tiny_model_dir), "--format", "nvfp4")
    assert rc == 2 and "applies to a --model SHAPE" in err
    rc, _, err = run(capsys, "bench", "scaling", "gsm8k_7b", "--dry-run")
    if not torch_cuda():  # gsm8k_7b rolls out with vLLM: its dry run checks for a GPU and vLLM
        assert rc == 2 and "--engine vllm needs a CUDA GPU" in err
    from qerl_cli.bench import preflight
    from qerl_cli.errors import Checked
    from qerl_cli.rl import preflight as train_checks

    monkeypatch.setattr(preflight, "gpu_available", lambda: True)  # the GPU machine it is prepared for
    monkeypatch.setattr(preflight, "vllm_available", lambda: True)
    monkeypatch.setattr(train_checks, "engine", lambda cfg: Checked("rollout.engine", "vllm (a GPU here)"))
    rc, out, err = run(
        capsys, "bench", "scaling", "gsm8k_7b", "--model", "qwen2.5-7b", "--synthetic", "--prompts-per-gpu",
        "16", "--dry-run",
    )  # fmt: skip
    assert rc == 0, err
    conf = yaml.safe_load(out)
    target = cache_dir / "bench" / "qwen2.5-7b" / "nvfp4-seed0"
    assert conf["model"]["path"] == str(target) and not target.exists()
    assert conf["data"]["dataset"] == "synthetic-addition"
    # gsm8k_7b's 256-token prompts: filler to ~256 byte-level tokens, the bound 64 above
    assert conf["rollout"]["max_prompt_length"] == 320 and len(conf["data"]["system_prompt"]) == 256 - 48
    assert conf["train"]["prompts_per_step"] == 16 and conf["output"]["save_steps"] == 3


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_scaling_other_local_ranks_wait_for_rank_zeros_checkpoint(cache_dir, monkeypatch) -> None:
    """Under torchrun only local rank 0 writes a shape's checkpoint; the others wait for it, and say
    so when it never comes."""
    import threading

    from qerl_cli.bench.models import shape_checkpoint_path
    from qerl_cli.bench.scaling import model_folder
    from qerl_cli.errors import QerlError
    from qerl_cli.files import write_folder_once

    monkeypatch.setenv("LOCAL_RANK", "1")
    target = shape_checkpoint_path("qwen2.5-0.5b", "mxfp4")
    with pytest.raises(QerlError, match="local rank 0 did not write"):
        model_folder("qwen2.5-0.5b", "mxfp4", write=True, wait_s=0.1)

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")

    writer = threading.Timer(0.5, write_folder_once, (target, write))
    writer.start()
    try:
        assert model_folder("qwen2.5-0.5b", "mxfp4", write=True, wait_s=60) == target
    finally:
        writer.join()
    assert (target / "config.json").is_file()


# -- library ----------------------------------------------------------------------------------------
def test_scaling_arithmetic() -> None:
    """Step 1 is left out of the means; efficiency is tokens/s per GPU against the reference's."""
    from qerl_cli.bench.scaling import gpus_in_use, run_summary, scaling_efficiency, scaling_kind

    def records(n: int, tokens: float, step_s: float) -> list[dict[str, Any]]:
        first = {"rollout_tokens": tokens, "time_step_s": 99.0, "time_rollout_s": 50.0, "world_size": n}
        rest = {
            "rollout_tokens": tokens,
            "time_step_s": step_s,
            "time_rollout_s": step_s / 2,
            "time_update_s": 1.0,
            "rollout/sync_seconds": 0.5,
            "time_aqn_s": 0.25,
            "world_size": n,
            "memory/device_peak_used_gib": 30.0 + n,
        }
        return [first, rest, dict(rest)]

    one = run_summary(records(1, 1000.0, 10.0), 1)  # 100 tokens/s of whole steps
    two = run_summary(records(2, 2000.0, 11.0), 2)  # twice the prompts, 10% slower steps
    four = run_summary(records(4, 4000.0, 12.5), 4)
    assert (one["steps"], one["steps_timed"], one["step_s"]) == (3, 2, 10.0)
    assert (one["sync_s"], one["aqn_s"]) == (0.5, 0.25)  # step 1 has neither: left out of the means
    assert two["rollout_tokens_per_s_per_gpu"] == pytest.approx(2000 / 5.5 / 2)
    assert scaling_efficiency(one, two) == pytest.approx((2000 / 11) / (2 * 100))
    assert scaling_efficiency(one, four) == pytest.approx((4000 / 12.5) / (4 * 100))
    assert scaling_efficiency(two, four) == pytest.approx((4000 / 12.5 / 4) / (2000 / 11 / 2))
    assert four["device_peak_used_gib"] == 34.0
    # strong scaling (the same tokens every step): the step times' ratio
    strong = {"gpus": 4, "step_tokens_per_s": 1000.0 / 2.5}
    assert scaling_efficiency(one, strong) == pytest.approx(10.0 / (4 * 2.5))
    assert run_summary([], 4) == {"gpus": 4, "steps": 0}
    assert scaling_efficiency(one, run_summary([], 4)) is None
    # Older runs without the sync / AQN metrics show none, not zero.
    old_rows = [{k: v for k, v in r.items() if k != "time_aqn_s"} for r in records(1, 1.0, 1.0)]
    assert run_summary(old_rows, 1)["aqn_s"] is None
    # A tensor-parallel process counts the rollout's GPUs, and is not a weak-scaling run.
    assert (gpus_in_use(1, 2), gpus_in_use(4, 1)) == (2, 4)
    kinds = (scaling_kind(16, 2), scaling_kind(16, 1), scaling_kind(None, 1))
    assert kinds == ("tensor-parallel", "weak", "strong")


def test_scaling_reference_must_be_a_scaling_report(tmp_path: Path) -> None:
    from qerl_cli.bench.scaling import read_reference
    from qerl_cli.errors import QerlError

    other = tmp_path / "bench.json"
    other.write_text(json.dumps({"schema": "qerl-bench/1"}))
    with pytest.raises(QerlError, match="not a qerl bench scaling report"):
        read_reference(other)


def test_memory_cap_is_nothing_without_a_cap_and_refused_on_the_cpu() -> None:
    import torch

    from qerl_cli.bench.ballast import memory_cap
    from qerl_cli.errors import QerlError

    with memory_cap(None) as held:
        assert held is None
    if not torch.cuda.is_available():
        with pytest.raises(QerlError, match="needs a CUDA GPU"), memory_cap(10.0):
            pass


# -- the repository: benchmarks are commands, not scripts ---------------------------------------------
def test_ci_runs_the_users_bench_command_and_the_gpu_tests() -> None:
    """The GPU job runs what users run (`qerl bench --batch 2,8`) and the tests marked gpu or vllm, in
    one process (every vLLM test starts an engine on the one GPU)."""
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "gpu.yml").read_text())
    runs = [
        line.strip()
        for step in workflow["jobs"]["bench"]["steps"]
        for line in step.get("run", "").splitlines()
    ]
    benches = [line for line in runs if line.startswith("qerl bench")]
    assert benches and all(line.startswith("qerl bench --batch 2,8 ") for line in benches)
    (tests,) = [line for line in runs if "-m pytest" in line]
    assert '-m "gpu or vllm"' in tests and "-n 0" in tests


def test_the_real_vllm_tests_carry_the_markers_the_gpu_job_selects() -> None:
    """tests/test_vllm_real.py runs in the GPU job only if its tests carry gpu / vllm (and are skipped
    elsewhere by tests/conftest.py for the same marks)."""
    import test_vllm_real

    assert {mark.name for mark in test_vllm_real.pytestmark} == {"gpu", "vllm"}
    tests = [name for name in dir(test_vllm_real) if name.startswith("test_")]
    tests += [name for name in dir(test_vllm_real.TestLoraEngine) if name.startswith("test_")]
    assert len(tests) >= 7  # start, sync, staleness, noise, sleep/wake, NVFP4, the merge backends


def test_scripts_holds_only_the_setup() -> None:
    """Measurements are `qerl bench` subcommands and a run's commands its benchmarks/<run>/run.sh."""
    done = subprocess.run(["git", "ls-files", "scripts"], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("not a git checkout")
    assert done.stdout.split() == ["scripts/setup.sh"]


def test_update_records_an_fp8_case_that_cannot_run_and_exits_1(cache_dir, tmp_path, capsys) -> None:
    """FP8 GEMMs need FP8 tensor cores (and layers large enough to gain): on the CPU the fp8 case is a row
    saying so, not a BF16 run under the fp8 label, and the command exits 1."""
    shape = ["--sequences", "2", "--group", "2", "--prompt-len", "4", "--gen-len", "4", "--lora-rank", "4"]
    rc, out, _ = run(capsys, "bench", "update", "--model", "tiny", "--formats", "nvfp4", "--fused", "off",
                     "--base-compute", "fp8", *shape, "--device", "cpu", "-o", str(tmp_path))  # fmt: skip
    assert rc == 1
    (row,) = json.loads((tmp_path / "update.json").read_text())["rows"]
    assert row["base_compute"] == "fp8" and "train.base_compute=fp8 cannot run" in row["error"]
    assert row["error"] in " ".join(out.split())  # in full below the table, which cuts it short


def test_the_sweep_takes_every_linear_backend_but_auto() -> None:
    """A sweep of the merged backends was refused on an H100 after the 16 x 8 runs (`--backends has
    unknown ['fp8-merged']`): the list the bench checks is rollout.linear_backend's."""
    from qerl_cli.config import BenchConfig, load_config
    from qerl_cli.config.stages import SWEPT_BACKENDS

    assert "auto" not in SWEPT_BACKENDS and {"fp8-merged", "merged"} <= set(SWEPT_BACKENDS)
    conf = load_config(BenchConfig, None, ["backends=[fp8-merged, merged]", "concurrency=[8]"])
    assert conf.backends == ["fp8-merged", "merged"]


# -- one configuration system ------------------------------------------------------------------------
def test_every_benchmark_takes_the_same_config_options() -> None:
    """--config (scaling and gap: their RECIPE is the config), --set, --dry-run and --device on every
    benchmark."""
    from typer.main import get_command

    from qerl_cli.cli import app

    for name, command in get_command(app).commands["bench"].commands.items():
        have = {opt for p in command.params for opt in p.opts}
        wanted = {"--set", "--dry-run", "--device"} | (
            {"--config"} if name not in ("scaling", "gap") else set()
        )
        assert wanted <= have, (name, sorted(wanted - have))


def test_a_tool_benchmark_reads_config_under_its_flags_and_set(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    conf = tmp_path / "update.yaml"
    conf.write_text("sequences: 16\ngroup: 4\nbase_compute: [bf16, fp8]\nfused: ['off']\n")
    flags = ["--config", str(conf), "--group", "2", "--set", "gen_len=64", "--dry-run"]
    rc, out, err = run(capsys, "bench", "update", *flags)
    assert rc == 0, err
    resolved = yaml.safe_load(out)
    assert (resolved["sequences"], resolved["group"], resolved["gen_len"]) == (16, 2, 64)
    assert resolved["base_compute"] == ["bf16", "fp8"] and resolved["fused"] == ["off"]
    rc, _, err = run(capsys, "bench", "update", "--set", "base_compute=[fp16]", "--dry-run")
    assert rc == 2 and "'base_compute'" in err and "'fp16'" in err


def test_e2e_has_its_own_settings_and_bench_config_no_e2e_keys() -> None:
    import dataclasses

    from qerl_cli.bench.settings import E2EConfig
    from qerl_cli.config import BenchConfig

    shared = [f.name for f in dataclasses.fields(BenchConfig)]
    assert not [name for name in shared if name.startswith("e2e") or name == "rollouts"]
    own = {f.name for f in dataclasses.fields(E2EConfig)} - {f.name for f in dataclasses.fields(BenchConfig)}
    assert own == {"generations", "prompts_per_step", "recipe", "linear_backend", "base_compute"}
