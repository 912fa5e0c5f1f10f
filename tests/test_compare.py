"""`qerl compare`: arms x seeds on the tiny model, the table and plot, and resuming."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from qerl_cli.compare import arms as arms_mod
from qerl_cli.compare import heldout as heldout_mod
from qerl_cli.compare import parallel, plot, runner, summary
from qerl_cli.compare import runs as runs_mod
from qerl_cli.compare.results import BaseHeldout, CompareReport, HeldoutScore, RunResult
from qerl_cli.compare.summary import arm_rows, steps_to
from qerl_cli.errors import QerlError
from qerl_cli.torch_utils import device_label

TINY_SETS = [
    "model.dtype=float32", "data.dataset=synthetic-addition", "data.template=plain",
    "rollout.num_generations=4", "rollout.max_completion_length=8", "rollout.max_prompt_length=64",
    "train.prompts_per_step=2", "train.max_steps=3", "train.micro_batch_size=8", "train.learning_rate=1e-2",
    "train.device=cpu", "train.gradient_checkpointing=false", "lora.rank=4", "lora.alpha=8",
    "output.save_steps=2", "aqn.num_stages=2", "reward.grader_workers=1",
    "compare.base_method=rtn",  # AWQ is the default; RTN keeps these tests to seconds
]  # fmt: skip


def _recipe(tmp_path: Path, model: Path, extra: dict | None = None) -> Path:
    data = {"model": {"path": str(model)}, "compare": {"heldout_problems": 4, **(extra or {})}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_summary_figures() -> None:
    assert steps_to([0.0] * 10 + [1.0] * 10, 0.5) == 11  # trailing mean of steps 10-11: (0 + 1) / 2
    assert steps_to([0.0] * 5, 0.5) is None
    runs = {
        "a": [RunResult("a", s, [0.0, 0.5, 1.0, 1.0], [2.0, 1.0, 1.0, 1.0], _score(p, 0.1))
              for s, p in ((0, 0.5), (1, 0.7))],
        "b": [RunResult("b", 0, [0.0] * 4, [3.0] * 4, _score(0.2, 0.05))],
    }  # fmt: skip
    rows, threshold = arm_rows(runs, None)
    assert threshold == pytest.approx(0.5)  # halfway from the first reward (0) to the best final (1)
    a, b = rows
    assert a.final_reward == 1.0 and a.early_entropy == 2.0 and a.reached_threshold == "2/2"
    assert a.heldout_accuracy == pytest.approx(0.6)
    assert a.heldout_se == pytest.approx(0.1)  # sd over seeds (0.1414) / sqrt(2)
    assert b.heldout_se == 0.05 and b.reached_threshold == "0/1"  # one seed: the eval's own SE


def _score(pass_at_1: float, se: float) -> HeldoutScore:
    return HeldoutScore("synthetic-addition", pass_at_1, se, problems=4, samples=1)


def test_arms_are_checked_and_recipes_add_their_own() -> None:
    settings = arms_mod.read_settings({"arms": {"mine": {"aqn.enabled": True, "model.format": "mxfp4"}}})
    assert set(settings.arms) == {"bf16-lora", "nvfp4-lora", "nvfp4-aqn", "nvfp4-dequant-lora", "mine"}
    with pytest.raises(QerlError, match="unknown arm"):
        arms_mod.select_arms(settings, ["bf16-lora", "nope"])
    with pytest.raises(QerlError, match=r"key 'compare.treshold'; did you mean compare.threshold\?"):
        arms_mod.read_settings({"treshold": 0.5})
    assert arms_mod.as_set_strings({"aqn.enabled": False, "model.format": "nvfp4"}) == [
        "aqn.enabled=false", "model.format=nvfp4",
    ]  # fmt: skip


@pytest.mark.slow
def test_compare_tiny_runs_tables_plots_and_resumes(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    out = tmp_path / "cmp"
    report = runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 2, out, sets=TINY_SETS).report
    assert [row.arm for row in report.arms] == ["bf16-lora", "nvfp4-aqn"]
    for row in report.arms:
        assert row.seeds == 2 and row.steps == 3
        assert 0.0 <= row.heldout_accuracy <= 1.0 and row.early_entropy > 0
        assert 0.0 <= row.base_heldout_accuracy <= 1.0  # where the arm started, no adapter
        assert row.base_entropy > 0  # the untrained base's own entropy at T=1
    # One evaluation per distinct base: the BF16 model and its NVFP4 counterpart.
    base_evals = sorted(p.parent.name for p in (out / "base-heldout").glob("*/heldout.json"))
    assert len(base_evals) == 2 and base_evals[1].startswith("nvfp4-"), base_evals
    assert (out / "compare.png").stat().st_size > 0
    md = (out / "compare.md").read_text()
    assert "| nvfp4-aqn | nvfp4 RTN | 2 |" in md and "| bf16-lora | bf16 | 2 |" in md
    assert "4-bit bases made here: RTN (round to nearest" in md
    for row in report.arms:  # where GRPO's signal started: from the runs' own first steps
        assert 0.0 <= row.start_reward <= 1.0 and 0.0 <= row.start_no_spread_fraction <= 1.0
    first = json.loads((out / "nvfp4-aqn" / "seed-0" / "result.json").read_text())
    assert len(first["zero_std_group_fraction"]) == 3
    assert len(first["logprob_gap"]) == 3 and all(g >= 0 for g in first["logprob_gap"])
    assert all(row.logprob_gap is not None and row.logprob_gap >= 0 for row in report.arms)
    assert "logprob gap" in (out / "compare.md").read_text()
    assert json.dumps(RunResult.from_dict(first).to_dict()) == json.dumps(first)  # the file's layout, kept
    on_disk = json.loads((out / "compare.json").read_text())
    assert on_disk["threshold"] == report.threshold and on_disk == report.to_dict()
    assert json.dumps(CompareReport.from_dict(on_disk).to_dict()) == json.dumps(on_disk)
    # Where the numbers came from: each run's result, the report, the table (the PNG's title too).
    assert report.devices == [device_label("cpu")] and device_label("cpu").startswith("CPU (")
    assert f"Ran on: {device_label('cpu')}." in (out / "compare.md").read_text()
    nvfp4 = yaml.safe_load((out / "nvfp4-aqn" / "seed-1" / "config.yaml").read_text())
    assert nvfp4["model"]["path"] == str(out / "bases" / "nvfp4") and nvfp4["aqn"]["enabled"] is True
    assert nvfp4["train"]["seed"] == 1
    bf16 = yaml.safe_load((out / "bf16-lora" / "seed-0" / "config.yaml").read_text())
    assert bf16["model"]["path"] == str(tiny_model_dir) and bf16["aqn"]["enabled"] is False

    # Interrupted run: no result.json, a checkpoint at step 2 -> resumed from it, the rest skipped.
    (out / "nvfp4-aqn" / "seed-0" / "result.json").unlink()
    calls = []
    import qerl_cli.rl.trainer as trainer_mod

    original = trainer_mod.train

    def spy(conf, resume=None, **kwargs):
        calls.append((conf.output.dir, resume))
        return original(conf, resume=resume, **kwargs)

    monkeypatch.setattr(trainer_mod, "train", spy)
    evaluated = []
    original_eval = heldout_mod.evaluate_heldout
    monkeypatch.setattr(
        heldout_mod, "evaluate_heldout", lambda conf, st, adapter, target, *rest: evaluated.append(adapter)
        or original_eval(conf, st, adapter, target, *rest),
    )  # fmt: skip
    again = runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 2, out, sets=TINY_SETS)
    assert None not in evaluated  # the bases' evaluations were kept, not repeated
    assert calls == [(str(out / "nvfp4-aqn" / "seed-0"), str(out / "nvfp4-aqn" / "seed-0"))]
    assert (again.runs, again.ran, again.report.skipped_finished_runs) == (4, 1, 3)
    assert [r.base_heldout_accuracy for r in again.report.arms] == [
        r.base_heldout_accuracy for r in report.arms
    ]
    resumed = json.loads((out / "nvfp4-aqn" / "seed-0" / "result.json").read_text())
    assert resumed["steps"] == 3 and len(resumed["reward"]) == 3


def test_vllm_runs_get_a_process_each_and_share_the_gpu_with_jobs(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    sets = [*TINY_SETS, "rollout.engine=vllm"]
    calls: list[tuple[int, float, list[str], float | None]] = []
    monkeypatch.setattr(
        runner, "run_parallel",
        lambda todo, recipe, seeds, out, child_sets, width, interval=0.0, ready=None, gpus=None, **kw:
        calls.append((width, interval, child_sets, ready)) or [],
    )  # fmt: skip
    # An in-process vLLM keeps its GPU memory after close: even sequential runs go to child processes.
    runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "b", sets=sets, summarize=False)
    runner.run_compare(recipe, ["bf16-lora"], 1, tmp_path / "c", sets=sets, summarize=False)  # one run too
    assert [(w, i, r) for w, i, _, r in calls] == [(1, 0.0, None), (1, 0.0, None)]
    assert all(child_sets == sets for _, _, child_sets, _ in calls)  # alone on the GPU: the recipe as is
    calls.clear()
    # --jobs 3 over 3 runs: they share the GPU, 0.92 / 3 each, vLLM without sleep mode and with half of
    # that (the recipe's default 0.3 is for a whole GPU); each starts once the previous engine is up, at
    # least 10 s later, waiting at most 45 s.
    runner.run_compare(recipe, ["bf16-lora"], 3, tmp_path / "d", sets=sets, jobs=3, summarize=False)
    ((width, interval, child_sets, ready),) = calls
    assert (width, interval, ready) == (3, 10.0, 45.0)
    assert child_sets[len(sets):] == ["train.gpu_fraction=0.306", "rollout.enable_sleep_mode=false",
                                      "rollout.gpu_memory_utilization=0.153"]  # fmt: skip
    calls.clear()
    waits = ["compare.start_interval_s=5", "compare.engine_ready_timeout_s=60"]
    runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "e", sets=[*sets, *waits], jobs=4,
                       summarize=False)  # fmt: skip
    assert calls[0][0:2] == (2, 5.0) and calls[0][3] == 60.0  # 2 runs: 2 at a time
    assert calls[0][2][-3:] == ["train.gpu_fraction=0.46", "rollout.enable_sleep_mode=false",
                                "rollout.gpu_memory_utilization=0.23"]  # fmt: skip
    # The user's fraction is kept when it fits, refused when it cannot.
    calls.clear()
    runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "f", sets=[*sets, "train.gpu_fraction=0.4"],
                       jobs=2, summarize=False)  # fmt: skip
    assert [s for s in calls[0][2] if "gpu_fraction" in s] == ["train.gpu_fraction=0.4"]
    assert calls[0][2][-1] == "rollout.gpu_memory_utilization=0.2"
    with pytest.raises(QerlError, match=r"train.gpu_fraction=0.6 is more than 1/2 .* at most 0.5"):
        runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "g", sets=[*sets, "train.gpu_fraction=0.6"],
                           jobs=2, summarize=False)  # fmt: skip
    # An explicit vLLM share above the run's fraction stops before any child starts.
    calls.clear()
    with pytest.raises(QerlError, match=r"gpu_memory_utilization=0.3 \(--set\) .* train.gpu_fraction=0.23"):
        share = [*sets, "rollout.gpu_memory_utilization=0.3"]
        runner.run_compare(recipe, ["bf16-lora"], 4, tmp_path / "h", sets=share, jobs=4, summarize=False)
    assert calls == []


def test_runs_sharing_the_gpu_run_vllm_without_sleep_mode_and_with_their_own_share(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sets = [*TINY_SETS, "rollout.engine=vllm"]
    calls: list[list[str]] = []

    def stand_in(todo, recipe, seeds, out, child_sets, *args, **kw) -> list[str]:
        calls.append(child_sets)
        return []

    monkeypatch.setattr(runner, "run_parallel", stand_in)

    outs = iter(range(100))

    def children(extra: dict | None = None, more_sets: tuple[str, ...] = ()) -> list[str]:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(yaml.safe_dump({"model": {"path": str(tiny_model_dir)}, **(extra or {})}))
        calls.clear()
        runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / f"out{next(outs)}", sets=[*sets, *more_sets],
                           jobs=2, summarize=False)  # fmt: skip
        return calls[0]

    # The recipe's sleep mode (as the Gemma recipe has it) and auto share: off, and half of 0.46.
    got = children({"rollout": {"enable_sleep_mode": True, "gpu_memory_utilization": "auto"}})
    assert got[-2:] == ["rollout.enable_sleep_mode=false", "rollout.gpu_memory_utilization=0.23"]
    # A smaller explicit share in the recipe is kept.
    assert children({"rollout": {"gpu_memory_utilization": 0.1}})[-1] == "rollout.gpu_memory_utilization=0.1"
    # A --set share within the fraction is the user's: kept as given, not appended again.
    got = children(more_sets=("rollout.gpu_memory_utilization=0.3",))
    assert got[-1] == "rollout.enable_sleep_mode=false" and "rollout.gpu_memory_utilization=0.3" in got
    # Every child's config (arm overrides applied last) has sleep mode off and a numeric share.
    for child_sets in (got, children()):
        for arm in ("bf16-lora", "nvfp4-aqn"):
            conf = runs_mod.arm_config({"model": {"path": str(tiny_model_dir)}}, arms_mod.BUILTIN_ARMS[arm],
                                     runs_mod.train_sets(child_sets), 0, tmp_path / "x", arm, {})  # fmt: skip
            assert conf.rollout.enable_sleep_mode is False
            assert conf.rollout.gpu_memory_utilization <= conf.train.gpu_fraction
            assert not isinstance(conf.rollout.gpu_memory_utilization, str)


def test_a_given_gpu_fraction_below_the_default_vllm_share_is_not_refused_for_runs_sharing_the_gpu(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--set train.gpu_fraction=0.075 with the default share (0.3, which the user never set): compare gives
    each vLLM half the fraction rather than refusing the default it replaces (on an H200 a SmolLM2
    comparison stopped at once: "rollout.gpu_memory_utilization=0.3 ... is more than train.gpu_fraction")."""
    calls: list[list[str]] = []
    monkeypatch.setattr(
        runner,
        "run_parallel",
        lambda todo, recipe, seeds, out, child_sets, *a, **kw: calls.append(child_sets) or [],
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": str(tiny_model_dir)}}))
    sets = [*TINY_SETS, "rollout.engine=vllm", "train.gpu_fraction=0.075"]
    runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "o", sets=sets, jobs=2, summarize=False)
    assert calls[0][-1] == "rollout.gpu_memory_utilization=0.037"
    # A share the user gives above the fraction is still refused, naming it.
    with pytest.raises(
        QerlError,
        match=r"gpu_memory_utilization=0.3 \(a fraction of the whole GPU\) is more than "
        r"train.gpu_fraction=0.075",
    ):
        runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "p", summarize=False, jobs=2,
                           sets=[*sets, "rollout.gpu_memory_utilization=0.3"])  # fmt: skip


def test_sleep_mode_forced_on_for_runs_sharing_the_gpu_is_refused(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(runner, "run_parallel", lambda *a: pytest.fail("no child may start"))
    recipe = _recipe(tmp_path, tiny_model_dir, {"arms": {"sleepy": {"rollout.enable_sleep_mode": True}}})
    sets = [*TINY_SETS, "rollout.engine=vllm"]
    with pytest.raises(QerlError, match=r"enable_sleep_mode=true \(--set\) with --jobs 2: vLLM runs sharing"):
        runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "a", summarize=False, jobs=2,
                           sets=[*sets, "rollout.enable_sleep_mode=true"])  # fmt: skip
    with pytest.raises(QerlError, match=r"enable_sleep_mode=true \(arm sleepy\)"):
        runner.run_compare(recipe, ["sleepy"], 2, tmp_path / "b", sets=sets, jobs=2, summarize=False)
    with pytest.raises(QerlError, match=r"gpu_memory_utilization=auto \(--set\) with --jobs 2"):
        runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "c", summarize=False, jobs=2,
                           sets=[*sets, "rollout.gpu_memory_utilization=auto"])  # fmt: skip
    # One at a time, sleep mode stays the user's.
    monkeypatch.setattr(runner, "run_parallel", lambda todo, recipe, seeds, out, child_sets, *a, **kw: [])
    runner.run_compare(recipe, ["sleepy"], 2, tmp_path / "d", sets=sets, jobs=1, summarize=False)
    # From the command line: exit 2 with the message.
    from qerl_cli.cli import main

    rc = main(["compare", str(recipe), "--arms", "sleepy", "--seeds", "2", "--jobs", "2", "-o",
               str(tmp_path / "e"), "--no-summary", *[x for s in sets for x in ("--set", s)]])  # fmt: skip
    assert rc == 2 and "cannot sleep" in " ".join(capsys.readouterr().err.split())


def test_a_compare_child_trains_its_vllm_run_in_process(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a child process (CHILD_ENV set) a vLLM run trains there: it must not start a child of its own,
    which would start another, without end."""
    ran = _fake_runs(monkeypatch)
    monkeypatch.setattr(runner, "run_parallel", lambda *a: pytest.fail("a child must not start a child"))
    monkeypatch.setenv(parallel.CHILD_ENV, "1")
    sets = [*TINY_SETS, "rollout.engine=vllm"]
    recipe = _recipe(tmp_path, tiny_model_dir)
    runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "a", sets=sets, only=["bf16-lora/0"],
                       summarize=False)  # fmt: skip
    assert ran == [("bf16-lora", 0)]
    runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "b", sets=sets, summarize=False)  # one by one
    assert ran == [("bf16-lora", 0), ("bf16-lora", 0), ("bf16-lora", 1)]


def test_parallel_children_carry_their_sets_and_start_staggered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = {"now": 0.0}
    started: list[tuple[float, list[str]]] = []

    class FakeProc:
        def __init__(self, command, **kwargs) -> None:
            started.append((clock["now"], command))
            self.returncode: int | None = None
            self.born = clock["now"]

        def poll(self) -> int | None:
            if clock["now"] - self.born >= 100:  # each run takes 100 s
                self.returncode = 0
            return self.returncode

    def sleep(seconds: float) -> None:
        clock["now"] += seconds

    monkeypatch.setattr(parallel.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(parallel, "time", SimpleNamespace(sleep=sleep, monotonic=lambda: clock["now"]))
    todo = [("a", 0), ("a", 1), ("a", 2)]
    sets = ["rollout.engine=vllm", "train.gpu_fraction=0.46"]
    failures = parallel.run_parallel(todo, "r.yaml", 3, tmp_path, sets, 2, 45.0)
    assert failures == []
    times = [t for t, _ in started]
    assert times[0] == 0.0 and times[1] >= 45.0  # the least gap between two starts
    assert times[2] >= 100.0  # the third waits for a free slot (two at a time)
    for _, command in started:
        i = command.index("train.gpu_fraction=0.46")
        assert command[i - 1] == "--set"
    assert [c[c.index("--only") + 1] for _, c in started] == ["a/0", "a/1", "a/2"]


def test_the_next_vllm_run_starts_once_the_previous_ones_engine_is_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fake clock and children that write engine_ready (as rl.setup does) some seconds after their start."""
    from qerl_cli.rl.setup import ENGINE_READY_FILE

    clock = {"now": 0.0}
    started: dict[str, float] = {}
    # Per run: seconds until its engine is up (None: never), seconds until it exits, its exit code.
    plan = {"a/0": (70.0, 300.0, 0), "a/1": (None, 400.0, 0), "a/2": (None, 15.0, 1), "a/3": (5.0, 50.0, 0)}
    procs: list[Any] = []

    class FakeProc:
        def __init__(self, command, **kwargs) -> None:
            self.only = command[command.index("--only") + 1]
            started[self.only] = clock["now"]
            self.returncode: int | None = None
            procs.append(self)

        def poll(self) -> int | None:
            if clock["now"] - started[self.only] >= plan[self.only][1]:
                self.returncode = plan[self.only][2]
            return self.returncode

    def sleep(seconds: float) -> None:
        clock["now"] += seconds
        for proc in procs:  # what each child's trainer writes once its vLLM engine is built
            up = plan[proc.only][0]
            arm, seed = proc.only.split("/")
            if up is not None and clock["now"] - started[proc.only] >= up and proc.returncode is None:
                (runs_mod.run_dir(tmp_path, arm, int(seed)) / ENGINE_READY_FILE).write_text("{}")

    monkeypatch.setattr(parallel.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(parallel, "time", SimpleNamespace(sleep=sleep, monotonic=lambda: clock["now"]))
    for seed in range(4):  # markers an earlier invocation left behind count for nothing
        folder = runs_mod.run_dir(tmp_path, "a", seed)
        folder.mkdir(parents=True)
        (folder / ENGINE_READY_FILE).write_text("{}")
    todo = [("a", s) for s in range(4)]
    with caplog.at_level("INFO"):
        failures = parallel.run_parallel(todo, "r.yaml", 1, tmp_path, [], 3, 10.0, 120.0)
    assert len(failures) == 1 and failures[0].startswith("a/seed-2 (exit 1")
    # a/1 waits for a/0's engine (70 s, not the 10 s gap); a/2 for a/1's, which never comes: the 120 s
    # timeout; a/3 for a free slot, which a/2 gives back when it fails before its engine is up.
    assert started["a/0"] == 0.0
    assert 70.0 <= started["a/1"] <= 71.0
    assert 120.0 <= started["a/2"] - started["a/1"] <= 121.0
    assert 15.0 <= started["a/3"] - started["a/2"] <= 16.0
    assert "a/seed-0: its rollout engine is up after 70 s" in caplog.text
    assert "a/seed-1: no engine_ready after 120 s" in caplog.text
    # Without a timeout (runs that do not share a GPU) only the gap counts.
    started.clear(), procs.clear()
    clock["now"] = 0.0
    parallel.run_parallel([("a", 0), ("a", 1)], "r.yaml", 1, tmp_path, [], 2, 10.0)
    assert started["a/1"] - started["a/0"] < 11.0


def _fake_gpu_children(
    monkeypatch: pytest.MonkeyPatch, out: Path, lifetime_s: float, engine_up_s: Callable[[str], float | None]
) -> list[tuple[float, str, str]]:
    """run_parallel's children faked on a fake clock: each lives ``lifetime_s`` and writes engine_ready (as
    rl.setup does) ``engine_up_s(its GPU)`` seconds after its start (None: never). Returns the list the
    starts go to, as (time, ARM/SEED, GPU)."""
    from qerl_cli.rl.setup import ENGINE_READY_FILE

    clock = {"now": 0.0}
    started: list[tuple[float, str, str]] = []
    procs: list[Any] = []

    class FakeProc:
        def __init__(self, command, env, **kwargs) -> None:
            self.only = command[command.index("--only") + 1]
            self.gpu = env["CUDA_VISIBLE_DEVICES"]
            self.born = clock["now"]
            self.returncode: int | None = None
            started.append((clock["now"], self.only, self.gpu))
            procs.append(self)

        def poll(self) -> int | None:
            if clock["now"] - self.born >= lifetime_s:
                self.returncode = 0
            return self.returncode

    def sleep(seconds: float) -> None:
        clock["now"] += seconds
        for proc in procs:
            up = engine_up_s(proc.gpu)
            if up is not None and clock["now"] - proc.born >= up and proc.returncode is None:
                arm, seed = proc.only.split("/")
                (runs_mod.run_dir(out, arm, int(seed)) / ENGINE_READY_FILE).write_text("{}")

    monkeypatch.setattr(parallel.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(parallel, "time", SimpleNamespace(sleep=sleep, monotonic=lambda: clock["now"]))
    return started


def test_runs_are_spread_over_the_gpus_each_seeing_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six runs, four at a time over GPUs 0 and 1: two on each, each child with CUDA_VISIBLE_DEVICES of
    its own GPU; the engine wait counts only the runs on the same GPU."""
    started = _fake_gpu_children(monkeypatch, tmp_path, 200.0, lambda gpu: 30.0)  # every engine up at 30 s
    todo = [("a", s) for s in range(6)]
    assert parallel.run_parallel(todo, "r.yaml", 6, tmp_path, [], 4, 5.0, 120.0, ["0", "1"]) == []
    first = started[:4]
    assert [gpu for _, _, gpu in first] == ["0", "1", "0", "1"]  # the least busy GPU first
    # The gap and the engine wait are each GPU's own: both GPUs' first runs start at once, the second run
    # on a GPU once the first one's engine there is up (30 s).
    assert first[1][0] < 1.0 and 30.0 <= first[2][0] <= 31.0 and 30.0 <= first[3][0] <= 31.0
    # Runs 5 and 6 start only when one of each GPU's two has finished, on the GPU it freed.
    later = started[4:]
    assert all(t >= 200.0 for t, _, _ in later) and sorted(g for _, _, g in later) == ["0", "1"]


def test_a_gpu_whose_engine_is_still_starting_does_not_hold_back_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 0's first engine never reports (it waits the whole timeout), GPU 1's is up after 20 s: GPU 1
    takes its second run at 20 s, not after GPU 0's 120 s (on a 4x H200 host, 18 runs once took 3 minutes
    to start, each start waiting on the least busy GPU's engine)."""
    started = _fake_gpu_children(monkeypatch, tmp_path, 300.0, lambda gpu: 20.0 if gpu == "1" else None)
    todo = [("a", s) for s in range(5)]
    assert parallel.run_parallel(todo, "r.yaml", 5, tmp_path, [], 5, 5.0, 120.0, ["0", "1"]) == []
    on = {gpu: [t for t, _, g in started if g == gpu] for gpu in ("0", "1")}
    assert on["1"][0] < 1.0 and 20.0 <= on["1"][1] <= 21.0  # GPU 1 does not wait for GPU 0's engine
    assert 120.0 <= on["0"][1] <= 121.0  # GPU 0's second run: after the timeout on its first one's engine
    assert len(started) == 5


def test_the_gpus_to_spread_runs_over(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parallel.visible_gpus("0, 2") == ["0", "2"]
    assert parallel.visible_gpus("GPU-3f2a,MIG-77") == ["GPU-3f2a", "MIG-77"]
    for bad in ("", "0,0", "cuda:1", "0;1"):
        with pytest.raises(QerlError, match="--gpus .* e.g. --gpus 0,1,2,3"):
            parallel.visible_gpus(bad)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert parallel.visible_gpus("auto") == ["4", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU (as CI runs): the children inherit that
    assert parallel.visible_gpus("auto") == []
    assert (parallel.runs_per_gpu(16, ["0", "1", "2", "3"]), parallel.runs_per_gpu(5, ["0", "1"])) == (4, 3)
    assert parallel.runs_per_gpu(3, []) == 3  # no GPU list: one device shared by all


def test_compare_shares_each_gpu_among_the_runs_spread_onto_it(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--jobs 6 over 2 GPUs: three runs share a GPU, so each gets 0.92 / 3 of it; --jobs 2 over 2 GPUs:
    each run alone on its GPU, the recipe as is."""
    recipe = _recipe(tmp_path, tiny_model_dir)
    sets = [*TINY_SETS, "rollout.engine=vllm"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # a machine with two GPUs (--gpus needs one)
    calls: list[tuple[list[str], int, list[str] | None]] = []
    monkeypatch.setattr(
        runner, "run_parallel",
        lambda todo, recipe, seeds, out, child_sets, width, interval=0.0, ready=None, gpus=None, **kw:
        calls.append((child_sets, width, gpus)) or [],
    )  # fmt: skip
    runner.run_compare(recipe, ["bf16-lora"], 6, tmp_path / "a", sets=sets, jobs=6, gpus="0,1",
                       summarize=False)  # fmt: skip
    child_sets, width, gpus = calls[0]
    assert (width, gpus) == (6, ["0", "1"]) and "train.gpu_fraction=0.306" in child_sets
    runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "b", sets=sets, jobs=2, gpus="0,1",
                       summarize=False)  # fmt: skip
    assert calls[1] == (sets, 2, ["0", "1"])
    with pytest.raises(QerlError, match="--gpus"):
        runner.run_compare(recipe, ["bf16-lora"], 2, tmp_path / "c", sets=sets, jobs=2, gpus="x")


@pytest.mark.slow
def test_compare_trains_the_control_arm_on_the_dense_copy(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    report = runner.run_compare(_recipe(tmp_path, tiny_model_dir), ["nvfp4-dequant-lora"], 1, out,
                                sets=[*TINY_SETS, "train.max_steps=2"]).report  # fmt: skip
    (row,) = report.arms
    assert row.base == "nvfp4 RTN dequantized to BF16" and row.steps == 2 and row.heldout_accuracy is not None
    conf = yaml.safe_load((out / "nvfp4-dequant-lora" / "seed-0" / "config.yaml").read_text())
    dense = str(out / "bases" / "nvfp4-dequantized")
    assert (conf["model"]["path"], conf["model"]["format"]) == (dense, "bf16")
    assert conf["aqn"]["enabled"] is False and "base" not in conf
    assert "| nvfp4-dequant-lora | nvfp4 RTN dequantized to BF16 | 1 |" in (out / "compare.md").read_text()


def test_an_arm_with_its_own_model_path_keeps_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    own = {"model.path": str(tmp_path / "elsewhere-nvfp4"), "model.format": "nvfp4"}
    data = {"model": {"path": str(tiny_model_dir)}}
    bases = runner.prepare_bases(data, {"mine": own}, TINY_SETS, tmp_path / "out")
    assert bases == {}  # nothing quantized for an arm that brings its base
    conf = runs_mod.arm_config(data, own, TINY_SETS, 0, tmp_path / "out", "mine", bases)
    assert conf.model.path == str(tmp_path / "elsewhere-nvfp4")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_bases_come_from_qerl_quantize_once(
    tiny_model_dir: Path, tmp_path: Path, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("llmcompressor", reason=f"base_method={method} needs llm-compressor (qerl[quantize])")
    from qerl_cli.data import calib_text
    from qerl_cli.files import is_complete_folder
    from qerl_cli.modeling.loading import detect_format, read_config

    # The wiring, not the calibration, is under test: a smaller calibration set than compare's own
    # (48 x 256 tokens: a minute of AWQ grid search in BF16 on a CPU), passed through as compare's.
    monkeypatch.setattr(calib_text, "SMALL_CALIB_SAMPLES", 8)
    monkeypatch.setattr(calib_text, "SMALL_CALIB_SEQ_LEN", 64)

    data = {"model": {"path": str(tiny_model_dir)}}
    arms = {"nvfp4-lora": arms_mod.BUILTIN_ARMS["nvfp4-lora"]}
    bases = runner.prepare_bases(data, arms, TINY_SETS, tmp_path / "out", method=method)
    awq = Path(bases["nvfp4-lora"])
    assert awq == tmp_path / "out" / "bases" / f"nvfp4-{method}" and is_complete_folder(awq)
    assert detect_format(read_config(awq)) == "nvfp4"
    report = json.loads((awq / "qerl_quant.json").read_text())
    calibration = report["calibration"]
    assert report["method"] == method and calibration["source"] == "qerl-text", calibration
    assert (calibration["requested_samples"], calibration["seq_len"]) == (8, 64), calibration
    stamp = (awq / "config.json").stat().st_mtime_ns
    assert runner.prepare_bases(data, arms, TINY_SETS, tmp_path / "out", method=method) == bases
    assert (awq / "config.json").stat().st_mtime_ns == stamp  # made once, then reused


def test_compare_settings_name_the_closest_key_and_check_the_base_method() -> None:
    with pytest.raises(QerlError, match=r"'compare.base_methd'; did you mean compare.base_method\?"):
        arms_mod.read_settings({"base_methd": "awq"})
    with pytest.raises(QerlError, match="compare.base_method must be one of gptq, awq, rtn, got 'gptx'"):
        arms_mod.read_settings({"base_method": "gptx"})
    with pytest.raises(QerlError, match=r"got 'rnt'; did you mean 'rtn'\?"):  # as every other choice says
        arms_mod.read_settings({"base_method": "rnt"})
    assert arms_mod.read_settings({"base_method": "gptq"}).base_method == "gptq"
    assert arms_mod.read_settings({"base_method": "awq"}).base_method == "awq"
    # Values are typed and checked like every recipe key.
    with pytest.raises(QerlError, match=r"'compare.heldout_problems' has value 'many' \(str\); expected int"):
        arms_mod.read_settings({"heldout_problems": "many"})
    with pytest.raises(QerlError, match="compare.heldout_problems and compare.heldout_samples must be > 0"):
        arms_mod.read_settings({"heldout_problems": 0})
    with pytest.raises(QerlError, match="compare.heldout_temperature must be >= 0"):
        arms_mod.read_settings({"heldout_temperature": -0.5})
    with pytest.raises(QerlError, match="compare.threshold must be a finite reward"):
        arms_mod.read_settings({"threshold": float("nan")})
    settings = arms_mod.read_settings({"threshold": 1, "heldout_temperature": 1})
    assert settings.threshold == 1.0 and isinstance(settings.heldout_temperature, float)


def _fake_runs(monkeypatch: pytest.MonkeyPatch, fail: tuple[str, int] | None = None) -> list:
    """run_one without training: writes a result.json (or raises for ``fail``), records the runs."""
    ran = []

    def fake_run(conf, settings, arm, progress, invocation=None, *, compare_dir):
        ran.append((arm, conf.train.seed))
        if (arm, conf.train.seed) == fail:
            raise QerlError("training diverged at step 2: the gradient norm is nan")
        result = RunResult(
            arm, conf.train.seed, [0.1, 0.3], [1.0, 0.9], _score(0.5, 0.1), device="CPU (test)"
        )
        (Path(conf.output.dir) / "result.json").parent.mkdir(parents=True, exist_ok=True)
        (Path(conf.output.dir) / "result.json").write_text(json.dumps(result.to_dict()))
        return result

    monkeypatch.setattr(runner, "run_one", fake_run)
    monkeypatch.setattr(heldout_mod, "base_entropy", lambda *a: {"exact_entropy": 1.5})
    return ran


def test_a_failed_run_costs_neither_the_others_nor_the_report(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on the H200: one of nine runs diverged; the rest must still run and be summarised."""
    ran = _fake_runs(monkeypatch, fail=("nvfp4-aqn", 1))
    monkeypatch.setattr(heldout_mod, "evaluate_heldout", lambda *a: _score(0.25, 0.05))
    out = tmp_path / "cmp"
    recipe = _recipe(tmp_path, tiny_model_dir)
    with pytest.raises(QerlError, match=r"1 of 4 runs failed: nvfp4-aqn/seed-1 \(training diverged.*"
                       r"compare.md covers the 3 finished runs.*run the same command again"):  # fmt: skip
        runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 2, out, sets=TINY_SETS)
    assert ran == [("bf16-lora", 0), ("nvfp4-aqn", 0), ("bf16-lora", 1), ("nvfp4-aqn", 1)]  # seed by seed
    assert "| nvfp4-aqn | nvfp4 RTN | 1 |" in (out / "compare.md").read_text()  # the one finished seed
    assert "| bf16-lora | bf16 | 2 |" in (out / "compare.md").read_text()


def test_a_base_that_cannot_be_evaluated_still_gets_a_report(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_runs(monkeypatch)

    def evaluate(conf, settings, adapter, target):
        if "nvfp4" in conf.model.path:
            raise RuntimeError("CUDA out of memory")
        return _score(0.25, 0.05)

    monkeypatch.setattr(heldout_mod, "evaluate_heldout", evaluate)
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    with pytest.raises(QerlError, match=r"Not evaluated: the base of nvfp4-aqn \(RuntimeError: CUDA out of"):
        runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 1, out, sets=TINY_SETS)
    table = (out / "compare.md").read_text()
    assert "| bf16-lora | bf16 | 1 | 0.300 | 25.0% ± 5.0 |" in table
    assert "| nvfp4-aqn | nvfp4 RTN | 1 | 0.300 | - |" in table
    assert len(list((out / "base-heldout").glob("*/heldout.json"))) == 1  # the failed one: retried next time


def test_base_figures_are_made_again_when_their_settings_change(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_runs(monkeypatch)
    evaluated = []
    monkeypatch.setattr(
        heldout_mod, "evaluate_heldout",
        lambda conf, settings, adapter, target: evaluated.append(settings.heldout_problems)
        or _score(0.25, 0.05),
    )  # fmt: skip
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    runner.run_compare(recipe, ["bf16-lora"], 1, out, sets=TINY_SETS)
    runner.run_compare(recipe, ["bf16-lora"], 1, out, sets=TINY_SETS)  # kept
    runner.run_compare(recipe, ["bf16-lora"], 1, out, sets=[*TINY_SETS, "compare.heldout_problems=3"])
    assert evaluated == [4, 3]


def test_compare_settings_refuse_reserved_arm_names_and_odd_keys() -> None:
    with pytest.raises(QerlError, match="compare.arms.bases: the output folder uses bases/ for itself"):
        arms_mod.read_settings({"arms": {"bases": {"aqn.enabled": True}}})
    with pytest.raises(QerlError, match=r"unknown config key 'compare.1'"):
        arms_mod.read_settings({1: "x"})
    with pytest.raises(QerlError, match="compare.arms must map arm names to overrides"):
        arms_mod.read_settings({"arms": ["mine"]})
    with pytest.raises(QerlError, match=r"compare.arms.mine must map config keys to values"):
        arms_mod.read_settings({"arms": {"mine": "aqn.enabled=true"}})


def test_runs_trained_on_another_base_are_flagged(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_runs(monkeypatch)
    monkeypatch.setattr(heldout_mod, "evaluate_heldout", lambda *a: _score(0.25, 0.05))
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    runner.run_compare(recipe, ["bf16-lora"], 1, out, sets=TINY_SETS)
    done = out / "bf16-lora" / "seed-0" / "result.json"
    done.write_text(json.dumps({**json.loads(done.read_text()), "model": "/old/base"}))  # e.g. an RTN base
    with caplog.at_level("WARNING"):
        runner.run_compare(recipe, ["bf16-lora"], 1, out, sets=TINY_SETS)
    assert "bf16-lora seed 0 was trained on /old/base, but the arm's base is now" in caplog.text


def test_parallel_runs_report_a_failed_child_and_summarise_the_rest(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--jobs N: children are separate processes; one exiting 2 is named, the others are summarised."""
    import sys

    def child(recipe, arm, seed_count, only, out, sets):
        seed = int(only.split("/")[1])
        result = {"arm": arm, "seed": seed, "reward": [0.2, 0.4], "entropy": [1.0, 0.8],
                  "heldout": {"pass@1": 0.5, "pass@1_se": 0.1}}  # fmt: skip
        target = out / arm / f"seed-{seed}" / "result.json"
        code = ("import sys; sys.exit(2)" if only == "bf16-lora/1"
                else f"open({str(target)!r}, 'w').write({json.dumps(json.dumps(result))})")  # fmt: skip
        return [sys.executable, "-c", code]

    monkeypatch.setattr(parallel, "_child_command", child)
    monkeypatch.setattr(heldout_mod, "evaluate_heldout", lambda *a: _score(0.25, 0.05))
    monkeypatch.setattr(heldout_mod, "base_entropy", lambda *a: {"exact_entropy": 1.5})
    out = tmp_path / "cmp"
    failed = r"1 of 4 runs failed: bf16-lora/seed-1 \(exit 2, see .*compare.log\)"
    with pytest.raises(QerlError, match=failed):
        runner.run_compare(_recipe(tmp_path, tiny_model_dir), ["bf16-lora", "nvfp4-aqn"], 2, out,
                           sets=TINY_SETS, jobs=2)  # fmt: skip
    table = (out / "compare.md").read_text()
    assert "| bf16-lora | bf16 | 1 |" in table and "| nvfp4-aqn | nvfp4 RTN | 2 |" in table


def test_awq_is_the_default_base_method_and_its_absence_is_explained(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hide_packages
) -> None:
    import inspect

    from qerl_cli.compare import bases as bases_mod

    assert arms_mod.read_settings(None).base_method == "awq"
    assert arms_mod.read_settings({"threshold": 0.5}).base_method == "awq"
    assert inspect.signature(runner.prepare_bases).parameters["method"].default == "awq"
    assert arms_mod.read_settings({"base_method": "rtn"}).base_method == "rtn"  # still an option
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    for name in ("smollm2_wordproblems.yaml", "gemma3_270m_wordproblems.yaml"):  # the real-model recipes
        assert runs_mod.load_recipe(recipes / name)[1].base_method == "awq", name
        # Their documented quantize step makes an AWQ base (qerl quantize's default method).
        assert "--format nvfp4 --calib qerl-text -o" in (recipes / name).read_text(), name
    hide_packages("llmcompressor")
    data = {"model": {"path": str(tiny_model_dir)}}
    arms = {"nvfp4-lora": arms_mod.BUILTIN_ARMS["nvfp4-lora"]}
    with pytest.raises(QerlError, match=r"making the nvfp4 AWQ base needs llm-compressor.*--method awq.*"
                       r"--set compare.base_method=rtn"):  # fmt: skip
        bases_mod.prepare_bases(data, arms, [], tmp_path / "out")
    given = {"a": str(tiny_model_dir)}
    labels = bases_mod.base_labels(given, {"a": {}}, given, tmp_path, "awq")
    assert labels == {"a": "bf16"}


def test_start_signal_columns_and_the_starving_base_warning(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The tiny model's compare with runs whose first steps had (almost) no groups with a reward spread."""
    no_spread = {"bf16-lora": [0.5, 0.75, 0.75], "nvfp4-aqn": [1.0, 0.5, 0.25]}

    def fake_run(conf, settings, arm, progress, invocation=None, *, compare_dir):
        result = RunResult(arm, conf.train.seed, [0.1, 0.3, 0.5], [1.0, 0.9, 0.8], _score(0.5, 0.1),
                           zero_std_group_fraction=no_spread[arm])  # fmt: skip
        (Path(conf.output.dir) / "result.json").parent.mkdir(parents=True, exist_ok=True)
        (Path(conf.output.dir) / "result.json").write_text(json.dumps(result.to_dict()))
        return result

    monkeypatch.setattr(runner, "run_one", fake_run)
    monkeypatch.setattr(heldout_mod, "base_entropy", lambda *a: {"exact_entropy": 1.5})
    monkeypatch.setattr(heldout_mod, "evaluate_heldout", lambda *a: _score(0.25, 0.05))
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    with caplog.at_level("WARNING"):
        report = runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 1, out, sets=TINY_SETS).report
    bf16, nvfp4 = report.arms
    # The first 10% of 3 steps is the first step: its reward and its share of groups without a spread.
    assert bf16.start_reward == pytest.approx(0.1) and bf16.start_no_spread_fraction == 0.5
    assert nvfp4.start_no_spread_fraction == 1.0 and nvfp4.base == "nvfp4 RTN"
    (warning,) = report.warnings
    assert warning.startswith("nvfp4-aqn (base nvfp4 RTN) starts with too little signal for GRPO: 0.0% of")
    assert "a GPTQ base (qerl quantize --method gptq" in warning and warning in caplog.text
    md = (out / "compare.md").read_text()
    assert "| 0.100 | 50.0% |" in md and "| 0.100 | 100.0% |" in md and "**Warning**: nvfp4-aqn" in md
    on_disk = json.loads((out / "compare.json").read_text())
    assert on_disk["base_method"] == "rtn" and on_disk == report.to_dict()
    assert json.dumps(CompareReport.from_dict(on_disk).to_dict()) == json.dumps(on_disk)  # key for key
    # A base whose groups mostly carry a spread is not warned about, and an AWQ base gets no AWQ hint.
    row = dataclasses.replace(
        nvfp4, arm="x", base="nvfp4 AWQ", start_no_spread_fraction=0.97, start_reward=0.0
    )
    (only,) = summary.signal_warnings([row])
    assert "3.0% of its groups" in only and "AWQ base" not in only
    assert summary.signal_warnings([dataclasses.replace(row, start_no_spread_fraction=0.7)]) == []
    assert summary.signal_warnings([dataclasses.replace(row, start_no_spread_fraction=0.9)]) == []  # a tenth
    older = dataclasses.replace(row, start_no_spread_fraction=None)  # results of an older qerl
    assert summary.signal_warnings([older]) == []


def test_compare_files_read_back_key_for_key(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compare.json, each base's heldout.json and each run's result.json keep their layout through the
    typed results; the files of an earlier qerl (committed in benchmarks/) still read."""
    _fake_runs(monkeypatch)
    monkeypatch.setattr(heldout_mod, "evaluate_heldout", lambda *a: _score(0.25, 0.05))
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    result = runner.run_compare(recipe, ["bf16-lora"], 1, out, sets=TINY_SETS)
    assert (result.output, result.runs, result.ran) == (str(out), 1, 1)
    (heldout,) = (out / "base-heldout").glob("*/heldout.json")
    files = {heldout: BaseHeldout, out / "bf16-lora" / "seed-0" / "result.json": RunResult,
             out / "compare.json": CompareReport}  # fmt: skip
    for path, kind in files.items():
        data = json.loads(path.read_text())
        assert json.dumps(kind.from_dict(data).to_dict()) == json.dumps(data), path
    assert list(json.loads(heldout.read_text())) == [
        "model", "device", "benchmark", "pass@1", "pass@1_se", "problems", "samples", "entropy", "settings",
    ]  # fmt: skip
    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "smollm2-h200-2026-11-23"
    old = CompareReport.from_dict(json.loads((committed / "compare.json").read_text()))
    assert old.arms[0].base is None and old.arms[0].heldout_accuracy is not None  # no base column yet
    for path in (committed / "base-heldout").glob("*/heldout.json"):
        assert 0.0 <= BaseHeldout.from_dict(json.loads(path.read_text())).heldout.pass_at_1 <= 1.0


def test_plan_runs_every_arm_of_a_seed_before_the_next_seed() -> None:
    """An ablation stopped part way (its GPU time ending) has compared every arm on its first seeds."""
    ablation = SimpleNamespace(arms={"a": {}, "b": {}, "c": {}}, seeds=2, base_seed=5)
    assert runner._plan(ablation, ["a", "b", "c"], None) == [
        ("a", 5),
        ("b", 5),
        ("c", 5),
        ("a", 6),
        ("b", 6),
        ("c", 6),
    ]
    assert runner._plan(ablation, ["a", "b", "c"], ["c/6", "a/5"]) == [("a", 5), ("c", 6)]


def test_signal_warning_names_arms_under_a_tenth_of_groups_with_a_spread() -> None:
    """Gemma 3 270M's AWQ NVFP4 base (6.2% of groups with a spread) starved; BF16 (29.2%) learned."""
    rows = [SimpleNamespace(arm=a, base=b, start_no_spread_fraction=f, start_reward=0.01)
            for a, b, f in (("bf16-lora", "bf16", 0.708), ("nvfp4-aqn", "nvfp4 AWQ", 0.938))]  # fmt: skip
    (warning,) = summary.signal_warnings(rows)
    assert warning.startswith("nvfp4-aqn (base nvfp4 AWQ) starts with too little signal for GRPO: 6.2% of")
    assert "(the BF16 arm's: 29.2%)" in warning
    assert "a GPTQ base (qerl quantize --method gptq" in warning and "lora.init: eora" in warning
    assert "more samples per prompt (rollout.num_generations: 16 instead of 8 doubled" in warning


def test_signal_warning_names_a_4bit_arm_far_behind_bf16_and_only_the_remedies_it_lacks() -> None:
    """Over a tenth of groups with a spread, but under half of BF16's: the base lost skill all the same."""
    rows = [SimpleNamespace(arm=a, base=b, start_no_spread_fraction=f, start_reward=0.05)
            for a, b, f in (("bf16-lora", "bf16", 0.5), ("gptq", "nvfp4 GPTQ", 0.8),
                            ("gptq-eora", "nvfp4 GPTQ + EoRA start", 0.7))]  # fmt: skip
    (warning,) = summary.signal_warnings(rows)  # 30% of BF16's 50% is over half of it: no warning
    assert warning.startswith("gptq (base nvfp4 GPTQ) starts with too little signal for GRPO: 20.0% of")
    assert "GPTQ base" not in warning and "lora.init: eora" in warning
    assert summary.signal_warnings(rows[1:]) == []  # no BF16 arm to compare with, and over a tenth
    rows[0].start_no_spread_fraction = None  # an older result: no BF16 figure to compare with
    assert summary.signal_warnings(rows) == []


# A committed `qerl eval --rescore` output: Gemma's nvfp4-lora seed 1, 0.0% -> 13.7% once its completions
# were graded without the few-shot stop string (the fix of 2026-11-24).
GEMMA = Path(__file__).resolve().parents[1] / "benchmarks" / "gemma3-270m-ablation-h100-2026-11-24"
RESCORED = GEMMA / "fixed-reward" / "nvfp4-lora" / "seed-1" / "heldout" / "results.json"


def _eval_results(folder: Path, pass_at_1: float, *, rescored: bool) -> None:
    """A complete results.json for the tiny task's held-out benchmark, re-graded or not."""
    data = json.loads(RESCORED.read_text())
    (score,) = data["benchmarks"].values()
    score["metrics"].update({"pass@1": pass_at_1, "pass@1_se": 0.05})
    data["benchmarks"] = {"synthetic-addition": score}
    if not rescored:
        del data["rescored"], data["rescored_from"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(data))


def test_a_rescored_heldout_evaluation_counts_with_its_new_grades(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`qerl eval --rescore` of a run's heldout/ (after a grader fix) changes what the report shows."""
    committed = HeldoutScore("synthetic-wordproblems", 0.0, 0.0, 256, 1).rescored(RESCORED.parent)
    assert committed.pass_at_1 == pytest.approx(0.1367, abs=1e-4) and committed.problems == 256
    run = tmp_path / "a" / "seed-0"
    run.mkdir(parents=True)
    result = RunResult("a", 0, [0.1, 0.2], [1.0, 1.0], _score(0.0, 0.0))
    (run / "result.json").write_text(json.dumps(result.to_dict()))
    _eval_results(run / "heldout", 0.25, rescored=False)  # the run's own: result.json holds it already
    assert summary.load_results(tmp_path, ["a"], [0])["a"][0].heldout.pass_at_1 == 0.0
    _eval_results(run / "heldout", 0.25, rescored=True)
    (loaded,) = summary.load_results(tmp_path, ["a"], [0])["a"]
    assert (loaded.heldout.pass_at_1, loaded.heldout.pass_at_1_se) == (0.25, 0.05)
    assert loaded.heldout.problems == 4  # what the evaluation was is kept
    other = dataclasses.replace(result.heldout, benchmark="gsm8k")  # another benchmark's grades: not these
    assert other.rescored(run / "heldout") == other
    assert "was re-graded but holds no gsm8k: the run's own figures are reported" in caplog.text


def test_a_rescored_base_evaluation_counts_with_its_new_grades(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_runs(monkeypatch)
    monkeypatch.setattr(heldout_mod, "evaluate_heldout", lambda *a: _score(0.25, 0.05))
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    first = runner.run_compare(recipe, ["bf16-lora"], 1, out, sets=TINY_SETS).report
    assert first.arms[0].base_heldout_accuracy == 0.25
    (folder,) = (out / "base-heldout").iterdir()  # then re-graded: qerl eval --rescore <folder>
    _eval_results(folder, 0.5, rescored=True)
    monkeypatch.setattr(heldout_mod, "evaluate_heldout", lambda *a: pytest.fail("evaluated again"))
    again = runner.run_compare(recipe, ["bf16-lora"], 1, out, sets=TINY_SETS).report
    assert again.arms[0].base_heldout_accuracy == 0.5


def test_plot_styles_stay_distinct_past_ten_arms() -> None:
    """The Gemma ablation has 11 arms: the eleventh took the first one's colour and line."""
    names = [f"arm-{i}" for i in range(23)]
    styles = plot.arm_styles(names)
    assert len(set(styles.values())) == len(names)
    assert styles["arm-0"] == ("C0", "-") and styles["arm-10"] == ("C0", "--")


def test_an_arm_with_a_lora_start_is_evaluated_from_it_before_training() -> None:
    """The base pass@1 of an EoRA arm is base + its stored start, where its runs begin."""
    from qerl_cli.config import TrainConfig

    conf = TrainConfig()
    conf.model.path = "/bases/nvfp4-gptq"
    assert heldout_mod.start_adapter(conf) is None
    conf.lora.init = "eora"
    assert heldout_mod.start_adapter(conf) == "/bases/nvfp4-gptq/lora_init"
    settings = arms_mod.read_settings(None)
    key = heldout_mod._base_eval_key(conf, settings, Path("/cmp"))
    assert key["lora_init"] == "eora"  # not the zeros arm's figure


def test_a_base_qerl_quantize_wrote_is_used_and_one_without_the_asked_start_is_refused(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hide_packages
) -> None:
    """Seen on an H100: a GPTQ base made by `qerl quantize -o DIR/bases/nvfp4-gptq` (where llm-compressor
    was, apart from vLLM) was refused by compare for want of compare's own completion marker."""
    pytest.importorskip("llmcompressor", reason="making the GPTQ base needs llm-compressor (qerl[quantize])")

    from qerl_cli.config import QuantizeConfig
    from qerl_cli.quantize import run_quantize

    def quantize(target: Path, lora_init: str) -> None:
        target.parent.mkdir(parents=True)
        run_quantize(QuantizeConfig(
            model=str(tiny_model_dir), format="nvfp4", method="gptq", calib="qerl-text", calib_field="text",
            num_samples=4, seq_len=32, output=str(target), device="cpu", lora_init=lora_init,
            lora_init_rank=4,
        ))  # fmt: skip

    data = {"model": {"path": str(tiny_model_dir)}}
    arms = {"g": {"model.format": "nvfp4", "base.method": "gptq"},
            "e": {"model.format": "nvfp4", "base.method": "gptq", "lora.init": "eora"}}  # fmt: skip
    target = tmp_path / "out" / "bases" / "nvfp4-gptq"
    quantize(target, "eora")
    other = tmp_path / "other" / "bases" / "nvfp4-gptq"
    quantize(other, "none")  # made before llm-compressor is hidden: quantize checks for it first
    hide_packages("llmcompressor")  # compare cannot make one here: it must take the one there
    assert runner.prepare_bases(data, arms, TINY_SETS, tmp_path / "out") == {
        "g": str(target),
        "e": str(target),
    }
    assert runner.prepare_bases(data, {"g": arms["g"]}, TINY_SETS, tmp_path / "other") == {"g": str(other)}
    with pytest.raises(QerlError, match=r"LoRA start \(lora.init, lora.rank\): zeros -> eora rank 4"):
        runner.prepare_bases(data, arms, TINY_SETS, tmp_path / "other")
    with pytest.raises(QerlError, match="ask for different LoRA starts"):
        runner.prepare_bases(
            data, {**arms, "s": {**arms["e"], "lora.init": "svd"}}, TINY_SETS, tmp_path / "x"
        )


def test_heldout_samples_beyond_one_sample_at_the_recipes_temperature() -> None:
    """One sample: greedy. k samples: the recipe's rollout temperature and top_p (the policy GRPO trains),
    unless compare.heldout_temperature says otherwise; k greedy copies of one answer are refused."""
    conf = SimpleNamespace(rollout=SimpleNamespace(temperature=0.7, top_p=0.95))
    sampling = heldout_mod.heldout_sampling
    assert sampling(conf, arms_mod.read_settings({})) == (0.0, 1.0)
    assert sampling(conf, arms_mod.read_settings({"heldout_samples": 4})) == (0.7, 0.95)
    hotter = arms_mod.read_settings({"heldout_samples": 4, "heldout_temperature": 1})
    assert sampling(conf, hotter) == (1.0, 0.95)
    assert sampling(conf, arms_mod.read_settings({"heldout_temperature": 0.5})) == (0.5, 1.0)
    with pytest.raises(QerlError, match="heldout_samples=4 at compare.heldout_temperature=0 would grade one"):
        arms_mod.read_settings({"heldout_samples": 4, "heldout_temperature": 0})


def test_a_sampled_heldout_evaluation_asks_qerl_eval_for_k_samples_at_temperature(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli import evaluation

    asked = []

    def fake_eval(eval_cfg, log):
        asked.append(eval_cfg)
        metrics = SimpleNamespace(pass_at_1=0.5, pass_at_1_se=0.1, num_problems=4)
        return SimpleNamespace(benchmarks={"synthetic-addition": SimpleNamespace(metrics=metrics)})

    monkeypatch.setattr(evaluation, "run_eval", fake_eval)
    data, settings = runs_mod.load_recipe(_recipe(tmp_path, tiny_model_dir, {"heldout_samples": 4}))
    conf = runs_mod.arm_config(data, {}, [*TINY_SETS, "rollout.temperature=0.9"], 0, tmp_path, "a", {})
    score = heldout_mod.evaluate_heldout(conf, settings, None, tmp_path / "heldout")
    (eval_cfg,) = asked
    assert (eval_cfg.samples, eval_cfg.temperature, eval_cfg.top_p) == (4, 0.9, conf.rollout.top_p)
    assert score.samples == 4 and score.pass_at_1 == 0.5
    greedy = heldout_mod._base_eval_key(conf, arms_mod.read_settings({}), tmp_path)
    assert greedy["heldout_temperature"] == 0.0 and "heldout_top_p" not in greedy  # kept keys unchanged


def test_the_logprob_gap_is_each_arms_mean_over_steps_and_seeds() -> None:
    """The rollout/trainer logprob gap of a run is its mean over steps (missing steps left out); an arm's is
    the mean over its seeds with their sd; an arm of older results without the figure has none."""
    gapped = [
        RunResult("a", 0, [0.1, 0.2], [1.0, 1.0], _score(0.5, 0.1), logprob_gap=[0.010, 0.014]),
        RunResult("a", 1, [0.1, 0.2], [1.0, 1.0], _score(0.5, 0.1), logprob_gap=[0.016, float("nan")]),
    ]
    rows, _ = arm_rows({"a": gapped, "b": [RunResult("b", 0, [0.1, 0.2], [1.0, 1.0], _score(0.4, 0.1))]}, 0.5)
    a, b = rows
    assert a.logprob_gap == pytest.approx(0.014)  # (0.012 + 0.016) / 2
    assert a.logprob_gap_sd == pytest.approx(0.002 * 2**0.5)
    assert b.logprob_gap is None and b.logprob_gap_sd is None
    assert RunResult.from_dict(gapped[0].to_dict()).logprob_gap == [0.010, 0.014]
    older = {k: v for k, v in gapped[0].to_dict().items() if k != "logprob_gap"}
    assert RunResult.from_dict(older).logprob_gap == []
