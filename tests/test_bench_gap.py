"""``qerl bench gap`` on the CPU: the paired ratio's statistics and verdicts, the trainer side (sequences,
adapter, trainer logprobs) on the tiny model, a backend measured through the engine protocol (the
transformers engine standing in for vLLM's), a vLLM backend's error row where vLLM is absent, the JSON's
shape, and the command's usage errors (exit 2)."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_trainer import tiny_cfg

from qerl_cli.bench import gap_report
from qerl_cli.bench.gap_settings import GapSettings
from qerl_cli.cli import main
from qerl_cli.stats import RatioInterval, mean_interval, paired_ratio_interval, ratio_verdict


# -- statistics -------------------------------------------------------------------------------------
def test_mean_interval_is_students_t() -> None:
    interval = mean_interval([1.0, 2.0, 3.0, 4.0])
    # mean 2.5, sd 1.291, t(0.975, 3) = 3.182: half width 2.054
    assert interval.mean == 2.5 and interval.n == 4
    assert interval.low == pytest.approx(2.5 - 2.0540, abs=1e-3) and interval.high == pytest.approx(
        4.554, abs=1e-3
    )
    with pytest.raises(ValueError, match="2 values"):
        mean_interval([1.0])


def _paired(n: int, scale: float, seed: int = 1) -> tuple[list[float], list[float]]:
    """A reference sample whose values vary a lot between pairs, and another at ``scale`` times it plus
    a little noise of its own: pairing takes the shared variation out of the ratio's interval."""
    rng = random.Random(seed)
    reference = [rng.uniform(0.005, 0.05) for _ in range(n)]
    other = [r * scale * rng.uniform(0.97, 1.03) for r in reference]
    return other, reference


def test_paired_ratio_interval_is_seeded_and_covers_the_ratio() -> None:
    other, reference = _paired(128, 1.05)
    a = paired_ratio_interval(other, reference, seed=3)
    assert a == paired_ratio_interval(other, reference, seed=3)  # deterministic for a seed
    assert a != paired_ratio_interval(other, reference, seed=4)
    assert a.low < a.ratio < a.high and a.ratio == pytest.approx(sum(other) / sum(reference))
    assert a.low > 1.04 and a.high < 1.07 and a.resamples == 2000 and a.n == 128
    with pytest.raises(ValueError, match="undefined"):
        paired_ratio_interval([1.0, 2.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="2 pairs"):
        paired_ratio_interval([1.0], [1.0])


def test_ratio_verdicts_within_outside_and_unresolved() -> None:
    within = ratio_verdict(paired_ratio_interval(*_paired(128, 1.02)), 0.10)
    outside = ratio_verdict(paired_ratio_interval(*_paired(128, 1.30)), 0.10)
    assert (within.verdict, within.text, within.needed) == ("within", "within", None)
    assert (outside.verdict, outside.text) == ("outside", "outside")
    # Straddling 1.1: 1.08 with an upper end at 1.12 needs the upper side 0.04 -> 0.02, four times the pairs.
    unresolved = ratio_verdict(RatioInterval(1.08, 1.04, 1.12, 128, 2000, 0, 0.95), 0.10)
    assert unresolved.verdict == "unresolved" and unresolved.needed == 512
    assert unresolved.text == "unresolved at 128 sequences; about 512 would resolve it"
    above = ratio_verdict(RatioInterval(1.12, 1.09, 1.15, 100, 2000, 0, 0.95), 0.10)
    assert above.verdict == "unresolved" and above.needed == 225  # the lower side, 0.03 -> 0.02
    on_bound = ratio_verdict(RatioInterval(1.1, 1.0, 1.2, 50, 2000, 0, 0.95), 0.10)
    assert on_bound.needed is None and "sits on the bound" in on_bound.text


# -- the trainer side and the backends ------------------------------------------------------------
def standalone_hf(spec: Any) -> Any:
    """A fresh transformers engine over the base and the adapter folder: the stand-in for vLLM's."""
    from qerl_cli.bench import gap_worker
    from qerl_cli.rollout import factory

    m = gap_worker.engine_config(spec).model
    return factory.make_engine(factory.EngineRequest("hf", m.path, adapter=spec.adapter_dir, dtype=m.dtype,
                                                     model_format=m.format, device="cpu"))  # fmt: skip


@pytest.fixture(scope="module")
def gap_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of the benchmark on the tiny model, its recipe sampling at temperature 0.7, top_p 0.95:
    two "vLLM" backends through a seam (a fresh transformers engine adding a seeded numerics error of its
    own to its logprobs), then ``hf``, the trainer side's own engine."""
    from qerl_cli.bench import gap, gap_worker

    out = tmp_path_factory.mktemp("gap")
    (out / "logprobs").mkdir()
    (out / "logprobs" / "fp8.json").write_text("{}")  # an earlier run's, in a reused folder
    (out / "gap.json").write_text('{"schema": "qerl-bench-gap/2"}')  # which it is: its report says so
    cfg = tiny_cfg(tiny_model_dir, out / "run")
    cfg = replace(cfg, rollout=replace(cfg.rollout, temperature=0.7, top_p=0.95))
    settings = GapSettings(
        recipe="tiny", backends=["marlin", "qerl-triton", "hf"], sequences=6, max_tokens=6, output=str(out)
    )
    seen: list[gap_worker.BackendSpec] = []

    def measure(spec: gap_worker.BackendSpec) -> gap_report.BackendResult:
        seen.append(spec)
        result = gap_worker.measure_in_process(spec, standalone_hf)
        rng = random.Random(spec.backend)
        noise = 0.01 if spec.backend == "marlin" else 0.02
        result.logprobs = [[lp + rng.gauss(0.0, noise) for lp in row] for row in result.logprobs or []]
        return result

    report = gap.run_gap(settings, cfg, command="qerl bench gap tiny", measure_backend=measure)
    return {"report": report, "out": out, "specs": seen, "cfg": cfg, "settings": settings}


def test_the_trainer_side_writes_the_sequences_adapter_and_logprobs(gap_run: dict[str, Any]) -> None:
    from qerl_cli.bench.gap_trainer import read_sequences

    out = gap_run["out"]
    sequences = read_sequences(out / "sequences.json")
    trainer = json.loads((out / "trainer_logprobs.json").read_text())["trainer_logprobs"]
    assert len(sequences) == len(trainer) == 6
    for sequence, logprobs in zip(sequences, trainer, strict=True):
        assert 1 <= len(sequence.completion_ids) <= 6 and len(logprobs) == len(sequence.completion_ids)
        assert all(lp <= 0 for lp in logprobs) and sequence.prompt_ids
    assert (out / "adapter" / "adapter_config.json").is_file()
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == gap_run["cfg"].lora.rank  # the recipe's LoRA, not another
    # Every backend gets the same sequences file, the adapter, and the recipe with AQN off.
    specs = gap_run["specs"]
    assert [s.backend for s in specs] == ["marlin", "qerl-triton"]  # hf: the trainer side's
    assert {s.sequences_file for s in specs} == {str(out / "sequences.json")}
    assert all(s.adapter_dir == str(out / "adapter") and s.config["aqn"]["enabled"] is False for s in specs)


def test_the_sequences_are_sampled_with_the_recipes_sampling(gap_run: dict[str, Any]) -> None:
    """Training's own SamplingSpec of the recipe (temperature 0.7 here, top_p, stop strings); only the
    length and the seed are the benchmark's."""
    from qerl_cli.bench.gap_trainer import gap_sampling_spec
    from qerl_cli.rl.rollouts import sampling_spec

    cfg, settings = gap_run["cfg"], gap_run["settings"]
    spec = gap_sampling_spec(cfg, settings)
    assert spec == replace(sampling_spec(cfg, 0, 0), max_new_tokens=6, seed=settings.seed)
    assert (spec.temperature, spec.top_p) == (0.7, 0.95)
    trainer = gap_run["report"].trainer
    assert (trainer.sample_temperature, trainer.score_temperature) == (0.7, 1.0)


def test_hf_is_the_trainer_sides_engine_and_every_side_scores_at_temperature_1(
    gap_run: dict[str, Any],
) -> None:
    """The hf row is training's transformers engine over the live policy: its logprobs (raw log-softmax,
    temperature 1) are the trainer's, which are at temperature 1 too though the recipe samples at 0.7;
    a fresh load without the adapter does not give them."""
    from qerl_cli.bench import gap_worker

    out = gap_run["out"]
    trainer = json.loads((out / "trainer_logprobs.json").read_text())["trainer_logprobs"]
    hf = json.loads((out / "logprobs" / "hf.json").read_text())["logprobs"]
    flat = [abs(a - b) for ra, rb in zip(hf, trainer, strict=True) for a, b in zip(ra, rb, strict=True)]
    assert max(flat) < 1e-4
    row = gap_run["report"].rows[2]
    assert row.backend == "hf" and row.linear_backend == "trainer" and row.load_seconds == 0.0
    spec = replace(gap_run["specs"][0], adapter_dir=None)
    base = gap_worker.measure_backend(spec, lambda s: standalone_hf(replace(s, adapter_dir=None)))
    moved = [
        abs(a - b)
        for ra, rb in zip(base.logprobs or [], trainer, strict=True)
        for a, b in zip(ra, rb, strict=True)
    ]
    assert max(moved) > 1e-4  # the random adapter does work: B is not zero


def test_the_report_json_and_markdown(gap_run: dict[str, Any]) -> None:
    from qerl_cli.bench.gap import read_gap_report

    out = gap_run["out"]
    data = json.loads((out / "gap.json").read_text())
    assert list(data)[:6] == ["schema", "command", "created", "device", "gpu", "versions"]
    assert data["schema"] == gap_report.SCHEMA == "qerl-bench-gap/2" and data["device"] == "cpu"
    assert (
        data["settings"]["backends"] == ["marlin", "qerl-triton", "hf"] and "output" not in data["settings"]
    )
    trainer = data["trainer"]
    assert trainer["sequences"] == 6 and trainer["tokens"] > 0
    assert trainer["sample_temperature"] == 0.7 and trainer["score_temperature"] == 1.0
    first, second, hf = data["rows"]
    assert first["engine_gap"] is None and second["engine_gap"] > 0  # engine vs engine: after the first
    for row in (first, second):
        assert row["error"] is None and len(row["sequence_gaps"]) == 6
        assert row["mean_gap_low"] < row["mean_gap"] < row["mean_gap_high"]
        assert row["max_token_gap"] >= row["max_sequence_gap"] >= row["mean_gap"] > 0
        assert row["tokens"] == trainer["tokens"]
    assert hf["error"] is None and hf["mean_gap"] < 1e-4  # the floor
    ratio, floor = data["ratios"]
    assert ratio["backend"] == "qerl-triton" and ratio["reference"] == "marlin" and ratio["margin"] == 0.10
    assert ratio["low"] < ratio["ratio"] < ratio["high"] and ratio["ratio"] > 1.1
    assert ratio["verdict"] in ("outside", "unresolved") and ratio["verdict_text"]
    assert floor["backend"] == "hf" and floor["verdict"] == "within"
    # The earlier run's fp8.json is gone: only this run's backends' logprobs.
    assert sorted(p.name for p in (out / "logprobs").iterdir()) == [
        "hf.json",
        "marlin.json",
        "qerl-triton.json",
    ]
    written = {k: data[k] for k in ("host_load", "host_busy", "host_busy_reason")}
    assert read_gap_report(out).to_dict() == {**gap_run["report"].to_dict(), **written}
    markdown = (out / "gap.md").read_text()
    assert "| hf | trainer |" in markdown and "(reference)" in markdown and ratio["verdict_text"] in markdown
    assert "sampled at temperature 0.7, scored at temperature 1 on every side" in markdown


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: about 7 s on 2 cores
def test_a_backend_in_a_child_process_reads_the_spec_and_returns_its_result(
    gap_run: dict[str, Any], tmp_path: Path
) -> None:
    """The child-process path every vLLM backend takes (``python -m qerl_cli.bench.gap_worker``): the
    recipe goes through JSON and back, and the engine's refusal on this CPU machine (no vLLM, or no GPU)
    comes back as the backend's typed error result."""
    from qerl_cli.bench import gap_worker

    spec = replace(gap_run["specs"][0], work_dir=str(tmp_path / "engine"))
    isolated = gap_worker.measure_isolated(spec)
    assert isinstance(isolated, gap_report.BackendResult)
    assert isolated.backend == "marlin" and isolated.error and isolated.logprobs is None


def test_a_failed_backend_is_a_row_with_its_reason() -> None:
    result = gap_report.BackendResult
    rows = gap_report.build_rows(
        [result("marlin", error="vLLM is not installed"), result("hf", "trainer", logprobs=[[-1.0], [-2.0]])],
        [[-1.1], [-2.2]],
    )
    assert rows[0].error == "vLLM is not installed" and rows[0].mean_gap is None
    assert rows[1].mean_gap == pytest.approx(0.15) and rows[1].engine_gap is None  # no first to compare with
    assert gap_report.build_ratios(rows, 0.1, 0) == []  # the reference failed: no ratio
    assert "failed: vLLM is not installed" in gap_report.gap_markdown(
        gap_report.GapReport(
            {},
            {"backends": ["marlin", "hf"], "adapter": "none", "margin": 0.1},
            gap_report.TrainerFigures(),
            rows,
        )
    )


def test_logprobs_of_the_wrong_shape_are_that_backends_error_row() -> None:
    """A backend returning too few sequences or tokens is an error row naming the mismatch; the run goes
    on, and a first backend so failed is no engine-vs-engine reference."""
    result = gap_report.BackendResult
    trainer = [[-1.1, -0.5], [-2.2]]
    rows = gap_report.build_rows(
        [
            result("marlin", "marlin", logprobs=[[-1.0, -0.4], [-2.0, -3.0]]),
            result("fp8", "fp8", logprobs=[[-1.0, -0.4]]),
            result("hf", "trainer", logprobs=[[-1.0, -0.4], [-2.0]]),
        ],
        trainer,
    )
    assert (
        rows[0].error == "logprobs of the wrong shape: sequence 1: 2 completion logprobs, the trainer has 1"
    )
    assert rows[1].error == "logprobs of the wrong shape: 1 sequences scored, the trainer has 2"
    assert rows[2].error is None and rows[2].mean_gap == pytest.approx(0.15) and rows[2].engine_gap is None


def test_an_unresolved_verdict_just_off_the_bound_caps_its_count() -> None:
    from qerl_cli.stats import NEEDED_CAP

    verdict = ratio_verdict(RatioInterval(1.1 + 1e-12, 1.0, 1.2, 128, 2000, 0, 0.95), 0.10)
    assert verdict.verdict == "unresolved" and verdict.needed == NEEDED_CAP + 1
    assert verdict.text == f"unresolved at 128 sequences; more than {NEEDED_CAP} would resolve it"


def test_a_vllm_backend_without_vllm_is_an_error_row(
    gap_run: dict[str, Any], hide_packages: Any, tmp_path: Path
) -> None:
    from qerl_cli.bench import gap, gap_worker

    hide_packages("vllm")
    spec = replace(gap_run["specs"][1], backend="marlin", work_dir=str(tmp_path / "engine"))
    assert gap.backend_unavailable("marlin") is not None
    assert "vLLM is not installed" in (gap.measure(spec).error or "")
    # The worker itself, as the child process runs it, writes the engine's refusal as the row's error.
    (tmp_path / "spec.json").write_text(json.dumps(gap_worker.asdict(spec)))
    assert gap_worker.main([str(tmp_path / "spec.json"), str(tmp_path / "out.json")]) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["backend"] == "marlin" and result["error"]


# -- the command --------------------------------------------------------------------------------------
def _recipe(tmp_path: Path, model_dir: Path) -> Path:
    from qerl_cli.config.loading import dump_yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(dump_yaml(tiny_cfg(model_dir, tmp_path / "run")))
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backends", "marlin,cutlass"], "unknown backend(s) cutlass"),
        (["--backends", ","], "--backends needs one backend"),
        (["--backends", "marlin,marlin"], "names a backend twice"),
        (["--sequences", "1"], "--sequences must be 2 or more"),
        (["--max-tokens", "0"], "--max-tokens must be a positive integer"),
        (["--adapter", "zeros"], "--adapter takes random or none"),
        (["--margin", "-0.1"], "--margin must be 0 or more"),
    ],
)
def test_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    rc = main(["bench", "gap", str(_recipe(tmp_path, tiny_model_dir)), *args, "-o", str(tmp_path / "out")])
    assert rc == 2 and message in capsys.readouterr().err.replace("\n", " ")


def test_device_cuda_without_a_gpu_exits_2_before_any_work(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.bench import preflight

    monkeypatch.setattr(preflight, "gpu_available", lambda: False)
    recipe = _recipe(tmp_path, tiny_model_dir)
    rc = main(
        ["bench", "gap", str(recipe), "--backends", "hf", "--device", "cuda", "-o", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err.replace("\n", " ")
    assert rc == 2 and "--device=cuda but this machine has no CUDA GPU; use --device=cpu or auto" in err, err
    assert not (tmp_path / "out").exists()


def test_more_sequences_than_prompts_exits_2_before_the_policy_is_built(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.bench import gap_trainer

    def no_policy(cfg: Any) -> Any:
        raise AssertionError("the policy was built before the prompt count was checked")

    monkeypatch.setattr(gap_trainer, "build_policy", no_policy)
    recipe = _recipe(tmp_path, tiny_model_dir)
    args = ["--backends", "hf", "--sequences", "100000", "--device", "cpu", "-o", str(tmp_path / "out")]
    rc = main(["bench", "gap", str(recipe), *args])
    err = capsys.readouterr().err.replace("\n", " ")
    assert rc == 2 and "--sequences 100000: the recipe's training data has" in err and "or fewer" in err


def test_a_missing_recipe_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(
        ["bench", "gap", str(tmp_path / "nosuch.yaml"), "--backends", "hf", "-o", str(tmp_path / "out")]
    )
    assert rc == 2 and "nosuch.yaml" in capsys.readouterr().err


def test_dry_run_prints_the_recipe_and_the_settings(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    rc = main(["bench", "gap", str(recipe), "--backends", "hf", "--set", "lora.rank=8", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "rank: 8" in out and "# backends: ['hf']" in out and "# sequences: 128" in out


def test_the_command_runs_on_the_cpu_with_the_hf_engine(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--backends hf`` runs end to end on the CPU; a vLLM backend that passed the checks before work
    (vLLM and a GPU found) but fails at run time is a failed row and exit 1 (one that cannot run here is
    refused before work: test_bench_gap_checks). The prompts are loaded and rendered once: the check
    before work takes them and the run reuses them."""
    from qerl_cli.bench import gap, gap_worker

    monkeypatch.setattr(gap, "vllm_available", lambda: True)
    monkeypatch.setattr(gap, "gpu_available", lambda: True)
    monkeypatch.setattr(gap, "measure_isolated", lambda spec: gap_worker.error_result(spec, "engine died"))
    renders: list[int] = []
    real_chosen = gap.chosen_prompts

    def counted(cfg: Any, count: int) -> Any:
        renders.append(count)
        return real_chosen(cfg, count)

    monkeypatch.setattr(gap, "chosen_prompts", counted)
    recipe = _recipe(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    sizes = ["--sequences", "3", "--max-tokens", "4", "--adapter", "none"]
    rc = main(["bench", "gap", str(recipe), "--backends", "hf,marlin", *sizes, "-o", str(out)])
    printed = capsys.readouterr().out
    assert rc == 1 and "| hf | trainer |" in printed and "failed: engine died" in printed
    assert "No ratios: the reference, marlin, failed." in printed  # hf first: marlin is the reference
    assert "Ratio: to marlin's gap" in printed
    names = ["gap.json", "gap.md", "sequences.json", "trainer_logprobs.json", "logprobs/"]
    assert f"wrote {', '.join(str(out / n) for n in names)}" in " ".join(printed.split())
    data = json.loads((out / "gap.json").read_text())
    assert data["settings"]["adapter"] == "none" and data["trainer"]["adapter_dir"] is None
    assert data["trainer"]["gpu_memory_utilization"] is not None  # a vLLM backend was asked for
    assert data["rows"][0]["mean_gap"] < 1e-4 and data["rows"][1]["error"] and data["ratios"] == []
    assert not (out / "adapter").exists()
    assert renders == [3]
