"""A short supervised warm start that gives a tiny random model something for RL to improve.

A randomly initialised model never samples a correct answer, so its reward is 0 everywhere and
GRPO has no signal (every group's advantage is 0). Real QeRL starts from a pretrained model that
already solves some problems; for the tiny offline model we stand in for pretraining with a few
steps of plain next-token training on worked synthetic problems (``reference_completion``), stopped
early on purpose: the result answers in the right format but is right only part of the time when
sampled at temperature 1, which is the regime RL improves. ``qerl demo`` says so in its output.

``prepare_tiny_base`` writes the warm-started model as a BF16 folder and, optionally, as an NVFP4
(compressed-tensors) folder: the same pipeline as for a real model (pretrained -> quantized -> RL).

``qerl tiny-base [OUT_DIR]`` (:func:`build_tiny_base`) builds the base that ``recipes/tiny.yaml`` uses.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from qerl_cli.data.problem import Problem
from qerl_cli.data.prompts import prompt_token_ids, render_prompt
from qerl_cli.data.synthetic import make_problems, reference_completion
from qerl_cli.errors import QerlError
from qerl_cli.files import file_given_for_folder, honour_umask, staged_folder
from qerl_cli.formats import check_names, model_names
from qerl_cli.formats.checkpoint import state_dict_groups, write_checkpoint
from qerl_cli.modeling.tiny import build_tiny_model, build_tokenizer, save_model_folder
from qerl_cli.modeling.work_folders import check_not_other_work
from qerl_cli.rewards.grading import is_correct
from qerl_cli.rollout import factory
from qerl_cli.rollout.base import SamplingSpec

DEFAULT_TASK = "synthetic-addition"
DEFAULT_TEMPLATE = "plain"
# A wrong worked answer is off by one of these: plausible slips, as in imperfect pretraining data.
NOISE_OFFSETS = (-2, -1, 1, 2)


@dataclass(frozen=True)
class WarmStartConfig:
    task: str = DEFAULT_TASK
    template: str = DEFAULT_TEMPLATE
    # Clean phase: stop as soon as the model, sampling at temperature 1, solves this share of a fixed
    # probe set of training problems (checked every ``check_every`` steps), or after ``max_steps``.
    # Tiny models learn this task abruptly (nothing, then most of it within ~100 steps), so a fixed
    # step count would land anywhere between 0% and 90%.
    target_accuracy: float = 0.7
    max_steps: int = 800
    check_every: int = 20
    probe_size: int = 32
    batch_size: int = 32
    learning_rate: float = 1e-3
    # Noisy phase: ``noisy_steps`` more steps where a share ``label_noise`` of the worked results are
    # off by 1 or 2 (see the module docstring).
    label_noise: float = 0.7
    noisy_steps: int = 100
    seed: int = 0


class _Examples:
    """Tokenized worked problems; a share ``label_noise`` of the draws carry a wrong result."""

    def __init__(self, problems: list[Problem], tokenizer: Any, template: str, label_noise: float) -> None:
        self.problems = problems
        self.tokenizer = tokenizer
        self.label_noise = label_noise
        self.prompts = [prompt_token_ids(p.question, tokenizer, template=template) for p in problems]
        # Each (problem, result) is tokenized once: a run draws every problem dozens of times.
        self._completions: dict[tuple[int, str | None], list[int]] = {}

    def draw(self, rng: random.Random) -> tuple[list[int], list[int]]:
        index = rng.randrange(len(self.problems))
        problem = self.problems[index]
        answer = None
        if rng.random() < self.label_noise:
            answer = str(int(problem.answer) + rng.choice(NOISE_OFFSETS))
        completion = self._completions.get((index, answer))
        if completion is None:
            text = reference_completion(problem, answer)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            completion = self._completions[(index, answer)] = [*ids, int(self.tokenizer.eos_token_id)]
        return self.prompts[index], completion


def sampled_accuracy(
    model: nn.Module,
    tokenizer: Any,
    problems: list[Problem],
    template: str,
    *,
    samples: int = 2,
    seed: int = 0,
    max_new_tokens: int = 64,
) -> float:
    """Share of ``samples`` temperature-1 completions per problem that math-verify grades correct."""
    engine = factory.make_engine(factory.EngineRequest(
        "hf", model=model, tokenizer=tokenizer, device=next(model.parameters()).device,
        generation_batch_size=128,
    ))  # fmt: skip
    prompts = [render_prompt(p.question, tokenizer, template=template) for p in problems]
    spec = SamplingSpec(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, seed=seed)
    result = engine.generate(prompts, samples, spec)
    # In-process grading is fine here: the answers are short integers the model wrote.
    correct = sum(is_correct(c.text, problems[i].answer) for i, c in result.flat())
    return correct / max(1, len(result.flat()))


@dataclass
class WarmStartResult:
    losses: list[float]
    clean_steps: int
    noisy_steps: int
    clean_accuracy: float  # probe accuracy when the clean phase ended
    final_accuracy: float  # probe accuracy of the returned model


def _batch_tensors(batch: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    width = max(len(p) + len(c) for p, c in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (p, c) in enumerate(batch):  # right padding: plain teacher forcing
        ids[row, : len(p) + len(c)] = torch.tensor(p + c)
        labels[row, len(p) : len(p) + len(c)] = torch.tensor(c)  # loss on the completion only
        attention[row, : len(p) + len(c)] = 1
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


def supervised_warm_start(
    model: nn.Module,
    tokenizer: Any,
    problems: list[Problem],
    cfg: WarmStartConfig,
    report: Callable[[str], None] | None = None,
) -> WarmStartResult:
    """Train ``model`` in place: clean worked problems until the probe accuracy reaches
    ``cfg.target_accuracy`` (or ``cfg.max_steps``), then ``cfg.noisy_steps`` steps on worked problems
    of which a share ``cfg.label_noise`` hold a slip. ``report`` gets a line at each probe check, so a
    log shows the minute of warm start move."""
    if not problems:
        raise QerlError("the warm start needs at least one problem")
    clean = _Examples(problems, tokenizer, cfg.template, 0.0)
    noisy = _Examples(problems, tokenizer, cfg.template, cfg.label_noise)
    probe = problems[: cfg.probe_size]
    pad = int(tokenizer.pad_token_id)
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    losses: list[float] = []

    def step(examples: _Examples) -> None:
        model.train()
        batch = _batch_tensors([examples.draw(rng) for _ in range(cfg.batch_size)], pad)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())

    accuracy = 0.0
    for n in range(1, cfg.max_steps + 1):
        step(clean)
        if n % cfg.check_every == 0 or n == cfg.max_steps:
            accuracy = sampled_accuracy(model, tokenizer, probe, cfg.template, seed=cfg.seed + n)
            if report is not None:
                report(
                    f"warm start step {n}: probe accuracy {accuracy:.0%} (done at {cfg.target_accuracy:.0%}, "
                    f"or step {cfg.max_steps})"
                )
            if accuracy >= cfg.target_accuracy:
                break
    clean_steps = len(losses)
    if report is not None and cfg.label_noise > 0:
        report(f"warm start: {cfg.noisy_steps} steps on worked additions with slips")
    for _ in range(cfg.noisy_steps if cfg.label_noise > 0 else 0):
        step(noisy)
    final = (
        sampled_accuracy(model, tokenizer, probe, cfg.template, seed=cfg.seed)
        if len(losses) > clean_steps
        else accuracy
    )
    model.eval()
    return WarmStartResult(losses, clean_steps, len(losses) - clean_steps, accuracy, final)


def prepare_tiny_base(
    out_dir: str | Path,
    cfg: WarmStartConfig | None = None,
    *,
    formats: tuple[str, ...] = ("bf16", "nvfp4"),
    report: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build the tiny model, warm-start it, and write ``out_dir/<format>`` for each format.

    Returns ``{"paths": {format: folder}, "warm_start": {...}, "losses": [...], "seconds": ...}``.
    """
    cfg = cfg or WarmStartConfig()
    check_names(formats, "tiny-base format", dense=True)
    start = time.perf_counter()
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    model = build_tiny_model(seed=cfg.seed).float()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        problems = make_problems(cfg.task, "train", seed=cfg.seed)
        result = supervised_warm_start(model, tokenizer, problems, cfg, report)
    model = model.to(torch.bfloat16)
    paths: dict[str, Path] = {}
    bf16_dir = save_model_folder(model, tokenizer, out / "bf16")
    record = {
        **asdict(cfg),
        "clean_steps": result.clean_steps,
        "noisy_steps_run": result.noisy_steps,
        "clean_accuracy": result.clean_accuracy,
        "final_accuracy": result.final_accuracy,
        "final_loss": result.losses[-1],
    }
    (bf16_dir / "warm_start.json").write_text(json.dumps(record, indent=2))
    if "bf16" in formats:
        paths["bf16"] = bf16_dir
    for fmt in formats:
        if fmt != "bf16":
            paths[fmt] = quantize_folder(bf16_dir, out / fmt, fmt)
    return {
        "paths": paths,
        "warm_start": record,
        "losses": result.losses,
        "seconds": time.perf_counter() - start,
    }


def quantize_folder(src: str | Path, dst: str | Path, fmt: str) -> Path:
    """Round-to-nearest 4-bit copy of a (small) BF16 model folder in ``fmt``'s checkpoint layout.

    Every ``nn.Linear`` weight except ``lm_head`` is quantized with qerl's bit-exact format code
    (NVFP4 fused q/k/v and gate/up groups share a global scale, as vLLM requires); embeddings and
    norms stay BF16. This is the in-memory path for tiny models; ``qerl quantize`` is the
    calibrated (AWQ) path for real ones.
    """
    src, dst = Path(src), Path(dst)
    state = load_file(str(src / "model.safetensors"))

    def groups() -> Iterator[tuple[dict[str, dict[str, torch.Tensor]], list[str]]]:
        for group in state_dict_groups(state):  # the *_proj linears; embeddings and norms stay BF16
            yield group, [n for n, p in group.items() if n.endswith("_proj") and _is_matrix(p.get("weight"))]

    write_checkpoint(dst, groups(), fmt, json.loads((src / "config.json").read_text()))
    for file in src.iterdir():
        if file.name not in ("model.safetensors", "config.json") and file.is_file():
            shutil.copy(file, dst / file.name)
    return honour_umask(dst)


def _is_matrix(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.dim() == 2


def build_tiny_base(
    out_dir: str | Path,
    *,
    formats: tuple[str, ...] = ("bf16", "nvfp4"),
    seed: int = 0,
    overwrite: bool = False,
    cfg: WarmStartConfig | None = None,
    report: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """``qerl tiny-base``: :func:`prepare_tiny_base` into ``out_dir``, refusing to replace an existing
    base unless ``overwrite``; ``report`` gets the warm start's progress lines. Returns
    ``{format: folder}``."""
    out = Path(out_dir)
    if not formats:
        raise QerlError("--formats is empty: give e.g. bf16,nvfp4")
    check_names(formats, dense=True, option="--formats")  # before the output folder is touched
    if out.exists() and not out.is_dir():
        raise file_given_for_folder(out, "", "a folder for the tiny base")
    existing = _existing_base(out)  # refuses a folder holding anything else, even with --overwrite
    if existing and not overwrite:
        raise QerlError(_existing_base_message(out, existing, formats))
    # Built beside the target and moved in once complete: a failed or interrupted rebuild leaves the
    # old base as it was. Each format folder replaces its namesake; the rest of the folder stays.
    with staged_folder(out, existing="merge") as staging:
        warm = cfg or WarmStartConfig(seed=seed)
        built = prepare_tiny_base(staging, warm, formats=formats, report=report)["paths"]
        for folder in set(staging.iterdir()) - set(built.values()):
            shutil.rmtree(folder)  # bf16 is always built (the others are quantized from it); not asked for
    for name in set(existing) - {Path(f).name for f in built.values()}:
        shutil.rmtree(out / name)  # formats of the old base that this one does not have
    return {fmt: out / Path(folder).name for fmt, folder in built.items()}


def _existing_base(out: Path) -> list[str]:
    """The format folders (bf16, nvfp4, ...) of an earlier base in ``out``: all that --overwrite may replace.
    Anything else there (a run, notes) is refused, --overwrite or not: `qerl tiny-base runs --overwrite`
    deleted every run in runs/, and the refusal listed the runs' names as formats to give."""
    if not out.is_dir():
        return []
    formats = model_names()
    base, other = [], []
    for entry in sorted(out.iterdir()):
        if entry.name.startswith("."):
            continue  # hidden (a file manager's): neither replaced nor removed, so nothing to lose
        if entry.name in formats and entry.is_dir() and not entry.is_symlink():
            # A format's name is not enough: it must hold a model (or nothing), not an adapter or notes.
            check_not_other_work(entry, "format folder", "give the tiny base a new or empty folder")
            if any(entry.iterdir()):  # an empty one is no earlier base, and holds nothing to lose
                base.append(entry.name)
        else:
            other.append(entry.name + "/" * entry.is_dir())
    if other:
        shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        raise QerlError(
            f"{out} holds {shown}, which qerl tiny-base did not write (it writes only the format folders "
            f"{', '.join(formats)}); nothing was changed, and --overwrite replaces only those folders: give "
            f"a new or empty folder, e.g. qerl tiny-base {out / 'tiny-base'}"
        )
    return base


def _existing_base_message(out: Path, existing: list[str], formats: tuple[str, ...]) -> str:
    """Why ``qerl tiny-base`` refuses ``out``, and what to give: --overwrite rebuilds the whole base and keeps
    only the formats asked for, so adding a format means asking for the old ones too."""
    held = ", ".join(existing)
    new = [fmt for fmt in formats if fmt not in existing]
    if not new:
        return f"{out} already holds {held}: it is built; to rebuild it, add --overwrite"
    every = ",".join(dict.fromkeys([*existing, *formats]))
    return (
        f"{out} already holds {held}, not {', '.join(new)}; nothing was changed. --overwrite rebuilds the "
        f"whole base with the --formats given and removes the others, so to add {', '.join(new)} run "
        f"qerl tiny-base {out} --formats {every} --overwrite"
    )
