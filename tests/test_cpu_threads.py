"""The CPU paths' thread count: the cores free now, never more than torch's own count, an explicit
QERL_NUM_THREADS / OMP_NUM_THREADS respected, and every CPU command wired to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_cli import torch_utils
from qerl_cli.cli import main
from qerl_cli.errors import QerlError
from qerl_cli.torch_utils import CpuLoad, choose_cpu_threads

REPO = Path(__file__).resolve().parents[1]


def machine(
    cores: int = 2, load: float = 0.0, others: int = 0, default: int | None = None, quota: float | None = None
) -> CpuLoad:
    """``load``: cores other processes kept busy during the reading; ``others``: their runnable threads."""
    return CpuLoad(cores, quota, load, others, cores if default is None else default)


@pytest.mark.parametrize(
    ("view", "threads"),
    [
        (machine(load=0.1), 2),  # an idle 2-core machine: both cores
        (machine(load=1.0, others=1), 1),  # the case: one CPU-bound process beside
        (machine(load=0.05, others=1), 1),  # that process just started: runnable now, little CPU time yet
        (machine(load=1.0, others=0), 1),  # it was busy during the window, not runnable at the samples
        (machine(load=9.0, others=8), 1),  # never below one thread
        (machine(cores=16, default=8), 8),  # never more than torch's own (physical-core) count
        (machine(cores=4, load=1.2), 3),  # a core counts as free when 3/4 of it is
        (machine(cores=4, load=1.6), 2),
        (machine(cores=64, default=32, quota=4.0), 4),  # a container: its CPU quota caps the count
        (machine(cores=64, default=32, quota=2.0, load=32.0, others=30), 1),  # the host's load, scaled
    ],
)
def test_threads_are_the_cores_free_now(view: CpuLoad, threads: int) -> None:
    choice = choose_cpu_threads(view, {})
    assert choice.threads == threads
    assert choice.lowered == (threads < view.torch_default)
    assert "QERL_NUM_THREADS=N" in choice.reason  # the message says how to choose otherwise


def test_an_explicit_count_wins() -> None:
    busy = machine(load=1.0, others=1)
    choice = choose_cpu_threads(busy, {"QERL_NUM_THREADS": "2", "OMP_NUM_THREADS": "1"})
    assert choice.threads == 2 and "QERL_NUM_THREADS" in choice.reason
    # OMP_NUM_THREADS alone: torch has read it already, and its count stands.
    choice = choose_cpu_threads(machine(load=1.0, others=1, default=3), {"OMP_NUM_THREADS": "3"})
    assert choice.threads == 3 and not choice.lowered and "OMP_NUM_THREADS" in choice.reason


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_explicit_count_is_a_user_error(value: str) -> None:
    with pytest.raises(QerlError, match=f"QERL_NUM_THREADS must be a positive whole number.*'{value}'"):
        choose_cpu_threads(machine(), {"QERL_NUM_THREADS": value})


def test_the_cgroup_quota_is_read(tmp_path: Path) -> None:
    assert torch_utils._cgroup_quota_cores(tmp_path) is None  # no cgroup files: unlimited
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert torch_utils._cgroup_quota_cores(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert torch_utils._cgroup_quota_cores(tmp_path) == 2.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert torch_utils._cgroup_quota_cores(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    assert torch_utils._cgroup_quota_cores(v1) == 2.0


def test_the_load_is_read_from_this_machine() -> None:
    view = torch_utils.read_cpu_load(samples=2, interval_s=0.01)
    assert view.cores >= 1 and view.busy_others >= 0.0 and view.runnable_others >= 0
    assert view.torch_default == torch.get_num_threads()


def test_only_other_processes_cpu_time_counts(tmp_path: Path) -> None:
    """The busy cores are the machine's CPU time less this process's own, over the window: not the load
    average, which still counts the user's previous command after it ended."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 0 0 0 0 0 0 0 0 0\ncpu1 1 0 0 0 0 0 0 0 0 0\n")
    before = torch_utils._stat_jiffies(stat)
    assert before == (150, 1000, 2)
    # 100 ticks later on 2 CPUs (200 CPU ticks): 120 busy, of which 80 were this process's.
    stat.write_text("cpu  200 0 70 860 70 0 0 0 0 0\ncpu0 1 0 0 0 0 0 0 0 0 0\ncpu1 1 0 0 0 0 0 0 0 0 0\n")
    after = torch_utils._stat_jiffies(stat)
    assert torch_utils.others_busy_cores(before, after, own_ticks=80) == pytest.approx(0.4)
    assert torch_utils.others_busy_cores(before, after, own_ticks=120) == 0.0  # an idle machine but us
    assert choose_cpu_threads(machine(load=0.0, others=0), {}).threads == 2  # whatever the load average
    own = tmp_path / "self"
    own.write_text("42 (a (b) c) R 1 2 3 4 5 6 7 8 9 10 17 5 0 0 20 0 1 0\n")
    assert torch_utils._own_jiffies(own) == 22


def test_the_choice_is_made_once_and_set(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(torch_utils, "_chosen", None)
    try:
        assert torch_utils.use_free_cpu_threads({"QERL_NUM_THREADS": "1"}).threads == 1
        assert torch.get_num_threads() == 1
        # The first CPU path decides; a second reading would count this process as other work.
        assert torch_utils.use_free_cpu_threads({"QERL_NUM_THREADS": "2"}).threads == 1
    finally:
        torch.set_num_threads(before)


def test_runs_on_cpu() -> None:
    assert torch_utils.runs_on_cpu("cpu") and torch_utils.runs_on_cpu("cpu:0")
    assert not torch_utils.runs_on_cpu("cuda") and not torch_utils.runs_on_cpu("cuda:1")
    assert torch_utils.runs_on_cpu("auto") == (not torch.cuda.is_available())


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--steps", "1", "-o", "out"],
        ["tiny-base", "out"],
        ["train", str(REPO / "recipes" / "tiny.yaml"), "--set", "output.dir=out"],
        ["eval", "tiny", "--engine", "hf", "--set", "device=cpu", "--benchmarks", "gsm8k", "-o", "out"],
        pytest.param(
            ["compare", str(REPO / "recipes" / "tiny.yaml"), "-o", "out"],
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="each run chooses on a GPU"),
        ),
    ],
    ids=["demo", "tiny-base", "train", "eval", "compare"],
)
def test_every_cpu_path_chooses_its_threads(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each CPU command reaches the thread choice before any work: a bad QERL_NUM_THREADS stops it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch_utils, "_chosen", None)
    monkeypatch.setenv("QERL_NUM_THREADS", "none")
    assert main(argv) == 2
    assert "QERL_NUM_THREADS must be a positive whole number" in " ".join(capsys.readouterr().err.split())
    assert list(tmp_path.iterdir()) == []  # nothing was built or written


def test_tiny_base_help_says_what_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tiny-base", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    # What it does, and where the times measured are (figures live in the docs, not in --help).
    assert "runs torch on the CPU cores free when it starts" in text and "docs/tools.md" in text
    assert "QERL_NUM_THREADS" in text
    tools = (Path(__file__).resolve().parents[1] / "docs" / "tools.md").read_text()
    assert "about a minute on 2 free cores" in " ".join(tools.split()) and "one of 2 cores busy" in tools
