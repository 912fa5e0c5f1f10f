"""``qerl bench``'s checks before any work, its plan and progress lines, and the timings of a GRPO step
that add up (the trainer's ``time_*_s``, ``bench e2e``'s phases, ``bench scaling``'s parts).

The GPU and the packages are faked (``bench.preflight.gpu_available``, ``package_available``): a GPU
runner without vLLM or bitsandbytes must fail with exit 2 naming the extra, before any checkpoint is
written or any engine started.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from qerl_cli.bench import preflight
from qerl_cli.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, " ".join(err.split())


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any checkpoint written or benchmark run fails the test: the checks must come first."""
    import qerl_cli.bench as bench_mod
    from qerl_cli.bench import models

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the checks refused the run")

    monkeypatch.setattr(models, "prepare_checkpoints", refuse)
    monkeypatch.setattr(bench_mod, "run_bench", refuse)


def fake_machine(monkeypatch: pytest.MonkeyPatch, *, gpu: bool, missing: tuple[str, ...]) -> None:
    monkeypatch.setattr(preflight, "gpu_available", lambda: gpu)
    real = preflight.package_available
    monkeypatch.setattr(
        preflight, "package_available", lambda m: m not in missing and (m == "vllm" or real(m))
    )


# -- a GPU without vLLM, a format without its package ----------------------------------------------------
def test_a_gpu_without_vllm_is_a_usage_error_naming_the_extra(monkeypatch, capsys, no_work, tmp_path) -> None:
    fake_machine(monkeypatch, gpu=True, missing=("vllm",))
    rc, out, err = run(capsys, "bench", "--batch", "2,8", "-o", str(tmp_path / "out"))
    assert rc == 2 and "vLLM is not installed" in err and 'pip install -e ".[vllm]"' in err
    assert "--engine hf" in err  # how to measure the transformers engine on purpose
    rc, _, err = run(capsys, "bench", "e2e", "--dry-run")
    assert rc == 2 and '".[vllm]"' in err  # the dry run checks it too
    rc, out, err = run(capsys, "bench", "--engine", "hf", "--dry-run")  # asked for: allowed
    assert rc == 0 and "engine: hf" in out
    print("a GPU without vLLM: exit 2 naming the vllm extra; --engine hf goes on")


def test_a_format_without_its_package_is_refused_before_any_case(monkeypatch, capsys, no_work) -> None:
    fake_machine(monkeypatch, gpu=True, missing=("bitsandbytes",))
    rc, _, err = run(capsys, "bench", "--batch", "2,8")  # the default formats: bf16, nf4, nvfp4
    assert rc == 2 and "the nf4 case on vLLM needs the bitsandbytes package" in err
    assert 'pip install -e ".[nf4]"' in err
    rc, out, err = run(capsys, "bench", "--formats", "bf16,nvfp4", "--dry-run")  # no NF4: nothing missing
    assert rc == 0 and "engine: vllm" in out, err
    # The transformers engine serves NF4 with qerl's own layers: no bitsandbytes needed.
    fake_machine(monkeypatch, gpu=False, missing=("bitsandbytes", "vllm"))
    rc, out, err = run(capsys, "bench", "--dry-run")
    assert rc == 0 and "engine: hf" in out, err
    print("NF4 on vLLM without bitsandbytes: exit 2 naming the nf4 extra before the BF16 case")


def test_the_sweep_leaves_out_an_uninstalled_default_backend_but_not_a_named_one(monkeypatch, capsys) -> None:
    fake_machine(monkeypatch, gpu=True, missing=("humming",))
    rc, out, err = run(capsys, "bench", "concurrency", "--formats", "nvfp4", "--dry-run")
    assert rc == 0, err
    assert yaml.safe_load(out)["backends"] == ["marlin", "fp8"]
    assert 'humming left out (not installed: pip install -e ".[humming]" in the qerl clone)' in out
    rc, _, err = run(
        capsys, "bench", "concurrency", "--formats", "nvfp4", "--backends", "humming", "--dry-run"
    )
    assert rc == 2 and 'pip install -e ".[humming]"' in err


@pytest.mark.parametrize("dry", [["--dry-run"], []])
def test_a_backend_named_for_the_hf_engine_is_refused_as_e2e_refuses_it(
    monkeypatch, capsys, no_work, dry, tmp_path
) -> None:
    """`concurrency --backends humming` on a CPU exited 0 and measured no backend, while `e2e
    --linear-backend marlin` refused the same: a backend named must run, so both refuse it."""
    fake_machine(monkeypatch, gpu=False, missing=("vllm", "humming"))
    rc, _, err = run(capsys, "bench", "concurrency", "--concurrency", "8", "--backends", "humming", *dry)
    assert rc == 2 and "--backends humming: the hf engine has no linear backends" in err, err
    assert "leave --backends out, or time the backends with --engine vllm on a GPU" in err
    rc, _, err = run(capsys, "bench", "e2e", "--linear-backend", "marlin", *dry)
    assert rc == 2 and "--linear-backend marlin: the hf engine has no linear backends" in err, err
    rc, out, err = run(capsys, "bench", "concurrency", "--concurrency", "8", "--dry-run")  # none named
    assert rc == 0, err
    saved = tmp_path / "concurrency.yaml"  # the dry run's YAML given back holds the default backends
    saved.write_text(out)
    rc, _, err = run(capsys, "bench", "concurrency", "--config", str(saved), "--dry-run")
    assert rc == 0, err
    fake_machine(monkeypatch, gpu=True, missing=())  # vLLM has them: the flag resolves
    rc, out, err = run(
        capsys, "bench", "concurrency", "--concurrency", "16", "--backends", "fp8", "--dry-run"
    )
    assert rc == 0 and yaml.safe_load(out)["backends"] == ["fp8"], err


def test_update_defaults_run_on_the_dev_install_and_liger_asked_for_is_checked(monkeypatch, capsys) -> None:
    from qerl_cli.cli import bench_tools

    monkeypatch.setattr(bench_tools, "package_available", lambda m: m != "liger_kernel")
    monkeypatch.setattr(preflight, "package_available", lambda m: m != "liger_kernel")
    rc, out, err = run(capsys, "bench", "update", "--dry-run")
    assert rc == 0 and yaml.safe_load(out)["fused"] == ["off"], err  # [dev] has no liger-kernel
    rc, _, err = run(capsys, "bench", "update", "--fused", "off,liger", "--dry-run")
    assert rc == 2 and "--fused liger needs the liger_kernel package" in err and '".[liger]"' in err
    monkeypatch.setattr(bench_tools, "package_available", lambda m: True)
    monkeypatch.setattr(preflight, "package_available", lambda m: True)
    rc, out, _ = run(capsys, "bench", "update", "--dry-run")
    assert rc == 0 and yaml.safe_load(out)["fused"] == ["off", "liger"]


def test_an_output_that_cannot_be_written_is_refused(capsys, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for argv in (["bench", "--dry-run"], ["bench", "kernels", "--dry-run"], ["bench", "update", "--dry-run"]):
        rc, _, err = run(capsys, *argv, "-o", str(blocker))
        assert rc == 2 and "is a file, not a folder" in err, argv


def test_gpu_only_settings_are_refused_on_the_cpu(monkeypatch, capsys) -> None:
    monkeypatch.setattr(preflight, "gpu_available", lambda: False)  # check_tool's too: it lives there
    rc, _, err = run(capsys, "bench", "kernels", "--device", "cuda", "--dry-run")
    assert rc == 2 and "--device cuda needs a GPU" in err
    rc, _, err = run(capsys, "bench", "--engine", "vllm", "--dry-run")
    assert rc == 2 and "--engine vllm needs a CUDA GPU" in err


@pytest.mark.parametrize(
    "bench",
    [[], ["concurrency"], ["e2e"], ["kernels"], ["update"], ["quality", "m"], ["scaling", "tiny"],
     ["gap", "tiny", "--backends", "hf"]],
)  # fmt: skip
@pytest.mark.parametrize("device", ["gpu", "cpux", "mps"])
def test_a_device_no_stage_runs_on_is_refused_by_every_benchmark(
    capsys, no_work, tmp_path, bench, device
) -> None:
    """``--device gpu`` passed the dry run (``cpux`` even as the CPU) and the run failed after preparing
    the checkpoints: now both refuse it first, naming the flag and the names it takes."""
    out = tmp_path / "out"
    runs = [["--dry-run"], []] if not bench else [["--dry-run"]]  # a real run: rollout's (no_work fakes it)
    for dry in runs:
        rc, _, err = run(capsys, "bench", *bench, "--device", device, "-o", str(out), *dry)
        message = f"--device={device} is not a device qerl runs on; use auto, cpu or cuda[:N]"
        assert rc == 2 and message in " ".join(err.split()), err
    assert not out.exists()


def test_the_dry_run_refuses_a_baseline_of_other_settings_as_the_run_does(capsys, no_work, tmp_path) -> None:
    """A baseline measured with --prompt-len 64 passed `--prompt-len 16 --dry-run` (the dry run read the
    file alone), then the run refused it: both now make the run's comparability check."""
    from qerl_cli.bench.result import new_report, write_json

    base = tmp_path / "base"  # the settings a baseline must share, as the default CPU run records them
    shared = {
        "model": "tiny",
        "engine": "hf",
        "prompt_len": 64,
        "gen_len": 32,
        "one_engine_per_format": False,
    }
    write_json(new_report({**shared, "e2e_shape": None, "formats": ["bf16", "nf4", "nvfp4"]}), base)
    argv = ["bench", "--batch", "2,8", "--baseline", str(base), "-o", str(tmp_path / "b2")]
    for dry in (["--dry-run"], []):
        rc, _, err = run(capsys, *argv, "--prompt-len", "16", *dry)
        assert rc == 2 and "measured with other settings (baseline vs now): prompt_len: 64 vs 16" in err, err
    rc, _, err = run(capsys, *argv, "--dry-run")  # the same settings: it can gate
    assert rc == 0 and "--baseline: " in err, err


# -- the plan and the progress lines ----------------------------------------------------------------------
def test_the_cpu_default_plans_the_time_it_takes_and_says_so(monkeypatch, capsys) -> None:
    """The default on an idle 2-core CPU took 10 s of work, 16 s end to end; the plan said ~1m30s."""
    fake_machine(monkeypatch, gpu=False, missing=("vllm",))
    rc, out, err = run(capsys, "bench", "--dry-run")
    assert rc == 0, err
    conf = yaml.safe_load(out)  # the plan is YAML comments: the output is still a config
    assert (conf["prompt_len"], conf["gen_len"]) == (64, 32)  # the CPU's lengths, not the GPU's 256 + 512
    plan = [line.removeprefix("#").strip() for line in out.splitlines() if line.startswith("#")]
    assert "engine: hf" in plan and any(line.startswith("cases: 6 (bf16; bf16 LoRA 16;") for line in plan)
    (time_line,) = [line for line in plan if line.startswith("time: ~")]
    assert "an estimate" in time_line
    from qerl_cli.bench.plan import bench_plan
    from qerl_cli.config import BenchConfig

    plan_s = bench_plan(BenchConfig(**{**conf, "model": ""})).estimate_s
    assert plan_s is not None and 10 / 2 <= plan_s <= 16 * 2  # within 2x of the measured run either way
    rc, out, _ = run(capsys, "bench", "--gen-len", "128", "--dry-run")  # given: kept
    assert rc == 0 and yaml.safe_load(out)["gen_len"] == 128 and yaml.safe_load(out)["prompt_len"] == 64


def test_progress_lines_say_what_how_many_elapsed_and_eta() -> None:
    import io

    from qerl_cli.bench.progress import Progress, clock

    stream = io.StringIO()
    progress = Progress("bench", 3, stream=stream)
    progress.start("bf16")
    progress.finish("bf16")
    progress.finish("nf4", "failed (no GPU)", seconds=120.0)
    progress.finish("nvfp4", seconds=1.0)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[bench] 1/3 bf16: started; elapsed")
    assert lines[1].startswith("[bench] 1/3 bf16: done in") and "eta ~" in lines[1]
    assert lines[2].startswith("[bench] 2/3 nf4: failed after 2m00s (no GPU)") and "eta ~1m00s" in lines[2]
    assert "eta" not in lines[3]  # the last one: nothing left
    assert (clock(5), clock(125), clock(3725)) == ("5 s", "2m05s", "1h02m")


def test_a_piped_rollout_run_prints_a_line_per_case(monkeypatch, capsys, tmp_path: Path) -> None:
    """No terminal (pytest captures stdout): each case still reports, on stderr, as it ends."""
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("QERL_NUM_THREADS", "1")
    rc, _, err = run(
        capsys, "bench", "--model", "tiny", "--engine", "hf", "--formats", "bf16", "--batch", "1",
        "--prompt-len", "8", "--gen-len", "2", "--lora-rank", "4", "-o", str(tmp_path / "out"),
    )  # fmt: skip
    assert rc == 0, err
    assert "plan: engine: hf" in err and "cases: 2 (bf16; bf16 LoRA 4)" in err
    assert "[bench] 1/2 bf16, LoRA 0, batches [1]: done in" in err and "eta ~" in err
    assert "[bench] 2/2 bf16, LoRA 4, batches [1]: done in" in err


# -- timings that add up ----------------------------------------------------------------------------------
PAUSE = 0.5  # seconds each engine hand-off of the fake takes: material against a tiny model's step


def test_a_steps_timed_parts_add_up_and_count_each_engine_call_once(tiny_model_dir, tmp_path) -> None:
    """The fake engine's sleep, wake-up, sync and staleness probe each take PAUSE: every one lands in
    exactly one part (time_sleep_s, time_wake_s, time_sync_s), and what no part counts is bookkeeping."""
    from test_engine_protocol import ProtocolOnlyEngine
    from test_trainer import FakeReward, tiny_cfg

    from qerl_cli.rl.tracking import STEP_PARTS, step_other_s
    from qerl_cli.rl.trainer import Trainer

    class SlowEngine(ProtocolOnlyEngine):
        def __init__(self, inner):
            super().__init__(inner)
            self.awake = True

        def sleep(self) -> None:
            super().sleep()
            time.sleep(PAUSE)
            self.awake = False

        def wake_up(self) -> None:
            super().wake_up()
            if not self.awake:  # as vLLM: waking an awake engine costs nothing
                time.sleep(PAUSE)
                self.awake = True

        def sync_policy(self, peft_model) -> None:
            super().sync_policy(peft_model)
            time.sleep(PAUSE)

        def check_staleness(self, probe_ids, trainer_logprobs, reference_logprobs=None):
            assert self.awake, "the staleness probe runs on an awake engine"
            time.sleep(PAUSE)
            return super().check_staleness(probe_ids, trainer_logprobs, reference_logprobs)

    trainer = Trainer(tiny_cfg(tiny_model_dir, tmp_path / "run"), reward_fn=FakeReward())
    trainer.engine = SlowEngine(trainer.engine)
    record = trainer.train_step()
    assert set(STEP_PARTS) <= set(record)
    assert PAUSE <= record["time_sleep_s"] < 2 * PAUSE
    assert PAUSE <= record["time_wake_s"] < 2 * PAUSE  # one real wake-up, counted once
    assert 2 * PAUSE <= record["time_sync_s"] < 3 * PAUSE  # the sync and its probe, no wake-up
    other = step_other_s(record)
    assert other is not None and 0 <= other < PAUSE  # no engine call outside the parts
    parts = sum(record[k] for k in STEP_PARTS)
    assert parts + other == pytest.approx(record["time_step_s"])
    print(f"step {record['time_step_s']:.2f} s = parts {parts:.2f} s + other {other:.3f} s")


def test_e2e_phases_are_the_median_steps_and_add_up() -> None:
    from qerl_cli.bench.e2e import PHASE_METRICS, median_step, step_phases
    from qerl_cli.bench.report import E2E_PHASES
    from qerl_cli.rl.tracking import STEP_PARTS

    assert tuple(metric for _, metric in PHASE_METRICS) == STEP_PARTS
    assert (*(name for name, _ in PHASE_METRICS), "other_s") == E2E_PHASES

    def record(step: float) -> dict[str, float]:
        parts = dict.fromkeys(STEP_PARTS, step / 10)
        return {**parts, "time_step_s": step}

    steps = [record(12.0), record(10.0), record(30.0), record(11.0)]
    chosen = median_step(steps)
    assert chosen["time_step_s"] == 11.0  # the lower middle of 10, 11, 12, 30
    phases = step_phases(chosen)
    assert phases["step_s"] == 11.0 and phases["other_s"] == pytest.approx(11.0 - 8 * 1.1)
    assert sum(phases[name] for name in E2E_PHASES) == pytest.approx(phases["step_s"])


def test_scaling_parts_add_up_to_the_mean_step_and_old_runs_keep_their_sync() -> None:
    from qerl_cli.bench.scaling import ENGINE_PARTS, ROLLOUT_UPDATE_PARTS, run_summary
    from qerl_cli.rl.tracking import STEP_PARTS

    rows = [{**dict.fromkeys(STEP_PARTS, float(i)), "time_step_s": 10.0 * i, "rollout_tokens": 1.0}
            for i in (1, 2, 3)]  # fmt: skip
    run_ = run_summary(rows, 1)
    total = sum(run_[k] for k in (*ROLLOUT_UPDATE_PARTS, *ENGINE_PARTS))
    assert total == pytest.approx(run_["step_s"]) and run_["other_s"] == pytest.approx(2.5 * 2)
    old = [{"time_step_s": 4.0, "rollout/sync_seconds": 0.5, "rollout_tokens": 1.0}] * 2
    summary = run_summary(old, 1)
    assert summary["sync_s"] == 0.5 and summary["sleep_s"] is None and summary["other_s"] is None


def test_the_dry_run_checks_the_model_folder_against_the_formats(capsys, tmp_path: Path) -> None:
    from qerl_cli.modeling.random_checkpoint import write_random_checkpoint

    folder = write_random_checkpoint(tmp_path / "nvfp4", "tiny", "nvfp4")
    rc, _, err = run(capsys, "bench", "--model", str(folder), "--engine", "hf", "--dry-run")
    assert rc == 2 and "already a nvfp4 checkpoint, so only --formats nvfp4" in err
    rc, out, err = run(capsys, "bench", "--model", str(folder), "--formats", "nvfp4", "--engine", "hf",
                       "--dry-run")  # fmt: skip
    assert rc == 0 and "(a local nvfp4 folder)" in out, err
    rc, _, err = run(capsys, "bench", "--model", str(tmp_path / "none"), "--dry-run")
    assert rc == 2 and "no such folder" in err


def test_quality_default_rows_skip_awq_without_llm_compressor_named_rows_need_it(
    monkeypatch, capsys, tiny_model_dir
) -> None:
    from qerl_cli.cli import bench_tools

    m = str(tiny_model_dir)  # a model that is there: the dry run checks it
    monkeypatch.setattr(bench_tools, "package_available", lambda m: m != "llmcompressor")
    monkeypatch.setattr(preflight, "package_available", lambda m: m != "llmcompressor")
    rc, out, err = run(capsys, "bench", "quality", m, "--dry-run")
    assert rc == 0 and yaml.safe_load(out)["rows"] == ["nvfp4-rtn", "mxfp4-rtn", "nf4-rtn"], err
    rc, _, err = run(capsys, "bench", "quality", m, "--rows", "nvfp4-awq,nf4-rtn", "--dry-run")
    assert rc == 2 and "--rows nvfp4-awq needs the llmcompressor package" in err and '".[quantize]"' in err


def test_the_gpu_default_plans_three_engines_within_the_recorded_ci_time(monkeypatch, capsys) -> None:
    """CI's `qerl bench --batch 2,8` on a GPU: three vLLM engines (each serving its LoRA case), 12
    figures, and an estimate inside what the recorded H100 / H200 runs took (300-560 s)."""
    fake_machine(monkeypatch, gpu=True, missing=())
    rc, out, err = run(capsys, "bench", "--batch", "2,8", "--dry-run")
    assert rc == 0, err
    conf = yaml.safe_load(out)
    assert (conf["prompt_len"], conf["gen_len"]) == (256, 512)  # the GPU keeps the recorded defaults
    plan = [line.removeprefix("#").strip() for line in out.splitlines() if line.startswith("#")]
    assert "engine: vllm" in plan and "cases: 3 (bf16; nf4; nvfp4)" in plan and "rollout figures: 12" in plan
    from qerl_cli.bench.plan import bench_plan
    from qerl_cli.config import BenchConfig

    estimate = bench_plan(BenchConfig(batch=[2, 8])).estimate_s
    assert estimate is not None and 300 <= estimate <= 560
