"""Issue 14's new-user findings, one test (or a few) each, plus the package's import layering."""

from __future__ import annotations

import ast
import json
import os
import stat
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from qerl_cli.cli import main
from qerl_cli.errors import QerlError
from qerl_cli.rl import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "qerl_cli"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, " ".join(err.split())  # rich wraps long lines


# -- 1. messages are printed verbatim, brackets included -------------------------------------------
def test_yaml_error_keeps_the_bracketed_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    recipe = tmp_path / "[runs]" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text("model: [unclosed\n")
    rc, _, err = run(capsys, "train", str(recipe), "--dry-run")
    assert rc == 2
    assert "[unclosed" in err and "[runs]" in err


def test_vllm_hint_keeps_the_extra_name(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    import qerl_cli.envinfo

    def boom() -> dict:
        raise QerlError('rollout engine "vllm" needs vLLM: pip install "qerl[vllm]"')

    monkeypatch.setattr(qerl_cli.envinfo, "collect", boom)
    rc, _, err = run(capsys, "env")
    assert rc == 2 and 'pip install "qerl[vllm]"' in err


# -- 2. the tiny recipe works on a fresh clone ------------------------------------------------------
def test_tiny_recipe_names_a_real_command() -> None:
    text = (REPO / "recipes" / "tiny.yaml").read_text()
    assert "qerl tiny-base" in text and "python -m" not in text


def test_tiny_recipe_without_its_base_names_the_command(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rc, _, err = run(capsys, "train", str(REPO / "recipes" / "tiny.yaml"))
    assert rc == 2 and "runs/tiny-base/nvfp4" in err and "qerl tiny-base" in err


@pytest.mark.slow
def test_tiny_recipe_on_a_fresh_clone(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Follow the recipe's instructions from an empty working folder: the missing base names the
    command, the command builds it, and the recipe then trains."""
    import functools

    from qerl_cli.rl import warmstart

    monkeypatch.chdir(tmp_path)
    recipe = str(REPO / "recipes" / "tiny.yaml")
    quick = [
        "--set",
        "train.max_steps=1",
        "--set",
        "train.prompts_per_step=2",
        "--set",
        "output.save_steps=0",
    ]
    rc, _, err = run(capsys, "train", recipe, *quick)
    assert rc == 2 and "runs/tiny-base/nvfp4" in err and "qerl tiny-base" in err
    # A short warm start: this test is about the commands, tests/test_trainer.py about the learning.
    monkeypatch.setattr(
        warmstart,
        "WarmStartConfig",
        functools.partial(warmstart.WarmStartConfig, max_steps=2, check_every=2, noisy_steps=1, probe_size=2),
    )
    rc, out, _ = run(capsys, "tiny-base")
    assert rc == 0 and "runs/tiny-base/nvfp4" in out
    assert (tmp_path / "runs" / "tiny-base" / "nvfp4" / "config.json").is_file()
    rc, _, err = run(capsys, "tiny-base")
    assert rc == 2 and "--overwrite" in err
    rc, _, err = run(capsys, "train", recipe, *quick)
    assert rc == 0, err
    assert (tmp_path / "runs" / "tiny" / "adapter" / "adapter_model.safetensors").is_file()


# -- 3. eval checks the model path before any dataset --------------------------------------------
def test_eval_missing_model_fails_fast_naming_it(capsys, tmp_path: Path, monkeypatch) -> None:
    import qerl_cli.evaluation.run as eval_run

    def no_data(*args, **kwargs):
        raise AssertionError("the dataset was loaded before the model path was checked")

    monkeypatch.setattr(eval_run, "load_benchmark", no_data)
    start = time.monotonic()
    rc, _, err = run(capsys, "eval", "./no-such-model", "--benchmarks", "gsm8k", "-o", str(tmp_path / "e"))
    assert rc == 2 and "./no-such-model: no such folder" in err
    assert time.monotonic() - start < 5


def test_eval_missing_adapter_fails_fast_naming_it(capsys, tiny_model_dir: Path, tmp_path: Path, monkeypatch):
    import qerl_cli.evaluation.run as eval_run

    monkeypatch.setattr(eval_run, "load_benchmark", lambda *a, **k: pytest.fail("dataset loaded first"))
    rc, _, err = run(
        capsys, "eval", str(tiny_model_dir), "--adapter", str(tmp_path / "nope"), "--benchmarks", "gsm8k",
        "-o", str(tmp_path / "e"),
    )  # fmt: skip
    assert rc == 2 and f"--adapter {tmp_path / 'nope'}: no such folder" in err


def test_offline_hub_id_fails_fast(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    rc, _, err = run(
        capsys, "eval", "nobody/no-such-model", "--benchmarks", "gsm8k", "-o", str(tmp_path / "e")
    )
    assert rc == 2 and "HF_HUB_OFFLINE=1 is set" in err and "nobody/no-such-model" in err
    assert time.monotonic() - start < 5


def test_unreachable_hub_fails_fast_without_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from qerl_cli.data import datasets
    from qerl_cli.modeling import source_checks as sources

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(QerlError, match="cannot be reached"):
        sources.check_model_source("nobody/no-such-model")
    with pytest.raises(QerlError, match="cannot be reached"):
        datasets.load_problems("nobody/no-such-dataset")


def test_unreachable_hub_still_loads_a_cached_dataset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A dataset already in the local cache loads without the network, as datasets always allowed."""
    import datasets as hf_datasets
    from huggingface_hub import constants

    from qerl_cli.data import datasets
    from qerl_cli.modeling import source_checks as sources

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout_s=3.0: False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    (tmp_path / "datasets--someone--cached-set").mkdir()
    rows = [{"question": "1 + 1?", "answer": "2"}]
    monkeypatch.setattr(hf_datasets, "load_dataset", lambda *a, **k: hf_datasets.Dataset.from_list(rows))
    assert datasets.load_hub_records("someone/cached-set", None, "train") == rows
    with pytest.raises(QerlError, match="cannot be reached"):  # not cached: still fails at once
        datasets.load_hub_records("someone/not-cached", None, "train")


def test_a_failed_tiny_base_rebuild_keeps_the_old_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl_cli.rl import warmstart

    old = tmp_path / "base" / "bf16"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_text("the old weights")

    def crash(out_dir, cfg, formats):
        (Path(out_dir) / "bf16").mkdir(parents=True)  # half a new base, then the failure
        raise KeyboardInterrupt

    monkeypatch.setattr(warmstart, "prepare_tiny_base", crash)
    with pytest.raises(KeyboardInterrupt):
        warmstart.build_tiny_base(tmp_path / "base", overwrite=True)
    assert (old / "model.safetensors").read_text() == "the old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # no staging folder left behind


# -- 4. damaged checkpoints -----------------------------------------------------------------------
def _checkpoints(tmp_path: Path, steps=(2, 4)) -> dict[int, Path]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()

    def save_adapter(folder: Path) -> None:
        folder.mkdir()
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()},
            str(folder / "adapter_model.safetensors"),
        )

    return {
        step: ckpt.save_checkpoint(
            tmp_path,
            ckpt.TrainingState(step=step, data_position=step),
            save_adapter=save_adapter,
            optimizer=optimizer,
            param_names=["weight", "bias"],
            scheduler=scheduler,
        )  # fmt: skip
        for step in steps
    }


def test_resume_auto_skips_a_damaged_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved = _checkpoints(tmp_path)
    adapter = saved[4] / "adapter" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:40])  # truncated
    with caplog.at_level("WARNING"):
        assert ckpt.find_last_checkpoint(tmp_path) == saved[2]
    assert (
        "skipped checkpoint-4" in caplog.text
        and "adapter/adapter_model.safetensors has 40 bytes" in caplog.text
    )
    with pytest.raises(
        QerlError, match=r"adapter/adapter_model.safetensors has 40 bytes.*newest good .*checkpoint-2"
    ):
        ckpt.find_last_checkpoint(saved[4])


def test_a_damaged_legacy_checkpoint_is_a_user_error(tmp_path: Path) -> None:
    saved = _checkpoints(tmp_path, steps=(1,))
    (saved[1] / "rng.safetensors").write_bytes(b"\x00garbage")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with pytest.raises(
        QerlError, match="cannot load the checkpoint"
    ):  # past the manifest, still no raw error
        ckpt.load_checkpoint(
            saved[1], optimizer=optimizer, param_names=["weight", "bias"], scheduler=scheduler,
            load_adapter=lambda folder: None,
        )  # fmt: skip


def test_a_checkpoint_from_before_manifests_resumes_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = _checkpoints(tmp_path, steps=(1, 2))
    for step in (1, 2):  # what qerl 0.1.0 wrote: no manifest, no promise of one in the state file
        (saved[step] / ckpt.MANIFEST_FILE).unlink()
        state_file = saved[step] / ckpt.STATE_FILE
        state = json.loads(state_file.read_text())
        del state["manifest"]
        state_file.write_text(json.dumps(state))
    with caplog.at_level("WARNING"):
        assert ckpt.find_last_checkpoint(tmp_path) == saved[2]
    assert "before checkpoint manifests" in caplog.text
    # A current checkpoint whose manifest is gone is damaged, not legacy.
    newer = _checkpoints(tmp_path / "new", steps=(3,))
    (newer[3] / ckpt.MANIFEST_FILE).unlink()
    with pytest.raises(QerlError, match="manifest.json is missing"):
        ckpt.find_last_checkpoint(newer[3])


# -- 5. files honour the umask --------------------------------------------------------------------
def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_honour_the_umask(tmp_path: Path) -> None:
    from qerl_cli.files import write_json
    from qerl_cli.modeling.tiny import write_tiny_model

    old = os.umask(0o022)
    try:
        assert _mode(write_json(tmp_path / "r.json", {"a": 1})) == 0o644
        saved = _checkpoints(tmp_path / "run", steps=(1,))
        for file in saved[1].rglob("*"):
            assert _mode(file) == (0o755 if file.is_dir() else 0o644), file
        model = write_tiny_model(tmp_path / "tiny")
        assert _mode(model / "model.safetensors") == 0o644
        # Cached folders (GGUF conversions, RTN bases, bench checkpoints) go through write_folder_once.
        from safetensors.torch import save_file

        from qerl_cli.files import write_folder_once

        cached = write_folder_once(tmp_path / "c", lambda d: save_file({"w": torch.zeros(1)}, d / "w.st"))
        assert _mode(cached / "w.st") == 0o644 and _mode(cached) == 0o755
        os.umask(0o077)
        assert _mode(write_json(tmp_path / "private.json", {})) == 0o600
    finally:
        os.umask(old)


def test_policy_adapter_files_are_readable_by_others(tiny_model_dir: Path, tmp_path: Path) -> None:
    from test_trainer import tiny_cfg

    from qerl_cli.rl.policy import build_policy

    policy = build_policy(tiny_cfg(tiny_model_dir, tmp_path / "run"))
    old = os.umask(0o022)
    try:
        out = policy.save_adapter(tmp_path / "adapter")
    finally:
        os.umask(old)
    assert _mode(out / "adapter_model.safetensors") == 0o644


# -- 6. list values: say which element is wrong -----------------------------------------------------
def test_bench_batch_names_the_bad_element(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "bench", "--batch", "2,abc", "--dry-run")
    assert rc == 2 and "--batch takes comma-separated positive integers" in err and "'abc'" in err
    rc, _, err = run(capsys, "bench", "--batch", "0", "--dry-run")
    assert rc == 2 and "got '0'" in err


def test_config_list_and_dict_errors_name_the_element(capsys, tmp_path: Path) -> None:
    rc, _, err = run(capsys, "bench", "--set", "batch=[1, x]", "--dry-run")
    assert rc == 2 and "item 2 ('x') is not int" in err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: m}\nreward: {extra: {'a.b:c': lots}}\ndata: {levels: [3, high]}\n")
    rc, _, err = run(capsys, "train", str(recipe), "--dry-run")
    assert rc == 2 and "'a.b:c'" in err and "is not float" in err


# -- 7. the GPU workflow ----------------------------------------------------------------------------
def test_gpu_workflow_installs_nf4_and_gates_on_a_baseline() -> None:
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "gpu.yml").read_text())
    steps = workflow["jobs"]["bench"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert '.[vllm,nf4]"' in runs
    assert "--baseline baseline/bench.json" in runs and "no baseline bench.json yet" in runs
    uses = [s.get("uses", "") for s in steps]
    assert any(u.startswith("actions/cache/restore") for u in uses)
    assert any(u.startswith("actions/cache/save") for u in uses)
    save = next(s for s in steps if s.get("uses", "").startswith("actions/cache/save"))
    assert "refs/heads/main" in save["if"]  # only main's results become the baseline
    # --baseline refuses another gen_len: a change of the default must also rename the baseline's key.
    from qerl_cli.config import BenchConfig

    assert save["with"]["key"].startswith(f"qerl-bench-baseline-gen{BenchConfig().gen_len}-")
    # The checkpoint cache must outlive the workspace, which checkout cleans before every job.
    assert "workspace" not in str(workflow["jobs"]["bench"].get("env", {}))


# -- layering ---------------------------------------------------------------------------------------
# Lower layers never import higher ones, and packages of one level never import each other. From the
# bottom: the base modules, formats, kernels, modeling, then data/rewards/rollout, then
# rl/evaluation/quantize, then bench/compare/demo, then the CLI.
BASE = {"errors", "torch_utils", "files", "config", "envinfo"}  # import nothing of qerl but each other
LEVELS = [
    {"formats"},
    {"kernels"},
    {"modeling"},
    {"data", "rewards", "rollout"},
    {"rl", "evaluation", "quantize"},
    {"bench", "compare", "demo"},
    {"cli"},
]
BASE_MAY_IMPORT = {"errors", "torch_utils", "files"}
# Edges the level rule allows but this code base keeps out (a reason each).
ALSO_FORBIDDEN = {
    "data": {"rollout"},  # datasets are plain data; generation uses them
    "quantize": {"rollout"},  # quantization never generates
}
# Same-level edges that exist on purpose.
ALLOWED_SIBLINGS = {("rewards", "data"), ("data", "rewards"), ("compare", "demo")}


def _forbidden(layer: str) -> set[str]:
    if layer in BASE:
        return {name for level in LEVELS for name in level} | (BASE - BASE_MAY_IMPORT)
    index = next(i for i, level in enumerate(LEVELS) if layer in level)
    higher = {name for level in LEVELS[index + 1 :] for name in level}
    siblings = {name for name in LEVELS[index] if (layer, name) not in ALLOWED_SIBLINGS} - {layer}
    return higher | siblings | ALSO_FORBIDDEN.get(layer, set())


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "qerl_cli" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_lower_layers_never_import_higher_ones() -> None:
    violations = []
    for file in PACKAGE.rglob("*.py"):
        layer = file.relative_to(PACKAGE).with_suffix("").parts[0]
        if layer in ("__init__", "__main__"):
            continue
        for target in sorted(_imports(file) & _forbidden(layer)):
            violations.append(f"{file.relative_to(REPO)} imports qerl_cli.{target}")
    assert violations == []


def test_the_layer_table_names_every_package() -> None:
    packages = {p.with_suffix("").name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    packages -= {"__init__", "__main__", "__pycache__"}
    assert packages == BASE | {name for level in LEVELS for name in level}
    assert {"rl", "data", "cli"} <= _forbidden("rollout") and "modeling" not in _forbidden("rollout")


def test_the_layering_check_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from qerl_cli.rl.policy import Policy\n    import qerl_cli.bench\n")
    assert _imports(source) == {"rl", "bench"}
