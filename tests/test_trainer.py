"""The training loop: data stream, token batches, trainer logprobs, a full tiny run, exact resume,
a hanging grader, divergence handling. That recipes/tiny.yaml learns is tests/test_demo.py's."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from qerl_cli.config import TrainConfig, load_config
from qerl_cli.data.problem import Problem
from qerl_cli.errors import QerlError
from qerl_cli.rl.checkpoint import list_checkpoints
from qerl_cli.rl.policy import completion_logprobs, make_token_batch
from qerl_cli.rl.tracking import MetricsLogger, read_metrics, step_sigma
from qerl_cli.rl.trainer import PromptStream, TrainResult, derive_seed, train
from qerl_cli.rl.update import normalizer as _normalizer
from qerl_cli.rollout.base import NOISE_SIGMA, PERTURBED_NORMS

REPO = Path(__file__).resolve().parents[1]


class FakeReward:
    """Rewards by a rule on the text, in-process (fast and deterministic); records each batch."""

    def __init__(self, value=None) -> None:
        self.batches: list[list[str]] = []
        self.value = value

    def __call__(self, completions, problems):
        self.batches.append([p.id for p in problems])
        if self.value is not None:
            rewards = [self.value] * len(completions)
        else:  # any rule that varies within groups gives a learning signal
            rewards = [float(len(c) % 3 == 0) for c in completions]
        return rewards, {
            "accuracy": sum(r > 0 for r in rewards) / len(rewards),
            "format_rate": 0.0,
            "grader_timeouts": 0.0,
        }


def tiny_cfg(model_dir: Path, out: Path, *overrides: str) -> TrainConfig:
    return load_config(
        TrainConfig,
        None,
        [
            f"model.path={model_dir}",
            "model.dtype=float32",
            "data.dataset=synthetic-addition",
            "data.template=plain",
            "rollout.num_generations=4",
            "rollout.max_completion_length=8",
            "rollout.max_prompt_length=64",
            "train.prompts_per_step=2",
            "train.max_steps=4",
            "train.micro_batch_size=3",
            "train.learning_rate=1e-2",
            "train.device=cpu",
            "train.gradient_checkpointing=false",
            "lora.rank=4",
            "lora.alpha=8",
            f"output.dir={out}",
            "output.save_steps=2",
            "aqn.num_stages=2",
            "reward.grader_workers=1",
            *overrides,
        ],
    )


# -- pieces ---------------------------------------------------------------------------------------
def test_prompt_stream_is_seeded_epoched_and_resumable() -> None:
    problems = [Problem(str(i), f"q{i}", str(i)) for i in range(5)]
    a = PromptStream(problems, seed=1)
    first = [p.id for p in a.take(7)]
    assert sorted(first[:5]) == ["0", "1", "2", "3", "4"]  # an epoch is a permutation
    b = PromptStream(problems, seed=1)
    b.position = 4
    assert [p.id for p in b.take(3)] == first[4:7]
    assert [p.id for p in PromptStream(problems, seed=2).take(5)] != first[:5]
    assert [p.id for p in PromptStream(problems, seed=1, shuffle=False).take(6)] == [
        "0",
        "1",
        "2",
        "3",
        "4",
        "0",
    ]


def test_derive_seed_is_stable_and_distinct() -> None:
    assert derive_seed(0, "rollout", 3, 0) == derive_seed(0, "rollout", 3, 0)
    assert len({derive_seed(0, "rollout", s, 0) for s in range(100)}) == 100
    assert derive_seed(0, "aqn", 1) != derive_seed(0, "rollout", 1)
    assert 0 <= derive_seed(5, "x") < 2**31


def test_token_batch_layout() -> None:
    batch = make_token_batch(
        [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], [[-0.1, -0.2], [-1.0, -2.0, -3.0]], pad_id=0
    )
    assert batch.input_ids.tolist() == [[1, 2, 3, 5, 6, 0], [0, 0, 4, 7, 8, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.rollout_logprobs[1].tolist() == [-1.0, -2.0, -3.0]
    with pytest.raises(QerlError, match="rollout logprobs"):
        make_token_batch([[1]], [[2, 3]], [[-1.0]], pad_id=0)


def test_normalizers_make_micro_batches_add_up() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert _normalizer("grpo", mask, 16) == 2.0  # sequences with at least one token
    assert _normalizer("dapo", mask, 16) == 5.0  # tokens
    assert _normalizer("dr_grpo", mask, 16) == 48.0  # B x max completion length


def test_trainer_logprobs_match_the_rollout_engine(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_tokenizer
    from qerl_cli.rollout.base import SamplingSpec
    from qerl_cli.rollout.hf import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(tiny_model_dir))
    result = HFEngine(model, tokenizer).generate(
        ["What is 1 + 2?", "Hi", "a much longer prompt than the others"],
        2,
        SamplingSpec(max_new_tokens=6, temperature=0.8, top_p=1.0, seed=0),
    )
    flat = result.flat()
    batch = make_token_batch(
        [result.prompt_token_ids[i] for i, _ in flat],
        [c.token_ids for _, c in flat],
        [c.logprobs for _, c in flat],
        pad_id=tokenizer.pad_token_id,
    )
    with torch.no_grad():
        whole = completion_logprobs(model, batch, 0.8, torch.device("cpu"))
        parts = torch.cat(
            [
                completion_logprobs(model, batch.rows(slice(b, b + 2)), 0.8, torch.device("cpu"))
                for b in range(0, batch.size, 2)
            ]
        )
    mask = batch.completion_mask.bool()
    assert torch.allclose(whole[mask], batch.rollout_logprobs[mask], atol=1e-4)
    assert torch.allclose(parts[mask], whole[mask], atol=1e-5)


# -- whole runs -----------------------------------------------------------------------------------
def test_tiny_run_writes_everything(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = train(tiny_cfg(tiny_model_dir, out), progress=False, reward_fn=FakeReward())
    assert result.steps == 4
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in (
        "reward_mean",
        "reward_std",
        "accuracy",
        "format_rate",
        "entropy",
        "clip_fraction",
        "tis_weight_mean",
        "completion_length_mean",
        "completion_length_max",
        "truncation_rate",
        NOISE_SIGMA,
        "time_rollout_s",
        "time_update_s",
        "time_aqn_s",
        "rollout_tokens_per_s",
        "grad_norm",
        "lr",
    ):
        assert key in records[-1], key
    # AQN: K=2 stages over 4 steps: noise-free first half, then the single noisy stage (sigma_start).
    assert [r[NOISE_SIGMA] for r in records] == [0.0, 0.0, 1e-2, 1e-2]
    assert all("aqn_sigma" not in r for r in records)  # one name for the sigma, the engines' own
    assert [step_sigma(r) for r in records] == [0.0, 0.0, 1e-2, 1e-2]  # and the readers read it
    assert records[2][PERTURBED_NORMS] == 5 and all("aqn_perturbed_norms" not in r for r in records)
    # What the reward paid for: one prompt group a step (output.log_completions=1), graded as trained.
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [g["step"] for g in samples] == [1, 2, 3, 4]
    first = samples[0]
    assert len(first["completions"]) == len(first["rewards"]) == len(first["finish_reasons"]) == 4
    assert first["rewards"] == [float(len(c) % 3 == 0) for c in first["completions"]]  # FakeReward's rule
    assert first["gold"] and first["question"] and first["problem_id"]
    assert [s for s, _ in list_checkpoints(out)] == [2, 4]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "config.yaml").is_file()
    prompt = json.loads((out / "prompt.json").read_text())
    assert prompt["name"] == "plain" and "What is" in prompt["example"] and prompt["template_hash"]
    assert result.plot is None or Path(result.plot).is_file()
    assert result.final["step"] == 4
    # The summary is typed and survives a trip through its dict (json: NaN figures compare equal there).
    assert json.dumps(TrainResult.from_dict(result.to_dict()).to_dict()) == json.dumps(result.to_dict())
    assert isinstance(result, TrainResult) and result.world_size == 1 and result.resumed_from is None


def test_resume_continues_with_the_same_next_batch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Uninterrupted 4 steps vs. killed after step 3 (checkpoint at 2) and resumed: same steps 3-4."""
    straight = FakeReward()
    train(tiny_cfg(tiny_model_dir, tmp_path / "a"), progress=False, reward_fn=straight)

    class Killed(Exception):
        pass

    def kill_after_3(step: int, record: dict) -> None:
        if step == 3:
            raise Killed

    first = FakeReward()
    with pytest.raises(Killed):
        train(tiny_cfg(tiny_model_dir, tmp_path / "b"), progress=False, reward_fn=first, on_step=kill_after_3)
    assert [s for s, _ in list_checkpoints(tmp_path / "b")] == [2]
    resumed = FakeReward()
    result = train(
        tiny_cfg(tiny_model_dir, tmp_path / "b"),
        resume=str(tmp_path / "b"),
        progress=False,
        reward_fn=resumed,
    )
    assert result.resumed_from.endswith("checkpoint-2") and result.steps == 4
    # The resumed run's batches are the uninterrupted run's steps 3 and 4.
    assert resumed.batches == straight.batches[2:]
    a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # step 3 of the killed run was dropped and redone
    groups = [json.loads(x) for x in (tmp_path / "b" / "completions.jsonl").read_text().splitlines()]
    assert [g["step"] for g in groups] == [1, 2, 3, 4]  # and so were its logged completions
    for ra, rb in zip(a, b, strict=True):
        for key in ("reward_mean", "entropy", "loss", "grad_norm", "data_position", NOISE_SIGMA):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), (ra["step"], key)
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-7) for k in wa)


def test_the_sigma_is_read_under_its_name_and_the_old_one() -> None:
    """Runs written before the trainer stopped logging "aqn_sigma" (the committed benchmark runs among
    them, some with no other name for it) still plot and summarise their sigma."""
    assert step_sigma({NOISE_SIGMA: 2e-3}) == 2e-3 and step_sigma({"aqn_sigma": 5e-4}) == 5e-4
    assert step_sigma({"step": 1}) == 0.0  # a run without AQN figures
    old = [r for path in sorted(REPO.glob("benchmarks/**/metrics*.jsonl")) for r in read_metrics(path)]
    assert any("aqn_sigma" in r and NOISE_SIGMA not in r for r in old)  # what the fallback is for
    assert all(step_sigma(r) == r["aqn_sigma"] for r in old if "aqn_sigma" in r)


def test_a_hanging_grader_does_not_stall_training(tiny_model_dir: Path, tmp_path: Path) -> None:
    from qerl_cli.config import RewardSection
    from qerl_cli.rewards import Grader, build_reward_fn

    grader = Grader(workers=2, timeout_s=0.5, grade_fn="grader_hooks:hang_on_some_answers")
    reward = build_reward_fn(RewardSection(grader_timeout_s=0.5), grader=grader)
    cfg = tiny_cfg(tiny_model_dir, tmp_path / "run", "train.max_steps=1", "output.save_steps=0")
    start = time.monotonic()
    result = train(cfg, progress=False, reward_fn=reward)
    assert result.steps == 1
    # Some grades hung and were cut off after 0.5 s each; the others were graded normally.
    assert 0 < result.final["grader_timeouts"] < 8
    assert time.monotonic() - start < 120


def test_divergence_stops_with_a_clear_error_and_no_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tiny_cfg(tiny_model_dir, out, "train.max_nonfinite_steps=0")  # no step skipped
    with pytest.raises(QerlError, match="diverged at step 1"):
        train(cfg, progress=False, reward_fn=FakeReward(value=float("nan")))
    assert list_checkpoints(out) == []
    assert not (out / "adapter").exists()


def test_every_algorithm_option_runs(tiny_model_dir: Path, tmp_path: Path) -> None:
    """DAPO loss, dynamic sampling, overlong shaping, truncation masking, KL to the adapter-free
    reference, several updates per batch and trainable norms, together."""
    cfg = tiny_cfg(
        tiny_model_dir,
        tmp_path / "run",
        "algorithm.loss_type=dapo",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_sampling_rounds=2",
        "algorithm.overlong_penalty=true",
        "algorithm.overlong_cache_length=4",
        "algorithm.mask_truncated=true",
        "algorithm.beta=0.1",
        "algorithm.num_iterations=2",
        "lora.train_norms=true",
        "train.max_steps=2",
    )
    result = train(cfg, progress=False, reward_fn=FakeReward())
    final = result.final
    assert final["kl"] >= 0 and "dynamic_sampling_rounds" in final
    # The second update of a batch sees a moved policy: the ratio is no longer exactly 1.
    assert final["ratio_max"] != 1.0 or final["ratio_min"] != 1.0
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert any("norm" in k for k in saved) and any("lora_A" in k for k in saved)


def test_a_separate_engine_gets_the_adapter_and_a_staleness_probe(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from qerl_cli.rl.trainer import Trainer

    class SeparateEngine:
        """Stands in for vLLM: samples through the trainer's HF engine, saves each synced adapter to a
        folder of its own and records the staleness probes."""

        def __init__(self, inner, folder: Path) -> None:
            self.inner, self.folder = inner, folder
            self.synced: list[Path] = []
            self.probes: list[tuple[list[int], list[float]]] = []

        def generate(self, prompts, n, sampling):
            return self.inner.generate(prompts, n, sampling)

        def set_norm_noise(self, sigma, seed):
            return self.inner.set_norm_noise(sigma, seed)

        def sync_adapter(self, adapter_dir):
            raise AssertionError("the trainer syncs its live model (sync_policy)")

        def sync_policy(self, peft_model):
            from qerl_cli.modeling.adapter import check_folder, save_peft_model

            self.synced.append(check_folder(save_peft_model(peft_model, self.folder / str(len(self.synced)))))

        def check_staleness(self, probe, trainer_logprobs, reference_logprobs=None):
            self.probes.append((list(probe), list(trainer_logprobs(probe))))
            return 0.0

        def stats(self):
            return {"rollout/staleness_gap": 0.0}

        linear_backend = "default"

        def sleep(self):
            pass

        def wake_up(self):
            pass

        def close(self):
            pass

    trainer = Trainer(tiny_cfg(tiny_model_dir, tmp_path / "run"), reward_fn=FakeReward())
    engine = SeparateEngine(trainer.engine, tmp_path / "synced")
    trainer.engine = engine
    trainer.train_step()
    trainer.train_step()
    assert len(engine.synced) == 2 and len(engine.probes) == 2
    probe, logprobs = engine.probes[-1]
    assert len(logprobs) == len(probe) - 1 and all(lp <= 0 for lp in logprobs)


def test_resume_without_checkpoint_is_a_user_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(QerlError, match="no complete checkpoint"):
        train(
            tiny_cfg(tiny_model_dir, tmp_path / "run"),
            resume=str(tmp_path / "empty"),
            progress=False,
            reward_fn=FakeReward(),
        )


def test_a_failed_start_closes_what_it_opened_and_not_what_it_was_lent(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli import rewards
    from qerl_cli.rl import setup
    from qerl_cli.rl.trainer import Trainer

    class Engine:
        closed = False
        linear_backend = "default"

        def close(self) -> None:
            self.closed = True

        def __getattr__(self, name: str):  # the sync and probe calls of a start: no-ops
            return lambda *args, **kwargs: None

    made = Engine()
    monkeypatch.setattr(setup, "make_engine", lambda *args, **kwargs: made)

    def no_grader(cfg, **kwargs):
        raise QerlError("no grader")

    monkeypatch.setattr(rewards, "build_reward_fn", no_grader)
    with pytest.raises(QerlError, match="no grader"):
        Trainer(tiny_cfg(tiny_model_dir, tmp_path / "a"))
    assert made.closed  # the engine it started is closed
    lent = Engine()
    with pytest.raises(QerlError, match="no grader"):
        Trainer(tiny_cfg(tiny_model_dir, tmp_path / "b"), engine=lent)
    assert not lent.closed  # the caller's engine is the caller's to close


def test_gradients_are_clipped_to_max_grad_norm(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimizer sees gradients of norm <= train.max_grad_norm; the logged norm is the one before."""
    seen: list[float] = []
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    out = tmp_path / "run"
    train(tiny_cfg(tiny_model_dir, out, "train.max_grad_norm=1e-4", "train.max_steps=2"), progress=False,
          reward_fn=FakeReward())  # fmt: skip
    logged = [json.loads(line)["grad_norm"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    updated = [n for n in logged if n > 0]
    assert updated and all(n > 1e-4 for n in updated)  # the norms before clipping are larger ...
    assert seen and all(n <= 1e-4 * 1.001 for n in seen)  # ... and the optimizer got clipped ones


def test_metrics_written_as_nan_text_read_back_as_floats(tmp_path: Path) -> None:
    """JSON has no NaN: the logger writes a skipped step's NaN as text, and the reader (the curves, the
    summary) gets a float back; other text stays text."""
    logger = MetricsLogger(tmp_path, resume_step=None)
    logger.log({"step": 1, "reward_mean": float("nan"), "loss": float("inf"), "note": "nan-free text"})
    logger.close()
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert '"nan"' in (tmp_path / "metrics.jsonl").read_text()
    assert math.isnan(record["reward_mean"]) and record["loss"] == math.inf
    assert record["note"] == "nan-free text"
