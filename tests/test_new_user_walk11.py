"""A new user's walk, round 11: what carries from one command to the next (quantize -> train -> eval ->
compare), each stumble held by the test that would have caught it."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error
from test_compare import TINY_SETS, _recipe
from test_compare_verdict import _fake_runs

from qerl_cli.compare import runner
from qerl_cli.errors import QerlError


# -- qerl compare again into the same folder with other settings --------------------------------------------
def _fake_trained_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """run_one without training, keeping what `qerl train` keeps of a run: its config.yaml and result.json;
    every run scores 0.3 and every group had no spread of rewards."""
    every_seed = defaultdict(lambda: [0.3] * 16)
    return _fake_runs(monkeypatch, every_seed, keep_config=True, zero_std=[1.0, 1.0])


def test_compare_refuses_finished_runs_of_other_settings(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl compare RECIPE -o DIR --set train.learning_rate=...` again into the folder of an earlier
    comparison skipped every run as "finished before" and wrote a report of the earlier learning rate's
    runs as this one's, exit 0. Now it is refused before any work, naming the runs and the settings that
    differ; the same settings (more seeds) still add to the folder."""
    ran = _fake_trained_runs(monkeypatch)
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    arms = ["bf16-lora", "nvfp4-aqn"]
    runner.run_compare(recipe, arms, 1, out, sets=TINY_SETS)
    report = (out / "compare.json").read_text()
    changed = [*TINY_SETS, "train.learning_rate=0.1"]
    argv = ["compare", str(recipe), "--arms", ",".join(arms), "--seeds", "2", "-o", str(out)]
    rc, _, err = run_cli(capsys, *argv, *(f"--set={s}" for s in changed), "--dry-run")
    assert usage_error(rc, err), err
    assert "bf16-lora/seed-0, nvfp4-aqn/seed-0" in err and "train.learning_rate: 0.01 -> 0.1" in err
    assert "-o DIR" in err
    with pytest.raises(QerlError, match="trained with other settings"):
        runner.run_compare(recipe, arms, 2, out, sets=changed)
    assert (out / "compare.json").read_text() == report and len(ran) == 2  # nothing trained or rewritten
    runner.run_compare(recipe, arms, 2, out, sets=TINY_SETS)  # the same settings: seed 1 added
    assert sorted(ran) == [("bf16-lora", 0), ("bf16-lora", 1), ("nvfp4-aqn", 0), ("nvfp4-aqn", 1)]


# -- qerl compare's report: the remedy for too little signal ------------------------------------------------
def test_compare_s_signal_remedy_doubles_the_arms_own_samples(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ablation at rollout.num_generations=4 whose arms started without reward spread was told
    "rollout.num_generations: 16 instead of 8", a value it never ran, where `qerl train` of the same run
    says "8 instead of this run's 4". The report now reads each arm's runs' own value."""
    _fake_trained_runs(monkeypatch)
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 1, out, sets=TINY_SETS)
    warnings = [w for w in json.loads((out / "compare.json").read_text())["warnings"] if "little signal" in w]
    assert len(warnings) == 2
    assert all("rollout.num_generations: 8 instead of this run's 4" in w for w in warnings), warnings


# -- a mistyped option --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "said", "not_said"),
    [
        (["bench", "kernels", "--baseline", "b.json"], "No such option: --baseline", "--seq-len"),
        (["train", "tiny", "--resum", "auto"], "No such option: --resum (did you mean --resume?)", "--keys"),
        (["eval", "--samplez", "3"], "No such option: --samplez (did you mean --samples?)", "Possible"),
    ],
)
def test_a_mistyped_option_gets_the_one_close_match_rule(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str, not_said: str
) -> None:
    """`qerl bench kernels --baseline b.json` (a flag of `bench rollout`) was answered "Possible options:
    --seq-len", and `qerl train tiny --resum auto` "--keys, --resume": click's own close matches, which
    count the shared "--". Options now get the "did you mean" of every other name (errors.closest)."""
    rc, _, err = run_cli(capsys, *argv)
    assert usage_error(rc, err) and said in err and not_said not in err, err


# -- qerl compare --dry-run: what each arm trains on -------------------------------------------------------
def test_compare_dry_run_says_which_arms_get_a_base_made(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`qerl compare tiny --arms nvfp4-lora,nvfp4-aqn --set model.path=<an NVFP4 base> --dry-run` said "an
    arm's 4-bit base is made once from model.path under DIR/bases (compare.base_method=awq)", where both
    arms train on the recipe's own 4-bit model and nothing is made. It now says what each arm trains on."""
    from qerl_cli.quantize.native import write_rtn_checkpoint

    nvfp4 = write_rtn_checkpoint(tiny_model_dir, tmp_path / "nvfp4", "nvfp4")
    recipe, out = _recipe(tmp_path, tiny_model_dir), tmp_path / "cmp"
    argv = ["compare", str(recipe), "--seeds", "1", "-o", str(out), "--dry-run"]
    sets = [f"--set={s}" for s in TINY_SETS]
    rc, _, err = run_cli(capsys, *argv, "--arms", "nvfp4-lora,nvfp4-aqn", *sets, f"--set=model.path={nvfp4}")
    assert rc == 0, err
    assert "bases: nvfp4-lora: the recipe's model; nvfp4-aqn: the recipe's model" in err
    assert "made once" not in err
    rc, _, err = run_cli(capsys, *argv, "--arms", "bf16-lora,nvfp4-aqn", *sets)
    assert rc == 0, err
    assert (
        f"bases: bf16-lora: the recipe's model; nvfp4-aqn: nvfp4 RTN, made once from model.path (under "
        f"{out / 'bases'}; compare.base_method=rtn)" in err
    )


# -- qerl eval of an adapter on another base than it trained on ---------------------------------------------
def test_eval_names_an_adapter_trained_on_another_base(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """quantize -> train on the 4-bit base -> `qerl eval BF16_MODEL --adapter RUN/adapter` scored the adapter
    on a base it never learned on, without a word, though its adapter_config.json names the base. The
    dry run's --adapter line and a warning now say so, naming the command that evaluates it as trained."""
    import torch

    from qerl_cli.modeling.adapter import write_tensors

    other = tmp_path / "other-base"
    other.mkdir()
    adapter = write_tensors(
        tmp_path / "adapter", {"w": torch.zeros(1)}, rank=4, alpha=8, target_modules=["q_proj"],
        base_model=str(other),
    )  # fmt: skip
    argv = ["eval", str(tiny_model_dir), "--adapter", str(adapter), "--benchmarks", "synthetic-addition"]
    argv += ["-o", str(tmp_path / "ev"), "--dry-run"]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0, err
    warned = " ".join(caplog.text.split())
    assert f"adapter {adapter} was trained on {other} and this evaluation loads {tiny_model_dir}" in warned
    assert f"qerl eval {other} --adapter {adapter}" in warned
    assert f"--adapter: {adapter}: a PEFT adapter folder; trained on {other}, not on MODEL" in err
    write_tensors(adapter, {"w": torch.zeros(1)}, rank=4, alpha=8, target_modules=["q_proj"],
                  base_model=str(tiny_model_dir))  # fmt: skip
    caplog.clear()
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0 and "was trained on" not in caplog.text and f"trained on {tiny_model_dir}" in err, err


# -- qerl tiny-model --overwrite over a 4-bit base -----------------------------------------------------------
def test_tiny_model_over_a_base_leaves_no_record_of_the_old_weights(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`qerl tiny-model -o BASE --overwrite` over a base `qerl quantize --lora-init svd` wrote replaced the
    weights but left qerl_quant.json, recipe.yaml and lora_init/: the new BF16 model read as that 4-bit base
    (compare's base column) and `lora.init: svd` trained from a start made for other weights. They go now;
    a file of the user's beside the model stays."""
    import shutil

    from qerl_cli.modeling.loading import folder_format

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    for name in ("qerl_quant.json", "recipe.yaml", "lora_init/adapter_config.json", "notes.txt"):
        (base / name).parent.mkdir(exist_ok=True)
        (base / name).write_text("{}")
    rc, _, err = run_cli(capsys, "tiny-model", "-o", str(base), "--overwrite", "--seed", "3")
    assert rc == 0, err
    left = sorted(p.name for p in base.iterdir())
    assert not {"qerl_quant.json", "recipe.yaml", "lora_init"} & set(left) and "notes.txt" in left, left
    assert folder_format(str(base)) == "bf16"
    rc, _, err = run_cli(capsys, "train", "tiny", f"--set=model.path={base}", "--set=lora.init=svd",
                         "--dry-run")  # fmt: skip
    assert usage_error(rc, err) and f"{base} is a BF16 model" in " ".join(err.split()), err


# -- qerl train into the model's own folder ----------------------------------------------------------------
@pytest.mark.parametrize("inside", ["", "run"])
def test_train_refuses_an_output_in_the_model_folder(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, inside: str
) -> None:
    """`qerl train tiny --set model.path=BASE --set output.dir=BASE` trained into the base's own folder,
    mixing adapter/, checkpoints and metrics into the model's files (`qerl quantize` refuses its input's
    folder for its output). It is now refused before any work, naming another output.dir."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    before = sorted(p.name for p in base.iterdir())
    out = base / inside if inside else base
    sets = [f"--set={s}" for s in TINY_SETS if not s.startswith("compare.")]
    sets += [f"--set=model.path={base}", f"--set=output.dir={out}"]
    for extra in (["--dry-run"], []):
        rc, _, err = run_cli(capsys, "train", "tiny", *sets, *extra)
        assert usage_error(rc, err) and "--set output.dir=DIR" in err, err
        assert f"output.dir {out} is {'inside ' if inside else ''}the folder of model.path {base}" in err
    assert sorted(p.name for p in base.iterdir()) == before


# -- qerl eval --set of a generating setting out of range ----------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("top_p=1.5", "top_p must be in (0, 1] (1: off), got 1.5"),
        ("top_p=0", "top_p must be in (0, 1]"),
        ("temperature=-1", "temperature must be >= 0 (0: greedy), got -1.0"),
        ("max_new_tokens=0", "max_new_tokens must be > 0, got 0"),
        ("generation_batch_size=0", "generation_batch_size must be > 0"),
        ("grader_workers=0", "grader_workers must be > 0"),
        ("gpu_memory_utilization=2", "gpu_memory_utilization must be in (0, 1]"),
    ],
)
def test_eval_dry_run_refuses_a_generating_setting_out_of_range(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, setting: str, said: str
) -> None:
    """`qerl eval MODEL --set top_p=1.5` (its key doc: "in (0, 1]") ran and reported T=0.6 top-p=1.5;
    `--set temperature=-1`, `max_new_tokens=0`, `generation_batch_size=0` or `grader_workers=0` passed
    --dry-run and were refused only once the model had loaded. The config's check refuses each now."""
    out = tmp_path / "ev"
    argv = ["eval", str(tiny_model_dir), "--benchmarks", "synthetic-addition", "-o", str(out)]
    rc, _, err = run_cli(capsys, *argv, "--set", setting, "--dry-run")
    assert usage_error(rc, err) and said in err, err
    assert not out.exists()


# -- qerl bench rollout --gen-len 1 ------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["rollout", "concurrency"])
def test_bench_dry_run_refuses_one_generated_token(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    """`qerl bench rollout --gen-len 1 --dry-run` passed, and the run refused it only once the first case
    had started ("decode latency needs a token after the first"). The settings' check refuses it now."""
    out = tmp_path / "bench"
    argv = ["bench", command, "--device", "cpu", "--gen-len", "1", "-o", str(out), "--dry-run"]
    rc, _, err = run_cli(capsys, *argv)
    assert usage_error(rc, err) and "--gen-len must be at least 2" in err and "got 1" in err, err
    assert not out.exists()


# -- qerl train: recipe values that did nothing, or the opposite of what they say ----------------------------
@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("train.max_grad_norm=-1", "train.max_grad_norm must be > 0, got -1.0"),
        ("train.max_grad_norm=0", "train.max_grad_norm must be > 0, got 0.0"),
        ("algorithm.beta=-0.1", "algorithm.beta must be >= 0 (0: no KL term), got -0.1"),
        ("algorithm.overlong_cache_length=-1", "algorithm.overlong_cache_length must be >= 0"),
        ("output.save_total_limit=0", "output.save_total_limit must be >= 1 (null: all checkpoints kept"),
    ],
)
def test_train_refuses_a_value_that_does_other_than_it_says(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, setting: str, said: str
) -> None:
    """`--set train.max_grad_norm=-1` clipped every gradient to a negative norm, flipping the update
    (0: zeroing it); `algorithm.beta=-0.1` rewarded drifting from the reference; `output.save_total_limit=0`
    ("checkpoints kept") kept every checkpoint. Each ran without a word; each is refused now."""
    out = tmp_path / "run"
    sets = [f"--set=model.path={tiny_model_dir}", f"--set=output.dir={out}", f"--set={setting}"]
    rc, _, err = run_cli(capsys, "train", "tiny", *sets, "--dry-run")
    assert usage_error(rc, err) and said in err, err
    assert not out.exists()
