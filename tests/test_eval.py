"""``run_eval`` end to end: fixture files, a scripted engine, the real HF engine on the tiny model."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from rich.console import Console

from qerl_cli.config import EvalConfig
from qerl_cli.data.prompts import template_hash
from qerl_cli.evaluation import EvalResult, eval_table, run_eval
from qerl_cli.evaluation import run as run_module
from qerl_cli.modeling.tiny import build_tokenizer
from qerl_cli.rewards import Grader
from qerl_cli.rollout.base import Completion, RolloutResult, SamplingSpec

# question -> (gold, scripted completions for the n=4 samples, finish reasons)
MATH_FIXTURE = {
    "Tom has 3 apples and buys 9 more. How many apples?": (
        "3 + 9 = 12\n#### 12",
        ["<think>3+9</think><answer>12</answer>", "<answer>1</answer>", "\\boxed{12}", "The answer is 12."],
    ),
    "A bike costs 1,250 dollars. Two bikes cost?": (
        "#### 2,500",
        ["<answer>2,500</answer>", "<answer>$2500$</answer>", "<answer>250</answer>", "I am not sure"],
    ),
    "What fraction of the cake is left?": (
        "#### 0.5",
        ["<answer>\\frac{1}{2}</answer>", "<answer>1/2</answer>", "so \\boxed{\\dfrac12}", "<think>hmm"],
    ),
}
TRUNCATED = "<think>hmm"
CUSTOM_FIXTURE = {
    "What percent is 1 of 4?": ("25\\%", ["<answer>25\\%</answer>", "<answer>25</answer>"]),
    "Simplify sqrt(12)/2.": (
        "\\sqrt{3}",
        ["<answer>\\frac{\\sqrt{12}}{2}</answer>", "HANG <answer>3</answer>"],
    ),
}


class ScriptedEngine:
    """A RolloutEngine that answers each prompt with the scripted completions of its question."""

    def __init__(self, script: dict[str, list[str]], tokenizer) -> None:
        self.script = script
        self.tokenizer = tokenizer
        self.synced: list[str | None] = []
        self.calls: list[tuple[list[str], int, SamplingSpec]] = []

    def generate(self, prompts: list[str], n: int, sampling: SamplingSpec) -> RolloutResult:
        self.calls.append((prompts, n, sampling))
        groups = []
        for prompt in prompts:
            (texts,) = [t for q, t in self.script.items() if q in prompt]
            assert len(texts) == n
            groups.append(
                [
                    Completion(
                        token_ids=list(range(len(t))),
                        text=t,
                        logprobs=[-1.0] * len(t),
                        finish_reason="length" if t == TRUNCATED else "stop",
                    )
                    for t in texts
                ]
            )
        return RolloutResult(prompt_token_ids=[[1] for _ in prompts], completions=groups)

    def sync_adapter(self, adapter_dir: str | None) -> None:
        self.synced.append(adapter_dir)

    def set_norm_noise(self, sigma: float, seed: int) -> int:
        return 0

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


def write_fixture(path: Path, fixture: dict, question_key: str) -> Path:
    rows = [{question_key: q, "answer": gold} for q, (gold, *_rest) in fixture.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    return {
        "gsm8k": str(write_fixture(tmp_path / "gsm8k.jsonl", MATH_FIXTURE, "question")),
        "custom": str(write_fixture(tmp_path / "custom.jsonl", CUSTOM_FIXTURE, "problem")),
    }


def script(*fixtures: dict) -> dict[str, list[str]]:
    return {q: texts for fixture in fixtures for q, (_gold, texts) in fixture.items()}


def make_cfg(tmp_path: Path, files: dict[str, str], name: str = "run", **overrides) -> EvalConfig:
    values = dict(
        model="scripted-model",
        benchmarks=["gsm8k"],
        samples=4,
        data_files={"gsm8k": files["gsm8k"]},
        output=str(tmp_path / name),
        grader_workers=1,
        grader_timeout_s=10.0,
    )
    values.update(overrides)
    return EvalConfig(**values)


def quiet(_message: str) -> None:
    pass


def test_run_eval_grades_fixtures_and_writes_every_file(tmp_path, files, monkeypatch) -> None:
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    tokenizer = build_tokenizer()
    engine = ScriptedEngine(script(MATH_FIXTURE), tokenizer)
    cfg = make_cfg(tmp_path, files, adapter="some/adapter")
    results = run_eval(cfg, engine=engine, log=quiet)

    # the adapter goes to the engine; paper sampling defaults reach it
    assert engine.synced == ["some/adapter"]
    (prompts, n, sampling) = engine.calls[0]
    assert n == 4 and (sampling.temperature, sampling.top_p, sampling.max_new_tokens) == (0.6, 0.95, 4096)
    assert sampling.seed == 0
    # the training prompt function, chat template applied
    assert prompts[0].startswith("<|im_start|>system\nSolve the following math problem step by step.")
    assert prompts[0].endswith("<|im_start|>assistant\n")

    m = results.benchmarks["gsm8k"].metrics
    # per problem: 3/4 (12: "1" is wrong), 2/4 (2,500: "250" wrong, no answer), 3/4 (truncated)
    assert m.pass_at_1 == pytest.approx((3 / 4 + 2 / 4 + 3 / 4) / 3)
    assert m.pass_at_1_se is not None and m.pass_at_1_se > 0
    assert m.truncation_rate == pytest.approx(1 / 12)
    assert m.extraction_failure_rate == pytest.approx(2 / 12)  # "I am not sure", truncated think
    assert m.grader_timeouts == 0
    assert set(m.pass_at_k) == {"1", "2", "4"}
    assert results.benchmarks["gsm8k"].per_problem == {"0": [3, 4], "1": [2, 4], "2": [3, 4]}

    out = Path(cfg.output)
    saved = json.loads((out / "results.json").read_text())
    assert saved == json.loads(json.dumps(results.to_dict(), default=str))  # the file is the result
    assert EvalResult.from_dict(saved).to_dict() == saved  # and reads back to the same layout
    assert saved["prompt"]["template_hash"] == template_hash("qerl")
    assert saved["prompt"]["chat_template_hash"] is not None
    assert saved["config"]["adapter"] == "some/adapter" and saved["sampling"]["seed"] == 0
    assert saved["versions"]["math-verify"] is not None
    lines = [json.loads(x) for x in (out / "samples_gsm8k.jsonl").read_text().splitlines()]
    first = lines[0]
    assert first["gold"] == "12" and first["prompt"] == prompts[0]
    assert first["correct"] == [True, False, True, True]
    assert first["extracted"] == ["12", "1", "12", "12"]
    assert first["extraction_methods"] == ["answer_tag", "answer_tag", "boxed", "anchor"]
    assert lines[2]["finish_reasons"][3] == "length"
    assert lines[1]["gold"] == "2500"  # commas removed from the #### answer
    markdown = (out / "results.md").read_text()
    assert "| gsm8k | 3 | 4 |" in markdown
    assert markdown in summary.read_text()

    text = _render(eval_table(results))
    assert "gsm8k" in text and "66.7" in text


def _render(renderable) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def test_grader_hang_is_a_counted_zero_not_a_stall(tmp_path, files, monkeypatch) -> None:
    monkeypatch.setattr(
        run_module, "Grader", functools.partial(Grader, grade_fn="grader_hooks:hang_if_marked")
    )
    engine = ScriptedEngine(script(CUSTOM_FIXTURE), build_tokenizer())
    cfg = make_cfg(
        tmp_path,
        files,
        benchmarks=["custom"],
        samples=2,
        data_files={"custom": files["custom"]},
        grader_timeout_s=1.0,
        template="boxed",
    )
    results = run_eval(cfg, engine=engine, log=quiet)
    assert results.benchmarks["custom"].metrics.grader_timeouts == 1
    # 25\% and 25 both equal the gold 25\%; sqrt(12)/2 = sqrt(3); the hung sample scores 0
    assert results.benchmarks["custom"].per_problem == {"0": [2, 2], "1": [1, 2]}
    assert "within \\boxed{}" in engine.calls[0][0][0]


def test_rescore_regrades_saved_samples_without_generating(tmp_path, files) -> None:
    engine = ScriptedEngine(script(MATH_FIXTURE), build_tokenizer())
    cfg = make_cfg(tmp_path, files)
    first = run_eval(cfg, engine=engine, log=quiet)
    out = Path(cfg.output)
    # simulate a gold-answer correction in the saved samples, then re-grade in place
    path = out / "samples_gsm8k.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[1]["gold"] = "250"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))

    class NoGeneration:
        def __getattr__(self, name):
            raise AssertionError("rescore must not touch an engine")

    rescored = run_eval(EvalConfig(rescore=str(out), grader_workers=1), engine=NoGeneration(), log=quiet)
    assert rescored.rescored_from == str(out)
    assert rescored.benchmarks["gsm8k"].per_problem["1"] == [1, 4]
    assert rescored.benchmarks["gsm8k"].previous_pass_at_1 == first.benchmarks["gsm8k"].metrics.pass_at_1
    assert rescored.prompt == first.prompt  # the run's record is kept
    saved = json.loads((out / "results.json").read_text())
    assert saved == json.loads(json.dumps(rescored.to_dict(), default=str))
    assert EvalResult.from_dict(saved).to_dict() == saved
    keys = list(saved)  # the original run's record first, then the rescore's
    assert keys[: keys.index("grading") + 1] == [
        "format", "created", "model", "adapter", "engine", "config", "versions", "prompt", "sampling",
        "grading",
    ]  # fmt: skip
    assert keys[keys.index("grading") + 1 :] == ["rescored_from", "rescored", "benchmarks"]
    assert list(saved["benchmarks"]["gsm8k"])[-1] == "previous_pass@1"
    again = [json.loads(x) for x in path.read_text().splitlines()]
    assert again[1]["correct"] == [False, False, True, False]
    assert again[1]["completions"] == lines[1]["completions"]
    # to another folder when --output is given
    elsewhere = tmp_path / "rescored"
    run_eval(EvalConfig(rescore=str(out), output=str(elsewhere), grader_workers=1), log=quiet)
    assert (elsewhere / "results.json").is_file() and (elsewhere / "samples_gsm8k.jsonl").is_file()


def test_baseline_gives_paired_differences(tmp_path, files) -> None:
    tokenizer = build_tokenizer()
    worse = {q: ["<answer>0</answer>"] * 4 for q in MATH_FIXTURE}
    worse["Tom has 3 apples and buys 9 more. How many apples?"] = ["<answer>12</answer>"] * 4
    base_cfg = make_cfg(tmp_path, files, name="base")
    run_eval(base_cfg, engine=ScriptedEngine(worse, tokenizer), log=quiet)

    cfg = make_cfg(tmp_path, files, baseline=str(Path(base_cfg.output) / "results.json"))
    results = run_eval(cfg, engine=ScriptedEngine(script(MATH_FIXTURE), tokenizer), log=quiet)
    d = results.baseline.benchmarks["gsm8k"]
    diffs = [3 / 4 - 1, 2 / 4 - 0, 3 / 4 - 0]
    mean = sum(diffs) / 3
    se = (sum((x - mean) ** 2 for x in diffs) / 2 / 3) ** 0.5
    assert d.num_paired == 3
    assert d.diff == pytest.approx(mean) and d.diff_se == pytest.approx(se)
    assert results.baseline.same_prompt and results.baseline.same_sampling
    saved = json.loads((Path(cfg.output) / "results.json").read_text())
    assert list(saved)[-2:] == ["benchmarks", "baseline"] and EvalResult.from_dict(saved).to_dict() == saved
    assert "Δ vs baseline" in _render(eval_table(results))
    assert "Δ vs baseline" in (Path(cfg.output) / "results.md").read_text()


def write_arith(path: Path, addend: int, count: int) -> Path:
    """``count`` problems "What is a + addend?" as a JSONL benchmark file."""
    path.write_text(
        "".join(
            json.dumps({"question": f"What is {a} + {addend}?", "answer": str(a + addend)}) + "\n"
            for a in range(count)
        )
    )
    return path


def hf_eval_config(model_dir: Path, data: Path, output: Path, **overrides) -> EvalConfig:
    """A CPU HF-engine eval of the ``arith`` file with two samples per problem."""
    settings = dict(
        model=str(model_dir),
        engine="hf",
        device="cpu",
        benchmarks=["arith"],
        data_files={"arith": str(data)},
        samples=2,
        template="plain",
        output=str(output),
        grader_workers=1,
    )
    return EvalConfig(**{**settings, **overrides})


def test_run_eval_with_the_hf_engine_on_the_tiny_model(tmp_path, tiny_model_dir) -> None:
    data = write_arith(tmp_path / "arith.jsonl", addend=1, count=3)
    cfg = hf_eval_config(tiny_model_dir, data, tmp_path / "hf", max_new_tokens=6)
    results = run_eval(cfg, log=quiet)
    metrics = results.benchmarks["arith"].metrics
    assert results.engine == "hf"
    assert metrics.num_samples == 6
    assert 0.0 <= metrics.pass_at_1 <= 1.0
    assert 1 <= metrics.max_length <= 6
    lines = [json.loads(x) for x in (Path(cfg.output) / "samples_arith.jsonl").read_text().splitlines()]
    assert lines[0]["prompt"] == "<|im_start|>user\nWhat is 0 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert all(len(x["completions"]) == 2 for x in lines)


def test_the_adapter_is_applied_on_the_hf_engine(tmp_path, tiny_model_dir, monkeypatch) -> None:
    """NVlabs/QeRL's eval never applied the LoRA; here a non-zero adapter must change the samples."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # init_lora_weights=False: random A and B, so the adapter really moves the logits
    lora = get_peft_model(
        base,
        LoraConfig(
            r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        ),
    )
    adapter_dir = tmp_path / "adapter"
    lora.save_pretrained(adapter_dir)

    data = write_arith(tmp_path / "arith.jsonl", addend=2, count=2)

    def run(name: str, adapter: str | None) -> list[list[str]]:
        cfg = hf_eval_config(tiny_model_dir, data, tmp_path / name, max_new_tokens=8, adapter=adapter)
        run_eval(cfg, log=quiet)
        lines = (tmp_path / name / "samples_arith.jsonl").read_text().splitlines()
        return [json.loads(x)["completions"] for x in lines]

    seen = {}

    from qerl_cli.rollout import factory

    real_make_engine = factory.make_engine

    def spy(request):
        seen.update(vars(request))
        return real_make_engine(request)

    # build_engine imports the factory function at call time, so patching the module attribute works
    monkeypatch.setattr(factory, "make_engine", spy)
    base_samples = run("base", None)
    assert run("base_again", None) == base_samples  # same seed, same samples
    adapted = run("adapted", str(adapter_dir))
    assert seen["adapter"] == str(adapter_dir) and seen["kind"] == "hf"
    assert adapted != base_samples


def test_vllm_engine_wiring_passes_the_adapter_and_its_rank(tmp_path, monkeypatch) -> None:
    from qerl_cli.rollout import factory

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 32, "rank_pattern": {"q_proj": 48}}))
    seen = {}
    monkeypatch.setattr(factory, "make_engine", lambda request: seen.update(vars(request)))
    cfg = EvalConfig(model="Qwen/Qwen2.5-7B-Instruct", adapter=str(adapter), engine="vllm", seed=3)
    run_module.build_engine(cfg, tokenizer=None)
    assert seen["kind"] == "vllm" and seen["model_path"] == "Qwen/Qwen2.5-7B-Instruct"
    assert seen["adapter"] == str(adapter) and seen["enable_lora"] is True
    assert seen["max_lora_rank"] == 48 and seen["seed"] == 3 and seen["enable_sleep_mode"] is False
    run_module.build_engine(EvalConfig(model="m", engine="vllm"), tokenizer=None)
    assert seen["enable_lora"] is False and seen["adapter"] is None


def test_missing_benchmark_data_fails_before_loading_a_model(tmp_path, monkeypatch) -> None:
    from qerl_cli.errors import QerlError

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr("datasets.load_dataset", offline)
    monkeypatch.setattr(run_module, "build_engine", lambda *a: pytest.fail("model loaded before data"))
    model = tmp_path / "m"  # passes the (cheap) path check that comes before the data
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(QerlError, match="--data-file"):
        run_eval(EvalConfig(model=str(model), benchmarks=["math500"], output=str(tmp_path / "x")), log=quiet)


def test_baseline_with_other_settings_is_flagged(tmp_path, files) -> None:
    tokenizer = build_tokenizer()
    base_cfg = make_cfg(tmp_path, files, name="base", temperature=1.0)
    run_eval(base_cfg, engine=ScriptedEngine(script(MATH_FIXTURE), tokenizer), log=quiet)
    cfg = make_cfg(tmp_path, files, baseline=base_cfg.output)  # a folder works too
    results = run_eval(cfg, engine=ScriptedEngine(script(MATH_FIXTURE), tokenizer), log=quiet)
    assert results.baseline.benchmarks["gsm8k"].diff == pytest.approx(0.0)
    assert not results.baseline.same_sampling
    assert "different sampling" in _render(eval_table(results))


def test_committed_results_read_back_key_for_key() -> None:
    """results.json is read by other tools and kept in benchmarks/: the typed result keeps it exactly."""
    from qerl_cli.evaluation import read_results

    repo = Path(__file__).resolve().parents[1]
    found = [p for p in (repo / "benchmarks").rglob("*.json") if "results" in p.name]
    assert len(found) >= 5
    for path in found:
        data = json.loads(path.read_text())
        result = read_results(path)
        assert json.dumps(result.to_dict()) == json.dumps(data), path
        score = next(iter(result.benchmarks.values()))
        assert 0.0 <= score.metrics.pass_at_1 <= 1.0
        assert (score.timing is None) == bool(result.rescored_from), path  # a re-grade generated nothing


def test_rescore_without_results_json_and_through_the_cli(tmp_path, files, capsys) -> None:
    """Samples alone (no results.json beside them) re-grade into a record that says so; the CLI renders
    the typed result as its table."""
    from qerl_cli.cli import main

    cfg = make_cfg(tmp_path, files)
    run_eval(cfg, engine=ScriptedEngine(script(MATH_FIXTURE), build_tokenizer()), log=quiet)
    samples_only = tmp_path / "samples-only"
    samples_only.mkdir()
    (samples_only / "samples_gsm8k.jsonl").write_text((Path(cfg.output) / "samples_gsm8k.jsonl").read_text())
    rescored = run_eval(EvalConfig(rescore=str(samples_only), grader_workers=1), log=quiet)
    assert rescored.model == f"samples in {samples_only} (3 problems)" and rescored.engine is None
    saved = json.loads((samples_only / "results.json").read_text())
    assert "engine" not in saved and "adapter" not in saved and "created" not in saved
    assert saved["prompt"]["note"] == "no results.json next to the samples"
    assert json.dumps(EvalResult.from_dict(saved).to_dict()) == json.dumps(saved)

    assert main(["eval", "--rescore", cfg.output, "--set", "grader_workers=1"]) == 0
    out = capsys.readouterr().out
    assert "qerl eval: scripted-model" in out and "gsm8k" in out and "66.7" in out


# A base model's few-shot answers: transformers keeps the stop string ("\nQuestion:") at the end of the
# text, vLLM drops it; the last one states the question's two numbers, which math-verify adds up.
FEWSHOT_FIXTURE = {
    "Mia saved 90 dollars in May and 16 dollars in June. How many dollars did Mia save?": (
        "#### 106",
        [" 106\nQuestion: Tom", " 106", " 90 + 16 = 106. The answer is 106.\nQuestion:", " 90 16\nQuestion:"],
    ),
}


def test_evaluation_grades_completions_cut_at_the_stop_strings_as_training_does(tmp_path) -> None:
    from qerl_cli.config import RewardSection
    from qerl_cli.data.problem import Problem
    from qerl_cli.data.prompts import get_template
    from qerl_cli.rewards import build_reward_fn

    data = {"gsm8k": str(write_fixture(tmp_path / "fewshot.jsonl", FEWSHOT_FIXTURE, "question"))}
    cfg = make_cfg(tmp_path, data, template="qerl-fewshot")
    engine = ScriptedEngine(script(FEWSHOT_FIXTURE), build_tokenizer())
    result = run_eval(cfg, engine=engine, log=quiet)
    assert engine.calls[0][2].stop == ("\nQuestion:",)
    assert result.benchmarks["gsm8k"].per_problem["0"] == [3, 4]  # the side-by-side numbers are wrong
    # The training reward grades the same completions the same way.
    ((question, (gold, texts)),) = FEWSHOT_FIXTURE.items()
    stop = get_template("qerl-fewshot").stop
    reward = build_reward_fn(RewardSection(grader_workers=1), answer_format="answer_is", stop=stop)
    with reward:
        rewards, _ = reward(texts, [Problem("0", question, "106")] * len(texts))
    assert rewards == [1.0, 1.0, 1.0, 0.0]
    # A rescore (no generation) cuts at the stop strings its samples were generated with.
    rescored = run_eval(EvalConfig(rescore=cfg.output, grader_workers=1), log=quiet)
    assert rescored.benchmarks["gsm8k"].per_problem["0"] == [3, 4]
