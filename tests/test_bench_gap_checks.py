"""``qerl bench gap``'s reference, notes and checks before work (a new user's walk on the CPU): the first
backend that is not ``hf`` is the ratios' reference and a reference gap of float noise gives no ratio, a
report without ratios says why, the gap's interval stays at or above 0, a failure's progress line, what the
run would refuse refused by the dry run too (exit 2, before the output folder is made), and no debris left
by an early failure."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_bench_gap import _recipe
from test_trainer import tiny_cfg

from qerl_cli.bench import gap_report
from qerl_cli.bench.gap_settings import GapSettings
from qerl_cli.cli import main


# -- the reference, the notes and the intervals ------------------------------------------------------
def _report(rows: list[gap_report.BackendRow], ratios: list[gap_report.GapRatio]) -> gap_report.GapReport:
    backends = [row.backend for row in rows]
    settings = {"backends": backends, "adapter": "none", "margin": 0.1}
    return gap_report.GapReport({}, settings, gap_report.TrainerFigures(), rows, ratios)


def test_hf_first_is_no_reference_the_first_other_backend_is() -> None:
    """``--backends hf,marlin,fp8``: hf's gap is the floor (~0), so marlin is the reference; hf keeps its
    row and gets a ratio to marlin's gap like any other backend."""
    result = gap_report.BackendResult
    trainer = [[-1.0, -2.0], [-1.5], [-0.5, -0.7]]
    rows = gap_report.build_rows(
        [
            result("hf", "trainer", logprobs=[[-1.0, -2.0], [-1.5], [-0.5, -0.7 + 1e-12]]),
            result("marlin", "marlin", logprobs=[[-1.01, -2.02], [-1.52], [-0.51, -0.72]]),
            result("fp8", "fp8", logprobs=[[-1.02, -2.03], [-1.53], [-0.52, -0.73]]),
        ],
        trainer,
    )
    assert rows[1].engine_gap is None and rows[0].engine_gap > 0 and rows[2].engine_gap > 0
    ratios = gap_report.build_ratios(rows, 0.1, 0)
    assert [(r.backend, r.reference) for r in ratios] == [("hf", "marlin"), ("fp8", "marlin")]
    assert ratios[0].ratio is not None and ratios[0].ratio < 1e-6 and ratios[1].ratio > 1
    markdown = gap_report.gap_markdown(_report(rows, ratios))
    assert "Ratio: to marlin's gap (the first backend that is not hf)" in markdown
    assert "| marlin | marlin |" in markdown and "(reference)" in markdown.split("| marlin |")[1]
    assert "No ratios" not in markdown


def test_a_reference_gap_of_float_noise_is_undefined_not_a_huge_ratio() -> None:
    result = gap_report.BackendResult
    trainer = [[-1.0, -2.0], [-1.5]]
    rows = gap_report.build_rows(
        [
            result("marlin", "marlin", logprobs=[[-1.0 + 1e-10, -2.0], [-1.5 - 1e-10]]),
            result("fp8", "fp8", logprobs=[[-1.1, -2.0], [-1.4]]),
        ],
        trainer,
    )
    (ratio,) = gap_report.build_ratios(rows, 0.1, 0)
    assert ratio.verdict == "undefined" and ratio.ratio is None and "float noise" in ratio.verdict_text


def test_the_gap_interval_does_not_go_below_0() -> None:
    """A mean of absolute values near 0 with a wide t interval: the lower end is clamped at 0."""
    result = gap_report.BackendResult
    trainer = [[-1.0], [-1.0], [-1.0]]
    rows = gap_report.build_rows(
        [
            result("marlin", "marlin", logprobs=[[-1.0], [-1.0], [-1.0 + 3e-11]]),
            result("fp8", "fp8", logprobs=[[-1.0], [-1.0], [-1.0 + 4e-11]]),
        ],
        trainer,
    )
    for row in rows:
        assert row.mean_gap > 0 and row.mean_gap_low == 0.0 and row.mean_gap_high > row.mean_gap
    assert rows[1].engine_gap_low == 0.0


@pytest.mark.parametrize(
    ("backends", "failed", "note"),
    [
        (["hf"], None, "No ratios: every backend is hf (the floor)"),
        (["marlin"], None, "No ratios: marlin alone was measured"),
        (["marlin", "hf"], "marlin", "No ratios: the reference, marlin, failed."),
        (["marlin", "fp8"], "fp8", "No ratios: no backend beside the reference, marlin, was measured."),
    ],
)
def test_a_report_without_ratios_says_why(backends: list[str], failed: str | None, note: str) -> None:
    result = gap_report.BackendResult
    results = [
        result(b, error="vLLM is not installed") if b == failed else result(b, b, logprobs=[[-1.0], [-2.0]])
        for b in backends
    ]
    rows = gap_report.build_rows(results, [[-1.1], [-2.2]])
    ratios = gap_report.build_ratios(rows, 0.1, 0)
    assert ratios == [] and note in gap_report.gap_markdown(_report(rows, ratios))


def test_a_failure_reads_failed_after_not_in() -> None:
    import io

    from qerl_cli.bench.progress import Progress

    stream = io.StringIO()
    progress = Progress("bench gap", 2, stream=stream)
    progress.finish("marlin", "failed: vLLM is not installed", seconds=0.2)
    progress.finish("hf", "done", seconds=3.0)
    first, second = stream.getvalue().splitlines()
    assert "marlin: failed after 0 s: vLLM is not installed; elapsed" in first and " in 0 s" not in first
    assert "hf: done in 3 s; elapsed" in second


# -- the checks before work ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "model.path=/nonexistent/tiny/nvfp4"], "/nonexistent/tiny/nvfp4"),
        (
            ["--set", "data.max_samples=3", "--sequences", "8"],
            "--sequences 8: the recipe's training data has 3",
        ),
        (["--device", "gpu"], "--device=gpu is not a device qerl runs on; use auto, cpu or cuda[:N]"),
        (["-o", "/proc/nope"], "--output /proc/nope cannot be written"),
    ],
)
@pytest.mark.parametrize("dry_run", [True, False])
def test_what_the_run_would_refuse_the_dry_run_refuses(
    capsys: pytest.CaptureFixture[str],
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    message: str,
    dry_run: bool,
) -> None:
    """A missing model, too few prompts, a device that is no device name and an output folder that cannot
    be made all exit 2 in the dry run as in the run, before the model loads and before -o is made."""
    if "/proc/nope" in args and not Path("/proc").is_dir():
        pytest.skip("no /proc")
    _no_policy(monkeypatch)
    out = tmp_path / "out"
    argv = ["bench", "gap", str(_recipe(tmp_path, tiny_model_dir)), "--backends", "hf", "-o", str(out), *args]
    rc = main([*argv, "--dry-run"] if dry_run else argv)
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and message in err, err
    assert not out.exists()


def _no_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from qerl_cli.bench import gap_trainer

    def no_policy(cfg: Any) -> Any:
        raise AssertionError("the policy was built before the inputs were checked")

    monkeypatch.setattr(gap_trainer, "build_policy", no_policy)


def test_a_bad_device_flag_is_named_as_the_flag(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--device gpu`` sets train.device, but the user typed --device: the message names the flag, and
    no YAML is printed before it."""
    _no_policy(monkeypatch)
    argv = ["bench", "gap", str(_recipe(tmp_path, tiny_model_dir)), "--backends", "hf", "--device", "gpu"]
    assert main([*argv, "-o", str(tmp_path / "out"), "--dry-run"]) == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert "--device=gpu is not a device qerl runs on" in err and "train.device" not in err, err
    assert captured.out == ""


def test_a_set_train_device_wins_over_the_flag_and_is_named_as_it(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--set train.device=cpu`` wins over ``--device cuda`` (the run is on the CPU: no GPU needed), and a
    ``--set train.device=cuda`` with no GPU is refused under its own name, with a remedy that works."""
    import qerl_cli.torch_utils as torch_utils

    _no_policy(monkeypatch)
    monkeypatch.setattr(torch_utils.torch.cuda, "is_available", lambda: False)
    recipe = str(_recipe(tmp_path, tiny_model_dir))
    argv = ["bench", "gap", recipe, "--backends", "hf", "-o", str(tmp_path / "o")]
    assert main([*argv, "--device", "cuda", "--set", "train.device=cpu", "--dry-run"]) == 0
    assert "train.device: cpu -> cpu" in " ".join(capsys.readouterr().err.split())
    assert main([*argv, "--set", "train.device=cuda", "--dry-run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "train.device=cuda but this machine has no CUDA GPU; use train.device=cpu" in err, err
    assert "--device" not in err, err


@pytest.mark.parametrize(
    ("vllm", "gpu", "reason"),
    [
        (False, False, "vLLM is not installed"),
        (False, True, "vLLM is not installed"),
        (True, False, "vLLM needs a CUDA GPU and none is visible"),
    ],
)
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_vllm_backend_that_cannot_run_here_is_refused_before_work(
    capsys: pytest.CaptureFixture[str],
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vllm: bool,
    gpu: bool,
    reason: str,
    dry_run: bool,
) -> None:
    """The default --backends (marlin, qerl-triton) on a machine without vLLM or a GPU: exit 2 naming the
    backends, why and what to do, in the dry run as in the run, before the trainer side samples anything
    (it used to sample and score first, then fail each backend after 0 s and exit 1)."""
    from qerl_cli.bench import gap

    _no_policy(monkeypatch)
    monkeypatch.setattr(gap, "vllm_available", lambda: vllm)
    monkeypatch.setattr(gap, "gpu_available", lambda: gpu)
    out = tmp_path / "out"
    argv = ["bench", "gap", str(_recipe(tmp_path, tiny_model_dir)), "--device", "cpu", "-o", str(out)]
    rc = main([*argv, "--dry-run"] if dry_run else argv)
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "--backends marlin, qerl-triton cannot run on this machine" in err, err
    assert reason in err and "--backends hf" in err and "on a GPU machine with vLLM installed" in err, err
    assert ('pip install -e ".[vllm]"' in err) is not vllm, err  # the extra's command where it is missing
    assert not out.exists()


def test_the_dry_run_lists_each_input_once(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One line per input: the output folder's (writable, and free of other runs' files), the device's
    (as the flag the user typed), the backends' (vLLM and a GPU found where a vLLM backend runs)."""
    from qerl_cli.bench import gap

    monkeypatch.setattr(gap, "vllm_available", lambda: True)
    monkeypatch.setattr(gap, "gpu_available", lambda: True)
    out = tmp_path / "g1"
    recipe = str(_recipe(tmp_path, tiny_model_dir))
    assert main(["bench", "gap", recipe, "--device", "cpu", "-o", str(out), "--dry-run"]) == 0
    lines = [line.strip() for line in capsys.readouterr().err.splitlines()]
    outputs = [line for line in lines if line.startswith(("--output:", "-o:"))]
    assert outputs == [f"--output: {out}: a folder that can be written, free of other runs' files"], lines
    assert [line for line in lines if "device" in line] == ["--device: cpu -> cpu"], lines
    backends = [line for line in lines if line.startswith("--backends")]
    assert backends == ["--backends: marlin, qerl-triton: vLLM installed, a GPU visible"], lines
    assert main(["bench", "gap", recipe, "--backends", "hf", "-o", str(out), "--dry-run"]) == 0
    lines = [line.strip() for line in capsys.readouterr().err.splitlines()]
    assert [line for line in lines if "device" in line] == ["train.device: cpu -> cpu"], lines
    assert "--backends: hf: the trainer side's transformers engine, no vLLM needed" in lines, lines
    assert not out.exists()


def test_an_early_failure_leaves_no_output_folder(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run failing in its trainer side (here when the policy is built) removes what it wrote and the
    folders it made; a folder that was there stays, with its other files."""
    from qerl_cli.bench import gap_trainer
    from qerl_cli.errors import QerlError

    def broken(cfg: Any) -> Any:
        raise QerlError("the policy could not be built")

    monkeypatch.setattr(gap_trainer, "build_policy", broken)
    recipe = _recipe(tmp_path, tiny_model_dir)
    out = tmp_path / "new" / "out"
    sizes = ["--backends", "hf", "--sequences", "2", "--max-tokens", "2"]
    assert main(["bench", "gap", str(recipe), *sizes, "-o", str(out)]) == 2
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    (kept / "gap.json").write_text('{"schema": "qerl-bench-gap/2"}')  # an earlier gap run's, replaced
    (kept / "gap.md").write_text("an earlier run's")
    assert main(["bench", "gap", str(recipe), *sizes, "-o", str(kept)]) == 2
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    capsys.readouterr()


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_folder_holding_another_runs_files_is_refused_and_kept(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, dry_run: bool
) -> None:
    """A gap run writes adapter/, sequences.json, ... in -o and replaces an earlier gap run's: a qerl train
    run's folder (its trained adapter/) or files of those names with no gap report beside them are
    refused, exit 2, every file left as it was."""
    recipe = _recipe(tmp_path, tiny_model_dir)
    sizes = ["--backends", "hf", "--sequences", "2", "--max-tokens", "2"]
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_model.safetensors").write_text("trained")
    (run / "metrics.jsonl").write_text("")
    (run / "config.yaml").write_text("model: {}\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "sequences.json").write_text("mine")
    for folder, message in (
        (run, "is a qerl train run's folder"),
        (other, "holds sequences.json of no bench gap run"),
    ):
        before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
        argv = ["bench", "gap", str(recipe), *sizes, "-o", str(folder)]
        assert main([*argv, "--dry-run"] if dry_run else argv) == 2
        assert message in " ".join(capsys.readouterr().err.split())
        assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before
    assert (run / "adapter" / "adapter_model.safetensors").read_text() == "trained"


def test_an_output_folder_the_system_refuses_is_refused_before_work(tmp_path: Path, monkeypatch: Any) -> None:
    """The permission bits pass for root everywhere (/proc too): the check makes and removes a probe
    folder where the output would go, and a refusal there is the exit-2 error, not an OSError later."""
    import errno

    from qerl_cli import files
    from qerl_cli.errors import QerlError

    real = files.tempfile.mkdtemp

    def refuse(*args: Any, dir: Any = None, **kwargs: Any) -> str:  # noqa: A002 - mkdtemp's own keyword
        if dir is not None and Path(dir) == tmp_path / "ro":
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(files.tempfile, "mkdtemp", refuse)
    (tmp_path / "ro").mkdir()
    with pytest.raises(QerlError, match="ro/out cannot be written: .*ro takes no new folder .Read-only"):
        files.check_writable_folder(tmp_path / "ro" / "out", "--output", "give another")
    assert files.check_writable_folder(tmp_path / "rw" / "out", "--output", "give another") is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]  # the probe left nothing


def test_vllms_share_is_recorded_only_where_a_vllm_engine_runs(tiny_model_dir: Path, tmp_path: Path) -> None:
    from qerl_cli.bench.gap import trainer_figures
    from qerl_cli.bench.gap_trainer import GapSequence, TrainerSide

    side = TrainerSide([GapSequence(0, "p", [1], [2], "stop")], [[-1.0]], None, 0.3, "nvfp4", {})
    cfg = tiny_cfg(tiny_model_dir, tmp_path / "run")
    settings = GapSettings(recipe="tiny", backends=["marlin", "hf"])
    assert trainer_figures(cfg, side, settings).gpu_memory_utilization == 0.3
    hf_alone = replace(settings, backends=["hf"])
    assert trainer_figures(cfg, side, hf_alone).gpu_memory_utilization is None
