"""Held-out evaluation: a run's adapter or an untrained base on the held-out split (via ``qerl eval``),
and each base's rollout entropy before training, kept in ``DIR/base-heldout``."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

from qerl_cli import evaluation
from qerl_cli.compare.base_identity import base_identity
from qerl_cli.compare.entropy import rollout_entropy
from qerl_cli.compare.results import BaseHeldout, HeldoutScore
from qerl_cli.compare.runs import arm_config
from qerl_cli.compare.settings import CompareSettings
from qerl_cli.config import EvalConfig, TrainConfig
from qerl_cli.config.choices import LinearBackend
from qerl_cli.data.benchmarks import benchmark_spec, load_benchmark
from qerl_cli.data.prompts import render_prompt
from qerl_cli.errors import QerlError
from qerl_cli.evaluation.run import resolve_engine
from qerl_cli.files import write_json
from qerl_cli.modeling.error_init import init_folder
from qerl_cli.modeling.loading import load_tokenizer
from qerl_cli.torch_utils import device_label, free_accelerator_memory

log = logging.getLogger(__name__)
BASE_RESULT_NAME = "heldout.json"


def heldout_benchmark(conf: TrainConfig) -> str:
    name = conf.data.dataset
    if name.startswith("synthetic-") or benchmark_spec(name) is not None:
        return name
    raise QerlError(
        f"qerl compare evaluates on a held-out split; data.dataset={name!r} has none built in "
        "(use a synthetic-* task or a registered benchmark)"
    )


def heldout_sampling(conf: TrainConfig, settings: CompareSettings) -> tuple[float, float]:
    """(temperature, top_p) of the held-out evaluation: greedy for one sample a problem; for k > 1 the
    recipe's rollout temperature and top_p (the policy as GRPO samples it), unless
    ``compare.heldout_temperature`` is set."""
    if settings.heldout_temperature is not None:
        temperature = settings.heldout_temperature
    else:
        temperature = conf.rollout.temperature if settings.heldout_samples > 1 else 0.0
    return temperature, conf.rollout.top_p if settings.heldout_samples > 1 else 1.0


def evaluate_heldout(
    conf: TrainConfig, settings: CompareSettings, adapter: str | None, out: Path,
    linear_backend: str | None = None,
) -> HeldoutScore:  # fmt: skip
    """pass@1 (with its standard error) on the held-out split, via qerl eval (no adapter: the base): each
    problem's share of correct answers among ``compare.heldout_samples``, averaged over the problems.
    ``linear_backend``: what the run's rollout engine resolved ``rollout.linear_backend`` to (a vLLM
    evaluation serves the adapter with the same kernels; None: the recipe's setting)."""

    eval_cfg = heldout_eval_config(conf, settings, adapter, out, linear_backend)
    bench = eval_cfg.benchmarks[0]
    results = evaluation.run_eval(eval_cfg, log=lambda message: log.info("%s", message))
    metrics = results.benchmarks[bench].metrics
    return HeldoutScore(
        benchmark=bench,
        pass_at_1=metrics.pass_at_1,
        pass_at_1_se=metrics.pass_at_1_se,
        problems=metrics.num_problems,
        samples=settings.heldout_samples,
        engine=eval_cfg.engine,
    )


def heldout_eval_config(
    conf: TrainConfig, settings: CompareSettings, adapter: str | None, out: Path,
    linear_backend: str | None = None,
) -> EvalConfig:  # fmt: skip
    """The ``qerl eval`` settings of a held-out evaluation on ``compare.heldout_engine``.

    ``vllm`` serves the base as the arm's rollouts did: the run's linear backend (``linear_backend``, when
    it is a ``rollout.linear_backend`` value, else the recipe's: ``auto`` resolves again for the eval's
    own batch), the recipe's ``rollout.vllm_kwargs``, and the run's vLLM share where it is a number (the
    one compare gives each run sharing a GPU); ``auto``, a share sized around the trainer, leaves the
    eval's own default, as nothing else holds the GPU once training is done."""

    bench = heldout_benchmark(conf)
    temperature, top_p = heldout_sampling(conf, settings)
    eval_cfg = EvalConfig(
        model=conf.model.path, adapter=adapter, benchmarks=[bench], samples=settings.heldout_samples,
        engine="hf", output=str(out), temperature=temperature, top_p=top_p,
        max_new_tokens=conf.rollout.max_completion_length, max_problems=settings.heldout_problems,
        seed=conf.train.seed, template=conf.data.template, system_prompt=conf.data.system_prompt,
        grader_workers=max(1, conf.reward.grader_workers), device=conf.train.device, dtype=conf.model.dtype,
        generation_batch_size=conf.rollout.generation_batch_size,
    )  # fmt: skip
    if settings.heldout_engine == "hf":
        return eval_cfg
    r = conf.rollout
    backend = linear_backend if linear_backend in get_args(LinearBackend) else r.linear_backend
    share = r.gpu_memory_utilization
    return replace(
        eval_cfg, engine="vllm", linear_backend=backend, vllm_kwargs=dict(r.vllm_kwargs),
        trust_remote_code=conf.model.trust_remote_code,
        gpu_memory_utilization=EvalConfig.gpu_memory_utilization if share == "auto" else float(share),
        # A run sharing the GPU (compare's train.gpu_fraction < 1) sizes the KV cache from its share, as
        # its training engine did: profiling would read the neighbours' memory as its own.
        kv_cache_from_share=conf.train.gpu_fraction < 1,
    )  # fmt: skip


def check_heldout_engine(settings: CompareSettings, rollout_engines: dict[str, str]) -> None:
    """Refuse, before anything trains, a held-out engine the comparison cannot use: ``vllm`` for an arm
    whose rollouts run on hf (``rollout_engines``: each arm's; its scores would come from other kernels
    than its rollouts' and its reference's), or on a machine without vLLM or a CUDA GPU (found now, not
    after every run trained)."""

    if settings.heldout_engine == "hf":
        return
    on_hf = [arm for arm, engine in rollout_engines.items() if engine != "vllm"]
    if on_hf:
        raise QerlError(
            f"compare.heldout_engine=vllm evaluates every run on vLLM, but arm(s) {', '.join(on_hf)} train "
            "with rollout.engine=hf: the comparison would evaluate those arms differently from how it "
            "trains them. Set rollout.engine=vllm (in the recipe or --set rollout.engine=vllm) or leave "
            "compare.heldout_engine at hf"
        )
    try:
        resolve_engine("vllm")
    except QerlError as exc:
        raise QerlError(
            f"compare.heldout_engine=vllm cannot evaluate on this machine (qerl eval's check: {exc}). Run "
            "the comparison on a CUDA GPU with vLLM installed, or leave compare.heldout_engine at hf"
        ) from None


def _base_eval_key(conf: TrainConfig, settings: CompareSettings, out: Path) -> dict[str, Any]:
    """Everything an untrained base's held-out figures depend on: a change to any of it re-evaluates. The
    base by its portable identity (:mod:`~qerl_cli.compare.base_identity`): the comparison in ``out``
    copied elsewhere, or reported under another cache, finds its figures."""
    d, r = conf.data, conf.rollout
    temperature, top_p = heldout_sampling(conf, settings)
    # top_p only where it is not 1 (sampled): the keys of greedy evaluations stay what they were, so
    # their kept figures are not made again.
    sampled = {"heldout_top_p": top_p} if top_p != 1.0 else {}
    return {
        "model": base_identity(conf.model.path, out), "dtype": conf.model.dtype, "dataset": d.dataset,
        "template": d.template, "system_prompt": d.system_prompt,
        "max_completion_length": r.max_completion_length, "seed": conf.train.seed,
        "heldout_problems": settings.heldout_problems,
        "heldout_samples": settings.heldout_samples, "heldout_temperature": temperature,
        "entropy_prompts": ENTROPY_PROMPTS, "entropy_samples": ENTROPY_SAMPLES, "lora_init": conf.lora.init,
        **sampled, **_engine_key(conf, settings),
    }  # fmt: skip


def _engine_key(conf: TrainConfig, settings: CompareSettings) -> dict[str, Any]:
    """The held-out engine's part of a base's key: nothing for hf, so the figures earlier comparisons kept
    (all on hf) are still found; for vllm the engine and the kernels it serves the base with, so neither
    engine's figures stand in for the other's."""
    if settings.heldout_engine == "hf":
        return {}
    return {"heldout_engine": settings.heldout_engine, "linear_backend": conf.rollout.linear_backend}


def read_base_heldout(folder: Path) -> BaseHeldout:
    """A base's kept figures (``DIR/base-heldout/<base>/``), with its evaluation's new grades if it was
    re-graded since (``qerl eval --rescore`` of that folder)."""
    kept = BaseHeldout.from_dict(json.loads((folder / BASE_RESULT_NAME).read_text()))
    return replace(kept, heldout=kept.heldout.rescored(folder))


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]


def _kept_figures_folder(conf: TrainConfig, key: dict[str, Any], out: Path) -> Path:
    """``DIR/base-heldout/<base>-<digest of key>``, or a kept folder whose settings are ``key`` once its
    base is read as an identity: one an earlier qerl named by the digest of the base's path as given (the
    base's absolute path, or a GGUF folder named by the file's path and mtime) stays found."""
    target = out / "base-heldout" / f"{Path(conf.model.path).name}-{_digest(key)}"
    if (target / BASE_RESULT_NAME).is_file():
        return target
    for kept in sorted((out / "base-heldout").glob(f"*/{BASE_RESULT_NAME}")):
        settings = json.loads(kept.read_text()).get("settings") or {}
        if "model" in settings and {**settings, "model": base_identity(settings["model"], out)} == key:
            return kept.parent
    return target


def evaluate_bases(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], sets: list[str], seed: int, out: Path,
    bases: dict[str, str], settings: CompareSettings, *, evaluate: bool = True,
) -> tuple[dict[str, BaseHeldout | None], list[str]]:  # fmt: skip
    """({arm: held-out pass@1 and entropy of its base before training, None when that failed},
    failures): where each arm started.

    Evaluated once per distinct (base, evaluation settings): arms differing only in AQN share one
    (evaluation adds no noise). Kept in ``DIR/base-heldout`` with the settings it was made with, so a
    resumed compare does not evaluate again unless they changed. A base that cannot be evaluated is
    reported as a failure; the others and the report go on. With ``evaluate`` off nothing is evaluated:
    a base without kept figures is None.
    """

    by_key: dict[str, BaseHeldout | None] = {}
    found: dict[str, BaseHeldout | None] = {}
    failures: list[str] = []
    for arm, overrides in arms.items():
        conf = arm_config(data, overrides, sets, seed, out, arm, bases)
        key = _base_eval_key(conf, settings, out)
        digest = _digest(key)
        if digest not in by_key:
            target = _kept_figures_folder(conf, key, out)
            done = target / BASE_RESULT_NAME
            if done.is_file():
                by_key[digest] = read_base_heldout(target)
            elif not evaluate:  # a report of runs made elsewhere: the figures kept, or none
                by_key[digest] = None
            else:
                log.info("%s: evaluating its base %s before training", arm, conf.model.path)
                try:
                    figures = evaluate_heldout(conf, settings, start_adapter(conf), target)
                    entropy = base_entropy(conf, settings)
                except Exception as exc:  # noqa: BLE001 - one base must not cost the report
                    log.error("%s: its base could not be evaluated: %s", arm, exc)
                    failures.append(f"the base of {arm} ({type(exc).__name__}: {exc})")
                    by_key[digest] = None
                    free_accelerator_memory()
                else:
                    result = BaseHeldout(key["model"], device_label(conf.train.device), figures, entropy, key)
                    by_key[digest] = result
                    write_json(done, result.to_dict())
        found[arm] = by_key[digest]
    return found, failures


def start_adapter(conf: TrainConfig) -> str | None:
    """The adapter a run starts from: none (PEFT's zeros), or the base's stored error-compensating start
    (lora.init), whose held-out score is where such an arm begins."""

    return None if conf.lora.init == "zeros" else str(init_folder(conf.model.path))


# The paper's entropy claim, measured on each untrained base: held-out prompts x samples at temperature 1.
ENTROPY_PROMPTS = 32
ENTROPY_SAMPLES = 4


def base_entropy(conf: TrainConfig, settings: CompareSettings) -> dict[str, Any]:
    """Rollout entropy of ``conf``'s base (no adapter, no noise) on the first held-out prompts; with a
    LoRA start (lora.init) the bare base's still: the entropy measure takes no adapter."""

    problems = load_benchmark(heldout_benchmark(conf), None, min(ENTROPY_PROMPTS, settings.heldout_problems))
    tokenizer = load_tokenizer(conf.model.path)
    data = conf.data
    prompts = [render_prompt(p.question, tokenizer, data.template, data.system_prompt) for p in problems]
    figures = rollout_entropy(
        conf.model.path, prompts, ENTROPY_SAMPLES, conf.rollout.max_completion_length, seed=conf.train.seed,
        device=conf.train.device, dtype=conf.model.dtype, batch=conf.rollout.generation_batch_size,
        trust_remote_code=conf.model.trust_remote_code,
    )  # fmt: skip
    free_accelerator_memory()
    return {"prompts": len(prompts), "samples_per_prompt": ENTROPY_SAMPLES, "temperature": 1.0, **figures}
