"""Where training metrics go: ``metrics.jsonl`` always, ``completions.jsonl`` (a few graded completions a
step, ``output.log_completions``), TensorBoard / Weights & Biases on request, and a PNG of reward, entropy
and AQN sigma per step at the end.

TensorBoard, wandb and matplotlib are optional and imported only when used.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, TextIO

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from qerl_cli.errors import QerlError
from qerl_cli.modeling.run_layout import METRICS_FILE
from qerl_cli.rollout.base import NOISE_SIGMA
from qerl_cli.torch_utils import duration

log = logging.getLogger(__name__)

COMPLETIONS_FILE = "completions.jsonl"
PLOT_FILE = "training_curves.png"
# The AQN sigma a step's rollouts were sampled with is logged under the engines' name, NOISE_SIGMA. Runs
# written before that also logged it as "aqn_sigma", and the oldest only so: readers still accept it.
OLD_SIGMA_KEYS = ("aqn_sigma",)
# The parts of a GRPO step the trainer times (``Trainer.train_step``), in the order they run: AQN (its
# probe and the noise), the rollouts and their rewards, the engine's sleep, the update (the old-policy
# logprobs, then forward, backward and optimizer), the engine's wake-up, the adapter sync with its
# staleness probe. Each second is in one part only; with the step's bookkeeping (advantages, the
# scheduler, memory release, its figures: :func:`step_other_s`) they add up to ``time_step_s``.
STEP_PARTS = ("time_aqn_s", "time_rollout_s", "time_reward_s", "time_sleep_s", "time_logprobs_s",
              "time_update_s", "time_wake_s", "time_sync_s")  # fmt: skip


def step_other_s(record: dict[str, Any]) -> float | None:
    """Seconds of a step's record outside its timed parts (None for a record without ``time_step_s``)."""
    if "time_step_s" not in record:
        return None
    return float(record["time_step_s"]) - sum(float(record.get(k, 0.0)) for k in STEP_PARTS)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the information as text
    return value


def step_sigma(record: dict[str, Any]) -> float:
    """The AQN sigma of one ``metrics.jsonl`` record, under its name or an old one (0 without any)."""
    for name in (NOISE_SIGMA, *OLD_SIGMA_KEYS):
        if name in record:
            return float(record[name])
    return 0.0


NONFINITE_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # as _jsonable writes them


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl``, in order; a NaN/inf the logger wrote as text is a float again
    (a skipped step's reward, say), so the figures and curves read numbers."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):  # the last write, cut short (a full disk, a kill): not a record yet
                break
            raise QerlError(
                f"{path} line {number} is not a JSON record ({exc.msg}): the file was changed by hand or "
                "damaged; mend or remove that line"
            ) from None
    return [{k: NONFINITE_TEXT.get(v, v) if isinstance(v, str) else v for k, v in r.items()} for r in records]


class MetricsLogger:
    """Appends one JSON line per step; forwards numbers to TensorBoard / wandb when enabled.

    ``resume_step``: records after that step (written by the interrupted run after its last
    checkpoint) are dropped, so the file reads as one uninterrupted run.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        resume_step: int | None = None,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "qerl",
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        self.completions_path = self.out_dir / COMPLETIONS_FILE
        for path in (self.path, self.completions_path):
            if resume_step is None:
                path.write_text("")
            else:
                kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
                path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._tb = self._open_tensorboard() if tensorboard else None
        self._wandb = self._open_wandb(wandb_project, run_config or {}) if wandb else None

    def _open_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise QerlError("output.tensorboard=true needs TensorBoard: pip install tensorboard") from None
        return SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))

    def _open_wandb(self, project: str, run_config: dict[str, Any]) -> Any:
        try:
            import wandb
        except ImportError:
            raise QerlError("output.wandb=true needs Weights & Biases: pip install wandb") from None
        return wandb.init(project=project, dir=str(self.out_dir), config=run_config, resume="allow")

    def log(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        step = int(record["step"])
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "step"}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def log_completions(self, step: int, groups: list[dict[str, Any]]) -> None:
        """One line per prompt group: the step, the problem, its completions and their rewards."""
        if groups:
            with self.completions_path.open("a") as fh:
                fh.writelines(json.dumps({"step": step, **group}) + "\n" for group in groups)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def plot_training_curves(records: list[dict[str, Any]], out_path: str | Path) -> Path | None:
    """Reward (and accuracy), rollout entropy and AQN sigma per step; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: skipping %s (pip install matplotlib)", Path(out_path).name)
        return None
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot(steps, [r.get("reward_mean", float("nan")) for r in records], label="reward mean")
    axes[0].plot(steps, [r.get("accuracy", float("nan")) for r in records], label="accuracy", alpha=0.7)
    axes[0].set_ylabel("reward")
    axes[0].legend(loc="lower right")
    axes[1].plot(steps, [r.get("entropy", float("nan")) for r in records], color="tab:orange")
    axes[1].set_ylabel("rollout entropy\n(nats/token)")
    axes[2].plot(steps, [step_sigma(r) for r in records], color="tab:green", drawstyle="steps-post")
    axes[2].set_ylabel("AQN sigma")
    axes[2].set_xlabel("training step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("qerl training")
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def progress_bar(enabled: bool, total: int, done: int, stream: TextIO | None = None) -> Any:
    """A context manager yielding ``update(record)``: a rich bar with ETA on a terminal, a log line per
    step where stdout is not one (CI logs, ``| tee``, ``nohup``: a live bar there prints nothing until
    the end), or a no-op."""
    if not enabled:
        return nullcontext(lambda record: None)
    out = stream if stream is not None else sys.stdout
    if not out.isatty():
        return nullcontext(StepLines(total, done, out))

    @contextmanager
    def bar():
        with Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
        ) as prog:
            task = prog.add_task("", total=total, completed=done)

            def update(record: dict[str, Any]) -> None:
                prog.update(task, advance=1, description=_figures(record))

            yield update

    return bar()


def _figures(record: dict[str, Any]) -> str:
    return (
        f"reward {record.get('reward_mean', 0):.3f} acc {record.get('accuracy', 0):.3f} "
        f"sigma {step_sigma(record):.1e}"
    )


class StepLines:
    """Progress as plain lines, flushed as they happen: ``train step 3/60 reward ... step 2.1s eta 2m05s``.

    Every step gets a line unless steps come faster than ``every_s`` apart (then the first, the last and
    one each ``every_s``), so a log shows progress without a line per millisecond."""

    def __init__(self, total: int, done: int, out: TextIO, every_s: float = 5.0) -> None:
        self.total, self.done, self.out, self.every_s = total, done, out, every_s
        self.start = time.monotonic()
        self.first = done
        self.last_line = float("-inf")

    def __call__(self, record: dict[str, Any]) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last_line < self.every_s and self.done not in (self.first + 1, self.total):
            return
        self.last_line = now
        per_step = (now - self.start) / (self.done - self.first)
        step_s = float(record.get("time_step_s", per_step))
        eta = duration(per_step * (self.total - self.done))
        self.out.write(
            f"train step {self.done}/{self.total} {_figures(record)} step {step_s:.1f}s eta {eta}\n"
        )
        self.out.flush()
