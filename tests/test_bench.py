"""``qerl bench rollout`` / ``e2e`` on CPU: the tiny shape end to end with the HF engine, bench.json's
schema, the regression gate, the Markdown summary, exact-length prompts, the random LoRA adapter and
the GRPO step. The other subcommands: tests/test_bench_commands.py."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from qerl_cli.bench import bench_table, gate_failures, run_bench
from qerl_cli.bench.adapter import write_random_lora
from qerl_cli.bench.gate import check_regressions
from qerl_cli.bench.memory import checkpoint_tensor_bytes
from qerl_cli.bench.report import to_markdown, write_markdown
from qerl_cli.bench.result import SCHEMA, BenchResult, read_report
from qerl_cli.bench.rollout import PromptMaker
from qerl_cli.config import BenchConfig, TrainConfig, load_config
from qerl_cli.errors import QerlError

FORMATS = ["bf16", "nvfp4"]
BATCHES = [1, 2]
RANK = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models on shared cores: thread oversubscription makes them 10x slower, not faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qerl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QERL_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def bench_run(cache_dir, tmp_path_factory) -> tuple[BenchResult, Path]:
    out = tmp_path_factory.mktemp("bench-out")
    cfg = BenchConfig(
        model="tiny",
        formats=FORMATS,
        batch=BATCHES,
        prompt_len=8,
        gen_len=3,
        lora_rank=RANK,
        engine="hf",
        output=str(out),
    )
    return run_bench(cfg), out


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    from qerl_cli.modeling.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


# --------------------------------------------------------------------------------------------
# End to end on the tiny shape
# --------------------------------------------------------------------------------------------
def test_tiny_shape_end_to_end_writes_every_figure(bench_run):
    report, out = bench_run
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk["schema"] == SCHEMA
    sections = ("machine", "gpu", "versions", "settings", "device", "figures_label", "rollout", "memory")
    assert set(sections) <= set(on_disk) and on_disk["e2e"] is None
    assert on_disk["device"] == ("gpu" if torch.cuda.is_available() else "cpu")
    assert on_disk["versions"]["torch"] and on_disk["versions"]["transformers"]
    settings = on_disk["settings"]
    assert settings["model"] == "tiny" and settings["engine"] == "hf"
    # Sampled as the shipped recipes' rollouts are (no nucleus: vLLM's top-p sampler is not a rollout's cost).
    recipe = load_config(TrainConfig, "gsm8k_7b").rollout
    assert (settings["temperature"], settings["top_p"]) == (recipe.temperature, recipe.top_p) == (1.0, 1.0)
    assert settings["ignore_eos"] is True

    keys = {(r["format"], r["lora_rank"], r["batch"]) for r in on_disk["rollout"]}
    assert keys == {(f, r, b) for f in FORMATS for r in (0, RANK) for b in BATCHES}
    for row in on_disk["rollout"]:
        assert row["output_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
        assert row["decode_ms_per_token"] >= 0
        assert len(row["generate_s"]) == 3 and len(row["prefill_s"]) == 3
        assert row["generate_s_median"] == sorted(row["generate_s"])[1]
        # Throughput is exactly batch x gen_len tokens over the median time.
        assert row["output_tokens_per_s"] == pytest.approx(row["batch"] * 3 / row["generate_s_median"])
        if row["format"] == "bf16":
            assert row["speedup_vs_bf16"] == 1.0

    memory = {(r["format"], r["lora_rank"]): r for r in on_disk["memory"]}
    assert set(memory) == {(f, r) for f in FORMATS for r in (0, RANK)}
    for row in memory.values():
        assert row["method"].startswith("cpu-rss") or row["method"].startswith("torch.cuda")
        assert row["peak_allocated_bytes"] > 0 and row["kv_cache_bytes"] > 0
    # Packed 4-bit linears hold fewer bytes than BF16; the adapter adds bytes.
    assert memory[("nvfp4", 0)]["weight_bytes"] < memory[("bf16", 0)]["weight_bytes"]
    assert memory[("bf16", RANK)]["weight_bytes"] > memory[("bf16", 0)]["weight_bytes"]
    assert memory[("nvfp4", 0)]["checkpoint_bytes"] < memory[("bf16", 0)]["checkpoint_bytes"]
    # Where the wall clock went (a CI budget): every format timed, the parts within the total.
    timings = on_disk["timings"]
    assert list(timings["formats_s"]) == FORMATS and timings["e2e_s"] is None
    parts = timings["checkpoints_s"] + sum(timings["formats_s"].values())
    assert 0 < parts <= timings["total_s"] and all(t > 0 for t in timings["formats_s"].values())


def test_table_and_markdown_show_speedups_and_label_cpu_figures(bench_run):
    report, out = bench_run
    console = Console(record=True, width=200)
    console.print(bench_table(report))
    text = console.export_text()
    assert "vs BF16" in text and "nvfp4" in text and "Memory" in text
    markdown = (out / "bench.md").read_text()
    assert markdown == to_markdown(report)
    assert "| format | LoRA | batch | output tok/s | vs BF16 |" in markdown
    assert "| nvfp4 | r4 | 2 |" in markdown
    assert f"Wall clock: {report.timings.total_s:.0f} s (random checkpoints" in markdown
    if report.device == "cpu":
        assert "CPU figures" in text and "CPU figures" in markdown


def test_markdown_goes_to_github_step_summary(bench_run, tmp_path, monkeypatch):
    report, _ = bench_run
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    write_markdown(report, tmp_path)
    text = summary.read_text()
    assert text.startswith("earlier step\n")  # appended, not overwritten
    assert "### Rollout throughput" in text and "### Memory" in text


def test_charts_are_written_when_matplotlib_is_present(bench_run):
    pytest.importorskip("matplotlib")
    report, out = bench_run
    assert {Path(p).name for p in report.files.charts} == {"throughput.png", "memory.png"}
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------
# Regression gate
# --------------------------------------------------------------------------------------------
def _row(report: BenchResult, section: str, **match) -> dict:
    rows = report.rollout if section == "rollout" else report.memory
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


def test_the_report_is_bench_json_key_for_key(bench_run):
    """bench.json is read by other tools and committed: the typed report writes and reads it unchanged."""
    report, out = bench_run
    on_disk = json.loads((out / "bench.json").read_text())
    assert json.dumps(report.to_dict()) == json.dumps(on_disk)  # same keys, same order, same values
    assert read_report(out) == report and json.dumps(read_report(out).to_dict()) == json.dumps(on_disk)
    assert list(on_disk) == [
        "schema", "created", "device", "figures_label", "host_busy", "host_busy_reason", "machine",
        "host_load", "gpu", "versions", "settings", "rollout", "memory", "e2e", "regression", "errors",
        "timings", "files",
    ]  # fmt: skip
    # While measuring, the file says it is not complete yet (and has no timings or files).
    partial = dataclasses.replace(report, complete=False, timings=None, files=None).to_dict()
    assert list(partial)[-2:] == ["errors", "complete"] and partial["complete"] is False


def test_committed_bench_reports_read_back_key_for_key():
    """Every bench.json kept in benchmarks/ (each of its qerl version's layout) round-trips exactly."""
    files = (Path(__file__).resolve().parents[1] / "benchmarks").rglob("*.json")
    found = {path: json.loads(path.read_text()) for path in files}
    reports = {
        path: data for path, data in found.items() if isinstance(data, dict) and data.get("schema") == SCHEMA
    }
    assert len(reports) >= 5
    for path, data in reports.items():
        assert json.dumps(read_report(path).to_dict()) == json.dumps(data), path


def test_gate_passes_against_itself(bench_run):
    report, _ = bench_run
    outcome = check_regressions(report, copy.deepcopy(report), tolerance=0.1)
    assert outcome.passed and outcome.failures == [] and outcome.compared > 0


def test_gate_names_a_throughput_drop_and_a_memory_rise(bench_run):
    report, _ = bench_run
    baseline = copy.deepcopy(report)
    _row(baseline, "rollout", format="nvfp4", lora_rank=0, batch=2)["output_tokens_per_s"] *= 1.5
    _row(baseline, "memory", format="bf16", lora_rank=RANK)["peak_allocated_bytes"] /= 2
    # Within tolerance: a 5% faster baseline is not a regression.
    _row(baseline, "rollout", format="bf16", lora_rank=0, batch=1)["prefill_tokens_per_s"] *= 1.05
    failures = check_regressions(report, baseline, tolerance=0.1).failures
    assert len(failures) == 2, failures
    drop = next(f for f in failures if "output_tokens_per_s" in f)
    assert "nvfp4" in drop and "batch=2" in drop and "dropped 33.3%" in drop
    rise = next(f for f in failures if "peak_allocated_bytes" in f)
    assert "bf16" in rise and f"lora_rank={RANK}" in rise and "rose 100.0%" in rise


def test_gate_fails_when_a_baseline_case_fails_now(bench_run):
    """A format that worked in the baseline and errors now (vLLM cannot serve it any more) must not
    pass the gate just because its rows are missing."""
    report, _ = bench_run
    broken = copy.deepcopy(report)
    broken.rollout = [r for r in broken.rollout if r["format"] != "nvfp4"]
    broken.memory = [r for r in broken.memory if r["format"] != "nvfp4"]
    broken.errors = [{"format": "nvfp4", "lora_rank": 0, "error": "Marlin kernel crashed"}]
    broken.e2e = [{"format": "nvfp4", "error": "out of memory"}]
    baseline = dataclasses.replace(copy.deepcopy(report), e2e=[{"format": "nvfp4", "step_s": 1.0}])
    outcome = check_regressions(broken, baseline, tolerance=0.1)
    assert not outcome.passed
    assert any("nvfp4 LoRA none" in f and "Marlin kernel crashed" in f for f in outcome.failures)
    assert any("e2e nvfp4" in f and "out of memory" in f for f in outcome.failures)
    # Not asked for now (no error) is not a failure: a run may bench a subset of the formats.
    subset = dataclasses.replace(broken, errors=[], e2e=None)
    assert check_regressions(subset, baseline, tolerance=10.0).passed


def test_gate_refuses_a_baseline_of_other_settings(bench_run):
    report, _ = bench_run
    baseline = copy.deepcopy(report)
    baseline.settings["gen_len"] = 2048
    with pytest.raises(QerlError, match="gen_len"):
        check_regressions(report, baseline, tolerance=0.1)
    # A baseline from before one vLLM engine served both LoRA cases, or of another e2e step shape.
    for name, value in (("one_engine_per_format", None), ("e2e_shape", {"prompts_per_step": 16})):
        with pytest.raises(QerlError, match=name):
            other = dataclasses.replace(baseline, settings={**report.settings, name: value})
            check_regressions(report, other, 0.1)
    with pytest.raises(QerlError, match="no measurement"):
        empty = dataclasses.replace(copy.deepcopy(report), rollout=[], memory=[], e2e=None)
        check_regressions(report, empty, 0.1)


def test_run_bench_with_baseline_reports_failures(cache_dir, bench_run, tmp_path):
    report, _ = bench_run
    baseline = copy.deepcopy(report)
    for row in baseline.rollout:
        row["output_tokens_per_s"] *= 100  # an impossibly fast baseline: every row regresses
    baseline_file = tmp_path / "baseline.json"
    baseline_file.write_text(json.dumps(baseline.to_dict()))
    cfg = BenchConfig(
        model="tiny",
        formats=["bf16"],
        batch=[1],
        prompt_len=8,
        gen_len=3,
        lora_rank=0,
        engine="hf",
        output=str(tmp_path / "out"),
        baseline=str(baseline_file),
        tolerance=0.1,
    )
    fresh = run_bench(cfg)
    failures = gate_failures(fresh)
    # CPU timings are noisy, so other figures may fail too; this one must.
    assert any("output_tokens_per_s dropped" in f and "format=bf16" in f and "batch=1" in f for f in failures)
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["regression"]["passed"] is False


def test_bad_baseline_and_settings_are_user_errors(tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_text('{"schema": "something-else"}')
    with pytest.raises(QerlError, match="not a qerl bench report"):
        run_bench(BenchConfig(model="tiny", engine="hf", baseline=str(bad), output=str(tmp_path)))
    with pytest.raises(QerlError, match="repeats"):
        run_bench(BenchConfig(model="tiny", engine="hf", repeats=2, output=str(tmp_path)))
    with pytest.raises(QerlError, match="unknown format"):
        run_bench(BenchConfig(model="tiny", engine="hf", formats=["int3"], output=str(tmp_path)))


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------
def _merging_tokenizer():
    """A BPE tokenizer with merges, where decode -> encode does not round-trip token by token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["the cat sat on the mat and the rat ate the hat", "four plus five is nine, nine minus two"] * 50
    backend.train_from_iterator(corpus, trainer)
    from tokenizers import decoders

    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.mark.parametrize("length", [1, 7, 64])
def test_prompts_have_exactly_the_requested_token_count(length):
    from qerl_cli.modeling.tiny import build_tokenizer

    for tokenizer in (build_tokenizer(), _merging_tokenizer()):
        maker = PromptMaker(tokenizer, seed=3)
        prompts = maker.batch(5, length, seed=1)
        assert len(set(prompts)) > 1 or length == 1
        for text in prompts:
            assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == length
        assert maker.batch(5, length, seed=1) == prompts  # seeded


def test_prompts_stay_inside_a_smaller_model_vocabulary():
    from qerl_cli.modeling.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    maker = PromptMaker(tokenizer, vocab_size=100)
    ids = tokenizer(maker.batch(4, 32, seed=0)[0], add_special_tokens=False)["input_ids"]
    assert max(ids) < 100 and max(maker.pool) < 100


def test_random_lora_loads_in_peft_and_changes_the_output(tiny_folder, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = write_random_lora(tiny_folder, tmp_path / "lora", rank=RANK, seed=1)
    base = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    ids = torch.tensor([[72, 105, 33, 10]])
    with torch.no_grad():
        plain = base(ids).logits
        model = PeftModel.from_pretrained(base, str(adapter))
        adapted = model(ids).logits
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["peft_type"] == "LORA"
    assert len(config["target_modules"]) == 7
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(bool(p.abs().sum() > 0) for p in lora_b)  # B is not PEFT's zero init
    assert not torch.allclose(plain, adapted)


def test_checkpoint_bytes_are_read_from_the_headers(tiny_folder):
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_folder / "model.safetensors"))
    assert checkpoint_tensor_bytes(tiny_folder) == sum(t.numel() * t.element_size() for t in tensors.values())


def test_e2e_splits_a_grpo_step_into_phases(tiny_folder, tmp_path, monkeypatch):
    from qerl_cli.bench import e2e
    from qerl_cli.bench.e2e import run_e2e
    from qerl_cli.bench.e2e_backends import e2e_pairs
    from qerl_cli.bench.gpuclocks import GpuReading
    from qerl_cli.bench.gpusampler import SampledClocks
    from qerl_cli.bench.hostload import HostProbes, start_host_load
    from qerl_cli.bench.settings import E2EConfig

    cfg = E2EConfig(
        model=str(tiny_folder),
        formats=["bf16"],
        batch=[2],
        prompt_len=8,
        gen_len=4,
        lora_rank=RANK,
        generations=2,
    )
    after: list[int] = []  # the report's host load and GPU clocks are sampled after every pair
    pairs = e2e_pairs(cfg, "hf", ["bf16"]).pairs
    # The timed steps' sampler (a stand-in), started 11 s into the run: one busy reading 2 s later.
    busy = GpuReading(2.0, 1755, 1980, 70, 600.0, 700.0, 99, [])
    sampled = SimpleNamespace(record=lambda: SampledClocks(51.0, [busy]))
    monkeypatch.setattr(e2e, "case_clock_sampler", lambda: contextlib.nullcontext(sampled))
    host = start_host_load(HostProbes(clock=lambda: 40.0, gpu_clocks=lambda: "no reading"))
    (row,) = run_e2e(cfg, pairs, {"bf16": tiny_folder}, "hf", tmp_path, lambda: after.append(len(after)),
                     host)  # fmt: skip
    assert "error" not in row, row.get("error")
    assert after == [0]
    # The row keeps the summary; its readings moved to the run's, at their time in the run.
    assert row["gpu_clocks"]["sm_mhz_median"] == 1755.0 and "gpu_clock_readings" not in row
    assert [(r.sm_mhz, r.elapsed_s) for r in host.gpu_clocks.readings] == [(1755, 13.0)]
    assert row["format"] == "bf16" and row["steps_timed"] == 3 and row["sequences_per_step"] == 4
    # The HF engine has no linear backends: one pair, auto, run on the trainer's own layers.
    assert (row["backend"], row["linear_backend"]) == ("auto", "trainer")
    assert (tmp_path / "e2e" / "bf16").is_dir()  # one pair for the format: its run folder keeps its name
    assert row["generation_s"] > 0 and row["update_s"] > 0
    assert row["logprobs_s"] >= 0 and row["sync_s"] >= 0 and row["other_s"] >= 0
    # The median step's own parts, each counted once: with "other" they are the step.
    from qerl_cli.bench.report import E2E_PHASES

    assert sum(row[p] for p in E2E_PHASES) == pytest.approx(row["step_s"])
    assert row["other_s"] < 0.5 * row["step_s"]  # the bookkeeping, not a phase left out
    timed = row["steps"][cfg.warmup :]
    assert row["step_s"] in [s["time_step_s"] for s in timed]
    # Every timed step's rollout speed, beside the median step's parts.
    from qerl_cli.bench.e2e_notes import RATES_KEY, SPREAD_KEY, rate_spread

    rates = [s["rollout_tokens_per_s"] for s in timed]
    assert row[RATES_KEY] == rates and len(rates) == 3 and row[SPREAD_KEY] == rate_spread(rates)


def test_e2e_shape_flags_and_recipe_reach_the_trainer_and_a_failed_step_exits_1(
    cache_dir, tmp_path, monkeypatch, capsys
):
    from qerl_cli.cli import main
    from qerl_cli.rl import trainer as trainer_module

    seen = []

    class OutOfMemoryTrainer:
        def __init__(self, cfg, **kwargs):
            seen.append(cfg)
            raise RuntimeError("CUDA Error: out of memory at wake_up")

    monkeypatch.setattr(trainer_module, "Trainer", OutOfMemoryTrainer)
    import yaml

    # A shipped recipe with values no default has, so each assert below can only pass if it came from it.
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "gsm8k_7b.yaml"
    data = yaml.safe_load(recipe.read_text())
    data["rollout"].update(num_generations=6, gpu_memory_utilization=0.25)
    data["train"].update(micro_batch_size=3, gradient_checkpointing=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    rc = main(
        [
            "bench",
            "e2e",
            "--model",
            "tiny",
            "--engine",
            "hf",
            "--formats",
            "bf16",
            "--lora-rank",
            "0",
            "--prompt-len",
            "8",
            "--gen-len",
            "3",
            "--recipe",
            str(recipe),
            "--prompts-per-step",
            "3",
            "-o",
            str(tmp_path / "out"),
        ]
    )
    captured = capsys.readouterr()
    err = captured.err
    assert rc == 1 and "failed" in err and "e2e bf16" in err and "out of memory at wake_up" in err
    (cfg,) = seen
    # Flags given win; the recipe gives the rest of the shape and its memory settings.
    assert (cfg.train.prompts_per_step, cfg.rollout.max_completion_length) == (3, 3)
    assert cfg.rollout.num_generations == 6  # the recipe's
    assert cfg.rollout.max_prompt_length == 8 + 64
    assert (cfg.train.micro_batch_size, cfg.train.gradient_checkpointing) == (3, False)
    assert cfg.rollout.gpu_memory_utilization == 0.25  # the recipe's share
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["settings"]["e2e_shape"]["prompts_per_step"] == 3
    assert report["timings"]["e2e_s"] > 0 and "Wall clock:" in captured.out and "e2e " in captured.out


def test_e2e_config_without_a_recipe_pads_prompts_and_takes_the_flags():
    from qerl_cli.bench.e2e import e2e_train_config, filler_system_prompt
    from qerl_cli.bench.settings import E2EConfig

    cfg = E2EConfig(batch=[2, 8], prompt_len=256, gen_len=2048, generations=4, prompts_per_step=16,
                    gpu_memory_utilization="auto")  # fmt: skip
    train = e2e_train_config(cfg, "model", "vllm", "out")
    assert (train.train.prompts_per_step, train.rollout.num_generations) == (16, 4)
    assert train.rollout.gpu_memory_utilization == "auto" and train.rollout.max_completion_length == 2048
    assert len(train.data.system_prompt) == 256 - 48 and filler_system_prompt(40) is None
    assert e2e_train_config(E2EConfig(batch=[2, 8]), "m", "vllm", "o").train.prompts_per_step == 8


def test_e2e_filler_is_sized_in_the_models_own_tokens():
    """A BPE tokenizer packs several characters per token: the filler must be longer to reach the length."""
    from qerl_cli.bench.e2e import QUESTION_ALLOWANCE, filler_system_prompt

    tokenizer = _merging_tokenizer()
    filler = filler_system_prompt(256, tokenizer)
    tokens = len(tokenizer(filler, add_special_tokens=False)["input_ids"])
    assert abs(tokens - (256 - QUESTION_ALLOWANCE)) <= 8, tokens
    assert len(filler) > 256 - QUESTION_ALLOWANCE  # longer than the byte-level (characters) filler


def test_vllm_bench_starts_one_engine_per_format_hf_one_per_case(tmp_path):
    from qerl_cli.bench.run import _cases

    cfg = BenchConfig(batch=[2, 8])
    (shared,) = _cases(cfg, "vllm", "nvfp4", tmp_path, [0, 16], tmp_path / "lora", {})
    assert shared.phases() == [0, 16] and shared.lora_dir == str(tmp_path / "lora")
    # Only the batches measured get CUDA graphs (vLLM captures up to 2 x max_num_seqs); a user's wins.
    assert shared.vllm_kwargs == {"max_num_seqs": 8}
    cfg = BenchConfig(batch=[2, 8], vllm_kwargs={"max_num_seqs": 64, "attention_backend": "TRITON_ATTN"})
    (shared,) = _cases(cfg, "vllm", "nvfp4", tmp_path, [0, 16], tmp_path / "lora", {})
    assert shared.vllm_kwargs == {"max_num_seqs": 64, "attention_backend": "TRITON_ATTN"}
    plain, lora = _cases(cfg, "hf", "nvfp4", tmp_path, [0, 16], tmp_path / "lora", {})
    assert (plain.phases(), plain.lora_dir, lora.phases()) == ([0], None, [16])


class _LengthRecorder:
    """An engine that returns exactly what was asked for and remembers each call's length."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.phases: list[str] = []  # the training phase each call ran in (qerl_cli.rl.phase)

    def generate(self, prompts, n, spec):
        from qerl_cli.rl.phase import phase_state
        from qerl_cli.rollout.base import Completion, RolloutResult

        self.lengths.append(spec.max_new_tokens)
        self.phases.append(phase_state()[0])
        done = [
            [Completion([1] * spec.max_new_tokens, "", [0.0] * spec.max_new_tokens, "length")]
            for _ in prompts
        ]
        return RolloutResult([[7] * 16 for _ in prompts], done)


def test_warm_up_is_short_and_every_timed_pass_is_full_length() -> None:
    from qerl_cli.bench.rollout import WARMUP_TOKENS, RolloutSettings, measure_batch
    from qerl_cli.modeling.tiny import build_tokenizer

    engine = _LengthRecorder()
    maker = PromptMaker(build_tokenizer(), seed=0)
    row = measure_batch(engine, maker, 2, RolloutSettings(prompt_len=16, gen_len=2048, warmup=1, repeats=3))
    # warm-up (short, then a prefill), then three (full, prefill) pairs
    assert engine.lengths == [WARMUP_TOKENS, 1, 2048, 1, 2048, 1, 2048, 1]
    # The timed full passes are a rollout to the GPU sampler, as training's generations are; the rest not.
    assert engine.phases == ["other", "other", "rollout", "other", "rollout", "other", "rollout", "other"]
    assert len(row["generate_s"]) == 3 and row["output_tokens_per_s"] > 0
    engine = _LengthRecorder()
    measure_batch(engine, maker, 2, RolloutSettings(prompt_len=16, gen_len=8, warmup=1, repeats=3))
    assert engine.lengths[0] == 8  # never longer than the measured generation
